"""Deadlines: one timer for every request of a transport, each request cut at its own time."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from nemesis.delivery.deadlines import Deadlines


async def _wait_past(deadlines: Deadlines, seconds: float) -> tuple[bool, float]:
    """Sleeps ``seconds`` under a deadline: (timed out, loop seconds since the start)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = deadlines.start()
    timed_out = False
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        if not deadline.timed_out():
            raise
        timed_out = True
    finally:
        deadlines.finish(deadline)
    return timed_out, loop.time() - started


async def test_each_deadline_falls_at_its_own_time_with_one_timer() -> None:
    deadlines = Deadlines(0.2)
    tasks = []
    for _ in range(3):
        tasks.append(asyncio.create_task(_wait_past(deadlines, 5.0)))
        await asyncio.sleep(0.05)
    finished_in_time = asyncio.create_task(_wait_past(deadlines, 0.01))
    results = await asyncio.gather(*tasks, finished_in_time)
    for timed_out, elapsed in results[:3]:
        assert timed_out  # cut by its deadline, not ended by its 5 s sleep
        assert elapsed >= 0.2  # never early
    assert results[3][0] is False
    assert len(deadlines) == 0


async def test_the_one_timer_is_armed_for_the_oldest_running_deadline() -> None:
    deadlines = Deadlines(0.2)
    first = asyncio.create_task(_wait_past(deadlines, 5.0))
    await asyncio.sleep(0.05)
    later = [asyncio.create_task(_wait_past(deadlines, 5.0)) for _ in range(2)]
    await asyncio.sleep(0)  # they have started: three deadlines, one timer
    oldest = next(iter(deadlines._running))  # the one switch this test needs
    assert deadlines._timer is not None
    assert deadlines._timer.when() == oldest.at
    assert (await first)[0]
    # Cut at its own time: the timer now waits for the next deadline, not a timeout more.
    following = next(iter(deadlines._running))
    assert following.at > oldest.at
    assert deadlines._timer is not None
    assert deadlines._timer.when() == following.at
    assert all([timed_out for timed_out, _ in await asyncio.gather(*later)])
    assert deadlines._timer is None


async def test_a_task_that_finished_in_time_is_never_cancelled_later() -> None:
    deadlines = Deadlines(0.1)
    timed_out, _ = await _wait_past(deadlines, 0.01)
    assert not timed_out
    await asyncio.sleep(0.3)  # past the deadline: would raise CancelledError if it fired
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_a_cancellation_from_elsewhere_goes_on() -> None:
    deadlines = Deadlines(5.0)
    waiting = asyncio.create_task(_wait_past(deadlines, 5.0))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(deadlines) == 0


async def test_a_swallowed_expiry_leaves_the_task_as_it_was() -> None:
    """A request whose library caught the cancellation: the task is not left 'cancelling'."""
    deadlines = Deadlines(0.05)
    deadline = deadlines.start()
    try:
        with contextlib.suppress(asyncio.CancelledError):  # as a library might
            await asyncio.sleep(0.5)
    finally:
        deadlines.finish(deadline)
    assert deadline.expired
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0
    await asyncio.sleep(0.01)  # and nothing is still pending for it


async def test_closing_stops_the_timer() -> None:
    deadlines = Deadlines(0.05)
    deadline = deadlines.start()
    deadlines.close()
    await asyncio.sleep(0.1)
    assert not deadline.expired
    deadlines.finish(deadline)


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Deadlines(0)
