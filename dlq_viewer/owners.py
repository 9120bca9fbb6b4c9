"""Who owns which integration, read from the configuration's integrations directory.

The viewer decides what a person sees by the ``owners`` of every configured
integration, not only the ones this process runs: in a fleet each replica
runs some integrations, and every replica's viewer must show them all. The
directory is read again when its files change (checked at most every
``refresh_s``), so an edit applies without a restart, as in the proxy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.loader import YAML_SUFFIXES, load_integrations
from nemesis.config.models import IntegrationConfig

log = logging.getLogger(__name__)

REFRESH_S = 2.0

_Signature = tuple[tuple[str, int, int], ...]


class ConfiguredIntegrations(Mapping[str, IntegrationConfig]):
    """Every valid integration file in ``directory``, by name; re-read when the files change.

    A file that stops validating keeps its last good version (its owners keep
    their view while someone fixes it); its problems are logged once per change.
    """

    def __init__(
        self,
        directory: Path,
        *,
        clock: Clock = SYSTEM_CLOCK,
        refresh_s: float = REFRESH_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._directory = directory
        self._clock = clock
        self._refresh_s = refresh_s
        self._env = env
        self._signature: _Signature | None = None
        self._checked_at: float | None = None
        self._integrations: dict[str, IntegrationConfig] = {}
        self._current()

    def _current(self) -> dict[str, IntegrationConfig]:
        now = self._clock.monotonic()
        if self._checked_at is not None and now - self._checked_at < self._refresh_s:
            return self._integrations
        self._checked_at = now
        signature = self._files()
        if signature != self._signature:
            self._signature = signature
            self._load()
        return self._integrations

    def _files(self) -> _Signature:
        try:
            entries = list(os.scandir(self._directory))
        except OSError:
            return ()
        found = []
        for entry in entries:
            if not entry.name.endswith(YAML_SUFFIXES):
                continue
            try:
                stat = entry.stat()
            except OSError:
                continue
            found.append((entry.name, stat.st_mtime_ns, stat.st_size))
        return tuple(sorted(found))

    def _load(self) -> None:
        loaded, problems = load_integrations(self._directory, self._env)
        for problem in problems:
            log.error("%s (the viewer keeps this integration's last good owners)", problem)
        broken = {Path(problem.file).stem for problem in problems if problem.file}
        kept = {name: config for name, config in self._integrations.items() if name in broken}
        self._integrations = {**kept, **loaded}

    def __getitem__(self, name: str) -> IntegrationConfig:
        return self._current()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())
