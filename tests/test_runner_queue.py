"""The runner over a queue source (``AckOrder.ANY``): each finished message commits alone.

The source is ``tests.queue_source``, an in-memory queue (a test double for an
SQS-like queue); the delivery is a transport in-process that holds the
messages it is told to until released.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from nemesis.broker.source import Source
from nemesis.config.models import IntegrationConfig
from nemesis.delivery.port import DeliveryResult, Event, Outcome
from nemesis.runtime.runner import IntegrationRunner, RunnerOptions
from tests.operability import wait_until_true
from tests.queue_source import MemoryQueue, MemoryQueueSource

FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=5)


class _Holds:
    """Delivers at once, except messages whose value is in ``held`` until ``release``."""

    def __init__(self, held: set[bytes]) -> None:
        self.held = held
        self.released = asyncio.Event()
        self.delivered: list[int] = []

    async def deliver(self, event: Event) -> DeliveryResult:
        if event.message.value in self.held:
            await self.released.wait()
        self.delivered.append(event.message.offset)
        return DeliveryResult(Outcome.DELIVERED, status=204)

    async def deliver_batch(self, events: Sequence[Event]) -> DeliveryResult:
        raise AssertionError("not a batch integration")

    async def close(self) -> None:
        pass


def _config(**delivery: Any) -> IntegrationConfig:
    return IntegrationConfig.model_validate(
        {
            "name": "jobs",
            "owners": ["team"],
            "source": {"topic": "jobs", "consumer": "jobs"},
            "target": {"url": "http://127.0.0.1:9/"},
            "delivery": {"workers": 4, "buffer": 40, **delivery},
        }
    )


def _runner(queue: MemoryQueue, transport: _Holds, **delivery: Any) -> IntegrationRunner:
    async def open_source() -> Source:
        return MemoryQueueSource(queue)

    return IntegrationRunner(_config(**delivery), open_source, transport, options=FAST)


async def test_a_stuck_message_holds_back_nothing_else_and_each_finished_one_commits() -> None:
    queue = MemoryQueue()
    queue.put(*[b"stuck" if n == 0 else b"n%d" % n for n in range(200)])
    transport = _Holds({b"stuck"})
    runner = _runner(queue, transport)
    task = asyncio.create_task(runner.run())
    # The first message never finishes; the 199 after it are delivered and committed
    # each on its own, out of read order at the source: a log would commit none of them.
    await wait_until_true(lambda: len(queue.acknowledged) == 199, timeout_s=30)
    assert 0 not in queue.acknowledged
    assert sorted(queue.acknowledged) == list(range(1, 200))
    stats = runner.statistics()
    assert stats.unfinished == 1
    assert stats.outstanding == 1
    assert stats.paused_partitions == 0  # nothing held back behind it
    transport.released.set()
    await wait_until_true(lambda: len(queue.acknowledged) == 200, timeout_s=30)
    runner.stop()
    await task
    assert sorted(queue.acknowledged) == list(range(200))


async def test_read_and_not_committed_stays_within_the_buffer() -> None:
    queue = MemoryQueue()
    queue.put(*[b"stuck"] * 100)
    transport = _Holds({b"stuck"})
    runner = _runner(queue, transport, buffer=40)
    task = asyncio.create_task(runner.run())
    await wait_until_true(lambda: queue.handed_out > 0, timeout_s=30)
    await asyncio.sleep(0.3)
    # Every message read is stuck: the flow takes no more than the buffer from the queue.
    assert queue.handed_out == 40
    assert runner.statistics().outstanding == 40
    transport.released.set()
    await wait_until_true(lambda: len(queue.acknowledged) == 100, timeout_s=30)
    runner.stop()
    await task


async def test_stop_drains_what_is_in_flight_and_commits_it() -> None:
    queue = MemoryQueue()
    queue.put(*[b"stuck"] * 4, *[b"n%d" % n for n in range(4, 30)])
    transport = _Holds({b"stuck"})
    runner = _runner(queue, transport, workers=8)
    task = asyncio.create_task(runner.run())
    await wait_until_true(lambda: len(queue.acknowledged) == 26, timeout_s=30)
    runner.stop()
    await asyncio.sleep(0.1)
    transport.released.set()  # the four in flight finish within the grace period
    await task
    assert sorted(queue.acknowledged) == list(range(30))
