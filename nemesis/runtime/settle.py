"""Carries out the failure policy's decisions for one flow (``nemesis.runtime.policy`` decides).

A delivered or dropped message is finished by the runner at once. Every
other one comes here: ``Settlement.settle`` asks ``policy.decide`` what to do
and does it, publishing to a retry tier topic, releasing it to a source that
takes it back for a delay (``broker.source.Releases``: a queue's visibility),
writing the DLQ, scheduling a retry in place, and keeping the keys the policy
halted. A flow whose source cannot release (the replay topic of a queue's
integration, on the log) retries in place instead, and so does one whose
release failed: the message is still held. It decides nothing
itself: what becomes of a message is the decision's action alone. Moves are
acknowledged only after the tier write or the DLQ write returned, so a crash
in between delivers the message again (at-least-once; the DLQ row is
idempotent, a duplicate in a tier is delivered twice under the same
``ce-id``).

A dead message the store cannot take waits, unacknowledged, and is written
later (``nemesis.runtime.waiting``): the rest of the flow goes on.

Logs: each dead letter is a warning, and so is a halt; each carries as fields
(``nemesis.logs``) the integration, flow, event id, source topic, partition
and offset, attempt, trace id and, for a dead letter, the reason; never the
payload. Retries are summed up in one warning
per ``RETRY_LOG_INTERVAL_S`` per flow, not a line each: an outage fails every
message, and a line per retry would flood the log at the delivery rate. The
first retry is reported at once; the ones after it with the first retry once
the interval has passed; a summary carries the fields of the retry that
reports it. Each decision is logged at debug.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final

from nemesis import tracecontext
from nemesis.broker.port import Message, OutgoingMessage, TopicWriter
from nemesis.broker.source import Releases, Source, TakesRequeues
from nemesis.clock import Clock
from nemesis.config.models import IntegrationConfig
from nemesis.dlq import DeadLetter, DeadLetterStore, Reason
from nemesis.errors import BrokerError, DlqError
from nemesis.metrics import Metrics
from nemesis.resilience.breaker import CircuitBreaker
from nemesis.runtime.events import event_id
from nemesis.runtime.policy import (
    HEALTHY,
    Action,
    Decision,
    Failure,
    Health,
    RetryPolicy,
    decide,
)
from nemesis.runtime.retries import (
    FlowSpec,
    carried_metadata,
    first_failure_at,
    origin,
    source_metadata,
)
from nemesis.runtime.scheduler import Scheduler, Work
from nemesis.runtime.waiting import WaitingDeadLetters
from nemesis.topology import (
    META_ATTEMPTS,
    META_DUE_AT,
    META_FIRST_FAILURE_AT,
    META_LAST_ERROR,
    META_LAST_SPAN,
    META_LAST_STATUS,
    META_STAGE,
    META_TIER,
)

log = logging.getLogger(__name__)

RETRY_LOG_INTERVAL_S: Final = 60.0
_ERROR_CHARS: Final = 500  # of the last error kept in a tier message's metadata


class Settlement:
    """The executor of one flow: does what the failure policy decides for each failed message."""

    def __init__(
        self,
        config: IntegrationConfig,
        flow: FlowSpec,
        scheduler: Scheduler,
        finish: Callable[[Work], None],
        *,
        clock: Clock,
        dlq: DeadLetterStore | None = None,
        tier_writers: Sequence[TopicWriter] = (),
        breaker: CircuitBreaker | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._name = config.name
        self._flow = flow
        self._scheduler = scheduler
        self._finish = finish
        self._clock = clock
        self._dlq = dlq
        self._writers = tier_writers
        self._breaker = breaker
        self.policy = RetryPolicy.of(config, dead_letters=dlq is not None)
        self._unit = "partition" if config.delivery.ordering == "partition" else "key"
        # Messages past their retries that hold their key (or partition) back, with
        # retry.on_exhausted: halt; each leaves when it finishes or its partition goes.
        self.halted: set[Work] = set()
        metrics = metrics or Metrics()
        self._metrics = metrics
        self._m_retries = metrics.retries_in_place.labels(config.name)
        self._m_halted = metrics.halted_keys.labels(config.name)
        self._m_published = {
            n: metrics.retry_publishes.labels(config.name, str(n))
            for n in range(1, len(config.retry.tiers) + 1)
        }
        self._retries = _RetryLog(config.name, flow.name, clock)
        # The flow's source, once it is open (``use_source``): where releases go, and the
        # address a dead letter keeps so that a requeue sends it back there.
        self._releases: Releases | None = None
        self._address: dict[str, str] = {}
        # Dead messages the store could not take yet; the runner runs its retries.
        self.waiting = (
            None
            if dlq is None
            else WaitingDeadLetters(
                config.name,
                flow.name,
                dlq,
                clock=clock,
                written=self._written,
                let_go=scheduler.done,
            )
        )

    def use_source(self, source: Source) -> None:
        """Takes the flow's open source: releases go to it, dead letters keep its address."""
        self._releases = source if isinstance(source, Releases) else None
        self._address = dict(source.return_address()) if isinstance(source, TakesRequeues) else {}

    def health(self, work: Work) -> Health:
        """The handler's health as the breaker sees it now, and since ``work`` last failed."""
        breaker = self._breaker
        if breaker is None:
            return HEALTHY
        failed_at: float | None = getattr(work, "failed_at", None)
        healthy_at = breaker.last_healthy_at
        answered = failed_at is not None and healthy_at is not None and healthy_at > failed_at
        return Health(breaker.state, breaker.recent_failure_rate, answered)

    async def settle(self, work: Work, failure: Failure) -> Decision:
        """Decides what becomes of a failed message and carries it out."""
        decision = decide(failure, work.attempt, self._flow.tier, self.policy, self.health(work))
        action = decision.action
        if log.isEnabledFor(logging.DEBUG):
            message = origin(work.message)
            log.debug(
                "integration %s: %s/%s@%s attempt %d: %s, %s",
                self._name,
                message.topic,
                message.partition,
                message.offset,
                work.attempt,
                failure.summary,
                action.value,
                extra={**self._fields(work), "stage": failure.stage},
            )
        if action is Action.DEAD_LETTER:
            assert decision.reason is not None
            await self._dead_letter(work, failure, decision.reason)
        elif action is Action.RELEASE:
            await self._release(work, failure, decision)
        elif action is Action.TO_TIER:
            await self._publish(work, failure, decision.tier, decision.delay_s)
            self._retries.note(failure, decision, self._fields(work))
            self._finish(work)
        else:
            if action is Action.HALT:
                self._halt(work)
            elif failure.kind.dead:
                self._keep_dead(work, failure)
            self._retry_in_place(work, failure, decision)
        return decision

    def _fields(self, work: Work) -> dict[str, object]:
        """A log record's coordinates of ``work`` (``nemesis.logs.COORDINATES``)."""
        message = work.message
        fields = _where(origin(message))
        fields["integration"] = self._name
        fields["flow"] = self._flow.name
        fields["event_id"] = event_id(message)
        fields["attempt"] = work.attempt
        if work.trace is not None:
            fields["trace_id"] = work.trace.trace_id
        return fields

    async def _release(self, work: Work, failure: Failure, decision: Decision) -> None:
        """Gives the message back to its source for the tier's delay, and finishes it here."""
        releases = self._releases
        if releases is not None:
            try:
                await releases.release([work.message], decision.delay_s)
            except BrokerError as exc:
                message = origin(work.message)
                log.warning(
                    "integration %s: %s/%s@%s could not be released (%s); retried in place",
                    self._name,
                    message.topic,
                    message.partition,
                    message.offset,
                    exc,
                    extra=self._fields(work),
                )
            else:
                self._m_published[decision.tier].inc()
                self._retries.note(failure, decision, self._fields(work))
                self._finish(work)  # its acknowledgement deletes nothing: it was released
                return
        self._retry_in_place(work, failure, decision)

    def _retry_in_place(self, work: Work, failure: Failure, decision: Decision) -> None:
        if work.first_failure_at is None:
            work.first_failure_at = self._clock.time()
        work.attempt += 1
        work.last_error = failure.error
        work.failed_at = self._clock.monotonic()
        self._m_retries.inc()
        self._retries.note(failure, decision, self._fields(work))
        self._scheduler.put_later(work, decision.delay_s)

    def _halt(self, work: Work) -> None:
        if work in self.halted:
            return
        self.halted.add(work)  # retried at the last delay until the handler accepts it
        self._m_halted.inc()
        message = origin(work.message)
        log.error(
            "integration %s: %s/%s@%s exhausted its retries; its %s is halted until "
            "the handler accepts it (retry.on_exhausted: halt)",
            self._name,
            message.topic,
            message.partition,
            message.offset,
            self._unit,
            extra=self._fields(work),
        )

    def _keep_dead(self, work: Work, failure: Failure) -> None:
        message = origin(work.message)
        log.error(
            "integration %s: handler rejected %s/%s@%s (%s); no dead-letter store is "
            "configured, so it is kept and retried",
            self._name,
            message.topic,
            message.partition,
            message.offset,
            failure.error or failure.summary,
            extra=self._fields(work),
        )

    async def _publish(self, work: Work, failure: Failure, tier: int, delay_s: float) -> None:
        message = work.message
        now = self._clock.time()
        meta = carried_metadata(message)
        meta[META_ATTEMPTS] = str(work.attempt)
        meta[META_DUE_AT] = repr(now + delay_s)
        meta[META_FIRST_FAILURE_AT] = repr(work.first_failure_at or now)
        meta[META_LAST_ERROR] = (failure.error or failure.summary)[:_ERROR_CHARS]
        meta[META_STAGE] = failure.stage
        meta[META_TIER] = str(tier)
        if failure.http_status is not None:
            meta[META_LAST_STATUS] = str(failure.http_status)
        if work.trace is not None:
            # A context Nemesis started goes on in the tier (a record's own travels in it).
            meta.update(tracecontext.carried(work.trace))
        await self._writers[tier - 1].write(
            [
                OutgoingMessage(
                    value=message.value,
                    key=message.key,
                    metadata=meta,
                    created_at=message.created_at or None,
                    headers=message.headers,
                    tombstone=message.tombstone,
                )
            ]
        )
        self._m_published[tier].inc()

    async def _dead_letter(self, work: Work, failure: Failure, reason: Reason) -> None:
        """Writes the message to the DLQ and finishes it; if the store cannot, it waits."""
        # The policy dead-letters only with a store.
        assert self._dlq is not None
        assert self.waiting is not None
        message = work.message
        source = origin(message)
        now = self._clock.time()
        letter = DeadLetter(
            integration=self._name,
            event_id=event_id(message),
            payload=message.value,
            reason=reason,
            error=failure.error or failure.summary,
            source_topic=source.topic,
            source_partition=source.partition,
            source_offset=source.offset,
            attempts=work.attempt,
            http_status=failure.http_status,
            key=message.key,
            metadata=source_metadata(message) | self._address | _trace_kept(work),
            headers=message.headers,
            tombstone=message.tombstone,
            stage=failure.stage,
            first_failure_at=work.first_failure_at or first_failure_at(message) or now,
            dead_lettered_at=now,
        )
        if self.waiting.outage:
            # The store is down: no worker waits on it.
            self.waiting.add(work, letter, failure.summary)
            return
        try:
            await self._dlq.put([letter])
        except DlqError as exc:
            self.waiting.add(work, letter, failure.summary, exc)
            return
        self._written(work, letter, failure.summary)

    def _written(self, work: Work, letter: DeadLetter, summary: str) -> None:
        """A dead letter the store took: counted, logged, and its message finished."""
        self._metrics.dlq_writes.labels(self._name, letter.reason.value).inc()
        log.warning(
            "integration %s: %s/%s@%s dead-lettered (%s) after %d attempts: %s",
            self._name,
            letter.source_topic,
            letter.source_partition,
            letter.source_offset,
            letter.reason.value,
            letter.attempts,
            summary,
            extra={**self._fields(work), "reason": letter.reason.value},
        )
        self._finish(work)


