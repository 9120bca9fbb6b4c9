"""The broker and the DLQ store a configuration names, opened by ``kind``.

``open_backend(config)`` and ``open_dlq(config)`` are what the CLI, the demo
and ``nemesis init`` call for either kind (``embedded``/``sqlite``, ``ydb``).
The factories live in a ``Backends`` registry: ``default_backends()`` makes
a fresh one with the built-in kinds; tests copy it, or start from an empty
one and register fakes.

A YDB DLQ without a connection of its own shares the broker's driver when
the broker is given, and opens one from the backend's connection otherwise.
The YDB modules are imported only when a YDB kind is opened, so the
embedded path never loads the SDK's gRPC stack.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import Broker
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import (
    EmbeddedBackendConfig,
    NemesisConfig,
    SqliteDlqConfig,
    YdbBackendConfig,
    YdbDlqConfig,
)
from nemesis.dlq import DeadLetterStore, open_sqlite_dlq

BrokerFactory = Callable[[NemesisConfig, Clock], Awaitable[Broker]]
DlqFactory = Callable[[NemesisConfig, Broker | None, Clock], Awaitable[DeadLetterStore]]


@dataclass
class Backends:
    """Broker and DLQ-store factories by ``kind``."""

    brokers: dict[str, BrokerFactory] = field(default_factory=dict)
    dlqs: dict[str, DlqFactory] = field(default_factory=dict)

    def copy(self) -> Backends:
        return Backends(dict(self.brokers), dict(self.dlqs))

    def register_broker(self, kind: str, factory: BrokerFactory) -> None:
        self.brokers[kind] = factory

    def register_dlq(self, kind: str, factory: DlqFactory) -> None:
        self.dlqs[kind] = factory


async def _embedded(config: NemesisConfig, clock: Clock) -> Broker:
    assert isinstance(config.backend, EmbeddedBackendConfig)  # chosen by kind
    return await open_embedded(config.backend, data_dir=Path(config.data_dir), clock=clock)


async def _ydb(config: NemesisConfig, clock: Clock) -> Broker:
    from nemesis.broker.ydb import open_ydb

    assert isinstance(config.backend, YdbBackendConfig)
    return await open_ydb(config.backend, clock=clock)


async def _kafka(config: NemesisConfig, clock: Clock) -> Broker:
    from nemesis.broker.kafka.broker import open_kafka
    from nemesis.broker.kafka.config import KafkaBackendConfig

    assert isinstance(config.backend, KafkaBackendConfig)
    return await open_kafka(config.backend, clock=clock)


async def _sqlite_dlq(
    config: NemesisConfig, broker: Broker | None, clock: Clock
) -> DeadLetterStore:
    assert isinstance(config.dlq, SqliteDlqConfig)
    return await open_sqlite_dlq(
        Path(config.data_dir, config.dlq.path),
        clock=clock,
        retention_s=config.dlq.retention or None,
    )


async def _ydb_dlq(config: NemesisConfig, broker: Broker | None, clock: Clock) -> DeadLetterStore:
    from nemesis.broker.ydb import YdbBroker
    from nemesis.dlq.ydb import open_ydb_dlq

    dlq = config.dlq
    assert isinstance(dlq, YdbDlqConfig)
    if dlq.connection is None and isinstance(broker, YdbBroker):
        return await open_ydb_dlq(dlq, driver=broker.driver, connection=broker.config, clock=clock)
    backend = config.backend if isinstance(config.backend, YdbBackendConfig) else None
    return await open_ydb_dlq(dlq, connection=backend, clock=clock)


def default_backends() -> Backends:
    """A fresh registry with the built-in kinds."""
    return Backends(
        brokers={"embedded": _embedded, "ydb": _ydb, "kafka": _kafka},
        dlqs={"sqlite": _sqlite_dlq, "ydb": _ydb_dlq},
    )


async def open_backend(
    config: NemesisConfig, *, clock: Clock = SYSTEM_CLOCK, backends: Backends | None = None
) -> Broker:
    """The broker ``config.backend`` names, connected."""
    registry = backends or default_backends()
    factory = registry.brokers.get(config.backend.kind)
    if factory is None:
        raise ValueError(f"no broker backend of kind {config.backend.kind!r}")
    return await factory(config, clock)


async def open_dlq(
    config: NemesisConfig,
    *,
    broker: Broker | None = None,
    clock: Clock = SYSTEM_CLOCK,
    backends: Backends | None = None,
) -> DeadLetterStore:
    """The DLQ store ``config.dlq`` names, its tables or file created if missing."""
    registry = backends or default_backends()
    factory = registry.dlqs.get(config.dlq.kind)
    if factory is None:
        raise ValueError(f"no DLQ store of kind {config.dlq.kind!r}")
    return await factory(config, broker, clock)
