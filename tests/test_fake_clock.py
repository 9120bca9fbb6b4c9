"""The public fake clock: sleeping, advancing, and jumping when every task waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from nemesis.clock import Clock
from nemesis.testing.clock import DEFAULT_WALL_START, FakeClock


def test_it_is_a_clock() -> None:
    clock: Clock = FakeClock(start=5.0)
    assert clock.monotonic() == 5.0
    assert clock.time() == DEFAULT_WALL_START
    assert isinstance(clock, FakeClock)
    clock.advance(2.5)
    assert (clock.monotonic(), clock.time()) == (7.5, DEFAULT_WALL_START + 2.5)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)


async def test_sleepers_wake_in_deadline_order_once_time_reaches_them() -> None:
    clock = FakeClock()
    woke: list[tuple[str, float]] = []

    async def nap(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.monotonic()))

    tasks = [asyncio.create_task(nap(n, s)) for n, s in [("late", 3.0), ("early", 1.0)]]
    cancelled = asyncio.create_task(nap("cancelled", 0.5))
    await asyncio.sleep(0)
    assert (clock.sleepers, clock.next_deadline) == (3, 0.5)
    cancelled.cancel()
    await asyncio.wait([cancelled])
    assert (clock.sleepers, clock.next_deadline) == (2, 1.0)
    clock.advance(0.9)
    await asyncio.sleep(0)
    assert woke == []
    clock.advance_to(5.0)
    await asyncio.gather(*tasks)
    assert woke == [("early", 5.0), ("late", 5.0)]
    await clock.sleep(0)  # yields, no deadline


async def test_autojump_jumps_from_deadline_to_deadline() -> None:
    clock = FakeClock()
    ticks: list[float] = []

    async def ticker() -> None:
        for _ in range(5):
            await clock.sleep(60)
            ticks.append(clock.monotonic())

    started = time.monotonic()
    async with clock.autojump():
        await ticker()
    assert ticks == [60, 120, 180, 240, 300]
    # 300 s of the fake clock went by; asleep for real, the run would take all of them.
    assert time.monotonic() - started < 300


async def test_autojump_with_a_threshold_lets_real_io_finish_first() -> None:
    clock = FakeClock()
    seen: list[float] = []

    async def io_then_sleep() -> None:
        await asyncio.sleep(0.02)  # real time, as a socket read would take
        seen.append(clock.monotonic())
        await clock.sleep(1)

    async with clock.autojump(threshold_s=0.1):
        await asyncio.gather(io_then_sleep(), clock.sleep(10))
    assert seen == [0.0]
    assert clock.monotonic() == 10.0


async def test_two_waiters_for_idleness_do_not_keep_each_other_busy() -> None:
    clock = FakeClock()
    async with asyncio.timeout(1):
        await asyncio.gather(clock.wait_all_tasks_blocked(), clock.wait_all_tasks_blocked())
