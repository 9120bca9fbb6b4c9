"""The failure policy: what becomes of a message that did not finish, decided in one place.

``decide`` is a pure function of the failure (its kind, status and
Retry-After), the attempt that failed, the flow it failed in (main, retry
tier n, replay), the integration's retry policy and the handler's health.
It answers with one ``Decision``; ``nemesis.runtime.settle`` carries it out.
The table, in words:

- **Dead** (a 400/409/410/413/415/422, ``nemesis-verdict: dead``, the gRPC
  mirror of those, a pipeline error, a payload that does not decode): to the
  DLQ at once, with the ``Reason`` its kind names, in every flow and ordering
  mode. Without a dead-letter store nothing may drop it: it is retried in
  place at the backoff of its attempt, forever.
- **Retry** (5xx and the statuses the contract counts as the handler's
  trouble, timeouts and refused connections, 429, ``nemesis-verdict:
  retry``): with ``ordering: none`` and retry tier topics it moves to the
  next tier after that tier's delay (main and replay go to tier 1, tier n to
  tier n + 1); with ``ordering: none`` on a source that releases (a queue,
  ``retry.via: release``) it is **released**: given back to the source for
  the delay of its attempt, which is the source's receive count; ordered
  flows, and flows without tier topics, retry in place after the delay of
  the attempt. Retry-After raises any delay, never lowers it.
- **Exhausted** (the last tier failed, or an ordered message failed once per
  tier after its first try): ``retry.on_exhausted: dead_letter`` writes it to
  the DLQ as ``retries_exhausted``; ``halt`` (ordered only) answers **halt**:
  it stays in place at the last delay and its key (or partition) counts as
  halted until the handler accepts it. Without a dead-letter store it stays
  in place at the last delay.
- **The handler may be down**: a retry kind says the handler may be unwell
  (``FailureKind.unwell``, the definition the circuit breaker counts by:
  5xx, timeouts, refused connections, 429, a retry verdict). Such a failure
  is dead-lettered only with evidence that it is the message's own: the
  breaker is closed, the handler's recent answers (the last ``min_requests``
  of them, however old) fail at no more than the breaker's ``open_above``,
  and the handler answered some other message without such a failure since
  this one last failed. Where it would be exhausted without that evidence it
  waits in place for the breaker's ``cooldown_s`` (or Retry-After) and is
  tried again; with ``halt`` it waits so halted, its key held back and
  shown. The first time it runs out it waits so once in any case: an outage
  that has just begun may not show in the answers yet.
  So during an outage messages wait in their topic or in place, never in the
  DLQ, whatever the tiers, the breaker's window and the traffic; a message
  the handler fails alone while others pass reaches the DLQ one cooldown
  later than its tiers say, and one it fails while nothing else is sent
  waits until something is.

A delivered or dropped message never comes here: it is finished by the
contract. The failure's kind is the contract's (``DeliveryResult.failure``)
or the pipeline's; nothing here reads a status to tell kinds apart.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from nemesis.config.models import IntegrationConfig
from nemesis.delivery.port import DeliveryResult, FailureKind
from nemesis.dlq import Reason
from nemesis.resilience.breaker import BreakerState
from nemesis.runtime.retries import moves_to_tiers

Ordering = Literal["none", "key", "partition"]


@dataclass(frozen=True, slots=True)
class Failure:
    """A message that did not finish: what went wrong, typed, with what the DLQ keeps of it."""

    kind: FailureKind
    status: int | None = None  # the HTTP status (gRPC code with protocol "grpc"); None: no answer
    error: str | None = None  # short, never the payload
    retry_after_s: float | None = None
    stage: str = "delivery"
    protocol: Literal["http", "grpc"] = "http"

    @property
    def reason(self) -> Reason:
        """The DLQ reason when it is dead-lettered at once (``retries_exhausted`` is not one)."""
        kind = self.kind
        if kind is FailureKind.REJECTED:
            return Reason.GRPC_STATUS if self.protocol == "grpc" else Reason.HTTP_4XX
        if kind is FailureKind.VERDICT_DEAD:
            return Reason.VERDICT_DEAD
        if kind is FailureKind.DECODE_ERROR:
            return Reason.DECODE_ERROR
        return Reason.PIPELINE_ERROR

    @property
    def summary(self) -> str:
        """A short label for logs and the ``nemesis-last-error`` of a tier message."""
        if self.status is None:
            return self.kind.value
        if self.protocol == "grpc":
            return f"{self.kind.value} (grpc {self.status})"
        return f"{self.kind.value} (http {self.status})"

    @property
    def http_status(self) -> int | None:
        """The status a DLQ row shows: an HTTP status only (a gRPC code is none)."""
        return self.status if self.protocol == "http" else None


def failure_of(result: DeliveryResult) -> Failure:
    """The failure a handler's answer amounts to, of the kind the contract named."""
    kind = result.failure
    if kind is None:
        raise ValueError(f"a {result.outcome.value} result names no failure kind")
    return Failure(
        kind,
        status=result.status,
        error=result.error,
        retry_after_s=result.retry_after_s,
        protocol=result.protocol,
    )


