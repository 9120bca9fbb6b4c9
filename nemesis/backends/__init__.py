"""Brokers and DLQ stores as plug-ins: each kind is a config model and a factory, by name.

``open_backend(config)`` and ``open_dlq(config)`` open what ``backend:`` and
``dlq:`` name; the CLI, the demo and ``nemesis init`` call them. The kinds
live in a ``Backends`` registry: ``default_backends()`` makes a fresh one
with the built-in kinds; tests copy it and register fakes, or start from an
empty ``Backends()``. The same registry makes the types the configuration
validates ``backend:`` and ``dlq:`` against (``Backends.backend_config``), so
a kind's fields, its JSON schema and its "unknown kind" error come from the
kinds registered, not from a list written elsewhere.

Adding a kind (say a Kafka broker):

1. One module here, ``nemesis/backends/kafka.py``, holding its config model
   (a ``BackendModel`` with ``kind: Literal["kafka"] = "kafka"``; a DLQ store's
   is a ``DlqModel``), its factory (``async def open_kafka(config, clock)``;
   a store's takes ``(config, broker, clock)``), and
   ``KAFKA = BrokerKind("kafka", KafkaBackendConfig, open_kafka)``. The
   factory imports the implementation inside its body, so that a process
   that does not use the kind never loads its client library.
2. One line in ``default_backends`` below: ``registry.register_broker(KAFKA)``.

A fleet state store kind (``state:``, see ``nemesis.fleet``) is the same with
``StateKind`` and ``register_state``; its factory takes ``(config)``.
A DLQ store kind is the same with ``DlqKind`` and ``register_dlq``; its
model may override ``DlqModel.location`` (what ``nemesis init`` prints) and
``DlqModel.check_backend`` (a store that needs a certain broker).

A source kind (an integration's ``source.kind``; ``topic``, a topic of the
process's backend, is the default) is the same with ``SourceKind`` and
``register_source``: its model is a ``SourceModel`` and its factory takes
``(source_config, SourceContext)`` and returns a ``nemesis.broker.source.Source``
(docs/design.md, "Adding a source").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemesis.backends.base import (
    BackendModel,
    Backends,
    BrokerFactory,
    BrokerKind,
    DlqFactory,
    DlqKind,
    DlqModel,
    ProcessConfig,
    SourceContext,
    SourceFactory,
    SourceKind,
    SourceModel,
    StateKind,
    StateModel,
)
from nemesis.backends.embedded import EMBEDDED
from nemesis.backends.kafka import KAFKA
from nemesis.backends.postgres import POSTGRES_DLQ, POSTGRES_STATE
from nemesis.backends.sqlite import SQLITE, SQLITE_STATE
from nemesis.backends.sqs import SQS
from nemesis.backends.topic import TOPIC
from nemesis.backends.ydb import YDB, YDB_DLQ, YDB_STATE
from nemesis.clock import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:  # the configuration imports this module for its kinds
    from nemesis.broker.port import Broker
    from nemesis.dlq.port import DeadLetterStore
    from nemesis.fleet.port import StateStore

__all__ = [
    "BackendModel",
    "Backends",
    "BrokerFactory",
    "BrokerKind",
    "DlqFactory",
    "DlqKind",
    "DlqModel",
    "ProcessConfig",
    "SourceContext",
    "SourceFactory",
    "SourceKind",
    "SourceModel",
    "StateKind",
    "StateModel",
    "default_backends",
    "open_backend",
    "open_dlq",
    "open_state",
]


def default_backends() -> Backends:
    """A fresh registry with the built-in kinds; the first of each is the default."""
    registry = Backends()
    registry.register_broker(EMBEDDED)
    registry.register_broker(YDB)
    registry.register_broker(KAFKA)
    registry.register_dlq(SQLITE)
    registry.register_dlq(YDB_DLQ)
    registry.register_dlq(POSTGRES_DLQ)
    registry.register_state(SQLITE_STATE)
    registry.register_state(POSTGRES_STATE)
    registry.register_state(YDB_STATE)
    registry.register_source(TOPIC)
    registry.register_source(SQS)
    return registry


async def open_backend(
    config: ProcessConfig, *, clock: Clock = SYSTEM_CLOCK, backends: Backends | None = None
) -> Broker:
    """The broker ``config.backend`` names, connected."""
    registry = backends or default_backends()
    kind = registry.brokers.get(config.backend.kind)
    if kind is None:
        raise ValueError(f"no broker backend of kind {config.backend.kind!r}")
    return await kind.open(config, clock)


async def open_dlq(
    config: ProcessConfig,
    *,
    broker: Broker | None = None,
    clock: Clock = SYSTEM_CLOCK,
    backends: Backends | None = None,
) -> DeadLetterStore:
    """The DLQ store ``config.dlq`` names, its tables or file created if missing.

    A YDB store without a connection of its own shares the YDB broker's driver.
    """
    registry = backends or default_backends()
    kind = registry.dlqs.get(config.dlq.kind)
    if kind is None:
        raise ValueError(f"no DLQ store of kind {config.dlq.kind!r}")
    return await kind.open(config, broker, clock)


async def open_state(config: ProcessConfig, *, backends: Backends | None = None) -> StateStore:
    """The fleet's state store ``config.state`` names, its tables or file created if missing."""
    registry = backends or default_backends()
    kind = registry.states.get(config.state.kind)
    if kind is None:
        raise ValueError(f"no state store of kind {config.state.kind!r}")
    return await kind.open(config)
