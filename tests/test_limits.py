"""Rate limits per flow on a fake clock: the rate, the burst, live changes, waits and metrics."""

from __future__ import annotations

import asyncio
import bisect
import time

import pytest

from nemesis.config.models import RateLimitsConfig
from nemesis.metrics import Metrics
from nemesis.resilience.limits import (
    MAX_NAP_S,
    Flow,
    FlowLimits,
    RateLimiter,
    wait_recorder,
)
from nemesis.testing.clock import FakeClock


async def drain(
    limiter: RateLimiter, clock: FakeClock, *, until: float, workers: int = 8, batch: int = 1
) -> list[float]:
    """Workers acquiring as fast as the limiter allows until ``until``; the grant times."""
    grants: list[float] = []

    async def worker() -> None:
        while clock.monotonic() < until:
            await limiter.acquire(batch)
            grants.extend([clock.monotonic()] * batch)

    async with asyncio.TaskGroup() as tasks:
        for _ in range(workers):
            tasks.create_task(worker())
    return grants


def busiest(grants: list[float], window_s: float) -> int:
    """The most grants in any window [t, t + window_s) that starts at a grant."""
    ordered = sorted(grants)
    return max(bisect.bisect_left(ordered, start + window_s) - i for i, start in enumerate(ordered))


async def test_the_rate_is_honoured_within_5_percent_over_a_long_run() -> None:
    clock = FakeClock()
    limiter = RateLimiter(100.0, clock=clock)
    clock.advance(3600)  # a long idle stretch first: the bucket is as full as it gets
    started = time.monotonic()
    async with clock.autojump():
        grants = await drain(limiter, clock, until=3600 + 20)
    # 20 s of the fake clock went by; asleep for real, the run would take all of them.
    assert time.monotonic() - started < 20
    for window_s in (1.0, 2.0, 5.0):
        assert busiest(grants, window_s) <= 100 * window_s * 1.05
    assert len(grants) >= 100 * 20 * 0.99  # and it does not fall short of the rate either


async def test_the_burst_after_an_outage_is_bounded() -> None:
    clock = FakeClock()
    limiter = RateLimiter(200.0, clock=clock)
    assert limiter.burst == 10.0  # 50 ms worth
    clock.advance(600)
    async with clock.autojump():
        grants = await drain(limiter, clock, until=600 + 1, workers=50)
    assert grants.count(600.0) == 10
    assert busiest(grants, 1.0) <= 210


async def test_batches_take_one_token_per_message() -> None:
    clock = FakeClock()
    limiter = RateLimiter(50.0, clock=clock)  # a burst of 2.5 messages
    async with clock.autojump():
        grants = await drain(limiter, clock, until=10, workers=4, batch=10)
    # Each batch of 10 waits for its 10 tokens (0.2 s) and goes out as one.
    assert busiest(grants, 2.0) <= 50 * 2 + 10
    assert len(grants) >= 50 * 10 * 0.95
    assert limiter.statistics().acquired == len(grants)


async def test_a_batch_larger_than_the_burst_saves_up_without_lending_to_others() -> None:
    clock = FakeClock()
    limiter = RateLimiter(10.0, clock=clock)  # burst: 1 token, full
    async with clock.autojump():
        waited = await limiter.acquire(5)
        assert waited == pytest.approx(0.4)
        assert await limiter.acquire(1) == pytest.approx(0.1)
    assert limiter.statistics().tokens == pytest.approx(0.0)


async def test_a_newcomer_does_not_jump_the_queue() -> None:
    clock = FakeClock()
    limiter = RateLimiter(10.0, clock=clock)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await limiter.acquire(n)
        order.append(name)

    async with clock.autojump():
        big = asyncio.create_task(take("big", 5))
        await clock.sleep(0.3)  # the batch has saved up 3.5 of its 5 tokens
        await take("small", 1)
        await big
    assert order == ["big", "small"]
    assert clock.monotonic() == pytest.approx(0.5)


async def test_a_snapshot_does_not_cost_a_saving_batch_its_tokens() -> None:
    clock = FakeClock()
    limiter = RateLimiter(10.0, clock=clock)
    async with clock.autojump():
        big = asyncio.create_task(limiter.acquire(5))
        await clock.sleep(0.3)
        assert limiter.statistics().tokens == pytest.approx(4.0)
        assert limiter.statistics().waiting == 1
        limiter.set_rate(10.0)  # the same rate, set again by a reload
        assert await big == pytest.approx(0.4)


async def test_tokens_saved_by_a_cancelled_batch_are_not_a_burst() -> None:
    clock = FakeClock()
    limiter = RateLimiter(10.0, clock=clock)  # burst: 1 token
    async with clock.autojump():
        big = asyncio.create_task(limiter.acquire(5))
        await clock.sleep(0.3)
        big.cancel()
        await asyncio.wait([big])
        waits = [await limiter.acquire() for _ in range(3)]
    assert waits == pytest.approx([0.0, 0.1, 0.1])


async def test_set_rate_higher_takes_effect_for_the_sleeping_head() -> None:
    clock = FakeClock()
    limiter = RateLimiter(0.1, clock=clock)  # one message per 10 s
    await limiter.acquire()
    head = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0)
    clock.advance(0.05)
    limiter.set_rate(100.0)
    async with clock.autojump():
        await head
    assert clock.monotonic() <= 0.05 + MAX_NAP_S


