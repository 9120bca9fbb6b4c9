"""The failure policy as a table: each row one failure in one situation, and what becomes of it.

Delays are the tiers 1s, 5s, 15s and the breaker's 10s cooldown unless a row
says otherwise. Expectations read:

- ``dead-letter <reason>``: written to the DLQ, then acknowledged;
- ``tier <n> in <d>s``: published to retry tier n, due d seconds later;
- ``in place in <d>s``: delivered again after d seconds, keeping its offset;
- ``wait <d>s``: in place too, held back because the handler may be down;
- ``halt in <d>s``: in place at the last delay, its key (or partition) halted;
- ``halt, wait <d>s``: halted, and held back because the handler may be down.

The settlement (``nemesis.runtime.settle``) does what the row says and
decides nothing: whether a key is halted is the policy's answer alone.
"""

from __future__ import annotations

import itertools
from typing import Literal

import pytest

from nemesis.config.models import IntegrationConfig
from nemesis.delivery.contract import Contract, WireError, WireFailure
from nemesis.delivery.port import DeliveryResult, FailureKind
from nemesis.dlq import Reason
from nemesis.resilience.breaker import BreakerState, is_healthy
from nemesis.runtime.policy import (
    HEALTHY,
    Action,
    Decision,
    Failure,
    Health,
    RetryPolicy,
    backoff_s,
    decide,
    failure_of,
    pipeline_failure,
)
from nemesis.runtime.retries import flows_of, tier_topics_of
from nemesis.topology import tier_topic

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
        return f"halt, wait {delay}" if decision.waiting_out else f"halt in {delay}"
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
    # A retry verdict asks to be called again later, as a 503 does: the handler may be
    # unwell (it counts against the breaker), so it waits as any such failure.
    row(K.VERDICT_RETRY, "tier-3", 4, "wait 10s"),
    row(K.VERDICT_RETRY, "tier-3", 5, "dead-letter retries_exhausted"),
    row(K.VERDICT_RETRY, "tier-3", 6, "wait 10s", health="open"),
    row(K.VERDICT_RETRY, "tier-3", 5, "wait 10s", health="quiet"),
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
    row(K.NO_ANSWER, "main", 8, "wait 10s", ordering="partition", health="failing"),
    row(K.VERDICT_RETRY, "main", 4, "wait 10s", ordering="key", health="open"),
    row(K.VERDICT_RETRY, "main", 5, "dead-letter retries_exhausted", ordering="key"),
    # --- halting: the policy halts; nothing after it decides again -------------------------
    # Not exhausted yet: retried in place, its key not halted.
    row(K.SERVER_ERROR, "main", 3, "in place in 15s", ordering="key", on_exhausted="halt"),
    # Exhausted: halted at the last delay ...
    row(K.SERVER_ERROR, "main", 5, "halt in 15s", ordering="key", on_exhausted="halt"),
    row(K.NO_ANSWER, "main", 5, "halt in 15s", ordering="partition", on_exhausted="halt"),
    row(K.VERDICT_RETRY, "main", 5, "halt in 15s", ordering="key", on_exhausted="halt"),
    row(
        K.RATE_LIMITED,
        "main",
        5,
        "halt in 30s",
        ordering="key",
        on_exhausted="halt",
        retry_after_s=30,
    ),
    # ... and halted too while it waits for a handler that may be down: the first time it
    # runs out, and whenever the breaker or the answers say "down".
    row(K.SERVER_ERROR, "main", 4, "halt, wait 10s", ordering="key", on_exhausted="halt"),
    row(K.VERDICT_RETRY, "main", 4, "halt, wait 10s", ordering="key", on_exhausted="halt"),
    row(
        K.SERVER_ERROR,
        "main",
        5,
        "halt, wait 10s",
        ordering="key",
        on_exhausted="halt",
        health="open",
    ),
    row(
        K.SERVER_ERROR,
        "main",
        6,
        "halt, wait 10s",
        ordering="partition",
        on_exhausted="halt",
        health="quiet",
    ),
    row(
        K.VERDICT_RETRY,
        "main",
        7,
        "halt, wait 10s",
        ordering="key",
        on_exhausted="halt",
        health="failing",
    ),
    row(
        K.NO_ANSWER,
        "main",
        4,
        "halt, wait 60s",
        ordering="key",
        on_exhausted="halt",
        retry_after_s=60,
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
    row(
        K.SERVER_ERROR,
        "main",
        4,
        "halt, wait 10s",
        dlq=False,
        ordering="key",
        on_exhausted="halt",
    ),
    # A dead message without a store is kept in place, never halted: it is not exhausted.
    row(K.REJECTED, "main", 9, "in place in 15s", dlq=False, ordering="key", on_exhausted="halt"),
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
            [kind for kind in FailureKind if kind.unwell],
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


CONTRACT = Contract()
GRPC: Literal["grpc"] = "grpc"


def _http(status: int, verdict: str | None = None) -> DeliveryResult:
    headers = {} if verdict is None else {"nemesis-verdict": verdict}
    return CONTRACT.http_answer(status, headers, b"", (), 0.0)


def _grpc(code: int, verdict: str | None = None) -> DeliveryResult:
    trailers = {} if verdict is None else {"nemesis-verdict": verdict}
    return CONTRACT.grpc_answer(code, None, trailers, (), 0.0)


@pytest.mark.parametrize(
    ("result", "kind", "reason"),
    [
        (_http(422), K.REJECTED, Reason.HTTP_4XX),
        (_http(200, "dead"), K.VERDICT_DEAD, Reason.VERDICT_DEAD),
        (_http(503, "dead"), K.VERDICT_DEAD, Reason.VERDICT_DEAD),
        (_grpc(3), K.REJECTED, Reason.GRPC_STATUS),
        (_grpc(0, "dead"), K.VERDICT_DEAD, Reason.VERDICT_DEAD),
        (_grpc(14, "dead"), K.VERDICT_DEAD, Reason.VERDICT_DEAD),
        (_http(503), K.SERVER_ERROR, None),
        (_http(404), K.SERVER_ERROR, None),
        (_http(429), K.RATE_LIMITED, None),
        (_http(200, "retry"), K.VERDICT_RETRY, None),
        (_http(503, "retry"), K.VERDICT_RETRY, None),
        (CONTRACT.wire_error(WireError(WireFailure.REFUSED), 0.0), K.NO_ANSWER, None),
        (_grpc(14), K.SERVER_ERROR, None),
        (_grpc(8), K.RATE_LIMITED, None),
        (_grpc(0, "retry"), K.VERDICT_RETRY, None),
        # Our own deadline, and an answer grpcio refused as too large, carry the library's
        # code; they are no answer, not the handler's DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED.
        (
            CONTRACT.wire_error(WireError(WireFailure.TIMEOUT), 0.0, protocol=GRPC, status=4),
            K.NO_ANSWER,
            None,
        ),
        (
            CONTRACT.wire_error(WireError(WireFailure.TOO_LARGE), 0.0, protocol=GRPC, status=8),
            K.NO_ANSWER,
            None,
        ),
        (
            CONTRACT.wire_error(WireError(WireFailure.CLOSED), None, protocol=GRPC),
            K.NO_ANSWER,
            None,
        ),
    ],
)
def test_the_contract_names_the_kind_and_the_policy_takes_it(
    result: DeliveryResult, kind: FailureKind, reason: Reason | None
) -> None:
    assert result.failure is kind
    assert result.outcome is kind.outcome
    failure = failure_of(result)
    assert failure.kind is kind
    assert failure.kind.dead == (reason is not None)
    if reason is not None:
        assert failure.reason is reason
    # A gRPC code is no HTTP status: it stays out of the DLQ's http_status.
    assert failure.http_status == (None if result.protocol == "grpc" else result.status)


def test_a_result_without_a_kind_is_refused_not_guessed() -> None:
    # Nothing reads the status to recover a kind: a failed result must carry one.
    with pytest.raises(ValueError, match="names no failure kind"):
        failure_of(DeliveryResult(K.SERVER_ERROR.outcome, 503))


@pytest.mark.parametrize("kind", list(FailureKind))
def test_the_breaker_and_the_policy_share_one_definition_of_unwell(kind: FailureKind) -> None:
    # What the breaker counts against the handler is exactly what the policy keeps out
    # of the DLQ while the handler is down; what it counts as healthy is the message's own.
    retry = policy()
    exhausted = decide(Failure(kind), len(TIERS) + 5, 3, retry, OPEN)
    if is_healthy(kind):
        assert kind.dead
        assert exhausted.action is Action.DEAD_LETTER
        assert exhausted.reason is not Reason.RETRIES_EXHAUSTED
    else:
        assert kind.unwell
        assert (exhausted.action, exhausted.waiting_out) == (Action.RETRY_IN_PLACE, True)


@pytest.mark.parametrize("kind", [kind for kind in FailureKind if kind.unwell])
@pytest.mark.parametrize("ordering", ["key", "partition"])
@pytest.mark.parametrize("tiers", [(), (0.1,), TIERS], ids=["no-tiers", "one-tier", "three-tiers"])
@pytest.mark.parametrize("health", list(HEALTHS))
@pytest.mark.parametrize("dlq", [True, False], ids=["dlq", "no-dlq"])
def test_a_halting_integration_halts_exactly_the_exhausted_messages(
    kind: FailureKind, ordering: Ordering, tiers: tuple[float, ...], health: str, dlq: bool
) -> None:
    retry = policy(ordering, "halt", dlq=dlq, tiers=tiers)
    for attempt in range(1, 12):
        decision = decide(Failure(kind), attempt, 0, retry, HEALTHS[health])
        exhausted = attempt > len(tiers)
        assert (decision.action is Action.HALT) == exhausted, attempt
        if not exhausted:
            assert decision.action is Action.RETRY_IN_PLACE


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


@pytest.mark.parametrize("ordering", ORDERINGS)
@pytest.mark.parametrize("dlq", [True, False], ids=["dlq", "no-dlq"])
def test_the_flows_the_topics_and_the_policy_agree_on_tier_topics(
    ordering: Ordering, dlq: bool
) -> None:
    config = IntegrationConfig.model_validate(
        {
            "name": "it",
            "owners": ["team-it"],
            "source": {"topic": "orders", "consumer": "it"},
            "target": {"url": "http://127.0.0.1:9/"},
            "delivery": {"ordering": ordering},
            "retry": {"tiers": ["1s", "5s"]},
        }
    )
    flows = [flow.name for flow in flows_of(config, dead_letters=dlq)]
    topics = tier_topics_of(config, dead_letters=dlq)
    retry = RetryPolicy.of(config, dead_letters=dlq)
    if dlq and ordering == "none":
        assert flows == ["main", "retry-1", "retry-2", "replay"]
        assert topics == [tier_topic("it", 1), tier_topic("it", 2)]
        assert not retry.in_place
    else:
        # Ordered, or nowhere for a last tier to end: retries happen in place.
        assert flows == (["main", "replay"] if dlq else ["main"])
        assert topics == []
        assert retry.in_place


def _queue_integration(ordering: Ordering, via: str | None) -> IntegrationConfig:
    retry: dict[str, object] = {"tiers": ["1s", "5s"]}
    if via is not None:
        retry["via"] = via
    return IntegrationConfig.model_validate(
        {
            "name": "it",
            "owners": ["team-it"],
            "source": {"kind": "sqs", "queue": "orders", "consumer": "it"},
            "target": {"url": "http://127.0.0.1:9/"},
            "delivery": {"ordering": ordering},
            "retry": retry,
        }
    )


@pytest.mark.parametrize("via", [None, "release", "topics"])
@pytest.mark.parametrize("ordering", ORDERINGS)
def test_a_queue_retries_by_release_unless_ordered_or_told_topics(
    ordering: Ordering, via: str | None
) -> None:
    config = _queue_integration(ordering, via)
    flows = [flow.name for flow in flows_of(config, dead_letters=True)]
    retry = RetryPolicy.of(config, dead_letters=True)
    unwell = Failure(FailureKind.SERVER_ERROR, status=503)
    decisions = [decide(unwell, attempt, 0, retry) for attempt in (1, 2, 3)]
    if ordering != "none":
        # Ordered: in place, its key held, whatever via says.
        assert flows == ["main", "replay"]
        assert [d.action for d in decisions[:2]] == [Action.RETRY_IN_PLACE] * 2
    elif via == "topics":
        assert flows == ["main", "retry-1", "retry-2", "replay"]
        assert decisions[0] == Decision(Action.TO_TIER, 1.0, tier=1)
    else:
        # Released for the delay of its attempt (the queue's receive count): no tier flows.
        assert flows == ["main", "replay"]
        assert decisions[:2] == [
            Decision(Action.RELEASE, 1.0, tier=1),
            Decision(Action.RELEASE, 5.0, tier=2),
        ]
        # Past its tiers it waits once for the handler, as everywhere, then the DLQ.
        assert decisions[2].waiting_out
        assert decide(unwell, 4, 0, retry).action is Action.DEAD_LETTER
        rejected = Failure(FailureKind.REJECTED, status=422)
        assert decide(rejected, 1, 0, retry).action is Action.DEAD_LETTER
