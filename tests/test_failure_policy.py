"""The failure policy as a table: each row one failure in one situation, and what becomes of it.

Delays are the tiers 1s, 5s, 15s and the breaker's 10s cooldown unless a row
says otherwise. Expectations read:

- ``dead-letter <reason>``: written to the DLQ, then acknowledged;
- ``tier <n> in <d>s``: published to retry tier n, due d seconds later;
- ``in place in <d>s``: delivered again after d seconds, keeping its offset;
- ``wait <d>s``: in place too, held back because the handler may be down;
- ``halt in <d>s``: in place at the last delay, its key (or partition) halted.
"""

from __future__ import annotations

import itertools
from typing import Literal

import pytest

from nemesis.delivery.port import DeliveryResult, Outcome
from nemesis.dlq import Reason
from nemesis.resilience.breaker import BreakerState
from nemesis.runtime.policy import (
    HEALTHY,
    Action,
    Decision,
    Failure,
    FailureKind,
    Health,
    RetryPolicy,
    backoff_s,
    decide,
    failure_of,
    pipeline_failure,
)

K = FailureKind
TIERS = (1.0, 5.0, 15.0)
FLOWS = {"main": 0, "replay": 0, "tier-1": 1, "tier-2": 2, "tier-3": 3}

OPEN = Health(BreakerState.OPEN, None)
HALF_OPEN = Health(BreakerState.HALF_OPEN, 0.0)
FAILING = Health(BreakerState.CLOSED, 0.9)  # closed, but most recent answers failed
BORDERLINE = Health(BreakerState.CLOSED, 0.5)  # at open_above, not above it
# Closed and mostly passing, but nothing answered since this message last failed.
QUIET = Health(BreakerState.CLOSED, 0.2, answered_since_failure=False)
HEALTHS = {
    "healthy": HEALTHY,
    "open": OPEN,
    "half-open": HALF_OPEN,
    "failing": FAILING,
    "quiet": QUIET,
}

Ordering = Literal["none", "key", "partition"]
OnExhausted = Literal["dead_letter", "halt"]
ORDERINGS: list[Ordering] = ["none", "key", "partition"]
ON_EXHAUSTED: list[OnExhausted] = ["dead_letter", "halt"]


def policy(
    ordering: Ordering = "none",
    on_exhausted: OnExhausted = "dead_letter",
    *,
    dlq: bool = True,
    tiers: tuple[float, ...] = TIERS,
) -> RetryPolicy:
    return RetryPolicy(
        delays_s=tiers,
        ordering=ordering,
        on_exhausted=on_exhausted,
        dead_letters=dlq,
        tier_topics=dlq and ordering == "none",
        open_above=0.5,
        cooldown_s=10.0,
    )


def described(decision: Decision) -> str:
    action, delay = decision.action, f"{decision.delay_s:g}s"
    if action is Action.DEAD_LETTER:
        assert decision.reason is not None
        return f"dead-letter {decision.reason.value}"
    if action is Action.TO_TIER:
        return f"tier {decision.tier} in {delay}"
    if action is Action.HALT:
        return f"halt in {delay}"
    if action is Action.ACK:
        return "ack"
    return f"wait {delay}" if decision.waiting_out else f"in place in {delay}"


def row(
    kind: FailureKind,
    flow: str,
    attempt: int,
    expected: str,
    *,
    ordering: Ordering = "none",
    on_exhausted: OnExhausted = "dead_letter",
    health: str = "healthy",
    dlq: bool = True,
    tiers: tuple[float, ...] = TIERS,
    retry_after_s: float | None = None,
) -> object:
    name = (
        f"{kind.value} {flow} attempt {attempt} ordering={ordering} {on_exhausted}"
        f" {health}{'' if dlq else ' no-dlq'}{f' tiers={len(tiers)}' if tiers != TIERS else ''}"
        f"{f' retry-after={retry_after_s:g}' if retry_after_s else ''} -> {expected}"
    )
    return pytest.param(
        Failure(kind, status=None, retry_after_s=retry_after_s),
        FLOWS[flow],
        attempt,
        policy(ordering, on_exhausted, dlq=dlq, tiers=tiers),
        {**HEALTHS, "borderline": BORDERLINE}[health],
        expected,
        id=name,
    )


