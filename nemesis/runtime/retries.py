"""Retry tiers, the dead-letter path and replays (DESIGN.md section 7).

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
retry topic would let later messages of the key overtake. They retry in
place with the same delays and, when the tiers run out, dead-letter and go
on, or halt the key (``retry.on_exhausted``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from nemesis.broker.port import Message, OutgoingMessage, TopicWriter
from nemesis.clock import Clock
from nemesis.config.models import IntegrationConfig
from nemesis.delivery.port import Outcome
from nemesis.dlq import DeadLetter, DeadLetterStore, Reason
from nemesis.metrics import Metrics
from nemesis.resilience.breaker import BreakerState, CircuitBreaker
from nemesis.runtime.events import event_id
from nemesis.runtime.scheduler import Work
from nemesis.runtime.settle import ACK, Action, Decision, Failure, backoff_delay
from nemesis.topology import (
    META_ATTEMPTS,
    META_DUE_AT,
    META_EVENT_ID,
    META_FIRST_FAILURE_AT,
    META_LAST_ERROR,
    META_LAST_STATUS,
    META_PREFIX,
    META_SOURCE_OFFSET,
    META_SOURCE_PARTITION,
    META_SOURCE_TOPIC,
    META_STAGE,
    META_TIER,
)

# Named here too (explicitly re-exported): the runtime's modules import them from here.
from nemesis.topology import replay_topic as replay_topic
from nemesis.topology import tier_topic as tier_topic

log = logging.getLogger(__name__)

_ERROR_CHARS = 500  # of the last error kept in a tier message's metadata


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


def flows_of(config: IntegrationConfig) -> list[FlowSpec]:
    """Every flow an integration runs: main, one per retry tier (unordered only), replay."""
    name = config.name
    flows = [FlowSpec("main", config.source.topic, config.source.consumer)]
    if config.delivery.ordering == "none":
        flows += [
            FlowSpec(f"retry-{n}", tier_topic(name, n), name, tier=n, limiter="retry")
            for n in range(1, len(config.retry.tiers) + 1)
        ]
    flows.append(FlowSpec("replay", replay_topic(name), name, limiter="replay"))
    return flows


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


class TieredSettler:
    """Decides where a failed message goes: the next retry tier, in-place retry, or the DLQ.

    ``flow.tier`` is the tier the message was read from (0 for main and
    replay). Moves are acknowledged only after the tier write or the DLQ
    write returned, so a crash in between delivers the message again
    (at-least-once; the DLQ row is idempotent, a duplicate in a tier is
    delivered twice under the same ``ce-id``).
    """

    def __init__(
        self,
        config: IntegrationConfig,
        flow: FlowSpec,
        *,
        tier_writers: Sequence[TopicWriter],
        dlq: DeadLetterStore,
        clock: Clock,
        breaker: CircuitBreaker | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._config = config
        self._flow = flow
        self._writers = tier_writers
        self._dlq = dlq
        self._clock = clock
        self._breaker = breaker
        self._delays = tuple(config.retry.tiers)
        metrics = metrics or Metrics()
        self._m_published = {
            n: metrics.retry_publishes.labels(config.name, str(n))
            for n in range(1, len(self._delays) + 1)
        }
        self._m_dead = metrics.dlq_writes
        self._m_halted = metrics.halted_keys.labels(config.name)

    async def settle(self, work: Work, failure: Failure) -> Decision:
        if failure.outcome is Outcome.DEAD:
            await self._dead_letter(work, failure, _reason_of(failure))
            return ACK
        if self._handler_down() and self._is_last_chance(work):
            # The breaker says the handler is down: its messages wait, they are not dead.
            return Decision(Action.RETRY_IN_PLACE, self._config.breaker.cooldown_s)
        if self._config.delivery.ordering != "none":
            return await self._retry_in_place(work, failure)
        next_tier = self._flow.tier + 1
        if next_tier > len(self._writers):
            await self._dead_letter(work, failure, Reason.RETRIES_EXHAUSTED)
            return ACK
        await self._publish(work, failure, next_tier)
        return ACK

    def _handler_down(self) -> bool:
        return self._breaker is not None and self._breaker.state is not BreakerState.CLOSED

    def _is_last_chance(self, work: Work) -> bool:
        if self._config.delivery.ordering != "none":
            return work.attempt > len(self._delays)
        return self._flow.tier >= len(self._writers)

    async def _retry_in_place(self, work: Work, failure: Failure) -> Decision:
        if work.attempt <= len(self._delays):
            delay_s = backoff_delay(work.attempt, self._delays, failure.retry_after_s)
            return Decision(Action.RETRY_IN_PLACE, delay_s)
        if self._config.retry.on_exhausted == "dead_letter":
            await self._dead_letter(work, failure, Reason.RETRIES_EXHAUSTED)
            return ACK
        # halt: the key (or partition) stops here until the handler accepts the message.
        if work.attempt == len(self._delays) + 1:
            self._m_halted.inc()
            message = origin(work.message)
            log.error(
                "integration %s: %s/%s@%s exhausted its retries; its %s is halted until "
                "the handler accepts it (retry.on_exhausted: halt)",
                self._config.name,
                message.topic,
                message.partition,
                message.offset,
                "partition" if self._config.delivery.ordering == "partition" else "key",
            )
        delay_s = backoff_delay(len(self._delays), self._delays, failure.retry_after_s)
        return Decision(Action.RETRY_IN_PLACE, delay_s)

    async def _publish(self, work: Work, failure: Failure, tier: int) -> None:
        message = work.message
        now = self._clock.time()
        delay_s = self._delays[tier - 1]
        if failure.retry_after_s is not None and failure.retry_after_s > delay_s:
            delay_s = failure.retry_after_s
        meta = carried_metadata(message)
        meta[META_ATTEMPTS] = str(work.attempt)
        meta[META_DUE_AT] = repr(now + delay_s)
        meta[META_FIRST_FAILURE_AT] = repr(work.first_failure_at or now)
        meta[META_LAST_ERROR] = (failure.error or failure.reason)[:_ERROR_CHARS]
        meta[META_STAGE] = failure.stage
        meta[META_TIER] = str(tier)
        if failure.status is not None:
            meta[META_LAST_STATUS] = str(failure.status)
        await self._writers[tier - 1].write(
            [
                OutgoingMessage(
                    value=message.value,
                    key=message.key,
                    metadata=meta,
                    created_at=message.created_at or None,
                )
            ]
        )
        self._m_published[tier].inc()

    async def _dead_letter(self, work: Work, failure: Failure, reason: Reason) -> None:
        message = work.message
        source = origin(message)
        now = self._clock.time()
        await self._dlq.put(
            [
                DeadLetter(
                    integration=self._config.name,
                    event_id=event_id(message),
                    payload=message.value,
                    reason=reason,
                    error=failure.error or failure.reason,
                    source_topic=source.topic,
                    source_partition=source.partition,
                    source_offset=source.offset,
                    attempts=work.attempt,
                    http_status=failure.status,
                    key=message.key,
                    metadata=source_metadata(message),
                    stage=failure.stage,
                    first_failure_at=work.first_failure_at or first_failure_at(message) or now,
                    dead_lettered_at=now,
                )
            ]
        )
        self._m_dead.labels(self._config.name, reason.value).inc()


def _reason_of(failure: Failure) -> Reason:
    try:
        return Reason(failure.reason)
    except ValueError:
        # A pipeline stage's own reason (type_error, ...) is a pipeline error in the DLQ.
        return Reason.PIPELINE_ERROR if failure.stage != "delivery" else Reason.HTTP_4XX
