"""The proxy process: every integration's flows, supervised, over one broker.

An integration runs up to three kinds of flow (``nemesis.runtime.retries``):
its main flow from the source topic, one flow per retry tier, and a replay
flow for messages requeued from the DLQ. They share the integration's
transport, pipeline, circuit breaker and rate limits; each flow has its own
runner. The main flow is restarted alone if it fails; the internal flows (retry
tiers and replay) read through one shared reader (``nemesis.runtime.internal``)
and are restarted together.

Integrations come and go while the proxy runs (``nemesis.runtime.reload``):
``add_integration`` starts one, ``remove_integration`` drains and stops one,
``replace_integration`` drains the old configuration before the new one
starts (the new one is built first, so a configuration that does not build
leaves the old one running), and ``update_file_config`` takes a changed YAML
whose changes all apply live. ``set_overrides`` lays live values (admin API)
over the YAML (``nemesis.config.overrides``); live values reach the
runners, the rate limiters and the pipeline's disabled types at once.

In a fleet (``nemesis.fleet``) the proxy holds every integration but starts
only those its member says run here (``set_placement``); the member starts
one that moves here (``start_integration``), drains one that moves away
(``release_integration``), sets each one's share of its rate limits
(``set_runners``) and lays the fleet's stored overrides over the YAML
(``replace_overrides``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from nemesis.aio import first_of
from nemesis.backends import SourceContext, SourceKind, default_backends
from nemesis.broker.logsource import SourceOpener, log_source
from nemesis.broker.port import Broker, ConsumerSpec, TopicWriter
from nemesis.broker.source import Source
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config import overrides as live
from nemesis.config.models import IntegrationConfig
from nemesis.delivery.port import Transport
from nemesis.dlq import DeadLetterStore
from nemesis.errors import BrokerError, ConfigError, ConfigProblem, NemesisError, TopicNotFound
from nemesis.metrics import Metrics
from nemesis.pipeline import Pipeline, build_integration_pipeline, file_digests
from nemesis.pipeline.offload import PipelineProcesses
from nemesis.resilience.breaker import BreakerListener, CircuitBreaker, bind_breaker_metrics
from nemesis.resilience.limits import FlowLimits, wait_recorder
from nemesis.runtime.internal import SharedReader
from nemesis.runtime.lag import LagMonitor, LagTarget, PartitionLag, oldest_unfinished_from
from nemesis.runtime.queues import QueueCounts, QueueMonitor, last_receive_at
from nemesis.runtime.retries import FlowSpec, flows_of, tier_topics_of
from nemesis.runtime.runner import IntegrationRunner, RunnerOptions, RunnerState, RunnerStats
from nemesis.runtime.sizing import LiveSizing
from nemesis.runtime.telemetry import IntegrationSnapshot, ProxySnapshot, metric_families
from nemesis.topology import register_internal
from nemesis.transports import Transports, default_transports

log = logging.getLogger(__name__)

# The connection pool of a transport is sized to the most workers an integration
# may ever run (DeliveryConfig.workers' bound), not to the workers it starts with:
# the runners' workers bound the concurrency and change at run time, and a pool
# sized at start would become a second bound that a live resize cannot move.
# Connections are opened on demand, so the ceiling costs nothing until used.
MAX_CONNECTIONS: Final = 4096


@dataclass(frozen=True, slots=True)
class SupervisorOptions:
    restart_delay_s: float = 1.0
    max_restart_delay_s: float = 30.0
    topic_wait_s: float = 5.0
    internal_partitions: int = 4  # of the retry tier and replay topics Nemesis creates
    lag_refresh_s: float = 5.0  # how often end offsets are asked for (commit lag)


@dataclass
class IntegrationGroup:
    """The running parts of one integration, shared by its flows."""

    config: IntegrationConfig  # running: file_config with the live overrides
    pipeline: Pipeline
    breaker: CircuitBreaker
    limits: FlowLimits
    transport: Transport | None = None
    tier_writers: list[TopicWriter] = field(default_factory=list)
    runners: dict[str, IntegrationRunner] = field(default_factory=dict)
    setup: asyncio.Lock = field(default_factory=asyncio.Lock)
    file_config: IntegrationConfig | None = None  # as the YAML says (None: same as config)
    file: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    # Why a flow is not running, by flow (a missing topic, an unknown URL scheme).
    issues: dict[str, str] = field(default_factory=dict)
    # Problems of its file at the last reload (the group runs the last good YAML).
    problems: list[ConfigProblem] = field(default_factory=list)
    sizing: LiveSizing = field(default_factory=LiveSizing)
    # The target.tls files it was built from, with their digests then (None: unreadable):
    # the reload restarts it when one changes on disk (a rotated certificate).
    tls_sources: dict[Path, str | None] = field(default_factory=dict)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    breaker_listener: BreakerListener | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def yaml(self) -> IntegrationConfig:
        """The configuration as its YAML says, without live overrides."""
        return self.file_config or self.config


class Proxy:
    """Runs every integration until ``stop()``; restarts a flow that fails, alone."""

    def __init__(
        self,
        broker: Broker,
        integrations: Mapping[str, IntegrationConfig],
        *,
        dlq: DeadLetterStore | None = None,
        pipelines_dir: Path | str = "pipelines",
        integration_files: Mapping[str, Path] | None = None,
        metrics: Metrics | None = None,
        transports: Transports | None = None,
        clock: Clock = SYSTEM_CLOCK,
        runner_options: RunnerOptions = RunnerOptions(),
        supervisor_options: SupervisorOptions = SupervisorOptions(),
        sources: Mapping[str, SourceKind] | None = None,
    ) -> None:
        self.broker = broker
        # Source kinds by name (``source.kind``); tests and embedders pass their own.
        self._sources = dict(default_backends().sources if sources is None else sources)
        self.dlq = dlq
        self.metrics = metrics or Metrics()
        self._pipelines_dir = pipelines_dir
        self._integrations: dict[str, IntegrationConfig] = {}
        # The kinds of transport, by URL scheme (nemesis.transports); tests pass fakes.
        self._transports = transports or default_transports()
        self._clock = clock
        # Costly pipelines run in worker processes of the proxy's own, unless the caller
        # gave it some to share (or none at all: see nemesis.pipeline.offload).
        self._own_processes: PipelineProcesses | None = None
        if runner_options.pipeline_processes is None:
            self._own_processes = PipelineProcesses()
            runner_options = dataclasses.replace(
                runner_options, pipeline_processes=self._own_processes
            )
        self._runner_options = runner_options
        self._supervisor = supervisor_options
        self._stopping = asyncio.Event()
        self._groups: dict[str, IntegrationGroup] = {}
        # Whether an integration runs in this process (None: every one does).
        self._runs_here: Callable[[str], bool] | None = None
        self._runners_of: dict[str, int] = {}  # members sharing an integration's rate limits
        self._tasks: asyncio.TaskGroup | None = None
        self._running = False
        self._lag = LagMonitor(
            broker, self.lag_targets, clock=clock, interval_s=supervisor_options.lag_refresh_s
        )
        self._queues = QueueMonitor(clock=clock)  # the lag of queue sources (their counts)
        files = integration_files or {}
        for name, config in integrations.items():
            try:
                group = self._build_group(config, files.get(name))
            except ConfigError as exc:
                for problem in exc.problems:
                    # A configuration problem, not a crash: no traceback.
                    log.error("%s (integration %s not started)", problem, name)  # noqa: TRY400
                continue
            self._activate(group)
        self.metrics.add_live_collector(lambda: metric_families(self.snapshot()))

    # --- reading ------------------------------------------------------------------

    @property
    def integrations(self) -> Mapping[str, IntegrationConfig]:
        """The running configuration of every integration (live overrides included)."""
        return self._integrations

    @property
    def groups(self) -> Mapping[str, IntegrationGroup]:
        return self._groups

    @property
    def pipelines_dir(self) -> Path:
        """Where named pipelines (``pipeline: <name>``) are found."""
        return Path(self._pipelines_dir)

    @property
    def runners(self) -> Mapping[str, IntegrationRunner]:
        """The main-flow runner of every integration that has started."""
        return {
            name: group.runners["main"]
            for name, group in self._groups.items()
            if "main" in group.runners
        }

    @property
    def running(self) -> bool:
        """Whether ``run()`` has started its integrations and ``stop()`` was not called."""
        return self._running and not self._stopping.is_set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def lag_monitor(self) -> LagMonitor:
        return self._lag

    @property
    def clock(self) -> Clock:
        return self._clock

    def flows(self, config: IntegrationConfig) -> list[FlowSpec]:
        """The flows an integration runs here (retry tiers and replay need a DLQ store)."""
        return flows_of(config, dead_letters=self.dlq is not None)

    def lag_targets(self) -> list[LagTarget]:
        """Every flow whose commit lag is watched: those on the process's log backend."""
        return [
            LagTarget(name, flow.name, flow.topic, flow.consumer)
            for name, group in self._groups.items()
            for flow in self.flows(group.config)
            if flow.name != "main" or group.config.source.on_backend
        ]

    def snapshot(self, names: Collection[str] | None = None) -> ProxySnapshot:
        """Every integration (or those named) as it is now: for metrics and the admin API."""
        groups = [g for n, g in self._groups.items() if names is None or n in names]
        flows = {g.name: [runner.statistics() for runner in g.runners.values()] for g in groups}
        oldest: dict[tuple[str, str, str, int], float] = {}
        for name, stats_list in flows.items():
            for stats in stats_list:
                for partition in stats.partitions:
                    written_at = partition.oldest_unfinished_written_at
                    if written_at is not None and written_at > 0:
                        key = (name, stats.flow, partition.topic, partition.partition)
                        oldest[key] = min(written_at, oldest.get(key, written_at))
        targets = [t for t in self.lag_targets() if names is None or t.integration in names]
        lags: dict[str, list[PartitionLag]] = {}
        for lag in self._lag.lags(targets, oldest_unfinished_from(oldest)):
            lags.setdefault(lag.integration, []).append(lag)
        for group in groups:
            queue_lag = self._queue_lag(group.name, oldest)
            if queue_lag is not None:
                lags.setdefault(group.name, []).insert(0, queue_lag)
            flows[group.name] = [self._with_receives(group, stats) for stats in flows[group.name]]
        return ProxySnapshot(
            monotonic=self._clock.monotonic(),
            time=self._clock.time(),
            running=self.running,
            stopping=self.stopping,
            integrations=[
                IntegrationSnapshot(
                    name=group.name,
                    state=self._state_of(group),
                    config=group.config,
                    file_config=group.yaml,
                    overrides=dict(group.overrides),
                    file=group.file,
                    flows=flows[group.name],
                    issues=dict(group.issues),
                    breaker=group.breaker.statistics(),
                    limits=group.limits.statistics(),
                    lags=lags.get(group.name, []),
                    sizing=group.sizing.estimate(),
                    problems=list(group.problems),
                    queue=self._queue_counts(group.name),
                )
                for group in groups
            ],
            lag=self._lag.statistics(),
        )

    def _queue_lag(
        self, name: str, oldest: Mapping[tuple[str, str, str, int], float]
    ) -> PartitionLag | None:
        """The main flow's lag on a queue source, from its counts (``runtime.queues``)."""
        reading = self._queues.reading(name)
        if reading is None:
            return None
        counts = reading.counts
        messages = counts.visible + counts.in_flight
        seconds: float | None = 0.0
        written_at = oldest.get((name, "main", counts.queue, 0))
        if not messages:
            pass
        elif written_at is not None:
            seconds = max(self._clock.time() - written_at, 0.0)
        elif counts.oldest_held_age_s is not None:
            seconds = counts.oldest_held_age_s + self._clock.monotonic() - reading.read_at
        else:
            seconds = None  # nobody here holds one: SQS does not tell a message's age
        # No offsets on a queue: "end" is what it holds, nothing counts as committed.
        return PartitionLag(name, "main", counts.queue, 0, messages, 0, messages, seconds, True)

    def _queue_counts(self, name: str) -> QueueCounts | None:
        reading = self._queues.reading(name)
        return None if reading is None else reading.counts

    def _with_receives(self, group: IntegrationGroup, stats: RunnerStats) -> RunnerStats:
        """A queue's main flow reads at every receive, an empty long poll included."""
        runner = group.runners.get(stats.flow)
        if stats.flow != "main" or runner is None:
            return stats
        received = last_receive_at(runner.source, self._clock)
        if received is None or (stats.last_read_at or 0.0) >= received:
            return stats
        return dataclasses.replace(stats, last_read_at=received)

    # --- live changes -------------------------------------------------------------

    def set_overrides(self, name: str, changes: Mapping[str, Any]) -> IntegrationConfig:
        """Lays live values over an integration's YAML and applies them at once.

        Values equal to the YAML's are not kept as overrides. Raises KeyError
        for an unknown integration and pydantic's ValidationError (the whole
        configuration is validated) for values that do not fit.
        """
        group = self._groups[name]
        merged = live.caught_up(group.yaml, {**group.overrides, **changes})
        config = live.apply_overrides(group.yaml, merged)
        group.overrides = merged
        self._apply_live(group, config, why="set live")
        return config

    def clear_overrides(
        self, name: str, fields: Collection[str] | None = None
    ) -> IntegrationConfig:
        """Back to the YAML for ``fields`` (every live field when None); applied at once."""
        group = self._groups[name]
        kept = {} if fields is None else live.only(group.overrides, fields)
        config = live.apply_overrides(group.yaml, kept)
        group.overrides = kept
        self._apply_live(group, config, why="back to the YAML")
        return config

    def update_file_config(self, config: IntegrationConfig, file: Path | None = None) -> list[str]:
        """Takes a changed YAML whose changes all apply live; returns the fields that changed.

        Overrides the YAML now agrees with are dropped. Raises ConfigError when
        the remaining overrides do not fit the new YAML (the old one stays).
        """
        group = self._groups[config.name]
        changed = live.changed_fields(group.yaml, config)
        kept = live.caught_up(config, group.overrides)
        running = self._with_overrides(config, kept, file)
        group.file_config, group.file, group.overrides = config, file, kept
        self._apply_live(group, running, why="changed in the YAML")
        return changed

    def replace_overrides(self, name: str, overrides: Mapping[str, Any]) -> IntegrationConfig:
        """Makes ``overrides`` the whole set of live values (the fleet's stored ones).

        Raises pydantic's ValidationError when they do not fit the YAML.
        """
        group = self._groups[name]
        kept = live.caught_up(group.yaml, overrides)
        config = live.apply_overrides(group.yaml, kept)
        group.overrides = kept
        self._apply_live(group, config, why="set live by the fleet")
        return config

    # --- placement in a fleet ---------------------------------------------------

    def set_placement(self, runs_here: Callable[[str], bool]) -> None:
        """From now on an integration starts only where ``runs_here(name)`` says."""
        self._runs_here = runs_here

    def start_integration(self, name: str) -> None:
        """Starts an integration the placement now puts here (or lets run() start it)."""
        self._start_group(self._groups[name])

    async def release_integration(self, name: str) -> None:
        """Drains and stops an integration that moved elsewhere; it stays, ready to start again."""
        old = self._groups[name]
        if old.task is None:
            return
        await self._halt_group(old)
        # Built after the drain, so overrides set meanwhile count too. One that no longer
        # builds stays halted (ConfigError): it cannot start here again until its YAML does.
        fresh = self._build_group(old.yaml, old.file, old.overrides)
        self._deactivate(old)
        self._activate(fresh)
        log.info("integration %s: stopped here, runs elsewhere", name, extra={"integration": name})

    def set_runners(self, name: str, runners: int) -> None:
        """Takes this process's share of rate limits that ``runners`` members hold together."""
        self._runners_of[name] = runners
        group = self._groups.get(name)
        if group is not None and group.limits.runners != runners:
            group.limits.set_runners(runners)

    def stop(self) -> None:
        """Drains and stops every flow; ``run()`` returns when all have."""
        self._stopping.set()
        for group in self._groups.values():
            for runner in group.runners.values():
                runner.stop()

    # --- integrations coming and going ------------------------------------------

    def add_integration(self, config: IntegrationConfig, file: Path | None = None) -> None:
        """Starts an integration; raises ConfigError when its pipeline does not build."""
        if config.name in self._groups:
            raise ValueError(f"integration {config.name} runs already")
        group = self._build_group(config, file)
        self._activate(group)
        self._start_group(group)
        log.info("integration %s: added", config.name, extra={"integration": config.name})

    async def replace_integration(
        self, config: IntegrationConfig, file: Path | None = None
    ) -> None:
        """Restarts an integration on a changed YAML: the old one drains, then the new one starts.

        The new one is built first, its transport too when the old one runs
        here: when either is refused (ConfigError: a pipeline that does not
        build, TLS files that do not load, a header value the transport
        refuses), the old one keeps running untouched. Live overrides carry
        over unless the new YAML says the same.
        """
        old = self._groups[config.name]
        new = self._build_group(config, file, live.caught_up(config, old.overrides))
        known = self._transports.kind_for(config.target.scheme) is not None
        if old.task is not None and known:
            # Made now, not once the old one drained: what the transport alone checks (the
            # headers; TLS files changed during the drain) must not stop the running one.
            try:
                new.transport = self._open_transport(new.config)
            except ConfigError as exc:
                raise _in_file(exc, config.name, file) from None
        try:
            await self._halt_group(old)
        except BaseException:
            await self._close_group(new)
            raise
        # Overrides set while the old one drained count too, if they still fit.
        overrides = live.caught_up(config, old.overrides)
        try:
            new.config = self._with_overrides(config, overrides, file)
        except ConfigError:
            pass  # they do not fit the new YAML: the ones it was built with stay
        else:
            new.overrides = overrides
        self._integrations[config.name] = new.config
        self._deactivate(old)
        self._activate(new)
        self._start_group(new)
        log.info("integration %s: restarted", config.name, extra={"integration": config.name})

    async def remove_integration(self, name: str) -> None:
        """Drains an integration's flows, stops it and forgets its metrics."""
        group = self._groups[name]
        await self._halt_group(group)
        self._deactivate(group)
        del self._groups[name]
        self._integrations.pop(name, None)
        self.metrics.forget_integration(name)
        log.info("integration %s: removed", name, extra={"integration": name})

    # --- the run ------------------------------------------------------------------

    async def run(self) -> None:
        """Runs every integration, and those added later, until ``stop()``; drains and returns."""
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                telemetry = tasks.create_task(self._telemetry(), name="telemetry")
                self._running = True
                for group in list(self._groups.values()):
                    self._start_group(group)
                await self._stopping.wait()
                self._running = False
                running = [g.task for g in self._groups.values() if g.task is not None]
                if running:
                    await asyncio.wait(running)
                telemetry.cancel()
        finally:
            self._running = False
            self._tasks = None
            for group in list(self._groups.values()):
                await self._close_group(group)
            if self._own_processes is not None:
                self._own_processes.close()

    def _start_group(self, group: IntegrationGroup) -> None:
        if self._tasks is None or not self._running or group.task is not None:
            return  # run() starts it, or it runs already
        if self._runs_here is not None and not self._runs_here(group.name):
            return  # another member of the fleet runs it
        group.task = self._tasks.create_task(
            self._run_group(group), name=f"integration:{group.name}"
        )

    async def _halt_group(self, group: IntegrationGroup) -> None:
        """Stops a group's flows and waits until they drained."""
        group.stopping.set()
        for runner in group.runners.values():
            runner.stop()
        if group.task is not None:
            await asyncio.wait([group.task])

    async def _run_group(self, group: IntegrationGroup) -> None:
        config = group.config
        if config.source.kind not in self._sources:
            group.issues["main"] = f"no source of kind {config.source.kind}"
            log.error(
                "integration %s: no source of kind %s; not started",
                config.name,
                config.source.kind,
                extra={"integration": config.name},
            )
            return
        known = self._transports.kind_for(config.target.scheme) is not None
        if not known and group.transport is None:
            group.issues["main"] = f"no transport for {config.target.scheme}:// targets"
            log.error(
                "integration %s: no transport for %s:// targets; not started",
                config.name,
                config.target.scheme,
                extra={"integration": config.name},
            )
            return
        try:
            try:
                if group.transport is None:  # replace_integration may have made it
                    group.transport = self._open_transport(config)
            except ConfigError as exc:
                # Its checks refused the target (headers; TLS files gone or changed since the
                # group was built): this integration waits for a fix, the others run on.
                group.issues["main"] = f"cannot start: {exc}"
                for problem in exc.problems:
                    log.error(  # noqa: TRY400  (a configuration problem: no traceback)
                        "%s (integration %s not started)",
                        problem,
                        config.name,
                        extra={"integration": config.name},
                    )
                return
            async with asyncio.TaskGroup() as tasks:
                main, *internal = self.flows(config)
                tasks.create_task(self._supervise(group, main), name=f"{config.name}:main")
                if internal:
                    tasks.create_task(
                        self._supervise_internal(group, internal), name=f"{config.name}:internal"
                    )
        finally:
            await self._close_group(group)

    async def _close_group(self, group: IntegrationGroup) -> None:
        for writer in group.tier_writers:
            with contextlib.suppress(NemesisError):
                await writer.close()
        group.tier_writers.clear()
        if group.transport is not None:
            await group.transport.close()
            group.transport = None

    async def _supervise(self, group: IntegrationGroup, flow: FlowSpec) -> None:
        """Keeps one flow running: waits for its topic, restarts it after a failure."""
        name = group.name
        where = {"integration": name, "flow": flow.name}
        delay_s = self._supervisor.restart_delay_s
        restarts = self.metrics.flow_restarts.labels(name, flow.name)  # at 0 from the start
        while not self._halted(group):
            try:
                await self._prepare_flow(group, flow)
            except TopicNotFound:
                group.issues[flow.name] = f"topic {flow.topic} does not exist"
                log.error(  # noqa: TRY400 - an expected state, not a failure with a traceback
                    "integration %s: topic %r does not exist; create it "
                    "(nemesis topics create %s --partitions N); checking again in %.0fs",
                    name,
                    flow.topic,
                    flow.topic,
                    self._supervisor.topic_wait_s,
                    extra=where,
                )
                await self._sleep_unless_halted(group, self._supervisor.topic_wait_s)
                continue
            except NemesisError as exc:
                group.issues[flow.name] = f"cannot start: {exc}"
                log.error(  # noqa: TRY400 - a broker problem, retried; not a bug
                    "integration %s, flow %s: cannot start: %s; trying again in %.1fs",
                    name,
                    flow.name,
                    exc,
                    delay_s,
                    extra=where,
                )
                restarts.inc()
                await self._sleep_unless_halted(group, delay_s)
                delay_s = min(delay_s * 2, self._supervisor.max_restart_delay_s)
                continue
            group.issues.pop(flow.name, None)
            try:
                runner = self._make_runner(group, flow)
                group.runners[flow.name] = runner
                if self._halted(group):
                    runner.stop()
                await runner.run()
            except* BrokerError as refusals:
                # The source's broker (a queue's server) refused or did not answer: its error
                # names the queue or topic and the call; a traceback would add only noise.
                for refusal in refusals.exceptions:
                    log.error(  # noqa: TRY400 - a broker's answer, retried; not a bug
                        "integration %s, flow %s failed: %s; restarting in %.1fs",
                        name,
                        flow.name,
                        refusal,
                        delay_s,
                        extra=where,
                    )
                group.issues[flow.name] = f"failed: {refusals.exceptions[0]}; restarting"
                restarts.inc()
            except* Exception as failures:
                for failure in failures.exceptions:
                    log.error(  # noqa: TRY400 - exc_info names the member of the group
                        "integration %s, flow %s failed; restarting in %.1fs",
                        name,
                        flow.name,
                        delay_s,
                        exc_info=failure,
                        extra=where,
                    )
                group.issues[flow.name] = "failed; restarting"
                restarts.inc()
            else:
                return
            await self._sleep_unless_halted(group, delay_s)
            delay_s = min(delay_s * 2, self._supervisor.max_restart_delay_s)

    async def _supervise_internal(self, group: IntegrationGroup, flows: list[FlowSpec]) -> None:
        """Keeps the internal flows running over one shared reader; restarts them together."""
        name = group.name
        delay_s = self._supervisor.restart_delay_s
        # Every internal flow restarts when one fails: each restart is counted.
        restarts = [self.metrics.flow_restarts.labels(name, flow.name) for flow in flows]
        while not self._halted(group):
            try:
                for flow in flows:
                    await self._prepare_flow(group, flow)
                shared = await self._open_shared(flows, lambda: group.config.delivery.buffer)
            except NemesisError as exc:
                for flow in flows:
                    group.issues[flow.name] = f"cannot start: {exc}"
                log.error(  # noqa: TRY400 - a broker problem, retried; not a bug
                    "integration %s, flows %s: cannot start: %s; trying again in %.1fs",
                    name,
                    ", ".join(flow.name for flow in flows),
                    exc,
                    delay_s,
                    extra={"integration": name},
                )
                for counter in restarts:
                    counter.inc()
                await self._sleep_unless_halted(group, delay_s)
                delay_s = min(delay_s * 2, self._supervisor.max_restart_delay_s)
                continue
            failures = await self._run_internal(group, flows, shared)
            if not failures:
                return
            for flow, failure in failures:
                log.error(
                    "integration %s, flow %s failed; restarting the internal flows in %.1fs",
                    name,
                    flow.name,
                    delay_s,
                    exc_info=failure,
                    extra={"integration": name, "flow": flow.name},
                )
                group.issues[flow.name] = "failed; restarting"
            for counter in restarts:
                counter.inc()
            await self._sleep_unless_halted(group, delay_s)
            delay_s = min(delay_s * 2, self._supervisor.max_restart_delay_s)

    async def _open_shared(
        self, flows: list[FlowSpec], buffer: Callable[[], int]
    ) -> SharedReader | None:
        """One reader over the flows' topics; None when each flow reads its own.

        One flow needs no sharing, and a backend that reads one topic per
        reader says so with NotImplementedError. ``buffer``: the flows'
        ``delivery.buffer``, the bound of each one's queue at the shared reader.
        """
        if len(flows) < 2:
            return None
        topics = [flow.topic for flow in flows]
        try:
            reader = await self.broker.reader(topics, flows[0].consumer)
        except NotImplementedError:
            return None
        return SharedReader(reader, topics, buffer)

    async def _run_internal(
        self, group: IntegrationGroup, flows: list[FlowSpec], shared: SharedReader | None
    ) -> list[tuple[FlowSpec, BaseException]]:
        """Runs the flows until they stop; when one fails, stops the others. Their failures."""
        runners: list[IntegrationRunner] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            for flow in flows:
                group.issues.pop(flow.name, None)
                runner = self._make_runner(group, flow, shared)
                group.runners[flow.name] = runner
                runners.append(runner)
                if self._halted(group):
                    runner.stop()
            tasks = [
                asyncio.create_task(runner.run(), name=f"{group.name}:{runner.flow.name}")
                for runner in runners
            ]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for runner in runners:
                runner.stop()  # one failed, or all were asked to stop
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            if shared is not None:
                with contextlib.suppress(NemesisError):
                    await shared.close()
        failures: list[tuple[FlowSpec, BaseException]] = []
        for runner, task in zip(runners, tasks, strict=True):
            error = task.exception()
            if error is not None:
                failures.append((runner.flow, error))
        return failures

    async def _prepare_flow(self, group: IntegrationGroup, flow: FlowSpec) -> None:
        """Registers the consumer; creates the retry tier and replay topics Nemesis owns."""
        admin = self.broker.admin
        if flow.name == "main":
            if group.config.source.on_backend:  # a source elsewhere opens on its own
                await admin.add_consumer(flow.topic, ConsumerSpec(flow.consumer))
        else:
            await self._prepare_internal(flow.topic, group.name)
        topics = tier_topics_of(group.config, dead_letters=self.dlq is not None)
        if not topics:
            return
        async with group.setup:  # the flows start together; one opens the tier writers
            if group.tier_writers:
                return
            for topic in topics:
                await self._prepare_internal(topic, group.name)
                group.tier_writers.append(await self.broker.writer(topic))

    async def _prepare_internal(self, topic: str, integration: str) -> None:
        """Creates one of the integration's own topics and registers its internal consumer."""
        admin = self.broker.admin
        # Without consumers: register_internal carries a former consumer's offsets over.
        await admin.create_topic(
            topic, partitions=self._supervisor.internal_partitions, exist_ok=True
        )
        await register_internal(admin, topic, integration)

    def _make_runner(
        self, group: IntegrationGroup, flow: FlowSpec, shared: SharedReader | None = None
    ) -> IntegrationRunner:
        assert group.transport is not None
        return IntegrationRunner(
            group.config,
            self._source_of(group, flow, shared),
            group.transport,
            flow=flow,
            dlq=self.dlq,
            tier_writers=group.tier_writers,
            pipeline=group.pipeline,
            breaker=group.breaker,
            limits=group.limits,
            metrics=self.metrics,
            clock=self._clock,
            options=self._runner_options,
            owns_transport=False,
        )

    def _source_of(
        self, group: IntegrationGroup, flow: FlowSpec, shared: SharedReader | None
    ) -> SourceOpener:
        """What a flow reads: the integration's source (of its kind), or a topic of the log.

        Retry tiers and the replay topic are topics of the process's backend,
        whatever the source's kind; they start at earliest (what they hold is
        owed to the handler, all of it).
        """
        if flow.name != "main":
            if shared is None:
                return log_source(self.broker, flow.topic, flow.consumer)
            view = shared.view(flow.topic)

            async def open_view() -> Source:
                return view

            return open_view
        source = group.config.source
        kind = self._sources[source.kind]  # known: _run_group starts no other
        context = SourceContext(group.name, self.broker, self._clock)

        async def open_source() -> Source:
            return await kind.open(source, context)

        return open_source

    async def _telemetry(self) -> None:
        """Refreshes commit lag and samples the live sizing figures, until cancelled."""
        while True:
            try:
                await self._lag.refresh()
                await self._queues.refresh(self._main_sources())
                self._sample_sizing()
            except Exception:
                # A supervisor boundary: a bug here must cost metrics, not deliveries.
                log.exception("refreshing commit lag failed; trying again")
            await self._clock.sleep(self._supervisor.lag_refresh_s)

    def _main_sources(self) -> dict[str, Source]:
        """The open source of each integration's main flow, by integration."""
        sources = {}
        for name, group in self._groups.items():
            runner = group.runners.get("main")
            if runner is not None and runner.source is not None:
                sources[name] = runner.source
        return sources

    def _sample_sizing(self) -> None:
        now = self._clock.monotonic()
        for group in self._groups.values():
            runner = group.runners.get("main")
            if runner is None:
                continue
            stats = runner.statistics()
            group.sizing.sample(
                now,
                attempted=stats.attempted,
                requests=stats.requests,
                request_seconds=stats.request_seconds,
                produced=self._lag.end_offsets(group.config.source.topic),
                read=stats.messages_read,
            )

    # --- groups -------------------------------------------------------------------

    def _build_group(
        self,
        file_config: IntegrationConfig,
        file: Path | None,
        overrides: Mapping[str, Any] | None = None,
    ) -> IntegrationGroup:
        """The parts of an integration, not started; raises ConfigError."""
        name = file_config.name
        config = self._with_overrides(file_config, overrides or {}, file)
        where = str(file) if file is not None else f"integration {name}"
        # Digested before they are loaded: a file replaced after this is seen as changed.
        tls_sources = file_digests(self._transports.files(config.target))
        # Read again by the transport; checked here to refuse at once, naming the file.
        self._transports.preflight(config.target, where=where)
        pipeline = build_integration_pipeline(
            config,
            pipelines_dir=self._pipelines_dir,
            disabled_types=self._disabled_types(name),
            metrics=self.metrics,
            integration_file=file,
        )
        breaker = CircuitBreaker(
            config.breaker, clock=self._clock, name=name, retries=len(config.retry.tiers)
        )
        limits = FlowLimits(
            config.rate_limits,
            clock=self._clock,
            on_wait=wait_recorder(self.metrics, name),
            runners=self._runners_of.get(name, 1),
        )
        return IntegrationGroup(
            config,
            pipeline,
            breaker,
            limits,
            file_config=file_config,
            file=file,
            overrides=dict(overrides or {}),
            tls_sources=tls_sources,
        )

    def _open_transport(self, config: IntegrationConfig) -> Transport:
        return self._transports.open(
            config.target, integration=config.name, max_connections=MAX_CONNECTIONS
        )

    def _with_overrides(
        self, file_config: IntegrationConfig, overrides: Mapping[str, Any], file: Path | None
    ) -> IntegrationConfig:
        try:
            return live.apply_overrides(file_config, overrides)
        except ValidationError as exc:
            where = str(file) if file is not None else f"integration {file_config.name}"
            raise ConfigError(
                [
                    ConfigProblem(
                        where,
                        None,
                        ".".join(str(part) for part in error["loc"]) or None,
                        f"{error['msg']} (with the live overrides"
                        f" {', '.join(sorted(overrides))}; clear them or change the file)",
                    )
                    for error in exc.errors()
                ]
            ) from None

    def _activate(self, group: IntegrationGroup) -> None:
        """Makes a built group the one its name refers to, and its breaker the one measured."""
        self._groups[group.name] = group
        self._integrations[group.name] = group.config
        group.breaker_listener = bind_breaker_metrics(group.breaker, self.metrics)

    def _deactivate(self, group: IntegrationGroup) -> None:
        if group.breaker_listener is not None:
            group.breaker.remove_listener(group.breaker_listener)
            group.breaker_listener = None

    def _apply_live(self, group: IntegrationGroup, config: IntegrationConfig, *, why: str) -> None:
        changed = live.changed_fields(group.config, config)
        group.config = config
        self._integrations[group.name] = config
        group.limits.apply(config.rate_limits)
        for runner in group.runners.values():
            runner.apply(config)
        if changed:
            log.info(
                "integration %s: %s %s",
                group.name,
                ", ".join(f"{path}={live.get_field(config, path)!r}" for path in changed),
                why,
                extra={"integration": group.name},
            )

    def _disabled_types(self, name: str) -> Callable[[], Collection[str]]:
        """A live view of an integration's flags.disabled_types (they change at run time)."""

        def current() -> Collection[str]:
            config = self._integrations.get(name)
            return () if config is None else config.flags.disabled_types

        return current

    def _halted(self, group: IntegrationGroup) -> bool:
        return self._stopping.is_set() or group.stopping.is_set()

    def _state_of(self, group: IntegrationGroup) -> str:
        if group.task is None and self._runs_here is not None and not self._runs_here(group.name):
            return "elsewhere"  # another member of the fleet runs it
        return _state_of(group)

    async def _sleep_unless_halted(self, group: IntegrationGroup, seconds: float) -> None:
        await first_of(self._clock.sleep(seconds), self._stopping.wait(), group.stopping.wait())


def _in_file(exc: ConfigError, name: str, file: Path | None) -> ConfigError:
    """A transport's problems (named ``integration <name>``) as problems of the YAML file."""
    if file is None:
        return exc
    return ConfigError(
        [
            dataclasses.replace(problem, file=str(file))
            if problem.file == f"integration {name}"
            else problem
            for problem in exc.problems
        ]
    )


def _state_of(group: IntegrationGroup) -> str:
    if group.stopping.is_set():
        return "stopping"
    main = group.runners.get("main")
    if main is None:
        return "waiting" if group.issues else "starting"
    state = main.state
    if state is RunnerState.RUNNING and group.config.paused:
        return "paused"
    return state.value
