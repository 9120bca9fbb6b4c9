"""The broker port's contract, written once and run on every backend (see conftest.py).

Each case states a behaviour the runner relies on, in terms of the port
alone: what a write returns, what a reader receives, what a commit keeps
after a restart, how two readers of one consumer share the partitions.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

import pytest

from nemesis.broker.port import (
    ConsumerSpec,
    Message,
    OutgoingMessage,
    TopicReader,
    WriteStatus,
)
from nemesis.errors import TopicExists, TopicNotFound
from tests.contract.conftest import Backend

pytestmark = pytest.mark.timeout(90)


async def receive_all(
    reader: TopicReader, count: int, *, timeout_s: float = 20.0, batch: int = 100
) -> list[Message]:
    """Receives until ``count`` messages arrived; fails after ``timeout_s``."""
    received: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(received) < count:
        assert time.monotonic() < deadline, f"received {len(received)} of {count}"
        received.extend(await reader.receive(batch, 0.5))
    return received


async def commit_all(reader: TopicReader, messages: Sequence[Message]) -> None:
    """Commits every received message, one run per partition session, in read order."""
    for _, run in itertools.groupby(messages, key=lambda m: (m.partition, id(m.session))):
        await reader.commit(list(run))


async def eventually(check: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert callable(check)
        if await check():
            return
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.2)


async def test_append_read_commit_and_redelivery_after_a_restart(backend: Backend) -> None:
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(
        ns("orders"), partitions=2, consumers=[ConsumerSpec(ns("billing"))]
    )
    writer = await broker.writer(ns("orders"), producer_id="shop")
    results = await writer.write(
        [
            OutgoingMessage(
                value=b"v%d" % i,
                key="customer-1",
                metadata={"type": "order.created", "n": str(i)},
                created_at=1_800_000_000.0 + i,
            )
            for i in range(6)
        ]
    )
    assert {r.status for r in results} == {WriteStatus.WRITTEN}
    (partition,) = {r.partition for r in results}  # one key, one partition
    offsets = [r.offset for r in results]
    assert offsets[0] is not None
    assert offsets == list(range(offsets[0], offsets[0] + 6))

    reader = await broker.reader(ns("orders"), ns("billing"))
    messages = await receive_all(reader, 6)
    assert [m.value for m in messages] == [b"v%d" % i for i in range(6)]
    first = messages[0]
    assert (first.topic, first.partition, first.key) == (ns("orders"), partition, "customer-1")
    assert dict(first.metadata) == {"type": "order.created", "n": "0"}
    assert first.producer_id == "shop"
    assert first.created_at == pytest.approx(1_800_000_000.0)
    assert first.written_at == pytest.approx(time.time(), abs=300)
    assert first.alive
    assert [m.offset for m in messages] == offsets
    await reader.commit(messages[:4])
    await broker.close()

    # A restart reads on from the committed offset.
    restarted = await backend.broker()
    again = await receive_all(await restarted.reader(ns("orders"), ns("billing")), 2)
    assert [m.value for m in again] == [b"v4", b"v5"]
    assert [m.offset for m in again] == [m.offset for m in messages[4:]]


async def test_a_consumer_added_later_starts_at_the_oldest_message(backend: Backend) -> None:
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(ns("t"), partitions=1, consumers=[ConsumerSpec(ns("early"))])
    await (await broker.writer(ns("t"))).write([OutgoingMessage(value=b"%d" % i) for i in range(3)])
    await broker.admin.add_consumer(ns("t"), ConsumerSpec(ns("late")))
    messages = await receive_all(await broker.reader(ns("t"), ns("late")), 3)
    assert [m.value for m in messages] == [b"0", b"1", b"2"]


async def test_seqnos_deduplicate_per_producer_across_writers(backend: Backend) -> None:
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(ns("t"), partitions=2)
    writer = await broker.writer(ns("t"), producer_id="p1")
    assert writer.producer_id == "p1"

    async def statuses(seqnos: Sequence[int], producer: str = "p1") -> list[str]:
        writing = writer if producer == "p1" else await broker.writer(ns("t"), producer_id=producer)
        results = await writing.write([OutgoingMessage(value=b"x", seqno=s) for s in seqnos])
        return [r.status.value for r in results]

    assert await statuses([1, 2, 3]) == ["written"] * 3
    # A retried batch: what was written is skipped, what was not is written.
    assert await statuses([2, 3, 4]) == ["duplicate", "duplicate", "written"]
    assert await statuses([5, 5]) == ["written", "duplicate"]
    # Another producer has a sequence of its own.
    assert await statuses([1], producer="p2") == ["written"]
    await writer.close()
    # A new writer of the same producer (a restart) knows what was written.
    reopened = await broker.writer(ns("t"), producer_id="p1")
    results = await reopened.write([OutgoingMessage(value=b"x", seqno=s) for s in (5, 6)])
    assert [r.status for r in results] == [WriteStatus.DUPLICATE, WriteStatus.WRITTEN]
    assert results[0].offset is None


async def test_two_readers_of_one_consumer_share_the_partitions(backend: Backend) -> None:
    ns = backend.names
    broker = await backend.broker()
    partitions = 4
    await broker.admin.create_topic(
        ns("t"), partitions=partitions, consumers=[ConsumerSpec(ns("c"))]
    )
    writer = await broker.writer(ns("t"))
    readers = [await broker.reader(ns("t"), ns("c")), await broker.reader(ns("t"), ns("c"))]
    seen: dict[int, set[int]] = {0: set(), 1: set()}

    async def shared() -> bool:
        # Messages keep coming on every partition: a YDB reader learns of a
        # partition it was given from its first message.
        await writer.write([OutgoingMessage(value=b"", partition=p) for p in range(partitions)])
        for index, reader in enumerate(readers):
            messages = await reader.receive(100, 0.2)
            seen[index].update(m.partition for m in messages)
            await commit_all(reader, [m for m in messages if m.alive])
        held = [{s.partition for s in reader.sessions()} for reader in readers]
        split = all(held) and not held[0] & held[1] and held[0] | held[1] == set(range(partitions))
        # Both have had messages too (on Kafka a session starts at assignment, before any).
        return split and bool(seen[0]) and bool(seen[1])

    await eventually(shared, timeout_s=60)


async def test_describe_reports_end_offsets_and_committed_offsets(backend: Backend) -> None:
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(
        ns("t"),
        partitions=2,
        consumers=[ConsumerSpec(ns("a")), ConsumerSpec(ns("b"))],
        retention_s=3600,
    )
    writer = await broker.writer(ns("t"))
    await writer.write([OutgoingMessage(value=b"", partition=0) for _ in range(5)])
    await writer.write([OutgoingMessage(value=b"", partition=1) for _ in range(2)])
    reader = await broker.reader(ns("t"), ns("a"))
    messages = await receive_all(reader, 7)
    await reader.commit([m for m in messages if m.partition == 0][:3])

    async def described() -> bool:
        description = await broker.admin.describe_topic(ns("t"))
        p0, p1 = description.partitions
        return (
            description.consumers == [ns("a"), ns("b")]
            and description.retention_s == 3600
            and (p0.end_offset - p0.start_offset, p1.end_offset - p1.start_offset) == (5, 2)
            and p0.committed[ns("a")] == p0.start_offset + 3
            and p0.committed[ns("b")] == p0.start_offset
            and p1.committed == {ns("a"): p1.start_offset, ns("b"): p1.start_offset}
            and p0.last_written_at is not None
        )

    await eventually(described)


async def test_topic_lifecycle(backend: Backend) -> None:
    ns = backend.names
    broker = await backend.broker()
    admin = broker.admin
    await admin.create_topic(ns("a"), partitions=2, consumers=[ConsumerSpec(ns("c1"))])
    await admin.create_topic(ns("b"), partitions=1)
    assert {ns("a"), ns("b")} <= set(await admin.list_topics())
    with pytest.raises(TopicExists):
        await admin.create_topic(ns("a"), partitions=2)
    # exist_ok keeps the topic as it is and adds the missing consumers.
    await admin.create_topic(
        ns("a"), partitions=9, consumers=[ConsumerSpec(ns("c2"))], exist_ok=True
    )
    await admin.add_consumer(ns("a"), ConsumerSpec(ns("c1")))
    described = await admin.describe_topic(ns("a"))
    assert (len(described.partitions), described.consumers) == (2, [ns("c1"), ns("c2")])
    await admin.drop_topic(ns("a"))
    assert ns("a") not in await admin.list_topics()
    with pytest.raises(TopicNotFound):
        await admin.describe_topic(ns("a"))
    with pytest.raises(TopicNotFound):
        await broker.reader(ns("b"), ns("nobody"))


async def test_a_stale_sessions_messages_are_not_committed(backend: Backend) -> None:
    """A reader that closes gives its partitions up; what it did not commit comes again."""
    ns = backend.names
    first_broker = await backend.broker()
    await first_broker.admin.create_topic(ns("t"), partitions=1, consumers=[ConsumerSpec(ns("c"))])
    await (await first_broker.writer(ns("t"))).write(
        [OutgoingMessage(value=b"%d" % i) for i in range(4)]
    )
    first = await first_broker.reader(ns("t"), ns("c"))
    taken = await receive_all(first, 4)
    await first.commit(taken[:1])
    await first.close()
    assert not any(m.alive for m in taken)
    await first.commit(taken[1:])  # stale: ignored, not an error

    second = await (await backend.broker()).reader(ns("t"), ns("c"))
    again = await receive_all(second, 3)
    assert [m.value for m in again] == [b"1", b"2", b"3"]
