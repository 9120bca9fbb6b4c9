"""The circuit breaker on a fake clock: the rate rule, the hysteresis band, probes, waiting.

Time is a ``FakeClock``: hours of simulated traffic run in milliseconds.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemesis.config.models import BreakerConfig
from nemesis.delivery.contract import answer_for_response
from nemesis.delivery.port import FailureKind
from nemesis.metrics import Metrics
from nemesis.resilience.breaker import (
    BreakerState,
    BreakerTransition,
    CircuitBreaker,
    SlidingWindow,
    bind_breaker_metrics,
    is_healthy,
)
from nemesis.testing.clock import FakeClock

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def config(**changes: float) -> BreakerConfig:
    values: dict[str, float] = {
        "open_above": 0.5,
        "close_below": 0.2,
        "window_s": 10.0,
        "min_requests": 10,
        "cooldown_s": 5.0,
    }
    values.update(changes)
    return BreakerConfig.model_validate(values)


@dataclass
class Rig:
    clock: FakeClock
    breaker: CircuitBreaker
    changes: list[BreakerTransition] = field(default_factory=list)

    def send(self, healthy: bool) -> bool:
        """One request through the breaker, answered at once; False when it was not let through."""
        permit = self.breaker.try_acquire()
        if permit is None:
            return False
        permit.record(healthy)
        return True

    def send_many(self, pattern: str, every_s: float = 0.0) -> None:
        """Requests answered as ``pattern`` says (``.`` healthy, ``x`` failed) ``every_s`` apart."""
        for answer in pattern:
            assert self.send(answer == "."), f"refused while {self.breaker.state}"
            self.clock.advance(every_s)

    def trip(self) -> None:
        """Opens a closed breaker with failures."""
        while self.breaker.state is CLOSED:
            assert self.send(False)

    def to_half_open(self) -> None:
        self.trip()
        self.clock.advance(self.breaker.config.cooldown_s)
        assert self.breaker.state is HALF_OPEN

    @property
    def path(self) -> list[tuple[BreakerState, BreakerState]]:
        return [(change.from_state, change.to_state) for change in self.changes]


def rig(probes_per_round: int | None = None, probe_concurrency: int = 5, **changes: float) -> Rig:
    clock = FakeClock()
    breaker = CircuitBreaker(
        config(**changes),
        clock=clock,
        name="orders",
        probes_per_round=probes_per_round,
        probe_concurrency=probe_concurrency,
    )
    made = Rig(clock, breaker)
    breaker.add_listener(made.changes.append)
    return made


# --- closed -------------------------------------------------------------------


def test_opens_when_the_window_error_rate_exceeds_open_above() -> None:
    r = rig()
    r.send_many("..x.x.x.x.", every_s=0.5)  # 4 of 10: 40%
    assert r.breaker.state is CLOSED
    r.send_many("x")  # 5 of 11: 45%
    r.send_many("x")  # 6 of 12: 50%, not above
    assert r.breaker.state is CLOSED
    r.send_many("x")  # 7 of 13: 54%
    assert r.breaker.state is OPEN
    assert r.path == [(CLOSED, OPEN)]
    assert (r.changes[0].requests, r.changes[0].failures) == (13, 7)
    assert r.breaker.try_acquire() is None


def test_does_not_open_below_min_requests() -> None:
    r = rig(min_requests=10)
    r.send_many("x" * 9, every_s=0.1)
    assert r.breaker.state is CLOSED
    r.send_many("x")
    assert r.breaker.state is OPEN


def test_the_window_forgets_old_errors() -> None:
    r = rig(window_s=10.0, min_requests=10)
    r.send_many("x" * 9)
    r.clock.advance(10.0)
    stats = r.breaker.statistics()
    assert (stats.window_requests, stats.window_failures) == (0, 0)
    r.send_many("x" * 3 + "." * 3)  # 9 old failures would have opened it; they are gone
    assert r.breaker.state is CLOSED
    assert r.breaker.statistics().window_failures == 3


def test_the_window_slides_a_bucket_at_a_time() -> None:
    r = rig(window_s=10.0)  # ten 1-second buckets
    r.send_many("xxxx")  # t = 0
    r.clock.advance(5.0)
    r.send_many("....")  # t = 5
    r.clock.advance(4.9)
    assert r.breaker.statistics().window_requests == 8
    r.clock.advance(0.1)  # t = 10: the first bucket has left the window
    stats = r.breaker.statistics()
    assert (stats.window_requests, stats.window_failures) == (4, 0)
    r.clock.advance(5.0)
    assert r.breaker.statistics().window_requests == 0


def test_message_level_answers_count_as_healthy() -> None:
    # The contract table names the kind; the breaker counts only what says "handler unwell".
    def healthy(status: int | None, verdict: str | None = None) -> bool:
        headers = None if verdict is None else {"nemesis-verdict": verdict}
        return is_healthy(answer_for_response(status, headers).failure)

    assert healthy(200)
    assert healthy(422)
    assert healthy(400)
    assert healthy(200, "drop")
    assert healthy(200, "dead")
    assert not healthy(503)
    assert not healthy(None)  # timeout, refused connection
    assert not healthy(429)
    # The handler asks to be called again later: counts against it, as the contract says.
    assert not healthy(200, "retry")
    r = rig()
    for _ in range(100):
        r.send(is_healthy(FailureKind.REJECTED))
        r.send(is_healthy(FailureKind.VERDICT_DEAD))
        r.send(is_healthy(None))  # delivered or dropped
    assert r.breaker.state is CLOSED
    assert r.breaker.statistics().window_failures == 0


# --- open and half-open -------------------------------------------------------


def test_open_refuses_until_the_cooldown_then_probes() -> None:
    r = rig(cooldown_s=5.0)
    r.trip()
    r.clock.advance(4.9)
    assert r.breaker.try_acquire() is None
    assert r.breaker.statistics().cooldown_remaining_s == pytest.approx(0.1)
    r.clock.advance(0.1)
    permit = r.breaker.try_acquire()
    assert permit is not None
    assert permit.probe
    assert r.breaker.state is HALF_OPEN
    assert r.path == [(CLOSED, OPEN), (OPEN, HALF_OPEN)]


def test_half_open_lets_a_limited_probe_through() -> None:
    r = rig(probes_per_round=10, probe_concurrency=4)
    r.to_half_open()
    permits = [r.breaker.try_acquire() for _ in range(6)]
    first = [p for p in permits if p is not None]
    assert len(first) == 4  # at most probe_concurrency at a time
    assert r.breaker.statistics().probes_in_flight == 4
    issued = len(first)
    for permit in first:
        permit.record(True)
    while (more := r.breaker.try_acquire()) is not None:
        issued += 1
        more.record(True)
        if r.breaker.state is not HALF_OPEN:
            break
    assert issued <= 10  # at most probes_per_round in a round
    assert r.breaker.state is CLOSED


def test_a_probe_round_sends_no_more_than_probes_per_round() -> None:
    r = rig(probes_per_round=4, probe_concurrency=2)
    r.to_half_open()
    r.send_many("..")
    last = [r.breaker.try_acquire(), r.breaker.try_acquire()]
    assert all(last)
    assert last[0] is not None
    last[0].record(False)  # 1 of 3 answered failed: the round is undecided, one probe still out
    assert r.breaker.statistics().probes_in_flight == 1
    assert r.breaker.try_acquire() is None  # a concurrency slot is free, but the round is sent
    assert last[1] is not None
    last[1].record(False)  # 2 of 4: in the band, a new round
    assert r.breaker.statistics().probe_rounds == 1
    assert r.breaker.try_acquire() is not None


def test_half_open_closes_below_close_below() -> None:
    r = rig(probes_per_round=10)
    r.to_half_open()
    r.send_many(".x.......")  # 1 failed; even if the tenth fails: 2 of 10 is not below 20%
    assert r.breaker.state is HALF_OPEN
    r.send_many(".")
    assert r.breaker.state is CLOSED
    assert r.path[-1] == (HALF_OPEN, CLOSED)
    assert (r.changes[-1].requests, r.changes[-1].failures) == (10, 1)
    assert r.breaker.statistics().window_requests == 0  # closed starts from fresh evidence


def test_half_open_closes_as_soon_as_the_verdict_is_certain() -> None:
    r = rig(probes_per_round=10)
    r.to_half_open()
    r.send_many("." * 9)  # even a failed tenth probe leaves 10%
    assert r.breaker.state is CLOSED
    assert r.changes[-1].requests == 9


def test_half_open_reopens_above_open_above() -> None:
    r = rig(probes_per_round=10, cooldown_s=5.0)
    r.to_half_open()
    r.send_many("x.x.x.x.x")  # 5 failed of 9
    assert r.breaker.state is HALF_OPEN
    r.send_many("x")  # 6 of 10
    assert r.breaker.state is OPEN
    assert r.path[-1] == (HALF_OPEN, OPEN)
    r.clock.advance(4.0)
    assert r.breaker.try_acquire() is None  # a fresh cooldown
    r.clock.advance(1.0)
    assert r.breaker.state is HALF_OPEN


def test_half_open_reopens_early_when_failures_already_exceed_open_above() -> None:
    r = rig(probes_per_round=10)
    r.to_half_open()
    r.send_many("xxxxxx")
    assert r.breaker.state is OPEN
    assert r.changes[-1].requests == 6


def test_half_open_in_the_band_stays_and_probes_another_round() -> None:
    r = rig(probes_per_round=10)
    r.to_half_open()
    r.send_many("x..x..x...")  # 30%
    assert r.breaker.state is HALF_OPEN
    stats = r.breaker.statistics()
    assert stats.probe_rounds == 1
    assert stats.round_requests == 0  # a new round started
    r.send_many("." * 9)
    assert r.breaker.state is CLOSED


# --- hysteresis: 30-40% must not flap -----------------------------------------


def flaky(minutes: float, rps: int) -> str:
    """A handler failing 30% and 40% of requests in alternating tens, for ``minutes``."""
    tens = itertools.cycle(["x..x..x...", "x.x..x..x."])
    return "".join(itertools.islice(itertools.chain.from_iterable(tens), int(minutes * 60 * rps)))


def test_a_30_to_40_percent_error_rate_never_opens_a_closed_breaker() -> None:
    r = rig(window_s=30.0, min_requests=20)
    r.send_many(flaky(minutes=60, rps=10), every_s=0.1)  # an hour of traffic
    assert r.changes == []
    assert r.breaker.state is CLOSED
    rate = r.breaker.statistics().error_rate
    assert rate is not None
    assert 0.3 <= rate <= 0.4


def test_a_30_to_40_percent_error_rate_neither_closes_nor_reopens_a_half_open_breaker() -> None:
    r = rig(window_s=30.0, min_requests=20)
    r.to_half_open()
    before = list(r.path)
    r.send_many(flaky(minutes=60, rps=10), every_s=0.1)
    assert r.path == before  # no transition in an hour of probing
    assert r.breaker.state is HALF_OPEN
    assert r.breaker.statistics().probe_rounds == 60 * 60 * 10 // 20


def test_outside_the_band_the_same_traffic_does_move_the_breaker() -> None:
    # The control for the two tests above: the rule is not simply inert.
    r = rig(window_s=30.0, min_requests=20)
    r.send_many("xx.x.x" * 3 + "xx", every_s=0.1)  # 70% of 20
    assert r.breaker.state is OPEN
    r.clock.advance(r.breaker.config.cooldown_s)
    r.send_many("....x....." * 2)  # 10%
    assert r.breaker.state is CLOSED


# --- answers from another state ----------------------------------------------


def test_late_answers_from_before_opening_do_not_count() -> None:
    r = rig(probes_per_round=10)
    early = [r.breaker.try_acquire() for _ in range(5)]
    r.trip()
    for permit in early[:3]:
        assert permit is not None
        permit.record(False)  # arrives while open
    r.clock.advance(r.breaker.config.cooldown_s)
    for permit in early[3:]:
        assert permit is not None
        permit.record(False)  # arrives while half-open: not a probe
    stats = r.breaker.statistics()
    assert stats.state is HALF_OPEN
    assert stats.round_requests == 0
    assert stats.ignored_answers == 5


def test_release_gives_a_probe_slot_back() -> None:
    r = rig(probes_per_round=2, probe_concurrency=2)
    r.to_half_open()
    a, b = r.breaker.try_acquire(), r.breaker.try_acquire()
    assert a is not None
    assert b is not None
    assert r.breaker.try_acquire() is None
    a.release()
    a.release()  # idempotent
    c = r.breaker.try_acquire()
    assert c is not None
    b.record(True)
    c.record(True)
    assert r.breaker.state is CLOSED
    with pytest.raises(RuntimeError):
        c.record(True)


# --- listeners, statistics, metrics -------------------------------------------


def test_listeners_see_every_transition_with_its_evidence(caplog: pytest.LogCaptureFixture) -> None:
    r = rig(probes_per_round=10)

    def broken(change: BreakerTransition) -> None:
        raise ValueError("a bug in a metrics hook")

    r.breaker.add_listener(broken)
    r.trip()
    r.clock.advance(5.0)
    r.send_many("." * 10)
    assert r.path == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]
    assert [c.at for c in r.changes] == [0.0, 5.0, 5.0]
    assert r.changes[0].error_rate == 1.0
    assert r.changes[1].error_rate is None
    assert all(c.name == "orders" for c in r.changes)
    assert "a state-change listener failed" in caplog.text
    r.breaker.remove_listener(broken)


def test_statistics_snapshot() -> None:
    r = rig(cooldown_s=5.0)
    r.send_many("..x", every_s=1.0)
    stats = r.breaker.statistics()
    assert stats.state is CLOSED
    assert stats.time_in_state_s == 3.0
    assert (stats.window_requests, stats.window_failures) == (3, 1)
    assert stats.error_rate == pytest.approx(1 / 3)
    r.trip()
    r.clock.advance(2.0)
    stats = r.breaker.statistics()
    assert stats.state is OPEN
    assert stats.time_in_state_s == 2.0
    assert stats.cooldown_remaining_s == 3.0
    assert stats.transitions == {(CLOSED, OPEN): 1}


def test_metrics_follow_the_breaker() -> None:
    metrics = Metrics()
    r = rig()
    bind_breaker_metrics(r.breaker, metrics)

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"integration": "orders", **labels})

    assert sample("nemesis_breaker_state") == 0
    r.trip()
    assert sample("nemesis_breaker_state") == 1
    r.clock.advance(5.0)
    assert r.breaker.state is HALF_OPEN
    assert sample("nemesis_breaker_state") == 2
    moves = {"from_state": "closed", "to_state": "open"}
    assert sample("nemesis_breaker_transitions_total", **moves) == 1


# --- waiting without busy-waiting ---------------------------------------------


async def test_acquire_waits_out_the_cooldown_on_the_clock() -> None:
    r = rig(cooldown_s=30.0)
    r.trip()
    started = time.monotonic()
    async with r.clock.autojump():
        permit = await r.breaker.acquire()
        await r.breaker.wait_until_not_open()
    # The cooldown went by on the fake clock; waited out for real, it takes 30 s.
    assert time.monotonic() - started < 30
    assert r.clock.monotonic() == 30.0
    assert permit.probe
    assert r.breaker.state is HALF_OPEN


async def test_a_reader_waits_while_open_and_resumes_at_half_open() -> None:
    r = rig(cooldown_s=5.0)
    r.trip()
    reader = asyncio.create_task(r.breaker.wait_until_not_open())
    await asyncio.sleep(0)
    r.clock.advance(4.0)
    await asyncio.sleep(0)
    assert not reader.done()
    r.clock.advance(1.0)
    await asyncio.wait_for(reader, timeout=1)
    assert r.breaker.state is HALF_OPEN


async def test_workers_wait_for_a_probe_slot_and_follow_a_reopening() -> None:
    r = rig(probes_per_round=3, probe_concurrency=1, cooldown_s=5.0)
    r.to_half_open()
    first = await r.breaker.acquire()
    waiting = asyncio.create_task(r.breaker.acquire())
    await asyncio.sleep(0)
    assert not waiting.done()
    first.record(False)  # 1 of 3 failed: undecided, the slot is free again
    second = await asyncio.wait_for(waiting, timeout=1)
    waiting = asyncio.create_task(r.breaker.acquire())
    await asyncio.sleep(0)
    second.record(False)  # 2 of 3: above 50% whatever comes: open again
    assert r.breaker.state is OPEN
    async with r.clock.autojump():
        third = await asyncio.wait_for(waiting, timeout=1)
    assert third.probe
    assert r.clock.monotonic() == 10.0  # woke with the reopening, then slept a full cooldown


async def test_the_permit_context_releases_an_unanswered_probe() -> None:
    r = rig(probes_per_round=1, probe_concurrency=1)
    r.to_half_open()
    with pytest.raises(ConnectionError):
        async with r.breaker.permit():
            raise ConnectionError("the message went stale before sending")
    async with r.breaker.permit() as permit:
        permit.record(True)
    assert r.breaker.state is CLOSED


# --- the state machine against a naive model ----------------------------------

STEPS_S = (0.0, 0.0, 0.01, 0.1, 0.3, 0.5, 1.0, 2.0, 7.0)


@settings(max_examples=100, deadline=None)
@given(
    answers=st.lists(st.tuples(st.sampled_from(STEPS_S), st.booleans()), max_size=250),
    min_requests=st.integers(1, 8),
    window_s=st.sampled_from([1.0, 2.5, 10.0]),
    cooldown_s=st.sampled_from([0.5, 3.0]),
    thresholds=st.sampled_from([(0.5, 0.2), (0.3, 0.1), (0.9, 0.5)]),
)
def test_the_breaker_agrees_with_a_naive_model(
    answers: list[tuple[float, bool]],
    min_requests: int,
    window_s: float,
    cooldown_s: float,
    thresholds: tuple[float, float],
) -> None:
    open_above, close_below = thresholds
    r = rig(
        min_requests=min_requests,
        window_s=window_s,
        cooldown_s=cooldown_s,
        open_above=open_above,
        close_below=close_below,
    )
    shape = SlidingWindow(window_s)
    seen: list[tuple[float, bool]] = []  # every answer since the breaker last closed
    opened_at = 0.0
    legal = {(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED), (HALF_OPEN, OPEN)}

    def in_window(now: float) -> list[bool]:
        oldest = shape.bucket_of(now) - shape.buckets + 1
        return [failed for t, failed in seen if shape.bucket_of(t) >= oldest]

    for step_s, healthy in answers:
        r.clock.advance(step_s)
        now = r.clock.monotonic()
        before = r.breaker.state
        if before is OPEN:
            assert now < opened_at + cooldown_s
            assert r.breaker.try_acquire() is None
            continue
        assert r.send(healthy) or before is HALF_OPEN  # closed never refuses
        after = r.breaker.state
        if before is CLOSED:
            seen.append((now, not healthy))
            window = in_window(now)
            stats = r.breaker.statistics()
            should_open = len(window) >= min_requests and sum(window) / len(window) > open_above
            assert after is (OPEN if should_open else CLOSED)
            if after is CLOSED:
                assert (stats.window_requests, stats.window_failures) == (len(window), sum(window))
        if after is OPEN and before is not OPEN:
            opened_at = now
        if after is CLOSED and before is not CLOSED:
            seen = []
    for change in r.changes:
        assert (change.from_state, change.to_state) in legal
        if change.from_state is HALF_OPEN:
            size = min_requests
            if change.to_state is OPEN:
                assert change.failures / size > open_above
            else:
                assert (change.failures + size - change.requests) / size < close_below


def test_answers_recorded_without_a_permit_while_closed_count_like_permitted_ones() -> None:
    # The runner sends without a permit while the breaker is closed and reports with record().
    clock = FakeClock()
    breaker = CircuitBreaker(config(), clock=clock)
    assert breaker.closed
    for healthy in [True] * 6 + [False] * 6:  # 6 of 12: 50%, not above
        breaker.record(healthy)
    assert breaker.closed
    assert (breaker.statistics().window_requests, breaker.statistics().window_failures) == (12, 6)
    breaker.record(False)  # 7 of 13: 54%
    assert breaker.state is OPEN
    assert breaker.statistics().transitions == {(CLOSED, OPEN): 1}
    # An answer that comes back after the breaker opened is not evidence for a probe round.
    breaker.record(False)
    assert breaker.statistics().ignored_answers == 1


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from([0.0, 0.05, 0.4, 3.0]), st.integers(-3, 40)),
        min_size=1,
        max_size=60,
    ),
    min_requests=st.integers(1, 25),
)
def test_healthy_answers_recorded_together_count_as_recorded_one_by_one(
    steps: list[tuple[float, int]], min_requests: int
) -> None:
    # The runner reports the healthy answers of a turn of the event loop at once.
    # Negative: that many failures, recorded one by one on both breakers.
    rigs = [rig(min_requests=min_requests, window_s=2.0, cooldown_s=1.0) for _ in range(2)]
    one_by_one, together = (r.breaker for r in rigs)
    for step_s, answers in steps:
        for r in rigs:
            r.clock.advance(step_s)
        if answers < 0:
            for _ in range(-answers):
                one_by_one.record(False)
                together.record(False)
        else:
            for _ in range(answers):
                one_by_one.record(True)
            together.record_healthy(answers)
        assert together.statistics() == one_by_one.statistics()
        assert together.recent_failure_rate == one_by_one.recent_failure_rate
        assert together.last_healthy_at == one_by_one.last_healthy_at
    assert rigs[1].path == rigs[0].path


def recent_rate(breaker: CircuitBreaker) -> float | None:
    """Read afresh each time (an assert on the property would narrow its type for mypy)."""
    return breaker.recent_failure_rate


def test_the_recent_failure_rate_sees_an_outage_the_window_still_outweighs() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(config(window_s=30.0, min_requests=20), clock=clock)
    rig = Rig(clock, breaker)
    assert recent_rate(breaker) is None
    rig.send_many("." * 200, every_s=0.01)
    rig.send_many("x" * 15, every_s=0.01)
    # The window weighs 200 successes against 15 failures: still closed ...
    assert breaker.state is CLOSED
    # ... while 15 of the last 20 answers failed: the policy's sign that the handler is down.
    assert recent_rate(breaker) == 15 / 20
    rig.send_many("." * 20)
    assert recent_rate(breaker) == 0.0


def test_the_recent_answers_count_in_every_state_and_survive_a_transition() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(config(min_requests=10), clock=clock)
    rig = Rig(clock, breaker)
    rig.trip()
    assert breaker.state is OPEN
    assert recent_rate(breaker) == 1.0  # the window was cleared; the recent answers not
    clock.advance(breaker.config.cooldown_s)
    rig.send_many("." * 10)  # a probe round that closes it
    assert breaker.state is CLOSED
    assert recent_rate(breaker) == 0.0