def pipeline_failure(reason: str | None, error: str | None, stage: str | None) -> Failure:
    """The typed failure of a pipeline stage's dead verdict (its own reason kept in ``error``)."""
    kind = FailureKind.DECODE_ERROR if reason == "decode_error" else FailureKind.PIPELINE_ERROR
    if error is None:
        error = reason
    elif reason is not None and reason not in (kind.value, "pipeline_error"):
        error = f"{reason}: {error}"
    return Failure(kind, error=error, stage=stage or "pipeline")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """What an integration allows a failed message: its tiers, ordering and exhausted rule."""

    delays_s: tuple[float, ...]
    ordering: Ordering = "none"
    on_exhausted: Literal["dead_letter", "halt"] = "dead_letter"
    dead_letters: bool = True  # a dead-letter store exists
    tier_topics: bool = True  # retry tier topics exist (unordered integrations with a DLQ)
    releases: bool = False  # failed messages go back to the source for their delay (unordered)
    open_above: float = 0.5  # the breaker's: a recent failure rate above it means "down"
    cooldown_s: float = 30.0  # the breaker's: how long a message waits while the handler is down

    @classmethod
    def of(cls, config: IntegrationConfig, *, dead_letters: bool) -> RetryPolicy:
        ordering = config.delivery.ordering
        return cls(
            delays_s=tuple(config.retry.tiers),
            ordering=ordering,
            on_exhausted=config.retry.on_exhausted,
            dead_letters=dead_letters,
            tier_topics=moves_to_tiers(config, dead_letters=dead_letters),
            releases=config.retries_by_release,
            open_above=config.breaker.open_above,
            cooldown_s=config.breaker.cooldown_s,
        )

    @property
    def in_place(self) -> bool:
        """Whether retries happen in place (ordered, or neither tier topics nor release)."""
        return self.ordering != "none" or not (self.tier_topics or self.releases)

    @property
    def halts(self) -> bool:
        """Whether an exhausted message halts its key (``on_exhausted: halt``, ordered only)."""
        return self.ordering != "none" and self.on_exhausted == "halt"


@dataclass(frozen=True, slots=True)
class Health:
    """The handler's health as the integration sees it now: its breaker and recent answers."""

    breaker: BreakerState = BreakerState.CLOSED
    failure_rate: float | None = None  # of the handler's last answers; None: no answer yet
    # Whether the handler answered some message without a health failure since this one
    # last failed: the evidence that its failure is its own, not the handler's.
    answered_since_failure: bool = True

    def down(self, open_above: float) -> bool:
        """Whether the handler counts as down: a breaker not closed, or most answers failing."""
        if self.breaker is not BreakerState.CLOSED:
            return True
        return self.failure_rate is not None and self.failure_rate > open_above