TABLE = [
    # --- unordered, with tier topics: up the tiers, then the DLQ -----------------------
    row(K.SERVER_ERROR, "main", 1, "tier 1 in 1s"),
    row(K.SERVER_ERROR, "replay", 1, "tier 1 in 1s"),
    row(K.NO_ANSWER, "tier-1", 2, "tier 2 in 5s"),
    row(K.RATE_LIMITED, "tier-2", 3, "tier 3 in 15s"),
    row(K.VERDICT_RETRY, "tier-2", 3, "tier 3 in 15s"),
    # Retry-After raises a tier's delay, never lowers it.
    row(K.RATE_LIMITED, "main", 1, "tier 1 in 30s", retry_after_s=30),
    row(K.RATE_LIMITED, "tier-1", 2, "tier 2 in 5s", retry_after_s=2),
    # Moving up the tiers is the same whatever the handler's health: the message waits in a topic.
    row(K.SERVER_ERROR, "main", 1, "tier 1 in 1s", health="open"),
    row(K.NO_ANSWER, "tier-2", 3, "tier 3 in 15s", health="failing"),
    # The last tier fails: a health failure waits one cooldown first, then the DLQ.
    row(K.SERVER_ERROR, "tier-3", 4, "wait 10s"),
    row(K.SERVER_ERROR, "tier-3", 5, "dead-letter retries_exhausted"),
    row(K.NO_ANSWER, "tier-3", 5, "dead-letter retries_exhausted", health="borderline"),
    row(K.RATE_LIMITED, "tier-3", 4, "wait 60s", retry_after_s=60),
    # ... but never while the handler is down (the outage rule), however many attempts.
    row(K.SERVER_ERROR, "tier-3", 5, "wait 10s", health="open"),
    row(K.SERVER_ERROR, "tier-3", 9, "wait 10s", health="half-open"),
    row(K.NO_ANSWER, "tier-3", 5, "wait 10s", health="failing"),
    row(K.RATE_LIMITED, "tier-3", 7, "wait 10s", health="failing"),
    # ... nor while nothing else was answered since it last failed: the handler may be down.
    row(K.NO_ANSWER, "tier-3", 5, "wait 10s", health="quiet"),
    row(K.SERVER_ERROR, "main", 2, "wait 10s", tiers=(), health="quiet"),
    # A retry verdict is the handler's word about this message, not about its health.
    row(K.VERDICT_RETRY, "tier-3", 4, "dead-letter retries_exhausted"),
    row(K.VERDICT_RETRY, "tier-3", 4, "dead-letter retries_exhausted", health="open"),
    # No tiers at all: the first failure is the last; a health failure still waits once.
    row(K.SERVER_ERROR, "main", 1, "wait 10s", tiers=()),
    row(K.SERVER_ERROR, "main", 2, "dead-letter retries_exhausted", tiers=()),
    row(K.NO_ANSWER, "main", 2, "wait 10s", tiers=(), health="failing"),
    # --- ordered: in place, then dead-letter and go on, or halt --------------------------
    row(K.SERVER_ERROR, "main", 1, "in place in 1s", ordering="key"),
    row(K.SERVER_ERROR, "main", 2, "in place in 5s", ordering="partition"),
    row(K.RATE_LIMITED, "main", 3, "in place in 20s", ordering="key", retry_after_s=20),
    row(K.SERVER_ERROR, "main", 4, "wait 10s", ordering="key"),
    row(K.SERVER_ERROR, "main", 5, "dead-letter retries_exhausted", ordering="key"),
    row(K.SERVER_ERROR, "main", 5, "halt in 15s", ordering="key", on_exhausted="halt"),
    row(K.NO_ANSWER, "main", 5, "halt in 15s", ordering="partition", on_exhausted="halt"),
    row(K.VERDICT_RETRY, "main", 4, "halt in 15s", ordering="key", on_exhausted="halt"),
    row(K.SERVER_ERROR, "main", 5, "wait 10s", ordering="key", on_exhausted="halt", health="open"),
    row(K.NO_ANSWER, "main", 8, "wait 10s", ordering="partition", health="failing"),
    row(K.VERDICT_RETRY, "main", 4, "dead-letter retries_exhausted", ordering="key", health="open"),
    row(
        K.SERVER_ERROR,
        "main",
        6,
        "wait 10s",
        ordering="partition",
        on_exhausted="halt",
        health="quiet",
    ),
    row(
        K.VERDICT_RETRY,
        "main",
        4,
        "halt in 15s",
        ordering="key",
        on_exhausted="halt",
        health="quiet",
    ),
    # on_exhausted: halt means nothing without ordering: the unordered tiers end in the DLQ.
    row(K.SERVER_ERROR, "tier-3", 5, "dead-letter retries_exhausted", on_exhausted="halt"),
    # --- no dead-letter store: nothing may be dropped, so everything stays in place -------
    row(K.REJECTED, "main", 1, "in place in 1s", dlq=False),
    row(K.VERDICT_DEAD, "main", 2, "in place in 5s", dlq=False, ordering="key"),
    row(K.SERVER_ERROR, "main", 1, "in place in 1s", dlq=False),
    row(K.SERVER_ERROR, "main", 9, "in place in 15s", dlq=False),
    row(K.SERVER_ERROR, "main", 9, "in place in 15s", dlq=False, health="open"),
    row(K.SERVER_ERROR, "main", 5, "halt in 15s", dlq=False, ordering="key", on_exhausted="halt"),
]

