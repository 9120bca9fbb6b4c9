"""The YDB reader and writer against the real SDK, with the server's side played here.

No YDB server runs on the build machine, so these tests do what the SDK's
own tests do (``ydb/_topic_reader/topic_reader_asyncio_test.py``): the SDK
opens its gRPC streams through ``GrpcWrapperAsyncIO``, which is replaced by
the SDK's ``StreamMock``; everything above it is the real SDK (reconnector,
read stream, partition sessions, commit waiters, writer, seqno checks) under
our adapter. The test speaks the server's half of the protocol with the
SDK's own message classes: partition starts and stops, read responses,
commit acks, write acks, stream failures.
"""

from __future__ import annotations

import asyncio
import datetime
import gzip
import itertools
import zlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, cast

import pytest
import zstandard
from ydb import TopicClientAsyncIO, issues
from ydb._grpc.grpcwrapper.common_utils import ServerStatus
from ydb._grpc.grpcwrapper.ydb_topic import (
    Codec,
    OffsetsRange,
    StreamReadMessage,
    StreamWriteMessage,
)
from ydb._topic_common.test_helpers import StreamMock
from ydb._topic_reader import topic_reader_asyncio
from ydb._topic_writer import topic_writer_asyncio
from ydb.aio.driver import Driver

from nemesis.broker.port import (
    Message,
    OutgoingMessage,
    PartitionSession,
    StartFrom,
    WriteStatus,
)
from nemesis.broker.ydb import YdbBroker, YdbReader, YdbSession, YdbWriter
from nemesis.broker.ydb.reader import open_sdk_reader
from nemesis.config.models import YdbBackendConfig
from nemesis.errors import BrokerError, BrokerTimeout, TopicNotFound
from nemesis.testing.clock import FakeClock

WRITTEN_AT = datetime.datetime(2026, 11, 30, 12, 0, 0)  # naive UTC, as protobuf makes them
CREATED_AT = datetime.datetime(2026, 11, 30, 11, 59, 0)
OK = ServerStatus(issues.StatusCode.SUCCESS, [])


# --- the fake transport: the SDK's StreamMock under the real SDK --------------------------


class FakeStream(StreamMock):
    """A gRPC stream that connects nowhere: the test reads from_client, fills from_server."""

    async def start(self, driver: object, stub: object, method: object) -> None:
        return None


# StreamMock's constructor is untyped (it is a test helper of the SDK).
_new_stream = cast(Callable[[], FakeStream], FakeStream)


class Grpc:
    """Replaces the SDK's stream wrapper; hands every stream the SDK opens to the test.

    Also the server's state that outlives one stream: which partition each
    producer id is bound to (YDB binds a producer id to the first partition it
    writes to, and refuses it on any other).
    """

    def __init__(self) -> None:
        self.opened: list[FakeStream] = []
        self._new: asyncio.Queue[FakeStream] = asyncio.Queue()
        self.producers: dict[str, int] = {}
        self.tasks: list[asyncio.Future[None]] = []  # the fake servers' own

    def __call__(self, convert: object) -> FakeStream:
        stream = _new_stream()
        self.opened.append(stream)
        self._new.put_nowait(stream)
        return stream

    async def next_stream(self) -> FakeStream:
        return await asyncio.wait_for(self._new.get(), 2)


class _NoCredentials:
    """All the SDK reads of a driver when its streams are fake."""

    _credentials = None


@pytest.fixture
def grpc(monkeypatch: pytest.MonkeyPatch) -> Grpc:
    fake = Grpc()
    monkeypatch.setattr(topic_reader_asyncio, "GrpcWrapperAsyncIO", fake)
    monkeypatch.setattr(topic_writer_asyncio, "GrpcWrapperAsyncIO", fake)
    return fake


@pytest.fixture
async def topics(grpc: Grpc) -> AsyncIterator[TopicClientAsyncIO]:
    client = TopicClientAsyncIO(cast(Driver, _NoCredentials()))
    yield client
    cast(Callable[[], None], client.close)()  # untyped in the SDK
    for task in grpc.tasks:
        task.cancel()


async def _from_client(stream: FakeStream, kind: type[Any]) -> Any:
    """The next message of ``kind`` the SDK sent on ``stream`` (others are skipped)."""
    while True:
        sent = await asyncio.wait_for(stream.from_client.get(), 2)
        message = getattr(sent, "client_message", getattr(sent, "value", sent))
        if isinstance(message, kind):
            return message


# What one message costs of the reader's read budget (YDB counts its bytes, roughly).
MESSAGE_BYTES = 10


