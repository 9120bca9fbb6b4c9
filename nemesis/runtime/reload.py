"""Configuration reload: ``integrations/*.yaml`` picked up while the proxy runs.

A reload reads the whole directory again, the way ``nemesis run`` does at
start, and brings the running integrations in line with it:

* a new file that validates starts its integration;
* a changed file whose changes are all live settings (``delivery.workers``,
  ``buffer``, ``batch``, ``rate_limits``, ``flags``, ``paused``, ``owners``)
  is applied to the running integration at once, nothing restarts;
* any other change (target, source, pipeline, retry, breaker, ordering)
  restarts that integration alone: the new configuration is built first, the
  old one drains (its in-flight messages finish and are committed), then the
  new one starts;
* so does a change in a file its pipeline was built from: the named
  pipeline's ``pipelines/<name>.yaml`` or a descriptor set a ``decode`` stage
  reads (each integration using it restarts; a pipeline file that no longer
  builds is reported, and they run on as they were);
* so does a change in a file its ``target.tls`` names (a renewed client
  certificate or key, a new CA bundle): the integration is built again with
  the files as they are now, and one that does not load (a key that is not
  the certificate's, a half-written file) is reported, naming the field and
  the path, while the running version goes on with the files it loaded;
* a removed file drains and stops its integration;
* a file that does not validate (or whose pipeline does not build) is
  reported, with file, line and field, in the log and the admin API, and
  ignored: its integration keeps running on the last good configuration.

What triggers a reload: a change in the directory, in the pipelines
directory or in a folder that holds a TLS file of an integration
(``reload.watch``, through ``watchfiles``: inotify, or polling with
``reload.force_polling``, one watcher for them all; a descriptor set
elsewhere is compared at every reload but not watched), SIGHUP
(``kill -HUP <pid>``), or ``POST /config/reload`` on the admin API. What
decides is content, not the event: each file an integration was built from
is compared by digest, so a reload that finds them the same restarts
nothing. Reloads never overlap; requests that arrive during one are folded
into one more.

Kubernetes updates a mounted ConfigMap or Secret by swapping a symlink in
its folder, which the watch sees as a change like any other; so is an
agent's write-then-rename of a renewed certificate, since a TLS file is
watched through its folder (and, when it is a symlink to another folder,
that one's too). The watched folders follow the integrations: a reload
after which their TLS files live elsewhere moves the watch there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config import overrides as live
from nemesis.config.limits import Caps, within_caps
from nemesis.config.loader import YAML_SUFFIXES, load_integrations
from nemesis.config.models import IntegrationConfig
from nemesis.config.problems import sort_problems
from nemesis.delivery.tls import tls_files
from nemesis.errors import ConfigError, ConfigProblem
from nemesis.pipeline import file_digests
from nemesis.runtime.app import Proxy

log = logging.getLogger(__name__)

_REWATCH_S = 10.0


@dataclass(frozen=True, slots=True)
class ReloadReport:
    """What one reload found and did."""

    trigger: str  # start | watch | signal | api
    at: float  # Unix seconds
    added: Sequence[str] = ()
    applied: Mapping[str, Sequence[str]] = field(default_factory=dict)  # name -> live fields
    restarted: Mapping[str, Sequence[str]] = field(default_factory=dict)  # name -> the reason
    removed: Sequence[str] = ()
    kept: Sequence[str] = ()  # broken files whose integration runs its last good configuration
    problems: Sequence[ConfigProblem] = ()

    @property
    def ok(self) -> bool:
        """Whether every file validated."""
        return not self.problems

    def summary(self) -> str:
        """One line for the log."""
        parts = [
            f"{label} {', '.join(names)}"
            for label, names in (
                ("added", self.added),
                ("applied live", list(self.applied)),
                ("restarted", list(self.restarted)),
                ("removed", self.removed),
                ("kept on their last good configuration", self.kept),
            )
            if names
        ]
        if self.problems:
            parts.append(f"{len(self.problems)} problem(s)")
        return "; ".join(parts) or "nothing changed"


class ConfigReloader:
    """Brings a running proxy in line with its integrations directory, on request or on change."""

    def __init__(
        self,
        proxy: Proxy,
        directory: Path,
        *,
        env: Mapping[str, str] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        watch: bool = True,
        debounce_ms: int = 500,
        force_polling: bool = False,
        initial_problems: Sequence[ConfigProblem] = (),
        caps: Caps | None = None,
    ) -> None:
        self._proxy = proxy
        self._caps = caps or Caps()
        self._directory = directory
        self._env = env
        self._clock = clock
        self._watch = watch
        self._debounce_ms = debounce_ms
        self._force_polling = force_polling
        self._lock = asyncio.Lock()
        self._watched: dict[Path, Path] = {}  # resolved -> as watched
        # The TLS files the valid YAML files name, built or not (one whose files do not
        # load yet is added by the reload that finds them loading).
        self._named_tls_files: list[Path] | None = None
        self._rewatch: asyncio.Event | None = None  # stops the running watch
        self._requested = asyncio.Event()
        self._trigger = "api"
        self._reloads = {True: 0, False: 0}
        self._last_success_at: float | None = None
        self.last: ReloadReport | None = None
        # What nemesis run found at start (it logged the problems already).
        self._record(
            ReloadReport("start", clock.time(), problems=sort_problems(list(initial_problems))),
            quiet=True,
        )
        proxy.metrics.add_live_collector(self._collect)

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def caps(self) -> Caps:
        """The platform's caps every reload holds the integrations to."""
        return self._caps

    @property
    def watching(self) -> bool:
        return self._watch

    def request(self, trigger: str = "signal") -> None:
        """Asks for a reload soon (safe from a signal handler: it only sets an event)."""
        self._trigger = trigger
        self._requested.set()

    async def run(self) -> None:
        """Reloads on every request (and directory change, when watching) until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            if self._watch:
                tasks.create_task(self._watch_directory(), name="reload:watch")
            while True:
                await self._requested.wait()
                self._requested.clear()
                try:
                    await self.reload(self._trigger)
                except Exception:
                    # A supervisor boundary: a bug in one reload must not stop deliveries.
                    log.exception("configuration reload failed; the running configuration stays")

    async def reload(self, trigger: str = "api") -> ReloadReport:
        """Reads the directory and applies what changed; returns what was done."""
        async with self._lock:
            report = await self._reload(trigger)
        self._record(report)
        await self._follow_tls_folders()
        return report

    # --- the work -------------------------------------------------------------------

    async def _reload(self, trigger: str) -> ReloadReport:
        directory = self._directory
        loaded, problems = await asyncio.to_thread(load_integrations, directory, self._env)
        self._named_tls_files = _named_tls_files(loaded.values())
        present = await asyncio.to_thread(_file_names, directory)
        proxy = self._proxy
        # Over a cap: refused like an invalid file (what runs keeps its share of a team's).
        loaded, over_caps = await asyncio.to_thread(
            within_caps,
            self._caps,
            loaded,
            {name: _file_of(directory, name) for name in loaded},
            {name: group.yaml for name, group in proxy.groups.items() if name in present},
            self._env,
        )
        problems = sort_problems([*problems, *over_caps])
        by_name = _problems_by_file(problems, directory)
        # Pipeline files, descriptor sets and TLS files that changed since their integration
        # was built.
        stale = await asyncio.to_thread(
            _stale_sources,
            {
                name: {**group.pipeline.sources, **group.tls_sources}
                for name, group in proxy.groups.items()
            },
        )
        added: list[str] = []
        applied: dict[str, list[str]] = {}
        restarts: dict[str, tuple[IntegrationConfig, list[str]]] = {}
        removals: list[str] = []
        kept: set[str] = set()
        for name, config in sorted(loaded.items()):
            file = _file_of(directory, name)
            group = proxy.groups.get(name)
            try:
                if group is None:
                    proxy.add_integration(config, file)
                    added.append(name)
                elif config != group.yaml or name in stale:
                    restart = [*live.needs_restart(group.yaml, config), *stale.get(name, ())]
                    if restart:
                        restarts[name] = (config, restart)
                    else:
                        applied[name] = proxy.update_file_config(config, file)
            except ConfigError as exc:
                # Its pipeline does not build, or its live overrides no longer fit.
                problems.extend(exc.problems)
                by_name.setdefault(name, []).extend(exc.problems)
                if group is not None:
                    kept.add(name)
        for name in proxy.groups:
            if name not in loaded:
                if name in present:
                    kept.add(name)  # its file is there but broken: the last good one runs on
                else:
                    removals.append(name)
        failed = await self._restart_and_remove(restarts, removals)
        for name, failures in failed.items():
            problems.extend(failures)
            by_name.setdefault(name, []).extend(failures)
        kept.update(failed)
        for name, group in proxy.groups.items():
            group.problems = list(by_name.get(name, ()))
        return ReloadReport(
            trigger=trigger,
            at=self._clock.time(),
            added=added,
            applied=applied,
            restarted={
                name: reason for name, (_, reason) in restarts.items() if name not in failed
            },
            removed=removals,
            kept=sorted(kept),
            problems=sort_problems(problems),
        )

    async def _restart_and_remove(
        self,
        restarts: Mapping[str, tuple[IntegrationConfig, list[str]]],
        removals: Sequence[str],
    ) -> dict[str, list[ConfigProblem]]:
        """Drains what restarts or goes side by side (one slow drain delays no other).

        Returns the integrations whose new configuration did not build (they
        run on as they were), with the problems.
        """
        proxy = self._proxy
        failed: dict[str, list[ConfigProblem]] = {}

        async def restart(name: str, config: IntegrationConfig) -> None:
            try:
                await proxy.replace_integration(config, _file_of(self._directory, name))
            except ConfigError as exc:
                failed[name] = exc.problems

        async with asyncio.TaskGroup() as tasks:
            for name, (config, _) in restarts.items():
                tasks.create_task(restart(name, config), name=f"reload:restart:{name}")
            for name in removals:
                tasks.create_task(proxy.remove_integration(name), name=f"reload:remove:{name}")
        return failed

    def _record(self, report: ReloadReport, *, quiet: bool = False) -> None:
        self.last = report
        self._reloads[report.ok] += 1
        if report.ok:
            self._last_success_at = report.at
        if quiet:
            return
        for problem in report.problems:
            # A configuration problem, not a crash: no traceback.
            log.error("%s (ignored; the running configuration stays)", problem)
        level = logging.INFO if report.ok else logging.WARNING
        log.log(level, "configuration reload (%s): %s", report.trigger, report.summary())

    async def _watch_directory(self) -> None:
        from watchfiles import awatch

        directory = self._directory
        if not directory.is_dir():
            log.warning(
                "not watching %s: no such directory; reload with SIGHUP or the admin API",
                directory,
            )
            return
        rewatched = False
        while True:
            watched = await self._watched_folders()
            self._watched = watched
            # Set by a reload after which other folders hold the TLS files: the watcher
            # (its thread looks at this event between waits) ends, and starts on the new set.
            rewatch = self._rewatch = asyncio.Event()
            if rewatched:
                # Whatever changed since that reload and before the new watcher is up: the
                # reload runs once this task waits, after awatch has set its watches.
                self.request("watch")
                rewatched = False
            try:
                # Every change counts (no filter): a ConfigMap update is a symlink swap of
                # dot-named entries, and a reload of an unchanged directory changes nothing.
                async for _ in awatch(
                    *watched.values(),
                    watch_filter=None,
                    debounce=self._debounce_ms,
                    recursive=False,
                    force_polling=self._force_polling,
                    stop_event=rewatch,
                ):
                    self.request("watch")
            except Exception:
                # A supervisor boundary (the directory went away, the watcher failed):
                # SIGHUP and the admin API still reload; watching starts again later.
                log.exception("watching %s failed; watching again in %.0fs", directory, _REWATCH_S)
            else:
                rewatched = True  # stopped by a reload: watch the new set now
                continue
            await self._clock.sleep(_REWATCH_S)
            if not directory.is_dir():
                continue
            self.request("watch")  # whatever changed meanwhile

    async def _watched_folders(self) -> dict[Path, Path]:
        """What the watch covers: the integrations, the pipelines, the folders of TLS files."""
        if self._named_tls_files is None:  # before the first reload: as nemesis run loaded them
            loaded, _ = await asyncio.to_thread(load_integrations, self._directory, self._env)
            self._named_tls_files = _named_tls_files(loaded.values())
        tls = [path for group in self._proxy.groups.values() for path in group.tls_sources]
        tls.extend(self._named_tls_files)
        return await asyncio.to_thread(
            _folders_to_watch, [self._directory, self._proxy.pipelines_dir], tls
        )

    async def _follow_tls_folders(self) -> None:
        """Has the watch cover the folders of the TLS files the integrations now use."""
        if self._rewatch is None or self._rewatch.is_set():
            return
        if (await self._watched_folders()).keys() != self._watched.keys():
            self._rewatch.set()

    def _collect(self) -> Iterable[Metric]:
        reloads = CounterMetricFamily(
            "nemesis_config_reloads",
            "Configuration reloads, by result: ok, or error (some file did not validate).",
            labels=["result"],
        )
        reloads.add_metric(["ok"], float(self._reloads[True]))
        reloads.add_metric(["error"], float(self._reloads[False]))
        invalid = GaugeMetricFamily(
            "nemesis_config_invalid_files",
            "Integration files the last reload found invalid (their last good configuration runs).",
            labels=[],
        )
        report = self.last
        invalid.add_metric([], float(len({p.file for p in report.problems}) if report else 0))
        success = GaugeMetricFamily(
            "nemesis_config_last_reload_success_timestamp_seconds",
            "When a reload last found every file valid (Unix seconds).",
            labels=[],
        )
        if self._last_success_at is not None:
            success.add_metric([], self._last_success_at)
        return [reloads, invalid, success]


def _stale_sources(sources: Mapping[str, Mapping[Path, str | None]]) -> dict[str, list[str]]:
    """Integration -> the files it was built from that have changed since (blocking).

    Each file is read once, however many integrations share it.
    """
    now = file_digests(path for files in sources.values() for path in files)
    stale: dict[str, list[str]] = {}
    for name, files in sources.items():
        changed = [path for path, known in files.items() if now.get(path) != known]
        if changed:
            stale[name] = [str(path) for path in changed]
    return stale


def _named_tls_files(configs: Iterable[IntegrationConfig]) -> list[Path]:
    """Every TLS file the configurations name (some may appear more than once)."""
    return [path for config in configs for path in tls_files(config.target.tls)]


def _folders_to_watch(folders: Iterable[Path], tls_paths: Iterable[Path]) -> dict[Path, Path]:
    """``folders`` and those of ``tls_paths`` that exist, by their resolved path (blocking).

    A TLS file is watched through its folder, not itself: a certificate is
    renewed by a rename into that folder (a mounted secret's symlink swap, an
    agent's write-then-rename), which a watch on the old file would not see.
    A symlink to a file outside that folder has the target's folder watched
    too (an agent rewriting the file it points to).
    """
    candidates = list(folders)
    for path in tls_paths:
        folder = path.absolute().parent
        candidates.append(folder)
        if path.is_symlink():
            target = path.resolve()
            if not target.is_relative_to(folder.resolve()):
                candidates.append(target.parent)
    watched: dict[Path, Path] = {}
    for folder in candidates:
        if folder.is_dir():
            watched.setdefault(folder.resolve(), folder)
    return watched


def _file_names(directory: Path) -> set[str]:
    """The integration names files in ``directory`` stand for, valid or not."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return set()
    return {
        entry.stem
        for entry in entries
        if entry.suffix in YAML_SUFFIXES and not entry.name.startswith(".") and entry.is_file()
    }


def _file_of(directory: Path, name: str) -> Path | None:
    for suffix in YAML_SUFFIXES:
        path = directory / f"{name}{suffix}"
        if path.exists():
            return path
    return None


def _problems_by_file(
    problems: Iterable[ConfigProblem], directory: Path
) -> dict[str, list[ConfigProblem]]:
    """Problems of the directory's files, by the integration each file stands for."""
    by_name: dict[str, list[ConfigProblem]] = {}
    for problem in problems:
        path = Path(problem.file)
        if path.suffix in YAML_SUFFIXES and path.parent == directory:
            # An integration lives in <name>.yaml: the file names it even when broken.
            by_name.setdefault(path.stem, []).append(problem)
    return by_name