HEALTHY = Health()


class Action(enum.Enum):
    ACK = "ack"  # finished: the offset may be committed (only after a tier or DLQ write)
    RETRY_IN_PLACE = "retry_in_place"  # deliver again after delay_s, keeping the offset
    TO_TIER = "to_tier"  # publish to retry tier `tier`, due after delay_s, then ack
    DEAD_LETTER = "dead_letter"  # write to the DLQ with `reason`, then ack
    HALT = "halt"  # retry in place after delay_s, its key (or partition) counted as halted
    RELEASE = "release"  # give it back to the source to come again after delay_s


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    delay_s: float = 0.0
    tier: int = 0  # TO_TIER, RELEASE: the tier (1-based)
    reason: Reason | None = None  # DEAD_LETTER: why
    waiting_out: bool = False  # RETRY_IN_PLACE or HALT: held back because the handler may be down


def backoff_s(attempt: int, delays_s: Sequence[float], retry_after_s: float | None) -> float:
    """The delay after failed attempt ``attempt``: that tier's delay, raised by Retry-After.

    Past the last tier the last delay repeats. Pure, so tests need no clock.
    """
    base = delays_s[min(max(attempt, 1), len(delays_s)) - 1] if delays_s else 1.0
    if retry_after_s is not None and retry_after_s > base:
        return retry_after_s
    return base


def decide(
    failure: Failure, attempt: int, tier: int, policy: RetryPolicy, health: Health = HEALTHY
) -> Decision:
    """What to do with a message whose attempt ``attempt`` failed in a flow of ``tier``.

    ``tier`` is the retry tier the message was read from: 0 for main and replay.
    """
    delays, retry_after = policy.delays_s, failure.retry_after_s
    if failure.kind.dead:
        if policy.dead_letters:
            return Decision(Action.DEAD_LETTER, reason=failure.reason)
        return Decision(Action.RETRY_IN_PLACE, backoff_s(attempt, delays, retry_after))
    tiers = len(delays)
    if policy.releases and not policy.in_place:
        # The source counts the attempts (a queue's receive count): attempt n waits tier n.
        if attempt <= tiers:
            return Decision(Action.RELEASE, backoff_s(attempt, delays, retry_after), tier=attempt)
    elif not policy.in_place:
        next_tier = tier + 1
        if next_tier <= tiers:
            return Decision(
                Action.TO_TIER, backoff_s(next_tier, delays, retry_after), tier=next_tier
            )
    elif attempt <= tiers:
        return Decision(Action.RETRY_IN_PLACE, backoff_s(attempt, delays, retry_after))
    # Exhausted.
    last_s = backoff_s(tiers, delays, retry_after)
    halts = policy.halts
    if not policy.dead_letters and not halts:
        return Decision(Action.RETRY_IN_PLACE, last_s)  # nowhere to go, and nothing may drop it
    if failure.kind.unwell and (
        attempt <= tiers + 1 or health.down(policy.open_above) or not health.answered_since_failure
    ):
        # Maybe not the message's fault: it waits for the handler, wherever the tiers end.
        # The first time it runs out it waits once in any case, so that an outage that
        # began with it (after a run of successes, with tiers shorter than it takes the
        # answers to turn) is seen before anything is dead-lettered; after that only the
        # handler answering other messages meanwhile shows the failure is the message's.
        wait_s = policy.cooldown_s
        if retry_after is not None and retry_after > wait_s:
            wait_s = retry_after
        # Past its retries, a message of a halting integration holds its key back while it
        # waits as when the handler rejects it alone: halted, and shown as halted.
        action = Action.HALT if halts else Action.RETRY_IN_PLACE
        return Decision(action, wait_s, waiting_out=True)
    if halts:
        return Decision(Action.HALT, last_s)
    return Decision(Action.DEAD_LETTER, reason=Reason.RETRIES_EXHAUSTED)
