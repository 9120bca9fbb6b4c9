"""The embedded broker against real SQLite files: the log, consumers, leases, retention."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemesis.broker.embedded import (
    EmbeddedBroker,
    EmbeddedReader,
    Wakeups,
    db,
    fair_share,
    log,
    open_embedded,
)
from nemesis.broker.embedded import broker as embedded_broker
from nemesis.broker.embedded.db import BACKGROUND_NICENESS
from nemesis.broker.port import (
    Broker,
    ConsumerSpec,
    Message,
    OutgoingMessage,
    PartitionSession,
    TopicAdmin,
    TopicReader,
    TopicWriter,
    WriteStatus,
    partition_for_key,
)
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.errors import BrokerError, BrokerTimeout, TopicExists, TopicNotFound

# A WAL this long (frames) is restarted under appends that never pause; the broker's is
# 16,384 by default (64 MB), too much to write in a test.
RESTART_WAL_FRAMES = 1024

# A long lease keeps the background heartbeats out of the way: tests that
# rebalance call reader.heartbeat() or rely on in-process pokes.
LONG_LEASE_S = 30.0


class FakeClock:
    """Wall time that tests move by hand; sleeps are real so background loops do not spin."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start
        self._monotonic = 0.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self._monotonic

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self._monotonic += seconds


class SkewedClock:
    """The system clock, shifted: a second broker whose leases look expired to nobody but itself."""

    def __init__(self, skew_s: float) -> None:
        self.skew_s = skew_s

    def time(self) -> float:
        return time.time() + self.skew_s

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def backend(path: Path, lease_s: float = LONG_LEASE_S) -> EmbeddedBackendConfig:
    return EmbeddedBackendConfig(path=str(path), lease_s=lease_s)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(backend(tmp_path / "nemesis.db"))
    try:
        yield opened
    finally:
        await opened.close()


# Readers that never poll the file within a test's time (nor does the broker's watch):
# what such a reader receives, a wake or a ring brought, however slow the host.
NO_POLL = Wakeups(
    poll_min_s=3600, poll_max_s=3600, belled_poll_max_s=3600, belled_tail_window_s=3600
)