class ReadServer:
    """The server's half of one read stream.

    Plays YDB's flow control: a message is sent only while the bytes the
    reader granted (``ReadRequest``: its buffer at the start, then what it
    frees) cover it; the rest waits here, in order, as on a server. Control
    messages (partition starts and stops, commit acks) are not counted.
    """

    def __init__(
        self,
        stream: FakeStream,
        init: StreamReadMessage.InitRequest,
        budget: int,
        grpc: Grpc,
    ) -> None:
        self.stream = stream
        self.init = init
        self.budget = budget
        self.held: list[tuple[int, int, StreamReadMessage.ReadResponse.MessageData]] = []
        self.received: asyncio.Queue[Any] = asyncio.Queue()  # what the SDK sent, not budget
        grpc.tasks.append(asyncio.ensure_future(self._read_client()))

    @classmethod
    async def accept(cls, grpc: Grpc) -> ReadServer:
        stream = await grpc.next_stream()
        init: StreamReadMessage.InitRequest = await _from_client(
            stream, StreamReadMessage.InitRequest
        )
        stream.from_server.put_nowait(
            StreamReadMessage.FromServer(
                server_status=OK,
                server_message=StreamReadMessage.InitResponse(session_id="read-session"),
            )
        )
        request: StreamReadMessage.ReadRequest = await _from_client(
            stream, StreamReadMessage.ReadRequest
        )
        return cls(stream, init, request.bytes_size, grpc)

    async def _read_client(self) -> None:
        while True:
            sent = await self.stream.from_client.get()
            message = getattr(sent, "client_message", getattr(sent, "value", sent))
            if isinstance(message, StreamReadMessage.ReadRequest):
                self.budget += message.bytes_size
                self._flush()
            else:
                self.received.put_nowait(message)

    def _put(self, message: Any, status: ServerStatus = OK) -> None:
        self.stream.from_server.put_nowait(
            StreamReadMessage.FromServer(server_status=status, server_message=message)
        )

    def start(
        self, session_id: int, partition: int, committed: int = 0, path: str = "/local/orders"
    ) -> None:
        self._put(
            StreamReadMessage.StartPartitionSessionRequest(
                partition_session=StreamReadMessage.PartitionSession(
                    partition_session_id=session_id, path=path, partition_id=partition
                ),
                committed_offset=committed,
                partition_offsets=OffsetsRange(committed, committed),
            )
        )

    def send(
        self,
        session_id: int,
        offsets: Sequence[int],
        *,
        metadata: Mapping[str, bytes] | None = None,
        codec: int = Codec.CODEC_RAW,
        encode: Callable[[bytes], bytes] = bytes,
    ) -> None:
        """Messages of one partition session, sent as the reader's budget allows."""
        for offset in offsets:
            data = StreamReadMessage.ReadResponse.MessageData(
                offset=offset,
                seq_no=offset + 1,
                created_at=CREATED_AT,
                data=encode(b"v%d" % offset),
                metadata_items=dict(metadata or {}),
                uncompresed_size=3,
                message_group_id="shop",
            )
            self.held.append((session_id, codec, data))
        self._flush()

    def _flush(self) -> None:
        """Sends what the budget covers, in order, consecutive messages of a session in a batch."""
        count = min(len(self.held), self.budget // MESSAGE_BYTES)
        if not count:
            return
        sending, self.held = self.held[:count], self.held[count:]
        self.budget -= count * MESSAGE_BYTES
        partitions = [
            StreamReadMessage.ReadResponse.PartitionData(
                partition_session_id=session_id,
                batches=[
                    StreamReadMessage.ReadResponse.Batch(
                        message_data=[data for _, _, data in run],
                        producer_id="shop",
                        write_session_meta={},
                        codec=codec,
                        written_at=WRITTEN_AT,
                    )
                ],
            )
            for (session_id, codec), grouped in itertools.groupby(
                sending, key=lambda item: (item[0], item[1])
            )
            for run in [list(grouped)]
        ]
        self._put(
            StreamReadMessage.ReadResponse(
                partition_data=partitions, bytes_size=count * MESSAGE_BYTES
            )
        )

    def stop(self, session_id: int, graceful: bool = False) -> None:
        self._put(
            StreamReadMessage.StopPartitionSessionRequest(
                partition_session_id=session_id, graceful=graceful, committed_offset=0
            )
        )

    def ack(self, session_id: int, committed: int) -> None:
        self._put(
            StreamReadMessage.CommitOffsetResponse(
                partitions_committed_offsets=[
                    StreamReadMessage.CommitOffsetResponse.PartitionCommittedOffset(
                        partition_session_id=session_id, committed_offset=committed
                    )
                ]
            )
        )

    def fail(self, error: Exception) -> None:
        self.stream.from_server.put_nowait(error)

    def refuse(self, status: issues.StatusCode) -> None:
        self._put(StreamReadMessage.InitResponse(session_id="x"), ServerStatus(status, []))

    async def commit_request(self) -> StreamReadMessage.CommitOffsetRequest:
        while True:
            message = await asyncio.wait_for(self.received.get(), 2)
            if isinstance(message, StreamReadMessage.CommitOffsetRequest):
                return message

    def sent_so_far(self) -> list[Any]:
        """What the SDK has sent on this stream, but for read requests, not read yet."""
        sent = []
        while not self.received.empty():
            sent.append(self.received.get_nowait())
        return sent


@pytest.fixture
async def reader(topics: TopicClientAsyncIO) -> AsyncIterator[YdbReader]:
    opened = YdbReader(
        lambda: open_sdk_reader(topics, "/local/orders", "billing", 1 << 20),
        topic="orders",
        consumer="billing",
        stash_limit=3,
        commit_timeout_s=2.0,
    )
    yield opened
    await opened.close()


async def receive_all(reader: YdbReader, count: int, max_messages: int = 100) -> list[Message]:
    received: list[Message] = []
    async with asyncio.timeout(30):
        while len(received) < count:
            received.extend(await reader.receive(max_messages, 0.5))
    return received


async def quiet_until(reader: YdbReader, reached: Callable[[], bool]) -> None:
    """Receives, expecting nothing, until ``reached()``: the SDK works in the background."""
    async with asyncio.timeout(30):
        while not reached():
            assert await reader.receive(10, 0.05) == ()


def offsets(messages: Sequence[Message]) -> list[tuple[int, int]]:
    return [(m.partition, m.offset) for m in messages]


def session_of(message: Message) -> PartitionSession:
    assert message.session is not None
    return message.session


# --- reading --------------------------------------------------------------------------


async def test_messages_come_with_the_port_fields_and_their_partition_session(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=5, partition=7, committed=10)
    server.send(5, [10, 11], metadata={"type": b"order.created", "__key": b"customer-1"})
    first, second = await receive_all(reader, 2)

    assert (first.topic, first.partition, first.offset, first.value) == ("orders", 7, 10, b"v10")
    assert first.key == "customer-1"
    assert dict(first.metadata) == {"type": "order.created"}
    assert (first.producer_id, first.seqno) == ("shop", 11)
    # Naive protobuf times are UTC, whatever the machine's time zone.
    assert first.written_at == WRITTEN_AT.replace(tzinfo=datetime.UTC).timestamp()
    assert first.created_at == CREATED_AT.replace(tzinfo=datetime.UTC).timestamp()
    session = session_of(first)
    assert isinstance(session, YdbSession)
    assert (session.topic, session.partition, session.id, session.alive) == ("orders", 7, 1, True)
    assert second.session is session
    assert list(reader.sessions()) == [session]


async def test_a_commit_sends_one_chained_range_and_returns_on_the_ack(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0, committed=10)
    server.send(1, [10, 11, 12])
    messages = await receive_all(reader, 3)

    committing = asyncio.create_task(reader.commit(messages[:2]))
    request = await server.commit_request()
    [partition] = request.commit_offsets
    assert partition.partition_session_id == 1
    assert partition.offsets == [OffsetsRange(10, 12)]
    await asyncio.sleep(0.01)
    assert not committing.done()  # not before the server acknowledged it
    server.ack(1, 12)
    await asyncio.wait_for(committing, 2)

    # The next run starts where the last one ended.
    committing = asyncio.create_task(reader.commit(messages[2:]))
    request = await server.commit_request()
    assert request.commit_offsets[0].offsets == [OffsetsRange(12, 13)]
    server.ack(1, 13)
    await asyncio.wait_for(committing, 2)
    assert reader.statistics().inflight == 0


async def test_a_stopped_partitions_messages_are_dropped_and_its_commits_ignored(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.start(session_id=2, partition=1)
    server.send(1, [0, 1])
    taken = await receive_all(reader, 2)
    server.send(1, [2, 3])  # waits in the SDK's buffer while the partition is taken away
    server.stop(1)
    server.send(2, [0])
    assert offsets(await receive_all(reader, 1)) == [(1, 0)]

    assert not taken[0].alive
    assert [s.partition for s in reader.sessions()] == [1]
    await reader.commit(taken)  # ignored: no request, no error
    assert reader.statistics().dropped == 2
    server.send(2, [1])
    assert offsets(await receive_all(reader, 1)) == [(1, 1)]
    assert not [
        m for m in server.sent_so_far() if isinstance(m, StreamReadMessage.CommitOffsetRequest)
    ]


async def test_a_commit_on_its_way_when_the_partition_stops_is_ignored(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.send(1, [0, 1])
    messages = await receive_all(reader, 2)
    committing = asyncio.create_task(reader.commit(messages))
    await server.commit_request()
    server.stop(1)  # before any ack: the SDK fails the waiter with PartitionExpired
    await asyncio.wait_for(committing, 2)
    assert not messages[0].alive


async def test_a_reconnect_ends_the_sessions_and_redelivers_under_new_ones(
    reader: YdbReader, grpc: Grpc
) -> None:
    first = await ReadServer.accept(grpc)
    first.start(session_id=1, partition=0)
    first.send(1, [0, 1])
    before = await receive_all(reader, 2)

    first.fail(issues.Unavailable("the node went away"))  # retriable: the SDK reconnects
    second = await ReadServer.accept(grpc)
    # YDB numbers partition sessions per stream: the new one may reuse the old id.
    second.start(session_id=1, partition=0)
    second.send(1, [0, 1])
    after = await receive_all(reader, 2)

    assert offsets(after) == offsets(before)
    assert not before[0].alive
    assert after[0].alive
    # A different session for the runner's commit tracking, though YDB's id is the same.
    assert session_of(after[0]).id != session_of(before[0]).id
    await reader.commit(before)  # the old session's: ignored
    committing = asyncio.create_task(reader.commit(after))
    assert (await second.commit_request()).commit_offsets[0].offsets == [OffsetsRange(0, 2)]
    second.ack(1, 2)
    await asyncio.wait_for(committing, 2)


async def test_a_receive_that_times_out_or_is_cancelled_loses_nothing(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    assert await reader.receive(10, 0.05) == ()
    waiting = asyncio.create_task(reader.receive(10, 5.0))
    await asyncio.sleep(0.02)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    server.send(1, [0, 1, 2])
    # The SDK receive started by the cancelled call hands its batch to the next.
    assert offsets(await receive_all(reader, 3)) == [(0, 0), (0, 1), (0, 2)]


async def test_interrupt_ends_a_waiting_receive_and_loses_nothing(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    waiting = asyncio.create_task(reader.receive(10, 60.0))
    await asyncio.sleep(0.02)
    assert not waiting.done()
    reader.interrupt()
    assert await asyncio.wait_for(waiting, 5) == ()
    server.send(1, [0, 1])
    # The SDK receive the interrupted call started hands its batch to the next.
    assert offsets(await receive_all(reader, 2)) == [(0, 0), (0, 1)]


async def test_one_reader_reads_several_topics_and_each_session_names_its_own(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    reader = YdbReader(
        lambda: open_sdk_reader(topics, ["/local/orders", "/local/refunds"], "billing", 1 << 20),
        topic="orders, refunds",
        consumer="billing",
        commit_timeout_s=2.0,
        topics=["orders", "refunds"],
    )
    try:
        server = await ReadServer.accept(grpc)
        paths = [selector.path for selector in server.init.topics_read_settings]
        assert paths == ["/local/orders", "/local/refunds"]
        server.start(session_id=1, partition=0, path="/local/orders")
        server.start(session_id=2, partition=0, path="/local/refunds")
        server.send(1, [0, 1])
        server.send(2, [5])
        received = await receive_all(reader, 3)
        assert sorted((m.topic, m.offset) for m in received) == [
            ("orders", 0),
            ("orders", 1),
            ("refunds", 5),
        ]
        assert sorted(s.topic for s in reader.sessions()) == ["orders", "refunds"]
        refund = next(m for m in received if m.topic == "refunds")
        assert session_of(refund).topic == "refunds"
        # Commits stay per partition session, of either topic.
        commit = asyncio.create_task(reader.commit([refund]))
        request = await server.commit_request()
        assert [p.partition_session_id for p in request.commit_offsets] == [2]
        server.ack(2, 6)
        await commit
    finally:
        await reader.close()


async def test_a_batch_larger_than_asked_for_is_handed_out_in_order(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.send(1, [0, 1, 2, 3, 4])
    await asyncio.sleep(0.02)
    first = await reader.receive(10, 1.0)  # the SDK's receive asked for up to 10
    assert offsets(first) == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]
    server.send(1, [5, 6, 7])
    got = [offsets(await reader.receive(2, 1.0)) for _ in range(2)]
    assert got == [[(0, 5), (0, 6)], [(0, 7)]]


async def test_pause_holds_a_partition_back_and_resume_hands_it_out_first(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.start(session_id=2, partition=1)
    server.send(1, [0])
    [head] = await receive_all(reader, 1)
    paused = session_of(head)
    reader.pause(paused)
    server.send(1, [1, 2])
    server.send(2, [0])
    assert offsets(await receive_all(reader, 1)) == [(1, 0)]
    assert await reader.receive(10, 0.05) == ()
    assert reader.statistics().stashed == 2

    # A receive waiting for new messages wakes up at the resume.
    waiting = asyncio.create_task(reader.receive(10, 5.0))
    await asyncio.sleep(0.02)
    reader.resume(paused)
    assert offsets(await asyncio.wait_for(waiting, 1.0)) == [(0, 1), (0, 2)]
    server.send(1, [3])
    assert offsets(await receive_all(reader, 1)) == [(0, 3)]


async def test_a_paused_partition_past_its_stash_costs_the_others_nothing(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    # A read buffer of 5 messages: the server sends no more than the reader frees.
    reader = YdbReader(
        lambda: open_sdk_reader(topics, "/local/orders", "billing", 5 * MESSAGE_BYTES),
        topic="orders",
        consumer="billing",
        stash_limit=3,
        commit_timeout_s=2.0,
    )
    try:
        server = await ReadServer.accept(grpc)
        server.start(session_id=1, partition=0)
        server.start(session_id=2, partition=1)
        server.send(1, [0])
        [head] = await receive_all(reader, 1)
        reader.pause(session_of(head))
        server.send(1, list(range(1, 11)))  # 10 messages: past the stash's 3
        # With partition 0 paused and spilled, partition 1 delivers all of its 60.
        server.send(2, list(range(60)))
        others = await receive_all(reader, 60)
        assert offsets(others) == [(1, offset) for offset in range(60)]
        stats = reader.statistics()
        assert (stats.paused, stats.spilled, stats.stashed, stats.dropped) == (1, 1, 0, 10)
        committing = asyncio.create_task(reader.commit([head]))  # the paused one's commits work
        assert (await server.commit_request()).commit_offsets[0].offsets == [OffsetsRange(0, 1)]
        server.ack(1, 1)
        await asyncio.wait_for(committing, 2)

        # The resume reads everything again from a new read session.
        reader.resume(session_of(head))
        again = asyncio.create_task(receive_all(reader, 10))
        second = await ReadServer.accept(grpc)
        assert not head.alive
        assert not others[0].alive
        second.start(session_id=1, partition=0, committed=1)
        second.send(1, list(range(1, 11)))
        assert offsets(await again) == [(0, offset) for offset in range(1, 11)]
        assert reader.statistics().reopens == 1
    finally:
        await reader.close()


async def test_the_pause_stash_is_bounded_in_bytes_too(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    reader = YdbReader(
        lambda: open_sdk_reader(topics, "/local/orders", "billing", 1 << 20),
        topic="orders",
        consumer="billing",
        stash_limit=1000,
        stash_bytes=7,  # three messages of 2 bytes (v1, v2, v3)
    )
    try:
        server = await ReadServer.accept(grpc)
        server.start(session_id=1, partition=0)
        server.send(1, [0])
        [head] = await receive_all(reader, 1)
        reader.pause(session_of(head))
        server.send(1, [1, 2, 3])
        await quiet_until(reader, lambda: reader.statistics().stashed == 3)
        assert (reader.statistics().stashed_bytes, reader.statistics().spilled) == (6, 0)
        server.send(1, [4])
        await quiet_until(reader, lambda: reader.statistics().spilled == 1)
        stats = reader.statistics()
        assert (stats.stashed, stats.stashed_bytes, stats.spilled) == (0, 0, 1)
    finally:
        await reader.close()


async def test_partitions_count_as_assigned_from_their_start_not_their_first_message(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.start(session_id=2, partition=1)
    # Nothing written: no message at all, and yet two partitions held.
    await quiet_until(reader, lambda: len(reader.sessions()) == 2)
    assert [s.partition for s in reader.sessions()] == [0, 1]
    assert reader.statistics().sessions == 2
    server.stop(2)
    await quiet_until(reader, lambda: len(reader.sessions()) == 1)
    assert [s.partition for s in reader.sessions()] == [0]

    # A reader that reconnects and then reads nothing still holds its partitions.
    server.fail(issues.Unavailable("the node went away"))
    second = await ReadServer.accept(grpc)
    second.start(session_id=1, partition=0)
    second.start(session_id=2, partition=2)
    await quiet_until(reader, lambda: [s.partition for s in reader.sessions()] == [0, 2])
    # A session listed before its first message is the one its messages come with.
    listed = reader.sessions()[1]
    second.send(2, [0])
    [message] = await receive_all(reader, 1)
    assert message.session is listed


# --- codecs -----------------------------------------------------------------------------------


def zstd_frames(data: bytes) -> bytes:
    """ZSTD as streaming producers write it: no content size in the header, two frames."""
    half = len(data) // 2
    frames = b""
    for part in (data[:half], data[half:]):
        compressor = zstandard.ZstdCompressor().compressobj()
        frames += compressor.compress(part) + compressor.flush()
    return frames


async def test_zstd_messages_are_decoded(reader: YdbReader, grpc: Grpc) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.send(1, [0, 1], codec=Codec.CODEC_ZSTD, encode=zstd_frames)
    server.send(1, [2], codec=Codec.CODEC_GZIP, encode=gzip.compress)
    assert [m.value for m in await receive_all(reader, 3)] == [b"v0", b"v1", b"v2"]


async def test_a_codec_nemesis_cannot_decode_parks_its_partition_and_says_why(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.start(session_id=2, partition=1)
    server.send(1, [0, 1], codec=Codec.CODEC_LZOP, encode=lambda data: b"lzop:" + data)
    server.send(2, [0])
    server.send(1, [2])  # after the parked batch: not handed out either
    server.send(2, [1])
    assert offsets(await receive_all(reader, 2)) == [(1, 0), (1, 1)]
    await quiet_until(reader, lambda: reader.statistics().dropped == 3)  # 0, 1 and 2
    stats = reader.statistics()
    assert stats.parked == {
        0: "orders[0] offset 0 is compressed with LZOP, which Nemesis cannot decode"
        " (it reads RAW, GZIP and ZSTD): the partition is parked"
    }
    assert stats.sessions == 2  # still held: the committed offset stays before it
    # What the runner, the admin API and nemesis_stalled_partitions show.
    assert reader.stalled() == {("orders", 0): stats.parked[0]}


async def test_an_unknown_codec_fails_the_reader_naming_it(reader: YdbReader, grpc: Grpc) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.send(1, [0], codec=10042)  # a custom codec
    with pytest.raises(BrokerError, match=r"codec Nemesis cannot decode .*10042"):
        await receive_all(reader, 1)


async def test_a_commit_that_times_out_is_a_broker_timeout_and_a_late_ack_is_harmless(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    reader = YdbReader(
        lambda: open_sdk_reader(topics, "/local/orders", "billing", 1 << 20),
        topic="orders",
        consumer="billing",
        commit_timeout_s=0.05,
    )
    try:
        server = await ReadServer.accept(grpc)
        server.start(session_id=1, partition=0)
        server.send(1, [0, 1])
        messages = await receive_all(reader, 2)
        with pytest.raises(BrokerTimeout, match="commit orders"):
            await reader.commit(messages[:1])
        assert (await server.commit_request()).commit_offsets[0].offsets == [OffsetsRange(0, 1)]
        server.ack(1, 1)  # resolves the SDK's waiter, which must not have been cancelled
        server.send(1, [2])
        assert offsets(await receive_all(reader, 1)) == [(0, 2)]
        assert grpc.opened == [server.stream]  # no reconnect: the stream survived
        # The next commit covers the run whose commit failed: no gap is left behind.
        committing = asyncio.create_task(reader.commit(messages[1:]))
        assert (await server.commit_request()).commit_offsets[0].offsets == [OffsetsRange(0, 2)]
        server.ack(1, 2)
        await asyncio.wait_for(committing, 2)
        assert reader.statistics().inflight == 1  # offset 2, not committed yet
    finally:
        await reader.close()


async def test_commit_takes_only_this_readers_messages_in_order(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.start(session_id=2, partition=1)
    server.send(1, [0, 1])
    server.send(2, [0])
    messages = await receive_all(reader, 3)
    p0 = [m for m in messages if m.partition == 0]
    p1 = [m for m in messages if m.partition == 1]
    with pytest.raises(ValueError, match="order"):
        await reader.commit([p0[1], p0[0]])
    with pytest.raises(ValueError, match="order"):
        await reader.commit([p0[0], p1[0]])
    with pytest.raises(ValueError, match="not received by this reader"):
        await reader.commit([Message(topic="orders", partition=0, offset=0, value=b"")])
    await reader.commit([])


async def test_a_server_error_that_is_not_retriable_fails_receive_as_a_broker_error(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.refuse(issues.StatusCode.SCHEME_ERROR)  # the topic was dropped
    with pytest.raises(TopicNotFound, match="receive from orders as billing"):
        await reader.receive(10, 2.0)


async def test_close_ends_the_sessions_and_a_closed_reader_refuses_to_read(
    reader: YdbReader, grpc: Grpc
) -> None:
    server = await ReadServer.accept(grpc)
    server.start(session_id=1, partition=0)
    server.send(1, [0])
    [message] = await receive_all(reader, 1)
    waiting = asyncio.create_task(reader.receive(10, 5.0))
    await asyncio.sleep(0.02)
    await reader.close()
    assert not message.alive
    assert reader.sessions() == []
    assert waiting.done() or await asyncio.wait_for(waiting, 2) == ()
    with pytest.raises(RuntimeError):
        await reader.receive(1, 0.0)
    await reader.close()  # twice is fine


# --- writing ----------------------------------------------------------------------------------


class ProducerRefused(Exception):
    """The fake server refused a write stream (the SDK was told why)."""


class WriteServer:
    """The server's half of one write stream (one partition)."""

    def __init__(self, stream: FakeStream, init: StreamWriteMessage.InitRequest) -> None:
        self.stream = stream
        self.init = init
        self.offset = 100

    @classmethod
    async def accept(cls, grpc: Grpc, last_seqno: int = 0) -> WriteServer:
        stream = await grpc.next_stream()
        init: StreamWriteMessage.InitRequest = await _from_client(
            stream, StreamWriteMessage.InitRequest
        )
        assert isinstance(init.partitioning, StreamWriteMessage.PartitioningPartitionID)
        partition = init.partitioning.partition_id
        bound = grpc.producers.setdefault(init.producer_id, partition)
        if bound != partition:
            # The server's partition chooser: a producer id writes to one partition only.
            refusal = f"SourceId {init.producer_id} already bound to PartitionGroupId {bound + 1}"
            stream.from_server.put_nowait(
                StreamWriteMessage.InitResponse(
                    last_seq_no=0,
                    session_id="",
                    partition_id=partition,
                    supported_codecs=[],
                    status=ServerStatus(issues.StatusCode.BAD_REQUEST, []),
                )
            )
            raise ProducerRefused(refusal)
        stream.from_server.put_nowait(
            StreamWriteMessage.InitResponse(
                last_seq_no=last_seqno,
                session_id="write-session",
                partition_id=partition,
                supported_codecs=[Codec.CODEC_RAW],
                status=OK,
            )
        )
        return cls(stream, init)

    @property
    def partition(self) -> int:
        partitioning = self.init.partitioning
        assert isinstance(partitioning, StreamWriteMessage.PartitioningPartitionID)
        return partitioning.partition_id

    async def written(self) -> list[StreamWriteMessage.WriteRequest.MessageData]:
        request: StreamWriteMessage.WriteRequest = await _from_client(
            self.stream, StreamWriteMessage.WriteRequest
        )
        return request.messages

    def ack(self, seqnos: Sequence[int], skipped: Sequence[int] = ()) -> None:
        acks = []
        for seqno in seqnos:
            status: Any
            if seqno in skipped:
                status = StreamWriteMessage.WriteResponse.WriteAck.StatusSkipped(
                    reason=StreamWriteMessage.WriteResponse.WriteAck.StatusSkipped.Reason.ALREADY_WRITTEN
                )
            else:
                status = StreamWriteMessage.WriteResponse.WriteAck.StatusWritten(self.offset)
                self.offset += 1
            acks.append(
                StreamWriteMessage.WriteResponse.WriteAck(seq_no=seqno, message_write_status=status)
            )
        zero = datetime.timedelta(0)
        self.stream.from_server.put_nowait(
            StreamWriteMessage.WriteResponse(
                partition_id=self.partition,
                acks=acks,
                write_statistics=StreamWriteMessage.WriteResponse.WriteStatistics(
                    zero, zero, zero, zero, zero
                ),
                status=OK,
            )
        )


def writer_for(topics: TopicClientAsyncIO, partitions: int = 4) -> YdbWriter:
    return YdbWriter(
        topics,
        topic="orders",
        path="/local/orders",
        producer_id="shop",
        partitions=partitions,
        open_timeout_s=2.0,
        close_timeout_s=1.0,
    )


async def test_a_write_returns_after_the_acks_with_offsets(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    writer = writer_for(topics)
    try:
        writing = asyncio.create_task(
            writer.write(
                [
                    OutgoingMessage(value=b"a", metadata={"type": "t"}, created_at=1_800_000_000.0),
                    OutgoingMessage(value=b"b"),
                ]
            )
        )
        server = await WriteServer.accept(grpc, last_seqno=7)
        # Unkeyed messages go to the producer's home partition, the same hash as embedded.
        assert server.partition == zlib.crc32(b"shop") % 4
        assert server.init.producer_id == f"shop.p{server.partition}"
        sent = await server.written()
        assert [(m.seq_no, m.data) for m in sent] == [(8, b"a"), (9, b"b")]
        assert sent[0].metadata_items == {"type": b"t"}
        assert sent[0].created_at == datetime.datetime.fromtimestamp(1_800_000_000.0, datetime.UTC)
        await asyncio.sleep(0.01)
        assert not writing.done()
        server.ack([8, 9])
        results = await asyncio.wait_for(writing, 2)
        assert [(r.status, r.partition, r.offset) for r in results] == [
            (WriteStatus.WRITTEN, server.partition, 100),
            (WriteStatus.WRITTEN, server.partition, 101),
        ]
    finally:
        await writer.close()


async def test_seqnos_not_above_the_last_are_duplicates(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    writer = writer_for(topics, partitions=1)
    try:
        writing = asyncio.create_task(
            writer.write([OutgoingMessage(value=b"", seqno=s) for s in (2, 3, 4, 4, 6)])
        )
        server = await WriteServer.accept(grpc, last_seqno=3)
        # 2 and 3 are known written, the second 4 repeats the first: none of them is sent.
        assert [m.seq_no for m in await server.written()] == [4, 6]
        server.ack([4, 6], skipped=[6])  # written meanwhile by another session
        results = await asyncio.wait_for(writing, 2)
        assert [r.status for r in results] == [
            WriteStatus.DUPLICATE,
            WriteStatus.DUPLICATE,
            WriteStatus.WRITTEN,
            WriteStatus.DUPLICATE,
            WriteStatus.DUPLICATE,
        ]
        assert results[0].offset is None
    finally:
        await writer.close()


async def test_keys_and_partitions_choose_the_partition_writer(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    writer = writer_for(topics, partitions=4)
    try:
        key_partition = zlib.crc32(b"customer-1") % 4
        explicit = (key_partition + 1) % 4
        writing = asyncio.create_task(
            writer.write(
                [
                    OutgoingMessage(value=b"k", key="customer-1"),
                    OutgoingMessage(value=b"p", partition=explicit),
                ]
            )
        )
        servers = {}
        for _ in range(2):
            server = await WriteServer.accept(grpc)
            servers[server.partition] = server
        assert sorted(servers) == sorted({key_partition, explicit})
        keyed = await servers[key_partition].written()
        assert keyed[0].metadata_items == {"__key": b"customer-1"}
        await servers[explicit].written()
        for server in servers.values():
            server.ack([1])
        results = await asyncio.wait_for(writing, 2)
        assert [r.partition for r in results] == [key_partition, explicit]
        # Each partition's writer is a producer of its own: the server binds a
        # producer id to one partition.
        assert {s.init.producer_id for s in servers.values()} == {
            f"shop.p{key_partition}",
            f"shop.p{explicit}",
        }
        with pytest.raises(ValueError, match="out of range"):
            await writer.write([OutgoingMessage(value=b"", partition=4)])
    finally:
        await writer.close()


async def test_a_timed_out_write_reopens_its_writer_and_the_retry_is_deduplicated(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    writer = writer_for(topics, partitions=1)
    try:
        batch = [OutgoingMessage(value=b"x", seqno=s) for s in (1, 2)]
        writing = asyncio.create_task(writer.write(batch, timeout_s=0.2))
        first = await WriteServer.accept(grpc)
        await first.written()
        with pytest.raises(BrokerTimeout, match="write 2 messages to orders"):
            await writing  # the server persisted them, but the acks never came

        retrying = asyncio.create_task(writer.write(batch))
        second = await WriteServer.accept(grpc, last_seqno=2)
        results = await asyncio.wait_for(retrying, 2)
        assert [r.status for r in results] == [WriteStatus.DUPLICATE] * 2
        assert second.stream.from_client.empty()  # nothing was sent again
    finally:
        await writer.close()


async def test_a_writer_that_cannot_start_is_a_broker_error(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    writer = writer_for(topics, partitions=1)
    try:
        writing = asyncio.create_task(writer.write([OutgoingMessage(value=b"")]))
        stream = await grpc.next_stream()
        await _from_client(stream, StreamWriteMessage.InitRequest)
        stream.from_server.put_nowait(
            StreamWriteMessage.InitResponse(
                last_seq_no=0,
                session_id="",
                partition_id=0,
                supported_codecs=[],
                status=ServerStatus(issues.StatusCode.UNAUTHORIZED, []),
            )
        )
        with pytest.raises(BrokerError, match="open a writer on orders"):
            await asyncio.wait_for(writing, 2)
    finally:
        await writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        await writer.write([OutgoingMessage(value=b"")])


async def test_each_partition_is_written_by_a_producer_of_its_own_and_keeps_its_seqnos(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    writer = writer_for(topics, partitions=2)
    try:
        writing = asyncio.create_task(
            writer.write([OutgoingMessage(value=b"a", partition=0, seqno=5)])
        )
        p0 = await WriteServer.accept(grpc, last_seqno=4)
        assert [m.seq_no for m in await p0.written()] == [5]
        p0.ack([5])
        await asyncio.wait_for(writing, 2)
        # The same writer on the other partition: refused by YDB if it reused the id.
        writing = asyncio.create_task(
            writer.write([OutgoingMessage(value=b"b", partition=1, seqno=5)])
        )
        p1 = await WriteServer.accept(grpc, last_seqno=0)
        # Seqnos are per (producer, partition): 5 is new on partition 1.
        assert [m.seq_no for m in await p1.written()] == [5]
        p1.ack([5])
        [result] = await asyncio.wait_for(writing, 2)
        assert (result.status, result.partition) == (WriteStatus.WRITTEN, 1)
        assert grpc.producers == {"shop.p0": 0, "shop.p1": 1}
    finally:
        await writer.close()


async def test_the_brokers_readers_decode_zstd_and_spill_by_its_configuration(
    topics: TopicClientAsyncIO, grpc: Grpc, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = YdbBackendConfig(
        endpoint="grpc://localhost:2136",
        database="/local",
        directory="nemesis",
        pause_stash_messages=2,
    )

    async def no_scheme(path: str) -> Any:
        raise AssertionError(f"no scheme call expected ({path})")

    async def registered(topic: str) -> list[str]:
        return ["billing"]

    broker = YdbBroker(
        cast(Driver, _NoCredentials()),
        config,
        owns_driver=False,
        topics=topics,
        list_directory=no_scheme,
        make_directory=no_scheme,
    )

    monkeypatch.setattr(broker.admin, "consumers", registered)
    reader = await broker.reader("orders", "billing")
    server = await ReadServer.accept(grpc)
    assert server.init.topics_read_settings[0].path == "/local/nemesis/orders"
    assert server.init.consumer == "billing"
    assert server.budget == config.reader_buffer_bytes
    server.start(session_id=1, partition=0)
    server.send(1, [0, 1], codec=Codec.CODEC_ZSTD, encode=zstd_frames)
    [head, second] = await receive_all(reader, 2)
    assert (head.value, second.value) == (b"v0", b"v1")
    reader.pause(session_of(head))
    server.send(1, [2, 3, 4])
    await quiet_until(reader, lambda: reader.statistics().spilled == 1)
    await broker.close()


async def test_start_from_latest_holds_on_the_reader_a_spilled_resume_opens_again(
    topics: TopicClientAsyncIO, grpc: Grpc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition that never committed keeps its start (``read_from``) through a reopen;
    once every partition has committed, the reopened reader reads without one."""
    config = YdbBackendConfig(
        endpoint="grpc://localhost:2136",
        database="/local",
        directory="nemesis",
        pause_stash_messages=1,
    )
    started = 1_780_000_000.0

    async def no_scheme(path: str) -> Any:
        raise AssertionError(f"no scheme call expected ({path})")

    broker = YdbBroker(
        cast(Driver, _NoCredentials()),
        config,
        owns_driver=False,
        clock=FakeClock(wall_start=started),
        topics=topics,
        list_directory=no_scheme,
        make_directory=no_scheme,
    )
    committed = {0: 0, 1: 0}  # the consumer's offsets, as DescribeConsumer reports them

    async def registered(topic: str) -> list[str]:
        return ["billing"]

    async def described(topic: str, consumer: str) -> dict[int, int]:
        return dict(committed)

    monkeypatch.setattr(broker.admin, "consumers", registered)
    monkeypatch.setattr(broker.admin, "committed", described)
    start = datetime.datetime.fromtimestamp(started, datetime.UTC)

    async def spill_and_resume(reader: YdbReader, server: ReadServer) -> ReadServer:
        server.start(session_id=1, partition=0)
        server.send(1, [0])
        [head] = await receive_all(reader, 1)
        reader.pause(session_of(head))
        server.send(1, [1, 2, 3])  # past the stash of 1: spilled
        await quiet_until(reader, lambda: reader.statistics().spilled == 1)
        reader.resume(session_of(head))
        receiving = asyncio.create_task(reader.receive(10, 0.5))
        again = await ReadServer.accept(grpc)
        await receiving
        return again

    reader = await broker.reader("orders", "billing", start_from=StartFrom("latest"))
    try:
        first = await ReadServer.accept(grpc)
        assert first.init.topics_read_settings[0].read_from == start
        committed[0] = 1  # partition 1 has still committed nothing
        second = await spill_and_resume(reader, first)
        assert second.init.topics_read_settings[0].read_from == start
        committed[1] = 7  # every partition has its own start now
        third = await spill_and_resume(reader, second)
        assert third.init.topics_read_settings[0].read_from is None
        assert reader.statistics().reopens == 2
    finally:
        await broker.close()
