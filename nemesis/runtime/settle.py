"""What happens to a message after its delivery: the one place that decides.

A delivered or dropped message is finished by the contract and acknowledged
at once. For every other outcome workers never decide on their own whether to
retry or dead-letter: they hand the delivery result to a ``Settler`` and do
what it says (faststream's acknowledgement middleware, dramatiq's Retries).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from nemesis.delivery.port import DeliveryResult, Outcome
from nemesis.runtime.scheduler import Work

log = logging.getLogger(__name__)


class Action(enum.Enum):
    ACK = "ack"  # finished: the offset may be committed
    RETRY_IN_PLACE = "retry_in_place"  # deliver again after `delay_s`, keeping the offset


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    delay_s: float = 0.0


ACK = Decision(Action.ACK)


def backoff_delay(attempt: int, delays_s: Sequence[float], retry_after_s: float | None) -> float:
    """The delay before attempt ``attempt + 1``: the tier for this attempt, raised by Retry-After.

    Past the last tier the last delay repeats. Pure, so tests need no clock.
    """
    base = delays_s[min(attempt, len(delays_s)) - 1] if delays_s else 1.0
    if retry_after_s is not None and retry_after_s > base:
        return retry_after_s
    return base


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a message did not finish: a handler's answer, or a pipeline stage's verdict."""

    outcome: Outcome  # RETRY or DEAD
    reason: str  # for the DLQ: http_4xx, verdict_dead, http_5xx, timeout, decode_error, ...
    error: str | None = None  # short, never the payload
    status: int | None = None
    retry_after_s: float | None = None
    stage: str = "delivery"


def failure_of(result: DeliveryResult) -> Failure:
    """The failure a handler's answer amounts to (only for outcomes that are not done)."""
    status = result.status
    if result.protocol == "grpc":
        # A gRPC code is no HTTP status: it names the reason and stays out of http_status.
        if result.outcome is Outcome.DEAD:
            reason = "verdict_dead" if status == 0 else "grpc_status"
        else:
            reason = "no_answer" if status is None else f"grpc_{status}"
        return Failure(
            result.outcome, reason, error=result.error, retry_after_s=result.retry_after_s
        )
    if result.outcome is Outcome.DEAD:
        # A 2xx that is dead can only be the verdict header; 4xx statuses are the contract table.
        reason = "verdict_dead" if status is not None and status < 300 else "http_4xx"
    elif status is None:
        reason = "no_answer"  # timeout or connection error
    elif status < 300:
        reason = "verdict_retry"
    else:
        reason = f"http_{status // 100}xx"
    return Failure(
        result.outcome,
        reason,
        error=result.error,
        status=status,
        retry_after_s=result.retry_after_s,
    )


class Settler(Protocol):
    async def settle(self, work: Work, failure: Failure) -> Decision: ...


class RetryInPlace:
    """Keeps every failed message and delivers it again after a backoff, forever.

    Used where no retry topic may take the message: with this settler nothing
    is ever committed past a message that did not finish. Dead outcomes are
    retried too (and logged at error), since without a dead-letter store
    dropping them would lose them.
    """

    def __init__(self, integration: str, delays_s: Sequence[float]) -> None:
        self._integration = integration
        self._delays_s = tuple(delays_s)

    async def settle(self, work: Work, failure: Failure) -> Decision:
        message = work.message
        if failure.outcome is Outcome.DEAD:
            log.error(
                "integration %s: handler rejected %s/%s@%s (%s); no dead-letter store is "
                "configured, so it is kept and retried",
                self._integration,
                message.topic,
                message.partition,
                message.offset,
                failure.error,
            )
        delay_s = backoff_delay(work.attempt, self._delays_s, failure.retry_after_s)
        return Decision(Action.RETRY_IN_PLACE, delay_s)