@pytest.fixture
async def unpolled(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(backend(tmp_path / "nemesis.db"), wakeups=NO_POLL)
    try:
        yield opened
    finally:
        await opened.close()


async def receive_all(
    reader: TopicReader, count: int, *, timeout_s: float = 10.0, batch: int = 500
) -> list[Message]:
    """Receives until ``count`` messages arrived (or fails after ``timeout_s``)."""
    received: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(received) < count:
        assert time.monotonic() < deadline, f"received {len(received)} of {count}"
        received.extend(await reader.receive(batch, 0.5))
    return received


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def owned(reader: TopicReader) -> list[int]:
    return [s.partition for s in reader.sessions()]


def values(messages: Sequence[Message]) -> list[bytes]:
    return [m.value for m in messages]


async def test_implements_the_port(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
    writer = await broker.writer("t")
    reader = await broker.reader("t", "c")
    # The assignments are the test: mypy checks each against its Protocol.
    as_broker: Broker = broker
    as_admin: TopicAdmin = broker.admin
    as_writer: TopicWriter = writer
    as_reader: TopicReader = reader
    assert as_broker.admin is as_admin
    assert as_writer.producer_id
    assert len(as_reader.sessions()) == 1
    assert all(isinstance(s, PartitionSession) for s in reader.sessions())


# --- the log --------------------------------------------------------------------------


async def test_append_read_commit(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("orders", partitions=2, consumers=[ConsumerSpec("billing")])
    writer = await broker.writer("orders", producer_id="shop")
    results = await writer.write(
        [
            OutgoingMessage(
                value=f"v{i}".encode(),
                key="k",
                metadata={"type": "order.created", "n": str(i)},
                seqno=i + 1,
                created_at=1000.0 + i,
            )
            for i in range(5)
        ]
    )
    partition = partition_for_key("k", 2)
    assert [(r.status, r.partition, r.offset) for r in results] == [
        (WriteStatus.WRITTEN, partition, i) for i in range(5)
    ]
    reader = await broker.reader("orders", "billing")
    messages = await receive_all(reader, 5)
    assert values(messages) == [f"v{i}".encode() for i in range(5)]
    first = messages[0]
    assert (first.topic, first.partition, first.offset, first.key) == ("orders", partition, 0, "k")
    assert dict(first.metadata) == {"type": "order.created", "n": "0"}
    assert (first.producer_id, first.seqno, first.created_at) == ("shop", 1, 1000.0)
    assert first.written_at == pytest.approx(time.time(), abs=60)
    assert first.alive
    assert first.session is not None
    assert first.session.partition == partition

    await reader.commit(messages[:3])
    described = await broker.admin.describe_topic("orders")
    assert described.partitions[partition].committed == {"billing": 3}
    # A commit never moves the offset back.
    await reader.commit(messages[:1])
    described = await broker.admin.describe_topic("orders")
    assert described.partitions[partition].committed == {"billing": 3}
    assert await reader.receive(10, 0.05) == ()


async def test_the_broker_time_is_read_once_the_write_lock_is_held(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    # A log-append time: an append that waited for another writer is stamped
    # after it, so written_at follows the offsets of a partition.
    await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
    writer = await broker.writer("t")
    await writer.write([OutgoingMessage(value=b"before")])
    holder = sqlite3.connect(tmp_path / "nemesis.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        waiting = asyncio.create_task(writer.write([OutgoingMessage(value=b"waited")]))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # it waits for the lock
        freed_at = time.time()
        holder.execute("COMMIT")
        await waiting
    finally:
        holder.close()
    reader = await broker.reader("t", "c")
    before, waited = await receive_all(reader, 2)
    assert before.written_at < freed_at <= waited.written_at
    assert waited.created_at == waited.written_at  # no time of the producer's: the broker's


async def test_restart_redelivers_from_the_committed_offset(tmp_path: Path) -> None:
    config = backend(tmp_path / "nemesis.db")
    first = await open_embedded(config)
    await first.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
    writer = await first.writer("t")
    await writer.write([OutgoingMessage(value=bytes([i])) for i in range(10)])
    reader = await first.reader("t", "c")
    messages = await receive_all(reader, 10)
    await reader.commit(messages[:4])
    await first.close()

    second = await open_embedded(config)
    try:
        again = await receive_all(await second.reader("t", "c"), 6)
        assert [m.offset for m in again] == list(range(4, 10))
        assert again[0].session is not None
        assert again[0].session.id == 2
    finally:
        await second.close()


async def test_a_consumer_that_never_committed_starts_at_the_oldest_message(
    broker: EmbeddedBroker,
) -> None:
    await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("early")])
    writer = await broker.writer("t")
    await writer.write([OutgoingMessage(value=b"%d" % i) for i in range(3)])
    await broker.admin.add_consumer("t", ConsumerSpec("late"))
    messages = await receive_all(await broker.reader("t", "late"), 3)
    assert [m.offset for m in messages] == [0, 1, 2]


async def test_key_partitioning_is_stable_across_processes(broker: EmbeddedBroker) -> None:
    keys = ["", "a", "user-42", "заказ", "x" * 300]
    script = (
        "import json, sys\n"
        "from nemesis.broker.port import partition_for_key\n"
        "print(json.dumps([partition_for_key(k, 7) for k in json.loads(sys.argv[1])]))\n"
    )
    for seed in ("1", "2"):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            json.dumps(keys),
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        stdout, _ = await process.communicate()
        assert process.returncode == 0
        assert json.loads(stdout) == [partition_for_key(k, 7) for k in keys]

    await broker.admin.create_topic("t", partitions=7)
    writer = await broker.writer("t")
    results = await writer.write([OutgoingMessage(value=b"", key=k) for k in keys])
    assert [r.partition for r in results] == [partition_for_key(k, 7) for k in keys]


async def test_messages_without_key_go_round_robin(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("t", partitions=3)
    writer = await broker.writer("t")
    first = await writer.write([OutgoingMessage(value=b"") for _ in range(4)])
    second = await writer.write([OutgoingMessage(value=b"") for _ in range(3)])
    assert [r.partition for r in (*first, *second)] == [0, 1, 2, 0, 1, 2, 0]
    assert [r.offset for r in (*first, *second)] == [0, 0, 0, 1, 1, 1, 2]


async def test_explicit_partition_wins_over_the_key(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("t", partitions=4)
    writer = await broker.writer("t")
    key = "k"
    other = (partition_for_key(key, 4) + 1) % 4
    results = await writer.write([OutgoingMessage(value=b"", key=key, partition=other)])
    assert results[0].partition == other
    with pytest.raises(ValueError, match="out of range"):
        await writer.write([OutgoingMessage(value=b"", partition=4)])


async def test_seqno_deduplication_survives_a_reopen(tmp_path: Path) -> None:
    config = backend(tmp_path / "nemesis.db")
    first = await open_embedded(config)
    await first.admin.create_topic("t", partitions=2)
    writer = await first.writer("t", producer_id="p1")
    assert writer.producer_id == "p1"

    def statuses(results: Sequence[object]) -> list[str]:
        return [r.status.value for r in results]  # type: ignore[attr-defined]

    batch = [OutgoingMessage(value=b"", seqno=s) for s in (1, 2, 3)]
    assert statuses(await writer.write(batch)) == ["written"] * 3
    again = [OutgoingMessage(value=b"", seqno=s) for s in (2, 3, 4)]
    results = await writer.write(again)
    assert statuses(results) == ["duplicate", "duplicate", "written"]
    assert results[0].offset is None
    # Within one batch too; a message without seqno is always written.
    mixed = [OutgoingMessage(value=b"", seqno=s) for s in (5, 5)] + [OutgoingMessage(value=b"")]
    assert statuses(await writer.write(mixed)) == ["written", "duplicate", "written"]
    # Another producer has its own sequence.
    other = await first.writer("t", producer_id="p2")
    assert statuses(await other.write([OutgoingMessage(value=b"", seqno=1)])) == ["written"]
    await first.close()

    second = await open_embedded(config)
    try:
        writer = await second.writer("t", producer_id="p1")
        results = await writer.write([OutgoingMessage(value=b"", seqno=s) for s in (5, 6)])
        assert statuses(results) == ["duplicate", "written"]
    finally:
        await second.close()


async def test_writers_get_distinct_random_producer_ids(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("t", partitions=1)
    a, b = await broker.writer("t"), await broker.writer("t")
    assert a.producer_id != b.producer_id
    # Without seqnos nothing is de-duplicated, whatever the producer.
    results = await a.write([OutgoingMessage(value=b"same"), OutgoingMessage(value=b"same")])
    assert [r.status for r in results] == [WriteStatus.WRITTEN] * 2


# --- admin ------------------------------------------------------------------------------


async def test_describe_reports_offsets_and_committed_per_consumer(
    broker: EmbeddedBroker,
) -> None:
    admin = broker.admin
    await admin.create_topic(
        "t", partitions=2, consumers=[ConsumerSpec("a"), ConsumerSpec("b")], retention_s=3600
    )
    writer = await broker.writer("t")
    await writer.write([OutgoingMessage(value=b"", partition=0) for _ in range(5)])
    await writer.write([OutgoingMessage(value=b"", partition=1) for _ in range(2)])
    reader = await broker.reader("t", "a")
    messages = await receive_all(reader, 7)
    await reader.commit([m for m in messages if m.partition == 0][:3])

    described = await admin.describe_topic("t")
    assert described.name == "t"
    assert described.consumers == ["a", "b"]
    assert described.retention_s == 3600
    p0, p1 = described.partitions
    assert (p0.partition, p0.start_offset, p0.end_offset) == (0, 0, 5)
    assert (p1.partition, p1.start_offset, p1.end_offset) == (1, 0, 2)
    assert p0.committed == {"a": 3, "b": 0}
    assert p1.committed == {"a": 0, "b": 0}
    assert p0.last_written_at is not None
    empty = await admin.describe_topic("t")
    assert empty.partitions[0].last_written_at == p0.last_written_at


async def test_topic_lifecycle(broker: EmbeddedBroker) -> None:
    admin = broker.admin
    await admin.create_topic("b", partitions=1)
    await admin.create_topic("a", partitions=2, consumers=[ConsumerSpec("c1")])
    assert await admin.list_topics() == ["a", "b"]
    with pytest.raises(TopicExists):
        await admin.create_topic("a", partitions=2)
    # exist_ok keeps the topic as it is and adds the missing consumers.
    await admin.create_topic("a", partitions=9, consumers=[ConsumerSpec("c2")], exist_ok=True)
    await admin.add_consumer("a", ConsumerSpec("c1"))
    described = await admin.describe_topic("a")
    assert (len(described.partitions), described.consumers) == (2, ["c1", "c2"])
    # The backend's retention is the default.
    assert described.retention_s == broker.config.retention

    writer = await broker.writer("a")
    await writer.write([OutgoingMessage(value=b"old")])
    await admin.drop_topic("a")
    assert await admin.list_topics() == ["b"]
    missing: list[Callable[[], Awaitable[object]]] = [
        lambda: admin.describe_topic("a"),
        lambda: admin.drop_topic("a"),
        lambda: admin.add_consumer("a", ConsumerSpec("c")),
        lambda: broker.writer("a"),
        lambda: broker.reader("a", "c1"),
    ]
    for call in missing:
        with pytest.raises(TopicNotFound):
            await call()
    with pytest.raises(TopicNotFound):
        await writer.write([OutgoingMessage(value=b"late")])

    # A topic created again under the same name starts empty.
    await admin.create_topic("a", partitions=1, consumers=[ConsumerSpec("c1")])
    assert (await admin.describe_topic("a")).partitions[0].end_offset == 0
    assert await (await broker.reader("a", "c1")).receive(10, 0.05) == ()


async def test_reading_needs_a_registered_consumer(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("t", partitions=1)
    with pytest.raises(TopicNotFound, match="no consumer"):
        await broker.reader("t", "nobody")
    with pytest.raises(ValueError, match="partition"):
        await broker.admin.create_topic("u", partitions=0)


async def test_sqlite_errors_become_broker_errors(tmp_path: Path) -> None:
    # A directory cannot be opened as a database file.
    with pytest.raises(BrokerError, match="sqlite"):
        await open_embedded(tmp_path)


async def test_a_write_waiting_for_the_lock_times_out_and_a_retry_is_deduplicated(
    broker: EmbeddedBroker,
) -> None:
    await broker.admin.create_topic("t", partitions=1)
    writer = await broker.writer("t", producer_id="p")
    blocker = sqlite3.connect(broker.path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(BrokerTimeout):
            await writer.write([OutgoingMessage(value=b"x", seqno=1)], timeout_s=0.2)
        blocker.execute("COMMIT")
    finally:
        blocker.close()
    # The abandoned write went on waiting for the lock and then committed:
    # the retry with the same seqno is recognised.
    results = await writer.write([OutgoingMessage(value=b"x", seqno=1)])
    assert results[0].status is WriteStatus.DUPLICATE
    assert (await broker.admin.describe_topic("t")).partitions[0].end_offset == 1


# --- retention ---------------------------------------------------------------------------


async def test_retention_deletes_expired_messages_in_batches(tmp_path: Path) -> None:
    clock = FakeClock()
    broker = await open_embedded(
        backend(tmp_path / "n.db"), clock=clock, housekeeping_interval_s=3600
    )
    try:
        admin = broker.admin
        await admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")], retention_s=60)
        writer = await broker.writer("t")
        # More than one delete batch expires at once.
        await writer.write([OutgoingMessage(value=b"old")] * 2500)
        clock.advance(30)
        await writer.write([OutgoingMessage(value=b"new")] * 5)
        assert await broker.housekeeping() == 0
        clock.advance(40)  # the first batch is 70 s old, the second 40 s
        assert await broker.housekeeping() == 2500
        partition = (await admin.describe_topic("t")).partitions[0]
        assert (partition.start_offset, partition.end_offset) == (2500, 2505)
        assert partition.committed == {"c": 2500}
        messages = await receive_all(await broker.reader("t", "c"), 5)
        assert [m.offset for m in messages] == list(range(2500, 2505))
        assert set(values(messages)) == {b"new"}
    finally:
        await broker.close()


async def test_retention_keeps_what_an_important_consumer_has_not_committed(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    broker = await open_embedded(
        backend(tmp_path / "n.db"), clock=clock, housekeeping_interval_s=3600
    )
    try:
        await broker.admin.create_topic(
            "t",
            partitions=1,
            consumers=[ConsumerSpec("audit", important=True), ConsumerSpec("casual")],
            retention_s=60,
        )
        writer = await broker.writer("t")
        await writer.write([OutgoingMessage(value=b"%d" % i) for i in range(10)])
        reader = await broker.reader("t", "audit")
        await reader.commit((await receive_all(reader, 10))[:4])
        await reader.close()
        clock.advance(120)
        assert await broker.housekeeping() == 4
        partition = (await broker.admin.describe_topic("t")).partitions[0]
        assert partition.start_offset == 4
        assert partition.committed == {"audit": 4, "casual": 4}
    finally:
        await broker.close()


async def test_zero_retention_keeps_messages_forever(tmp_path: Path) -> None:
    clock = FakeClock()
    config = EmbeddedBackendConfig(path=str(tmp_path / "n.db"), retention=0)
    broker = await open_embedded(config, clock=clock, housekeeping_interval_s=3600)
    try:
        await broker.admin.create_topic("t", partitions=1)
        assert (await broker.admin.describe_topic("t")).retention_s is None
        await (await broker.writer("t")).write([OutgoingMessage(value=b"")])
        clock.advance(10 * 365 * 86400)
        assert await broker.housekeeping() == 0
    finally:
        await broker.close()


async def test_checkpoints_copy_the_wal_into_the_database(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("t", partitions=1)
    writer = await broker.writer("t")
    for _ in range(20):
        await writer.write([OutgoingMessage(value=b"x" * 1000)] * 10)
    # Appends leave checkpoints to housekeeping, so the WAL holds every page.
    done = await broker.checkpoint()
    assert done.copied > 20
    assert done.copied == done.wal_frames


async def test_the_wal_restarts_under_a_steady_stream_of_appends(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Appends that never pause land during every checkpoint of the maintenance thread,
    # so without the write thread copying what it left behind, the WAL never restarts
    # and grows by every append (to the backstop: hundreds of megabytes).
    monkeypatch.setattr(embedded_broker, "RESTART_WAL_FRAMES", RESTART_WAL_FRAMES)
    await broker.admin.create_topic("t", partitions=1)
    writer = await broker.writer("t")
    value = b"x" * 10_000  # three overflow pages: at least three frames per message
    for _ in range(2 * RESTART_WAL_FRAMES // 3 // 20 + 1):
        await writer.write([OutgoingMessage(value=value)] * 20)
    streaming = True

    async def stream() -> None:
        while streaming:
            await writer.write([OutgoingMessage(value=value)])

    task = asyncio.create_task(stream())
    try:
        await asyncio.sleep(0.05)
        first = await broker.checkpoint()
        later = []
        for _ in range(5):
            await asyncio.sleep(0.05)
            later.append(await broker.checkpoint())
    finally:
        streaming = False
        await task
    assert first.wal_frames >= 2 * RESTART_WAL_FRAMES
    # The WAL restarted from its beginning at least once while the appends went on.
    assert min(done.wal_frames for done in later) < first.wal_frames


async def test_a_restarted_wal_is_cut_back_to_the_size_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db, "WAL_SIZE_LIMIT_BYTES", 1024 * 1024)
    broker = await open_embedded(backend(tmp_path / "nemesis.db"))
    try:
        await broker.admin.create_topic("t", partitions=1)
        writer = await broker.writer("t")
        for _ in range(25):  # a burst: 500 messages of 10 kB, 5 MB of WAL at least
            await writer.write([OutgoingMessage(value=b"x" * 10_000)] * 20)
        wal = tmp_path / "nemesis.db-wal"
        grown = wal.stat().st_size
        await broker.checkpoint()
        await writer.write([OutgoingMessage(value=b"y")])  # restarts the WAL
        assert grown > 5_000_000
        assert wal.stat().st_size <= 1024 * 1024
    finally:
        await broker.close()


# --- readers sharing a consumer ---------------------------------------------------------------


def test_fair_share_is_deterministic_and_even() -> None:
    members = ["b", "c", "a"]
    shares = [fair_share(members, 8, m) for m in ("a", "b", "c")]
    assert shares == [frozenset({0, 3, 6}), frozenset({1, 4, 7}), frozenset({2, 5})]
    assert fair_share(members, 8, "z") == frozenset()


async def test_readers_in_one_process_split_partitions_and_rebalance(
    broker: EmbeddedBroker,
) -> None:
    await broker.admin.create_topic("t", partitions=6, consumers=[ConsumerSpec("c")])
    first = await broker.reader("t", "c")
    assert owned(first) == [0, 1, 2, 3, 4, 5]
    first_sessions = {s.partition: s for s in first.sessions()}

    second = await broker.reader("t", "c")

    async def split(readers: list[EmbeddedReader], sizes: list[int]) -> bool:
        held = [owned(r) for r in readers]
        everything = sorted(p for h in held for p in h)
        return sorted(len(h) for h in held) == sizes and everything == list(range(6))

    await eventually(lambda: split([first, second], [3, 3]))
    # The partitions that moved ended their old sessions; the new ones have new generations.
    for partition in owned(second):
        assert not first_sessions[partition].alive
        assert second.sessions()[owned(second).index(partition)].id == 2

    third = await broker.reader("t", "c")
    await eventually(lambda: split([first, second, third], [2, 2, 2]))

    # Each reader receives only its own partitions' messages.
    writer = await broker.writer("t")
    await writer.write([OutgoingMessage(value=b"%d" % p, partition=p) for p in range(6)])
    for reader in (first, second, third):
        messages = await receive_all(reader, 2)
        assert sorted(m.partition for m in messages) == owned(reader)

    # A reader that closes hands its partitions over at once.
    await second.close()
    await eventually(lambda: split([first, third], [3, 3]))
    assert first.statistics().members == 2


async def test_a_reader_whose_lease_was_taken_loses_its_session_and_its_commit(
    tmp_path: Path,
) -> None:
    path = tmp_path / "n.db"
    here = await open_embedded(backend(path))
    # Another process whose clock runs far ahead sees every lease of ours as expired.
    elsewhere = await open_embedded(backend(path), clock=SkewedClock(10 * LONG_LEASE_S))
    try:
        await here.admin.create_topic("t", partitions=2, consumers=[ConsumerSpec("c")])
        writer = await here.writer("t")
        await writer.write([OutgoingMessage(value=b"%d" % i) for i in range(8)])
        stale_reader = await here.reader("t", "c")
        stale = await receive_all(stale_reader, 8)
        assert all(m.alive for m in stale)

        thief = await elsewhere.reader("t", "c")
        assert owned(thief) == [0, 1]

        # The stale reader has not noticed yet: its session still looks alive, but
        # the commit is fenced in the file and nothing moves.
        in_p0 = [m for m in stale if m.partition == 0]
        await stale_reader.commit(in_p0)
        assert not in_p0[0].alive
        described = await here.admin.describe_topic("t")
        assert [p.committed["c"] for p in described.partitions] == [0, 0]

        # Its next heartbeat ends the other session too.
        await stale_reader.heartbeat()
        assert stale_reader.sessions() == []
        assert not any(m.alive for m in stale)
        await stale_reader.commit([m for m in stale if m.partition == 1])

        # The new owner reads everything again from the committed offsets.
        again = await receive_all(thief, 8)
        assert sorted(values(again)) == sorted(values(stale))
        assert {m.session.id for m in again if m.session is not None} == {2}
        for partition in (0, 1):
            await thief.commit([m for m in again if m.partition == partition])
        described = await here.admin.describe_topic("t")
        assert [p.committed["c"] for p in described.partitions] == [4, 4]
    finally:
        await elsewhere.close()
        await here.close()


async def test_a_lease_that_ran_out_unrenewed_ends_its_session(tmp_path: Path) -> None:
    clock = FakeClock()
    broker = await open_embedded(
        backend(tmp_path / "n.db"), clock=clock, housekeeping_interval_s=3600
    )
    try:
        await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        writer = await broker.writer("t")
        await writer.write([OutgoingMessage(value=b"%d" % i) for i in range(4)])
        reader = await broker.reader("t", "c")
        messages = await receive_all(reader, 4)
        await reader.commit(messages[:1])
        (session,) = reader.sessions()

        clock.advance(LONG_LEASE_S + 1)  # no heartbeat ran in that time
        assert await reader.receive(10, 0.01) == ()
        assert not session.alive
        await reader.commit(messages)  # ignored: the session is dead

        # The next heartbeat takes the partition again, under a new generation.
        await reader.heartbeat()
        (renewed,) = reader.sessions()
        assert renewed.id == session.id + 1
        again = await receive_all(reader, 3)
        assert [m.offset for m in again] == [1, 2, 3]
    finally:
        await broker.close()


async def test_closing_a_reader_releases_its_leases_to_other_processes(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    one, two = await open_embedded(backend(path)), await open_embedded(backend(path))
    try:
        await one.admin.create_topic("t", partitions=4, consumers=[ConsumerSpec("c")])
        leaving = await one.reader("t", "c")
        staying = await two.reader("t", "c")
        # The newcomer waits for its share until the holder lets it go.
        assert owned(staying) == []
        await leaving.heartbeat()
        await staying.heartbeat()
        assert len(owned(leaving)) == len(owned(staying)) == 2
        await leaving.close()
        # No waiting for the lease to expire (it has 30 s left).
        await staying.heartbeat()
        assert owned(staying) == [0, 1, 2, 3]
        with pytest.raises(RuntimeError):
            await leaving.receive(1, 0.0)
    finally:
        await two.close()
        await one.close()


async def test_a_dropped_topic_fails_its_readers(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
    reader = await broker.reader("t", "c")
    await broker.admin.drop_topic("t")
    with pytest.raises(TopicNotFound):
        await reader.heartbeat()


# --- receive: waking, pausing, fairness ------------------------------------------------------


async def test_pause_and_resume_a_partition(unpolled: EmbeddedBroker) -> None:
    broker = unpolled
    await broker.admin.create_topic("t", partitions=2, consumers=[ConsumerSpec("c")])
    reader = await broker.reader("t", "c")
    writer = await broker.writer("t")
    await writer.write([OutgoingMessage(value=b"%d" % p, partition=p) for p in (0, 1, 0, 1)])
    paused = reader.sessions()[0]
    reader.pause(paused)
    messages = await receive_all(reader, 2)
    assert {m.partition for m in messages} == {1}
    assert await reader.receive(10, 0.05) == ()
    stats = reader.statistics()
    assert stats.paused == 1
    assert [(p.partition, p.paused, p.position) for p in stats.partitions] == [
        (0, True, 0),
        (1, False, 2),
    ]

    # A waiting receive wakes up when the partition resumes (it never polls: NO_POLL).
    waiting = asyncio.create_task(reader.receive(10, 30.0))
    await asyncio.sleep(0.05)
    reader.resume(paused)
    resumed = await waiting
    assert [(m.partition, m.offset) for m in resumed] == [(0, 0), (0, 1)]


async def test_a_read_of_large_messages_ends_at_its_byte_budget(tmp_path: Path) -> None:
    """One read takes at most READ_MAX_BYTES (a larger first message alone); the rest follows."""
    path = tmp_path / "n.db"
    writing = await open_embedded(backend(path))
    # Another broker object reads: the writer's rows are not in its tail cache, only in the file.
    reading = await open_embedded(backend(path), wakeups=NO_POLL)
    try:
        await writing.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        writer = await writing.writer("t")
        chunk = log.READ_MAX_BYTES // 3 + 1
        sizes = [chunk] * 6 + [log.READ_MAX_BYTES * 2, 10, 10]
        await writer.write(
            [OutgoingMessage(value=bytes([n]) * size) for n, size in enumerate(sizes)]
        )
        reader = await reading.reader("t", "c")
        batches: list[Sequence[Message]] = []
        while sum(len(b) for b in batches) < len(sizes):
            # NO_POLL: a read cut short by bytes must not wait for an append to go on.
            batch = await reader.receive(500, 30.0)
            assert batch
            batches.append(batch)
        assert [[len(m.value) for m in batch] for batch in batches] == [
            [chunk] * 3,
            [chunk] * 3,
            [log.READ_MAX_BYTES * 2],
            [10, 10],
        ]
        assert [m.offset for batch in batches for m in batch] == list(range(len(sizes)))
    finally:
        await reading.close()
        await writing.close()


async def test_an_append_wakes_a_waiting_reader(unpolled: EmbeddedBroker) -> None:
    broker = unpolled
    await broker.admin.create_topic("t", partitions=4, consumers=[ConsumerSpec("c")])
    reader = await broker.reader("t", "c")
    writer = await broker.writer("t")
    assert await reader.receive(10, 0.05) == ()  # drained: it reads again when woken
    reads = reader.statistics().file_reads
    for i in range(5):
        waiting = asyncio.create_task(reader.receive(10, 30.0))
        await asyncio.sleep(0.01)  # waiting
        await writer.write([OutgoingMessage(value=b"%d" % i)])
        # It never polls (NO_POLL): only the append's wake can end this wait early.
        assert values(await waiting) == [b"%d" % i]
    stats = reader.statistics()
    assert (stats.rings, stats.watch_rings) == (0, 0)  # its own broker's write: no bell
    # Each woke it once, and the broker's own appends are in its cache: no file read.
    assert stats.file_reads == reads


async def test_a_reader_sees_appends_from_another_process(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    reading = await open_embedded(backend(path), wakeups=NO_POLL)
    writing = await open_embedded(backend(path))
    try:
        await writing.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        reader = await reading.reader("t", "c")
        writer = await writing.writer("t")
        assert await reader.receive(10, 0.05) == ()
        waiting = asyncio.create_task(reader.receive(10, 30.0))
        await asyncio.sleep(0.01)
        await writer.write([OutgoingMessage(value=b"hello")])
        # Never polled (NO_POLL): the writer's ring woke it.
        assert values(await waiting) == [b"hello"]
        assert reader.statistics().rings == 1
    finally:
        await writing.close()
        await reading.close()


async def test_receive_shares_the_batch_between_partitions(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("t", partitions=3, consumers=[ConsumerSpec("c")])
    writer = await broker.writer("t")
    await writer.write([OutgoingMessage(value=b"", partition=0)] * 100)
    await writer.write([OutgoingMessage(value=b"", partition=1)] * 100)
    await writer.write([OutgoingMessage(value=b"", partition=2)] * 5)
    reader = await broker.reader("t", "c")
    batch = await reader.receive(30, 1.0)
    counts = [sum(1 for m in batch if m.partition == p) for p in range(3)]
    # 10 each, then the 5 left over go to the two partitions that had more.
    assert sorted(counts) == [5, 12, 13]
    # A lone busy partition still fills the whole batch.
    await reader.receive(1000, 1.0)
    await writer.write([OutgoingMessage(value=b"", partition=1)] * 50)
    assert len(await reader.receive(40, 1.0)) == 40


async def test_commit_rejects_messages_out_of_order_or_from_elsewhere(
    broker: EmbeddedBroker,
) -> None:
    await broker.admin.create_topic("t", partitions=2, consumers=[ConsumerSpec("c")])
    writer = await broker.writer("t")
    await writer.write([OutgoingMessage(value=b"", partition=p) for p in (0, 0, 1)])
    reader = await broker.reader("t", "c")
    messages = await receive_all(reader, 3)
    p0 = [m for m in messages if m.partition == 0]
    p1 = [m for m in messages if m.partition == 1]
    with pytest.raises(ValueError, match="order"):
        await reader.commit([p0[1], p0[0]])
    with pytest.raises(ValueError, match="order"):
        await reader.commit([p0[0], p1[0]])
    with pytest.raises(ValueError, match="not received by this reader"):
        await reader.commit([Message(topic="t", partition=0, offset=0, value=b"")])
    await reader.commit([])


async def test_statistics_track_positions_and_commits(broker: EmbeddedBroker) -> None:
    await broker.admin.create_topic("t", partitions=2, consumers=[ConsumerSpec("c")])
    writer = await broker.writer("t")
    await writer.write([OutgoingMessage(value=b"", partition=0)] * 3)
    reader = await broker.reader("t", "c")
    messages = await receive_all(reader, 3)
    await reader.commit(messages[:2])
    stats = reader.statistics()
    assert (stats.topic, stats.consumer, stats.members, stats.closed) == ("t", "c", 1, False)
    assert stats.member_id.startswith(broker.member_id)
    assert [(p.partition, p.session_id, p.position, p.committed) for p in stats.partitions] == [
        (0, 1, 3, 2),
        (1, 1, 0, 0),
    ]
    await reader.close()
    assert reader.statistics().closed
    assert reader.statistics().partitions == ()


async def test_sqlite_work_does_not_block_the_event_loop(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    await broker.admin.create_topic("t", partitions=4, consumers=[ConsumerSpec("c")])
    writer = await broker.writer("t")
    reader = await broker.reader("t", "c")
    # The write lock is held here, on the loop's thread; the append waits for it (up to
    # the 5 s busy timeout). Run on the loop, it would hold the loop while it waits, the
    # release below could not run, and the append would fail as locked: off the loop,
    # the loop goes on and releases the lock, and the append goes through.
    locker = sqlite3.connect(tmp_path / "nemesis.db", isolation_level=None)
    try:
        locker.execute("BEGIN IMMEDIATE")
        appending = asyncio.create_task(writer.write([OutgoingMessage(value=b"x")] * 100))
        await asyncio.sleep(0.05)
        assert not appending.done()  # waiting for the lock, and the loop still runs
        locker.rollback()
        assert len(await appending) == 100
    finally:
        locker.close()
    assert len(await receive_all(reader, 100)) == 100


# --- property: every message exactly once, in order ---------------------------------------------

batches = st.lists(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.text(max_size=5)),
            st.one_of(st.none(), st.integers(0, 2)),
        ),
        min_size=1,
        max_size=40,
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=15, deadline=None)
@given(batches=batches, page=st.integers(1, 64))
def test_a_single_reader_gets_every_message_once_in_partition_order(
    batches: list[list[tuple[str | None, int | None]]], page: int
) -> None:
    async def scenario(directory: str) -> None:
        broker = await open_embedded(backend(Path(directory) / "n.db"))
        try:
            await broker.admin.create_topic("t", partitions=3, consumers=[ConsumerSpec("c")])
            writer = await broker.writer("t")
            reader = await broker.reader("t", "c")
            sent: dict[bytes, int] = {}
            serial = 0
            for batch in batches:
                outgoing = []
                for key, partition in batch:
                    outgoing.append(
                        OutgoingMessage(value=b"%d" % serial, key=key, partition=partition)
                    )
                    serial += 1
                for message, result in zip(outgoing, await writer.write(outgoing), strict=True):
                    expected = message.partition
                    if expected is None and message.key is not None:
                        expected = partition_for_key(message.key, 3)
                    assert expected is None or result.partition == expected
                    sent[message.value] = result.partition
            received = await receive_all(reader, len(sent), batch=page)
            assert await reader.receive(page, 0.01) == ()
            assert sorted(values(received)) == sorted(sent)  # each exactly once
            for partition in range(3):
                offsets = [m.offset for m in received if m.partition == partition]
                assert offsets == list(range(len(offsets)))
                assert all(sent[m.value] == m.partition for m in received)
        finally:
            await broker.close()

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(scenario(directory))


@pytest.mark.skipif(sys.platform != "linux", reason="threads have their own niceness on Linux only")
async def test_maintenance_runs_at_a_lower_priority_than_the_loop(broker: EmbeddedBroker) -> None:
    def niceness(_: sqlite3.Connection) -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    loop_niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    checkpoints = await broker.db.maintenance.run(niceness, timeout_s=5)
    writes = await broker.db.writer.run(niceness, timeout_s=5)
    assert writes == loop_niceness
    assert checkpoints == min(19, loop_niceness + BACKGROUND_NICENESS)
