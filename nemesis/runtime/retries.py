"""The topics and metadata of retry tiers and replays.

::

    main ──retry──> tier 1 (1m) ──retry──> tier 2 (5m) ──retry──> tier 3 (15m) ──retry──> DLQ
      │                │                      │                      │
      └────dead────────┴──────────dead────────┴──────────dead────────┴──────────────────> DLQ
    DLQ ──requeue──> replay topic (this integration only) ──> replay flow ──retry──> tier 1 ...

Each integration has its own tier topics (``nemesis.retry.<integration>.<n>``)
and replay topic (``nemesis.replay.<integration>``), so a retry or a replay
reaches that integration alone, never the shared source topic. A message in a
tier carries the original bytes and metadata plus the ``nemesis-*`` keys
below; every message of a tier has the same delay, so the tier's flow admits
each one when its due time comes.

Ordered integrations (``ordering: key|partition``) never use the tiers: a
retry topic would let later messages of the key overtake. Nor does a source
that can give a message back to come again after a delay (a queue, unless
``retry.via: topics``): its failed message is released for the tier's delay
and its receive count is the attempt. Where a failed
message goes is decided by ``nemesis.runtime.policy`` and carried out by
``nemesis.runtime.settle``; this module only names the topics and reads and
writes the metadata they carry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nemesis.broker.port import Message
from nemesis.config.models import IntegrationConfig
from nemesis.runtime.events import event_id
from nemesis.topology import (
    META_ATTEMPTS,
    META_DUE_AT,
    META_EVENT_ID,
    META_FIRST_FAILURE_AT,
    META_PREFIX,
    META_SOURCE_OFFSET,
    META_SOURCE_PARTITION,
    META_SOURCE_TOPIC,
    internal_consumer,
    replay_topic,
    tier_topic,
)


@dataclass(frozen=True, slots=True)
class FlowSpec:
    """One of an integration's flows: what it reads, and how its messages are admitted."""

    name: str  # main | retry-<n> | replay (a metric label)
    topic: str
    consumer: str
    tier: int = 0  # 0: main or replay; n: retry tier n
    limiter: str = "main"  # main | retry | replay: the rate limit that applies

    @property
    def delayed(self) -> bool:
        """Whether messages wait for their due time (retry tiers)."""
        return self.tier > 0


def moves_to_tiers(config: IntegrationConfig, *, dead_letters: bool) -> bool:
    """Whether a failed message moves up retry tier topics rather than retrying in place.

    Only unordered integrations do (a retry topic would let later messages of
    the key overtake), only with a dead-letter store for the last tier to end
    in (``dead_letters``), and only those that do not retry by giving the
    message back to its source (``IntegrationConfig.retries_by_release``: a
    queue's visibility timeout holds it for the tier's delay). The one place
    this is decided: the flows Nemesis runs, the topics it creates and the
    failure policy follow it.
    """
    return dead_letters and config.delivery.ordering == "none" and not config.retries_by_release


def flows_of(config: IntegrationConfig, *, dead_letters: bool = True) -> list[FlowSpec]:
    """Every flow an integration runs: main, one per retry tier, replay.

    ``dead_letters``: whether a dead-letter store exists; without one there
    is nothing to requeue from and nowhere for a tier to end, so main alone.
    """
    name = config.name
    internal = internal_consumer(name)
    flows = [FlowSpec("main", config.source.topic, config.source.consumer)]
    if moves_to_tiers(config, dead_letters=dead_letters):
        flows += [
            FlowSpec(f"retry-{n}", tier_topic(name, n), internal, tier=n, limiter="retry")
            for n in range(1, len(config.retry.tiers) + 1)
        ]
    if dead_letters:
        flows.append(FlowSpec("replay", replay_topic(name), internal, limiter="replay"))
    return flows


def tier_topics_of(config: IntegrationConfig, *, dead_letters: bool) -> list[str]:
    """The tier topics failed messages move to, tier 1 first; none when they retry in place."""
    return [flow.topic for flow in flows_of(config, dead_letters=dead_letters) if flow.delayed]


def origin(message: Message) -> Message:
    """The message as its handler should see it: at its source coordinates.

    A message read from a retry tier or the replay topic keeps the topic,
    partition and offset of its first appearance in ``ce-topic`` etc.
    """
    meta = message.metadata
    topic = meta.get(META_SOURCE_TOPIC)
    if topic is None:
        return message
    try:
        partition = int(meta[META_SOURCE_PARTITION])
        offset = int(meta[META_SOURCE_OFFSET])
    except (KeyError, ValueError):
        return message
    return replace(message, topic=topic, partition=partition, offset=offset)


def attempts_so_far(message: Message) -> int:
    try:
        return max(0, int(message.metadata.get(META_ATTEMPTS, "0")))
    except ValueError:
        return 0


def due_at(message: Message) -> float:
    try:
        return float(message.metadata.get(META_DUE_AT, "0"))
    except ValueError:
        return 0.0


def first_failure_at(message: Message) -> float | None:
    try:
        value = message.metadata.get(META_FIRST_FAILURE_AT)
        return None if value is None else float(value)
    except ValueError:
        return None


def source_metadata(message: Message) -> dict[str, str]:
    """The producer's metadata, without Nemesis' own bookkeeping."""
    return {k: v for k, v in message.metadata.items() if not k.startswith(META_PREFIX)}


def carried_metadata(message: Message) -> dict[str, str]:
    """What a message keeps wherever it goes next: its metadata, its id and its source."""
    source = origin(message)
    meta = dict(message.metadata)
    meta[META_EVENT_ID] = event_id(message)
    meta[META_SOURCE_TOPIC] = source.topic
    meta[META_SOURCE_PARTITION] = str(source.partition)
    meta[META_SOURCE_OFFSET] = str(source.offset)
    return meta
