"""The scheduler's ready queue: bulk admission, batch takes, and cancellation without loss."""

from __future__ import annotations

import asyncio

import pytest

from nemesis.broker.port import Message
from nemesis.runtime.scheduler import Scheduler, Work
from nemesis.testing.clock import FakeClock


def messages(count: int, key: str | None = None) -> list[Message]:
    return [Message("t", 0, offset, b"", key=key) for offset in range(count)]


async def test_put_all_then_take_keeps_read_order() -> None:
    scheduler = Scheduler("none", FakeClock())
    scheduler.put_all(messages(5))
    first = await scheduler.get()
    rest = scheduler.take(10)
    assert [w.message.offset for w in [first, *rest]] == [0, 1, 2, 3, 4]
    assert scheduler.ready == 0
    assert scheduler.take(3) == []
    assert scheduler.get_nowait() is None


async def test_take_stops_at_its_limit() -> None:
    scheduler = Scheduler("none", FakeClock())
    scheduler.put_all(messages(5))
    assert [w.message.offset for w in scheduler.take(2)] == [0, 1]
    assert scheduler.ready == 3


async def test_waiting_workers_are_woken_one_per_message() -> None:
    scheduler = Scheduler("none", FakeClock())
    workers = [asyncio.create_task(scheduler.get()) for _ in range(3)]
    await asyncio.sleep(0)
    scheduler.put_all(messages(2))
    done, pending = await asyncio.wait(workers, timeout=1)
    assert sorted(task.result().message.offset for task in done) == [0, 1]
    assert len(pending) == 1
    scheduler.put(Work(Message("t", 0, 2, b"")))
    assert (await asyncio.wait_for(pending.pop(), 1)).message.offset == 2


async def test_a_worker_cancelled_after_being_woken_leaves_its_message_for_another() -> None:
    scheduler = Scheduler("none", FakeClock())
    first = asyncio.create_task(scheduler.get())
    second = asyncio.create_task(scheduler.get())
    await asyncio.sleep(0)
    scheduler.put_all(messages(1))  # wakes `first` only
    first.cancel()  # before it ran: the message must not go with it
    with pytest.raises(asyncio.CancelledError):
        await first
    got = await asyncio.wait_for(second, 1)
    assert got.message.offset == 0


async def test_key_ordering_still_holds_with_bulk_admission() -> None:
    scheduler = Scheduler("key", FakeClock())
    scheduler.put_all([*messages(3, key="k"), Message("t", 0, 3, b"", key="other")])
    first = await scheduler.get()
    assert [w.message.offset for w in [first, *scheduler.take(10)]] == [0, 3]
    scheduler.done(first)
    assert [w.message.offset for w in scheduler.take(10)] == [1]