# Dead kinds go to the DLQ at once, with their own reason, in every flow, mode and health.
DEAD_REASONS = {
    K.REJECTED: "http_4xx",
    K.VERDICT_DEAD: "verdict_dead",
    K.PIPELINE_ERROR: "pipeline_error",
    K.DECODE_ERROR: "decode_error",
}
TABLE += [
    row(
        kind, flow, attempt, f"dead-letter {reason}", ordering=ordering, on_exhausted=rule, health=h
    )
    for (kind, reason), flow, ordering, rule, h in itertools.product(
        DEAD_REASONS.items(),
        ["main", "tier-2", "replay"],
        ORDERINGS,
        ON_EXHAUSTED,
        ["healthy", "open"],
    )
    if ordering == "none" or flow != "tier-2"  # ordered flows have no tiers
    for attempt in [1 if flow != "tier-2" else 3]
]


@pytest.mark.parametrize(("failure", "tier", "attempt", "retry", "health", "expected"), TABLE)
def test_the_failure_policy(
    failure: Failure,
    tier: int,
    attempt: int,
    retry: RetryPolicy,
    health: Health,
    expected: str,
) -> None:
    assert described(decide(failure, attempt, tier, retry, health)) == expected


@pytest.mark.parametrize(
    ("kind", "flow", "ordering", "on_exhausted"),
    list(
        itertools.product(
            [K.SERVER_ERROR, K.NO_ANSWER, K.RATE_LIMITED],
            list(FLOWS),
            ORDERINGS,
            ON_EXHAUSTED,
        )
    ),
)
@pytest.mark.parametrize("tiers", [(), (0.1,), TIERS], ids=["no-tiers", "one-tier", "three-tiers"])
@pytest.mark.parametrize("health", ["open", "half-open", "failing", "quiet"])
def test_a_health_failure_is_never_dead_lettered_while_the_handler_is_down(
    kind: FailureKind,
    flow: str,
    ordering: Ordering,
    on_exhausted: OnExhausted,
    tiers: tuple[float, ...],
    health: str,
) -> None:
    retry = policy(ordering, on_exhausted, tiers=tiers)
    for attempt in range(1, 12):
        decision = decide(Failure(kind), attempt, FLOWS[flow], retry, HEALTHS[health])
        assert decision.action is not Action.DEAD_LETTER


@pytest.mark.parametrize(
    ("result", "kind", "reason"),
    [
        (DeliveryResult(Outcome.DEAD, 422), K.REJECTED, Reason.HTTP_4XX),
        (DeliveryResult(Outcome.DEAD, 200), K.VERDICT_DEAD, Reason.VERDICT_DEAD),
        (DeliveryResult(Outcome.DEAD, 3, protocol="grpc"), K.REJECTED, Reason.GRPC_STATUS),
        (DeliveryResult(Outcome.DEAD, 0, protocol="grpc"), K.VERDICT_DEAD, Reason.VERDICT_DEAD),
        (DeliveryResult(Outcome.RETRY, 503), K.SERVER_ERROR, None),
        (DeliveryResult(Outcome.RETRY, 404), K.SERVER_ERROR, None),
        (DeliveryResult(Outcome.RETRY, 429), K.RATE_LIMITED, None),
        (DeliveryResult(Outcome.RETRY, None), K.NO_ANSWER, None),
        (DeliveryResult(Outcome.RETRY, 200), K.VERDICT_RETRY, None),
        (DeliveryResult(Outcome.RETRY, 14, protocol="grpc"), K.SERVER_ERROR, None),
        (DeliveryResult(Outcome.RETRY, 8, protocol="grpc"), K.RATE_LIMITED, None),
        (DeliveryResult(Outcome.RETRY, None, protocol="grpc"), K.NO_ANSWER, None),
    ],
)
def test_a_handlers_answer_is_typed_once(
    result: DeliveryResult, kind: FailureKind, reason: Reason | None
) -> None:
    failure = failure_of(result)
    assert failure.kind is kind
    assert failure.kind.dead == (reason is not None)
    if reason is not None:
        assert failure.reason is reason
    # A gRPC code is no HTTP status: it stays out of the DLQ's http_status.
    assert failure.http_status == (None if result.protocol == "grpc" else result.status)


def test_a_pipeline_failure_keeps_its_stage_and_its_own_reason() -> None:
    decode = pipeline_failure("decode_error", "not JSON", "decode")
    assert (decode.kind, decode.reason, decode.stage) == (
        K.DECODE_ERROR,
        Reason.DECODE_ERROR,
        "decode",
    )
    typed = pipeline_failure("type_error", "expr: TypeError", None)
    assert (typed.kind, typed.reason, typed.stage) == (
        K.PIPELINE_ERROR,
        Reason.PIPELINE_ERROR,
        "pipeline",
    )
    assert typed.error == "type_error: expr: TypeError"


@pytest.mark.parametrize(
    ("attempt", "retry_after_s", "expected"),
    [
        (1, None, 1.0),
        (2, None, 5.0),
        (3, None, 15.0),
        (9, None, 15.0),
        (1, 3.0, 3.0),
        (3, 3.0, 15.0),
    ],
)
def test_backoff_is_the_tier_of_the_attempt_raised_by_retry_after(
    attempt: int, retry_after_s: float | None, expected: float
) -> None:
    assert backoff_s(attempt, TIERS, retry_after_s) == expected
