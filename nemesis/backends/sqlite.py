"""The ``sqlite`` kinds: the DLQ store (``nemesis.dlq.sqlite``) and the fleet's state
store (``nemesis.fleet.sqlite``), each one SQLite file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from nemesis.backends.base import DlqKind, DlqModel, ProcessConfig, StateKind, StateModel
from nemesis.config_base import DurationS

if TYPE_CHECKING:
    from nemesis.broker.port import Broker
    from nemesis.clock import Clock
    from nemesis.dlq.port import DeadLetterStore
    from nemesis.fleet.port import StateStore


class SqliteDlqConfig(DlqModel):
    kind: Literal["sqlite"] = "sqlite"
    # Relative paths are taken from data_dir.
    path: str = "dlq.db"
    # Rows older than this (by dead-letter time) are deleted; months, so teams can look back.
    retention: DurationS = 180 * 86400.0

    per_host: ClassVar[bool] = True

    def location(self, data_dir: str) -> str:
        return f"sqlite:{Path(data_dir, self.path)}"


async def open_sqlite_store(
    config: ProcessConfig, broker: Broker | None, clock: Clock
) -> DeadLetterStore:
    from nemesis.dlq.sqlite import open_sqlite_dlq

    assert isinstance(config.dlq, SqliteDlqConfig)  # chosen by kind
    return await open_sqlite_dlq(
        Path(config.data_dir, config.dlq.path),
        clock=clock,
        retention_s=config.dlq.retention or None,
    )


SQLITE = DlqKind("sqlite", SqliteDlqConfig, open_sqlite_store)


class SqliteStateConfig(StateModel):
    kind: Literal["sqlite"] = "sqlite"
    # Relative paths are taken from data_dir. Replicas on one host share the file.
    path: str = "state.db"

    per_host: ClassVar[bool] = True

    def location(self, data_dir: str) -> str:
        return f"sqlite:{Path(data_dir, self.path)}"


async def open_sqlite_state_store(config: ProcessConfig) -> StateStore:
    from nemesis.fleet.sqlite import open_sqlite_state

    assert isinstance(config.state, SqliteStateConfig)  # chosen by kind
    return await open_sqlite_state(Path(config.data_dir, config.state.path))


SQLITE_STATE = StateKind("sqlite", SqliteStateConfig, open_sqlite_state_store)