async def test_set_rate_lower_takes_effect_without_a_burst() -> None:
    clock = FakeClock()
    limiter = RateLimiter(1000.0, clock=clock)
    limiter.set_rate(20.0)
    assert limiter.statistics().tokens == 1.0  # not the 50 saved up at 1000/s
    limiter.set_rate(1000.0)
    async with clock.autojump():
        fast = await drain(limiter, clock, until=2)
        limiter.set_rate(20.0)
        assert limiter.statistics().tokens <= limiter.burst == 1.0
        slow = await drain(limiter, clock, until=12)
    assert len(fast) >= 1900
    assert busiest(slow, 1.0) <= 21
    assert len(slow) >= 20 * 10 * 0.95


async def test_set_rate_keeps_the_tokens_built_up_so_far() -> None:
    clock = FakeClock()
    limiter = RateLimiter(10.0, clock=clock)
    await limiter.acquire()  # the bucket is empty at t = 0
    clock.advance(0.05)  # half a token at 10/s
    limiter.set_rate(20.0)
    async with clock.autojump():
        waited = await limiter.acquire()
    assert waited == pytest.approx(0.025)  # the other half at 20/s


async def test_unlimited_acquire_never_suspends() -> None:
    limiter = RateLimiter(None)
    assert limiter.burst == 0.0
    acquiring = limiter.acquire(1_000_000)
    with pytest.raises(StopIteration):
        acquiring.send(None)  # finished on the first step: no await, no token counting
    assert limiter.statistics().acquired == 0


async def test_switching_between_unlimited_and_limited() -> None:
    clock = FakeClock()
    limiter = RateLimiter(1.0, clock=clock)
    await limiter.acquire()
    waiters = [asyncio.create_task(limiter.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    limiter.set_rate(None)
    async with clock.autojump():
        await asyncio.gather(*waiters)
    assert clock.monotonic() <= MAX_NAP_S  # released by the change, not by tokens
    limiter.set_rate(5.0)
    assert limiter.statistics().tokens == 1.0  # a fresh bucket, not a backlog of credit
    with pytest.raises(ValueError, match="positive"):
        limiter.set_rate(0)
    with pytest.raises(ValueError, match="positive"):
        RateLimiter(-1.0)


async def test_waiters_are_served_in_order_and_a_cancelled_one_loses_nothing() -> None:
    clock = FakeClock()
    limiter = RateLimiter(10.0, clock=clock)
    await limiter.acquire()
    order: list[str] = []

    async def take(name: str) -> None:
        await limiter.acquire()
        order.append(name)

    tasks = {name: asyncio.create_task(take(name)) for name in "abcd"}
    await asyncio.sleep(0)
    tasks["a"].cancel()  # the head, asleep: its place goes to the next
    tasks["c"].cancel()  # in the queue: it just leaves
    async with clock.autojump():
        await asyncio.wait(tasks.values())
    assert order == ["b", "d"]
    assert clock.monotonic() == pytest.approx(0.2)  # one token each, none lost to the cancels


async def test_wait_time_is_recorded_per_flow() -> None:
    clock = FakeClock()
    metrics = Metrics()
    seen: list[tuple[Flow, float]] = []
    record = wait_recorder(metrics, "orders")

    def on_wait(flow: Flow, waited_s: float) -> None:
        seen.append((flow, waited_s))
        record(flow, waited_s)

    limits = FlowLimits(
        RateLimitsConfig(main=None, retry=10, replay=2), clock=clock, on_wait=on_wait
    )
    async with clock.autojump():
        for _ in range(3):
            assert await limits.acquire(Flow.MAIN, 100) == 0.0
            await limits.acquire(Flow.RETRY)
    assert [flow for flow, _ in seen] == [Flow.RETRY, Flow.RETRY]
    assert [waited for _, waited in seen] == pytest.approx([0.1, 0.1])
    stats = limits.statistics()
    assert stats[Flow.RETRY].waits == 2
    assert stats[Flow.RETRY].waited_s == pytest.approx(0.2)
    assert stats[Flow.REPLAY].acquired == 0

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"integration": "orders", "flow": "retry"})

    assert sample("nemesis_rate_limit_wait_seconds_count") == 2
    assert sample("nemesis_rate_limit_wait_seconds_sum") == pytest.approx(0.2)


async def test_flows_do_not_take_each_others_budget() -> None:
    clock = FakeClock()
    limits = FlowLimits(RateLimitsConfig(main=100, retry=5, replay=1), clock=clock)
    async with clock.autojump():
        retry_backlog = asyncio.create_task(limits.acquire(Flow.RETRY, 50))
        await asyncio.sleep(0)
        for _ in range(100):
            await limits.acquire(Flow.MAIN)
        assert clock.monotonic() <= 1.0  # fresh traffic at its own pace behind a retry backlog
        assert not retry_backlog.done()
        await retry_backlog


async def test_apply_changes_the_flows_live() -> None:
    clock = FakeClock()
    limits = FlowLimits(RateLimitsConfig(main=100, retry=5, replay=1), clock=clock)
    replay = limits[Flow.REPLAY]
    limits.apply(RateLimitsConfig(main=None, retry=50, replay=1))
    assert limits[Flow.MAIN].rate is None
    assert limits[Flow.RETRY].rate == 50
    assert limits[Flow.REPLAY] is replay
    assert replay.rate == 1


def test_try_acquire_takes_only_what_is_there_now() -> None:
    clock = FakeClock()
    limiter = RateLimiter(10.0, clock=clock, burst_s=1.0)
    assert limiter.try_acquire(10)  # the full burst
    assert not limiter.try_acquire(1)  # nothing left, and nothing was taken
    assert limiter.statistics().acquired == 10
    clock.advance(0.1)
    assert limiter.try_acquire(1)
    assert RateLimiter(None, clock=clock).try_acquire(10**6)
    with pytest.raises(ValueError, match="negative"):
        limiter.try_acquire(-1)