class _RetryLog:
    """Sums up a flow's retries in one warning per interval (the first one at once)."""

    __slots__ = ("_clock", "_flow", "_integration", "_last", "_next_at", "_retried", "_waiting")

    def __init__(self, integration: str, flow: str, clock: Clock) -> None:
        self._integration = integration
        self._flow = flow
        self._clock = clock
        self._next_at = float("-inf")
        self._retried = 0
        self._waiting = 0
        self._last = ""

    def note(self, failure: Failure, decision: Decision, where: dict[str, object]) -> None:
        """Counts one retry; ``where``: its message's coordinates, the last one's reported."""
        self._retried += 1
        self._waiting += decision.waiting_out
        self._last = failure.summary
        now = self._clock.monotonic()
        if now < self._next_at:
            return
        log.warning(
            "integration %s, flow %s: %d retries since the last report (%d of them waiting"
            " for the handler to recover); the last failure: %s",
            self._integration,
            self._flow,
            self._retried,
            self._waiting,
            self._last,
            extra=where,
        )
        self._retried = self._waiting = 0
        self._next_at = now + RETRY_LOG_INTERVAL_S


def _trace_kept(work: Work) -> dict[str, str]:
    """A started trace context, kept with the dead letter so that a requeue continues it;
    and the span of the attempt that dead-lettered it, when that span was recorded."""
    trace = work.trace
    if trace is None:
        # Dead before any attempt (a pipeline stage refused it): its context, or a new one.
        message = work.message
        trace = tracecontext.record_context(message.metadata, message.headers)
        if trace is None:
            trace = work.trace = tracecontext.start()
    kept = tracecontext.carried(trace)
    last_span: str | None = getattr(work, "last_span", None)
    if last_span is not None:
        kept[META_LAST_SPAN] = last_span
    return kept


def _where(message: Message) -> dict[str, object]:
    return {"topic": message.topic, "partition": message.partition, "offset": message.offset}
