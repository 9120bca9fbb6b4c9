"""``nemesis init``: creates what a configuration needs, on either backend, idempotently.

Per integration: its consumer on the source topic; for unordered delivery
one topic per retry tier (``tier_topic``), each with the integration's
internal consumer (``internal_consumer``); its replay topic
(``replay_topic``) with the same consumer. Then
the DLQ's table (YDB) or file (sqlite). Running it again changes nothing
and reports everything as there already.

Source topics belong to the teams that produce to them: a missing one is
reported, not created (``create_sources=True`` creates it, for demos and
tests).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nemesis.backends import Backends, open_backend, open_dlq
from nemesis.broker.port import Broker, ConsumerSpec
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import IntegrationConfig, NemesisConfig
from nemesis.errors import TopicNotFound
from nemesis.runtime.retries import flows_of
from nemesis.topology import register_internal

# As the supervisor's ``internal_partitions``: the partitions of the topics Nemesis owns.
INTERNAL_PARTITIONS = 4


class Outcome(enum.StrEnum):
    CREATED = "created"
    ADDED = "added"  # a consumer registered on a topic that existed
    EXISTS = "exists"
    MISSING = "missing"  # a source topic nobody has created
    READY = "ready"  # the DLQ's storage: created if it was missing


@dataclass(frozen=True, slots=True)
class InitStep:
    """One thing ``init`` made sure of."""

    kind: str  # topic | consumer | dlq
    name: str  # the topic; topic/consumer; the DLQ's kind and location
    outcome: Outcome
    integration: str | None = None

    def __str__(self) -> str:
        owner = f" ({self.integration})" if self.integration else ""
        return f"{self.kind} {self.name}: {self.outcome.value}{owner}"


@dataclass(frozen=True, slots=True)
class InitReport:
    """Everything ``init`` checked, in order."""

    steps: tuple[InitStep, ...]

    @property
    def changed(self) -> tuple[InitStep, ...]:
        return tuple(s for s in self.steps if s.outcome in (Outcome.CREATED, Outcome.ADDED))

    @property
    def missing(self) -> tuple[InitStep, ...]:
        return tuple(s for s in self.steps if s.outcome is Outcome.MISSING)

    @property
    def ok(self) -> bool:
        """False when a source topic is missing: its integration cannot start."""
        return not self.missing

    def lines(self) -> list[str]:
        return [str(step) for step in self.steps]


async def init_backend(
    config: NemesisConfig,
    integrations: Mapping[str, IntegrationConfig] | Iterable[IntegrationConfig],
    *,
    broker: Broker | None = None,
    with_dlq: bool = True,
    create_sources: bool = False,
    partitions: int = INTERNAL_PARTITIONS,
    clock: Clock = SYSTEM_CLOCK,
    backends: Backends | None = None,
) -> InitReport:
    """Creates the topics, consumers and DLQ storage ``integrations`` need; see the module."""
    configs = list(integrations.values() if isinstance(integrations, Mapping) else integrations)
    opened = broker is None
    if broker is None:
        broker = await open_backend(config, clock=clock, backends=backends)
    steps: list[InitStep] = []
    try:
        for integration in sorted(configs, key=lambda c: c.name):
            steps += await _integration(broker, integration, create_sources, partitions)
        if with_dlq:
            store = await open_dlq(config, broker=broker, clock=clock, backends=backends)
            await store.close()
            steps.append(InitStep("dlq", _dlq_location(config), Outcome.READY))
    finally:
        if opened:
            await broker.close()
    return InitReport(tuple(steps))


async def _integration(
    broker: Broker, config: IntegrationConfig, create_sources: bool, partitions: int
) -> list[InitStep]:
    steps: list[InitStep] = []
    name = config.name
    main, *owned = flows_of(config)
    source_exists = await _topic_exists(broker, main.topic)
    if not source_exists and create_sources:
        await broker.admin.create_topic(main.topic, partitions=partitions, exist_ok=True)
        steps.append(InitStep("topic", main.topic, Outcome.CREATED, name))
    elif not source_exists:
        steps.append(InitStep("topic", main.topic, Outcome.MISSING, name))
        return steps
    steps.append(await _consumer(broker, main.topic, main.consumer, name))
    for flow in owned:
        if await _topic_exists(broker, flow.topic):
            steps.append(InitStep("topic", flow.topic, Outcome.EXISTS, name))
        else:
            # Without consumers: register_internal carries a former consumer's offsets over.
            await broker.admin.create_topic(
                flow.topic,
                partitions=partitions,
                exist_ok=True,  # another init may be running
            )
            steps.append(InitStep("topic", flow.topic, Outcome.CREATED, name))
        added = await register_internal(broker.admin, flow.topic, name)
        outcome = Outcome.ADDED if added else Outcome.EXISTS
        steps.append(InitStep("consumer", f"{flow.topic}/{flow.consumer}", outcome, name))
    return steps


async def _topic_exists(broker: Broker, topic: str) -> bool:
    try:
        await broker.admin.describe_topic(topic)
    except TopicNotFound:
        return False
    return True


async def _consumer(broker: Broker, topic: str, consumer: str, integration: str) -> InitStep:
    described = await broker.admin.describe_topic(topic)
    name = f"{topic}/{consumer}"
    if consumer in described.consumers:
        return InitStep("consumer", name, Outcome.EXISTS, integration)
    await broker.admin.add_consumer(topic, ConsumerSpec(consumer))
    return InitStep("consumer", name, Outcome.ADDED, integration)


def _dlq_location(config: NemesisConfig) -> str:
    return config.dlq.location(config.data_dir)
