"""The ``sqlite`` DLQ store kind: one SQLite file (``nemesis.dlq.sqlite``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from nemesis.backends.base import DlqKind, DlqModel
from nemesis.config_base import DurationS

if TYPE_CHECKING:
    from nemesis.broker.port import Broker
    from nemesis.clock import Clock
    from nemesis.config.models import NemesisConfig
    from nemesis.dlq.port import DeadLetterStore


class SqliteDlqConfig(DlqModel):
    kind: Literal["sqlite"] = "sqlite"
    # Relative paths are taken from data_dir.
    path: str = "dlq.db"
    # Rows older than this (by dead-letter time) are deleted; months, so teams can look back.
    retention: DurationS = 180 * 86400.0

    def location(self, data_dir: str) -> str:
        return f"sqlite:{Path(data_dir, self.path)}"


async def open_sqlite_store(
    config: NemesisConfig, broker: Broker | None, clock: Clock
) -> DeadLetterStore:
    from nemesis.dlq.sqlite import open_sqlite_dlq

    assert isinstance(config.dlq, SqliteDlqConfig)  # chosen by kind
    return await open_sqlite_dlq(
        Path(config.data_dir, config.dlq.path),
        clock=clock,
        retention_s=config.dlq.retention or None,
    )


SQLITE = DlqKind("sqlite", SqliteDlqConfig, open_sqlite_store)
