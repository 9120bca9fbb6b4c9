"""The broker port's offsets for operators, on every backend (see conftest.py).

Where a consumer with no commit starts (``StartFrom``), looking an offset up
by time, moving a committed offset (``seek``), and the live readers a
safety check asks about. The cases speak the port alone; a backend added to
the parametrization implements them.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from nemesis.broker.port import (
    Broker,
    ConsumerSpec,
    Message,
    OutgoingMessage,
    StartFrom,
    TopicReader,
)
from nemesis.errors import BrokerError
from tests.contract.conftest import Backend
from tests.contract.test_broker import commit_all, eventually, receive_all

pytestmark = pytest.mark.timeout(90)


async def write(broker: Broker, topic: str, values: list[bytes]) -> None:
    writer = await broker.writer(topic)
    await writer.write([OutgoingMessage(value=v, partition=0) for v in values])
    await writer.close()


async def two_batches(backend: Backend) -> list[Message]:
    """``t`` (one partition) with a0..a2 written, then b0..b1 written later; all five as read."""
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(
        ns("t"), partitions=1, consumers=[ConsumerSpec(ns("all")), ConsumerSpec(ns("c"))]
    )
    await write(broker, ns("t"), [b"a0", b"a1", b"a2"])
    # Apart in the broker's write time, whatever the clock's resolution.
    await asyncio.sleep(0.05)
    await write(broker, ns("t"), [b"b0", b"b1"])
    return await receive_all(await broker.reader(ns("t"), ns("all")), 5)


async def test_latest_starts_after_what_was_written_before_the_reader(backend: Backend) -> None:
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(ns("t"), partitions=2, consumers=[ConsumerSpec(ns("c"))])
    writer = await broker.writer(ns("t"))
    await writer.write([OutgoingMessage(value=b"old-%d" % i) for i in range(4)])
    reader = await broker.reader(ns("t"), ns("c"), start_from=StartFrom("latest"))
    # The reader holds its partitions before anything new is written.
    await eventually(lambda: _holds(reader, 2))
    await writer.write([OutgoingMessage(value=b"new-%d" % i) for i in range(4)])
    received = await receive_all(reader, 4)
    assert sorted(m.value for m in received) == [b"new-%d" % i for i in range(4)]
    assert list(await reader.receive(10, 0.5)) == []


async def _holds(reader: TopicReader, count: int) -> bool:
    if len(reader.sessions()) < count:
        await reader.receive(1, 0.2)  # YDB starts sessions while reading
        return False
    return True


async def test_a_time_starts_at_the_first_message_written_at_or_after_it(
    backend: Backend,
) -> None:
    ns = backend.names
    messages = await two_batches(backend)
    broker = await backend.broker()
    at = messages[3].written_at
    assert messages[2].written_at < at
    reader = await broker.reader(ns("t"), ns("c"), start_from=StartFrom("time", at))
    received = await receive_all(reader, 2)
    assert [m.value for m in received] == [b"b0", b"b1"]


async def test_start_from_is_ignored_once_the_consumer_committed(backend: Backend) -> None:
    ns = backend.names
    await two_batches(backend)
    broker = await backend.broker()
    reader = await broker.reader(ns("t"), ns("c"))
    first = await receive_all(reader, 2, batch=2)
    await commit_all(reader, first)
    await reader.close()
    again = await broker.reader(ns("t"), ns("c"), start_from=StartFrom("latest"))
    rest = await receive_all(again, 3)
    assert [m.value for m in rest] == [b"a2", b"b0", b"b1"]


async def test_offsets_for_time_finds_the_first_message_at_or_after_a_time(
    backend: Backend,
) -> None:
    ns = backend.names
    messages = await two_batches(backend)
    broker = await backend.broker()
    if backend.kind == "ydb":
        # YDB has no lookup by time (only a reader's read_from): it says so.
        with pytest.raises(BrokerError, match="by time"):
            await broker.admin.offsets_for_time(ns("t"), messages[3].written_at)
        return
    assert await broker.admin.offsets_for_time(ns("t"), messages[3].written_at) == {
        0: messages[3].offset
    }
    assert await broker.admin.offsets_for_time(ns("t"), 0.0) == {0: messages[0].offset}
    # After the last message: the end.
    assert await broker.admin.offsets_for_time(ns("t"), messages[4].written_at + 60) == {
        0: messages[4].offset + 1
    }


async def test_seek_moves_a_committed_offset_back_and_forth(backend: Backend) -> None:
    ns = backend.names
    messages = await two_batches(backend)
    broker = await backend.broker()
    reader = await broker.reader(ns("t"), ns("c"))
    await commit_all(reader, await receive_all(reader, 5))
    await reader.close()
    first, end = messages[0].offset, messages[4].offset + 1

    moved = await broker.admin.seek(ns("t"), ns("c"), 0, first + 1)
    assert (moved.partition, moved.before, moved.after) == (0, end, first + 1)
    assert (await broker.admin.describe_topic(ns("t"))).partitions[0].committed[
        ns("c")
    ] == first + 1
    reader = await broker.reader(ns("t"), ns("c"))
    assert [m.value for m in await receive_all(reader, 4)] == [b"a1", b"a2", b"b0", b"b1"]
    await reader.close()

    # Past the end is the end: nothing to read.
    moved = await broker.admin.seek(ns("t"), ns("c"), 0, end + 100)
    assert (moved.before, moved.after) == (first + 1, end)
    reader = await broker.reader(ns("t"), ns("c"))
    assert list(await reader.receive(10, 1.0)) == []


async def test_seek_names_a_partition_that_does_not_exist(backend: Backend) -> None:
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(ns("t"), partitions=2, consumers=[ConsumerSpec(ns("c"))])
    with pytest.raises(ValueError, match="partition 5 is out of range"):
        await broker.admin.seek(ns("t"), ns("c"), 5, 0)


async def test_live_readers_lists_an_open_reader_and_forgets_a_closed_one(
    backend: Backend,
) -> None:
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(ns("t"), partitions=1, consumers=[ConsumerSpec(ns("c"))])
    assert await broker.admin.live_readers(ns("t"), ns("c")) == []
    reader = await broker.reader(ns("t"), ns("c"))

    async def listed() -> bool:
        await reader.receive(1, 0.2)  # YDB starts the read session while reading
        return len(await broker.admin.live_readers(ns("t"), ns("c"))) == 1

    await eventually(listed)
    await reader.close()

    async def gone() -> bool:
        return await broker.admin.live_readers(ns("t"), ns("c")) == []

    await eventually(gone)


async def test_write_times_are_the_messages_written_at_where_given(backend: Backend) -> None:
    ns = backend.names
    messages = await two_batches(backend)
    broker = await backend.broker()
    times = await broker.admin.write_times(ns("t"), {0: messages[3].offset})
    # A backend may leave out what it cannot tell cheaply; what it tells is exact.
    for partition, written_at in times.items():
        assert partition == 0
        assert written_at == pytest.approx(messages[3].written_at, abs=0.001)
    assert time.time() >= messages[3].written_at - 300
