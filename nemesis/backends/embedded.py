"""The ``embedded`` broker kind: one SQLite file (``nemesis.broker.embedded``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from pydantic import Field

from nemesis.backends.base import BackendModel, BrokerKind, ProcessConfig
from nemesis.config_base import DurationS

if TYPE_CHECKING:
    from nemesis.broker.port import Broker
    from nemesis.clock import Clock


class EmbeddedBackendConfig(BackendModel):
    kind: Literal["embedded"] = "embedded"
    # Relative paths are taken from data_dir.
    path: str = "nemesis.db"
    lease_s: Annotated[float, Field(gt=0)] = 10.0
    retention: DurationS = 7 * 86400.0
    default_partitions: Annotated[int, Field(ge=1, le=1024)] = 4

    spans_hosts: ClassVar[bool] = False  # one file: its readers share a host


async def open_embedded_backend(config: ProcessConfig, clock: Clock) -> Broker:
    from nemesis.broker.embedded import open_embedded

    assert isinstance(config.backend, EmbeddedBackendConfig)  # chosen by kind
    return await open_embedded(config.backend, data_dir=Path(config.data_dir), clock=clock)


EMBEDDED = BrokerKind("embedded", EmbeddedBackendConfig, open_embedded_backend)
