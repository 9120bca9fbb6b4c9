"""The source port's contract: what the runner relies on of every source.

Run for every source: each log backend read through its adapter
(``nemesis.broker.logsource.LogSource``, the ``backend`` fixture's kinds) and
the in-memory queue double (``tests.queue_source``), which stands for a
queue until a real one is registered. A case uses only the ``Source``
methods: receive, commit by the source's ``ack_order``, interrupt, sessions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from nemesis.broker.logsource import LogSource
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage
from nemesis.broker.source import AckOrder, Source
from tests.contract.conftest import (
    BACKENDS,
    Backend,
    drop_everything,
    embedded_config,
    kafka_config,
    ydb_config,
)
from tests.queue_source import MemoryQueue, MemoryQueueSource

pytestmark = pytest.mark.timeout(90)


@dataclass
class SourceCase:
    """A source under test: ``put`` values in, ``open`` a source (again) over them."""

    put: Callable[[Sequence[bytes]], Awaitable[None]]
    open: Callable[[], Awaitable[Source]]


@pytest.fixture(params=[*BACKENDS, pytest.param("memory-queue", id="memory-queue")])
async def source_case(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SourceCase]:
    if request.param == "memory-queue":
        queue = MemoryQueue()

        async def put_queue(values: Sequence[bytes]) -> None:
            queue.put(*values)

        async def open_queue() -> Source:
            return MemoryQueueSource(queue)

        yield SourceCase(put_queue, open_queue)
        return
    kind = request.param
    if kind == "kafka":
        config = kafka_config(request.getfixturevalue("kafka").bootstrap, tmp_path)
    elif kind == "embedded":
        config = embedded_config(tmp_path)
    else:
        config = ydb_config(request.node.name)
    backend = Backend(kind, config)
    try:
        async for case in _log_case(backend):
            yield case
    finally:
        await backend.close()
        if kind == "ydb":
            await drop_everything(config)


async def _log_case(backend: Backend) -> AsyncIterator[SourceCase]:
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(ns("jobs"), partitions=1, consumers=[ConsumerSpec(ns("c"))])

    async def put_log(values: Sequence[bytes]) -> None:
        writer = await broker.writer(ns("jobs"))
        await writer.write([OutgoingMessage(value=v) for v in values])
        await writer.close()

    async def open_log() -> Source:
        return LogSource(await broker.reader(ns("jobs"), ns("c")))

    yield SourceCase(put_log, open_log)


async def receive_all(source: Source, count: int, *, timeout_s: float = 30.0) -> list[Message]:
    received: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(received) < count:
        assert time.monotonic() < deadline, f"received {len(received)} of {count}"
        received.extend(await source.receive(100, 0.5))
    return received


async def test_messages_come_in_growing_offsets_of_a_live_session(source_case: SourceCase) -> None:
    await source_case.put([b"m%d" % n for n in range(10)])
    source = await source_case.open()
    try:
        assert isinstance(source.ack_order, AckOrder)
        received = await receive_all(source, 10)
        assert sorted(m.value for m in received) == sorted(b"m%d" % n for n in range(10))
        for message in received:
            assert message.alive
            assert message.session is not None
        sessions = {id(s) for s in source.sessions()}
        assert {id(m.session) for m in received} <= sessions
        offsets = [m.offset for m in received]
        assert offsets == sorted(set(offsets))
    finally:
        await source.close()


async def test_committed_messages_do_not_come_again(source_case: SourceCase) -> None:
    await source_case.put([b"m%d" % n for n in range(6)])
    source = await source_case.open()
    try:
        received = await receive_all(source, 6)
        if source.ack_order is AckOrder.ANY:
            # A queue takes finished messages in any order, each on its own.
            await source.commit([received[3], received[0], received[5]])
            await source.commit([received[1], received[2], received[4]])
        else:
            await source.commit(received)  # a log: the contiguous run, in offset order
    finally:
        await source.close()
    await source_case.put([b"after"])
    again = await source_case.open()
    try:
        assert [m.value for m in await receive_all(again, 1)] == [b"after"]
        assert list(await again.receive(100, 0.5)) == []
    finally:
        await again.close()


async def test_interrupt_ends_a_waiting_receive(source_case: SourceCase) -> None:
    source = await source_case.open()
    try:
        waiting = asyncio.create_task(source.receive(10, 60.0))
        await asyncio.sleep(0.2)  # let it wait
        source.interrupt()
        # Returns long before its 60 s timeout: the case's 90 s limit catches a miss.
        async with asyncio.timeout(30):
            assert list(await waiting) == []
    finally:
        await source.close()
