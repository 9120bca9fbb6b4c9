"""Bells: readers in one process woken by appends in another, over real sockets and processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from nemesis.broker.embedded import EmbeddedBroker, Wakeups, open_embedded
from nemesis.broker.embedded.bells import (
    MAX_PARTITIONS_PER_RING,
    REFRESH_S,
    decode,
    encode,
    encode_rows,
    read_ring,
)
from nemesis.broker.embedded.reader import EmbeddedReader
from nemesis.broker.embedded.tail import ReadRow, TailCache
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage, TopicReader
from nemesis.config.models import EmbeddedBackendConfig
from tests.operability import wait_until_true

PARTITIONS = 4
# Polling alone would find an append after 250 ms on average: anything much
# faster was woken by a ring.
SLOW_POLL = Wakeups(poll_min_s=0.5, poll_max_s=0.5, belled_poll_max_s=0.5)
# No poll, no watch and no tail-window look within a test's time: only a ring (or a
# write through the same broker) sends a reader to the file, so what a reader finds,
# and how, does not depend on how fast the host runs.
RINGS_ONLY = Wakeups(
    poll_min_s=3600, poll_max_s=3600, belled_poll_max_s=3600, belled_tail_window_s=3600
)

# A writer process: appends `count` messages at `rate` msg/s, one per write, each
# stamped with the monotonic clock (shared by the processes of one machine), to
# one partition or round robin (-1); then prints what it rang as JSON.
WRITER_SCRIPT = """
import asyncio, json, sys, time
from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import OutgoingMessage

async def main(path, topic, count, rate, partition):
    broker = await open_embedded(path)
    try:
        writer = await broker.writer(topic)
        started = time.monotonic()
        for n in range(count):
            delay = started + n / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            stamp = time.monotonic_ns()
            target = n % 4 if partition < 0 else partition
            await writer.write([OutgoingMessage(value=b"%d %d" % (n, stamp), partition=target)])
        rung = broker.bell_statistics().rung
    finally:
        await broker.close()
    print(json.dumps({"sent": rung.sent, "dropped": rung.dropped, "dead": rung.dead_removed}))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])))
"""

# A writer process in step with the test: one message per line read from stdin
# ("n partition"), so at most one ring waits in a reader's socket at a time (none is
# refused); at the end of stdin it prints what it rang as JSON.
STEP_WRITER_SCRIPT = """
import asyncio, json, sys
from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import OutgoingMessage

async def main(path, topic):
    broker = await open_embedded(path)
    try:
        writer = await broker.writer(topic)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            n, partition = line.split()
            await writer.write([OutgoingMessage(value=n.encode(), partition=int(partition))])
        rung = broker.bell_statistics().rung
    finally:
        await broker.close()
    print(json.dumps({"sent": rung.sent, "dropped": rung.dropped, "dead": rung.dead_removed}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

# A reader process on the given event loop that only rings can wake (no poll, no
# watch): reports its bell's address once it holds the topic's partitions and has
# read the (empty) topic, then each message's number as it arrives, then its
# statistics after `count` messages.
RINGS_ONLY_READER_SCRIPT = """
import asyncio, json, sys
from nemesis.broker.embedded import Wakeups, open_embedded
from nemesis.config.models import EmbeddedBackendConfig

async def main(path, count):
    rings_only = Wakeups(poll_min_s=3600, poll_max_s=3600, belled_poll_max_s=3600,
                         belled_tail_window_s=3600)
    broker = await open_embedded(EmbeddedBackendConfig(path=path, lease_s=30), wakeups=rings_only)
    try:
        reader = await broker.reader("t", "c")
        assert not await reader.receive(10, 0.05)
        ready = reader.statistics()
        print(json.dumps({"file_reads": ready.file_reads, "cache_reads": ready.cache_reads}),
              flush=True)
        received = 0
        while received < count:
            for message in await reader.receive(500, 5.0):
                print(json.dumps({"n": int(message.value), "partition": message.partition}),
                      flush=True)
                received += 1
        stats = reader.statistics()
        print(json.dumps({"rings": stats.rings, "watch_rings": stats.watch_rings,
                          "file_reads": stats.file_reads, "cache_reads": stats.cache_reads}),
              flush=True)
    finally:
        await broker.close()

loop = sys.argv[3]
if loop == "uvloop":
    import uvloop
    uvloop.run(main(sys.argv[1], int(sys.argv[2])))
else:
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

# A reader process that reports its bell's address once it holds the topic's
# partitions, then waits to be killed.
IDLE_READER_SCRIPT = """
import asyncio, json, sys
from nemesis.broker.embedded import open_embedded
from nemesis.config.models import EmbeddedBackendConfig

async def main(path):
    broker = await open_embedded(EmbeddedBackendConfig(path=path, lease_s=30))
    try:
        await broker.reader("t", "c")
        print(json.dumps({"bell": broker.bell_statistics().address.hex()}), flush=True)
        await asyncio.Event().wait()
    finally:
        await broker.close()

asyncio.run(main(sys.argv[1]))
"""


def backend(path: Path) -> EmbeddedBackendConfig:
    return EmbeddedBackendConfig(path=str(path), lease_s=30.0)


async def run_script(
    tmp_path: Path, name: str, script: str, *args: str, stdin: bool = False
) -> asyncio.subprocess.Process:
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    stderr = (tmp_path / f"{name}.stderr").open("wb")
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            str(path),
            *args,
            stdin=asyncio.subprocess.PIPE if stdin else None,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
    finally:
        stderr.close()


async def next_report(process: asyncio.subprocess.Process, tmp_path: Path) -> dict[str, Any]:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    if not line:
        pytest.fail(f"the process ended without a report:\n{stderr_of(tmp_path)}")
    report: dict[str, Any] = json.loads(line)
    return report


async def write_from_another_process(
    tmp_path: Path, topic: str, count: int, *, rate: float = 1000.0, partition: int = -1
) -> dict[str, Any]:
    writer = await run_script(
        tmp_path,
        "writer",
        WRITER_SCRIPT,
        str(tmp_path / "n.db"),
        topic,
        str(count),
        str(rate),
        str(partition),
    )
    report = await next_report(writer, tmp_path)
    assert await writer.wait() == 0
    return report


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(backend(tmp_path / "n.db"), wakeups=SLOW_POLL)
    try:
        for topic in ("t", "other"):
            await opened.admin.create_topic(
                topic, partitions=PARTITIONS, consumers=[ConsumerSpec("c")]
            )
        yield opened
    finally:
        await opened.close()


def stderr_of(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in tmp_path.glob("*.stderr"))


async def receive_while_writing(
    reader: TopicReader,
    count: int,
    writer: asyncio.subprocess.Process,
    tmp_path: Path,
    timeout_s: float = 30.0,
) -> list[Message]:
    """The ``count`` messages a writer process appends, received as it writes them.

    ``timeout_s`` only bounds a failing run: a process that starts on a busy host
    may take seconds before its first write.
    """
    got: list[Message] = []
    try:
        while len(got) < count:
            batch = await reader.receive(500, timeout_s)
            assert batch, f"only {len(got)} of {count} arrived:\n{stderr_of(tmp_path)}"
            got.extend(batch)
    finally:
        assert await writer.wait() == 0, stderr_of(tmp_path)
    return got


def socket_file_exists(address: bytes) -> bool:
    return os.path.exists(address)


def bell_rows(path: Path) -> list[tuple[int, str, bytes]]:
    with sqlite3.connect(path) as conn:
        return [
            (r[0], r[1], bytes(r[2]))
            for r in conn.execute("SELECT topic_id, member_id, address FROM bells")
        ]


# --- the fast path --------------------------------------------------------------------------


async def step_writer(tmp_path: Path) -> asyncio.subprocess.Process:
    """A writer process that appends one message per ``write_step`` (see STEP_WRITER_SCRIPT)."""
    return await run_script(
        tmp_path, "writer", STEP_WRITER_SCRIPT, str(tmp_path / "n.db"), "t", stdin=True
    )


async def write_step(writer: asyncio.subprocess.Process, n: int) -> None:
    """Has the step writer append message ``n`` to partition ``n % PARTITIONS``."""
    assert writer.stdin is not None
    writer.stdin.write(b"%d %d\n" % (n, n % PARTITIONS))
    await writer.stdin.drain()


async def end_steps(writer: asyncio.subprocess.Process, tmp_path: Path) -> dict[str, Any]:
    """Closes the step writer's stdin; what it rang."""
    assert writer.stdin is not None
    writer.stdin.close()
    report = await next_report(writer, tmp_path)
    assert await writer.wait() == 0, stderr_of(tmp_path)
    return report


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_ring_alone_wakes_a_reader_in_another_process(
    broker: EmbeddedBroker, tmp_path: Path, loop: str
) -> None:
    # The reader never polls and has no watch: each message it receives, a ring told it
    # of. In step: the next message is written once the reader has the last one.
    count = 100
    reader = await run_script(
        tmp_path, "reader", RINGS_ONLY_READER_SCRIPT, str(tmp_path / "n.db"), str(count), loop
    )
    writer = await step_writer(tmp_path)
    try:
        ready = await next_report(reader, tmp_path)  # holds every partition, read the topic
        received = []
        for n in range(count):
            await write_step(writer, n)
            received.append(await next_report(reader, tmp_path))
        stats = await next_report(reader, tmp_path)
        written = await end_steps(writer, tmp_path)
    finally:
        for process in (reader, writer):
            if process.returncode is None:
                process.kill()
            await process.wait()
    assert received == [{"n": n, "partition": n % PARTITIONS} for n in range(count)]
    assert (written["sent"], written["dropped"]) == (count, 0)
    assert (stats["rings"], stats["watch_rings"]) == (count, 0)
    # Every ring carried its row: after the first append to each partition (nothing
    # held in the cache to continue, so the file is read), each came from the cache.
    assert stats["file_reads"] - ready["file_reads"] == PARTITIONS
    assert stats["cache_reads"] - ready["cache_reads"] == count - PARTITIONS


async def test_rings_wake_only_readers_of_the_topic_and_partitions_written(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    first = await broker.reader("t", "c")
    second = await broker.reader("t", "c")
    await first.heartbeat()  # hands half of the partitions to the second now
    await second.heartbeat()
    assert len(first.sessions()) == len(second.sessions()) == PARTITIONS // 2
    bystander = await broker.reader("other", "c")
    holder = first if 0 in [s.partition for s in first.sessions()] else second
    idle = second if holder is first else first

    waiting = asyncio.create_task(holder.receive(100, 5.0))
    await asyncio.sleep(0.05)  # waiting in its 500 ms poll
    written = await write_from_another_process(tmp_path, "t", 20, rate=200, partition=0)
    got = list(await waiting)
    while len(got) < 20:
        got.extend(await holder.receive(100, 1.0))

    assert [m.partition for m in got] == [0] * 20
    assert written["sent"] == 20  # one bell (this broker's) for all three readers
    assert broker.bell_statistics().rings_received == 20
    assert holder.statistics().rings > 0
    assert idle.statistics().rings == 0
    assert bystander.statistics().rings == 0


async def test_a_reader_on_a_long_path_gets_an_abstract_bell(tmp_path: Path) -> None:
    if sys.platform != "linux":
        pytest.skip("abstract AF_UNIX names are Linux only")
    deep = tmp_path / ("d" * 110)
    deep.mkdir()
    broker = await open_embedded(backend(deep / "n.db"), wakeups=RINGS_ONLY)
    try:
        await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("t", "c")
        address = broker.bell_statistics().address
        assert address is not None
        assert address.startswith(b"\0")
        assert not await reader.receive(10, 0.05)  # drained: only a ring can wake it now
        waiting = asyncio.create_task(reader.receive(10, 30.0))
        other = await open_embedded(backend(deep / "n.db"))
        try:
            writer = await other.writer("t")
            await writer.write([OutgoingMessage(value=b"far")])
            assert [m.value for m in await waiting] == [b"far"]  # never polled: rung
            assert other.bell_statistics().rung.sent == 1
            assert reader.statistics().rings == 1
        finally:
            await other.close()
    finally:
        await broker.close()


# --- the fallback and the clean-up ---------------------------------------------------------


# A writer process that mixes small appends (their rings carry the rows) with
# appends too big to carry (plain rings: the reader reads the file), with keys,
# metadata and its own timestamps, so that what arrives can be compared field by field.
MIXED_WRITER_SCRIPT = """
import asyncio, sys
from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import OutgoingMessage

async def main(path, count):
    broker = await open_embedded(path)
    try:
        writer = await broker.writer("t", producer_id="mixed")
        for n in range(count):
            big = n % 10 == 7
            value = (b"%d " % n) + (b"x" * 40_000 if big else b"small")
            await writer.write([OutgoingMessage(
                value=value, key=f"k{n}", metadata={"n": str(n)}, partition=n % 4,
                seqno=n + 1, created_at=1_700_000_000.0 + n)])
            await asyncio.sleep(0.002)
    finally:
        await broker.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_small_appends_reach_a_reader_in_another_process_without_a_file_read(
    tmp_path: Path,
) -> None:
    # Only rings send this reader to the file (RINGS_ONLY), so its file reads are counted
    # exactly: in step, every ring waits alone in the socket and none is refused.
    broker = await open_embedded(backend(tmp_path / "n.db"), wakeups=RINGS_ONLY)
    try:
        await broker.admin.create_topic("t", partitions=PARTITIONS, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("t", "c")
        assert not await reader.receive(10, 0.05)  # caught up: a read of the (empty) file
        before = reader.statistics()
        count = 200
        writer = await step_writer(tmp_path)
        got: list[Message] = []
        try:
            for n in range(count):
                await write_step(writer, n)
                got.extend(await reader.receive(10, 30.0))
                assert len(got) == n + 1, stderr_of(tmp_path)
            written = await end_steps(writer, tmp_path)
        finally:
            if writer.returncode is None:
                writer.kill()
            await writer.wait()
        assert [(int(m.value), m.partition) for m in got] == [
            (n, n % PARTITIONS) for n in range(count)
        ]
        assert (written["sent"], written["dropped"]) == (count, 0)
        # Every ring carried its append's row into the cache...
        bells = broker.bell_statistics()
        assert bells.rings_received == bells.rows_received == count
        # ...and the reader went to the file only for each partition's first append (no
        # run in the cache to continue yet); every other append came from the cache.
        after = reader.statistics()
        assert after.file_reads - before.file_reads == PARTITIONS, after
        assert after.cache_reads - before.cache_reads == count - PARTITIONS, after
    finally:
        await broker.close()


async def test_a_reader_fed_by_rings_does_not_poll_the_file_between_them(tmp_path: Path) -> None:
    # The default wakeups: a poll soon after data. Appends 10 ms apart leave that
    # poll time to run between every two rings, if announced data set it off.
    opened = await open_embedded(backend(tmp_path / "n.db"))
    try:
        await opened.admin.create_topic("t", partitions=PARTITIONS, consumers=[ConsumerSpec("c")])
        reader = await opened.reader("t", "c")
        await reader.receive(10, 0.05)
        count = 100
        writer = await run_script(
            tmp_path, "writer", WRITER_SCRIPT, str(tmp_path / "n.db"), "t", str(count), "100", "-1"
        )
        loop = asyncio.get_running_loop()
        try:
            got = list(await reader.receive(500, 30.0))  # the first ring: the writer runs
            first, started = reader.statistics(), loop.time()
            while len(got) < count:
                batch = await reader.receive(500, 30.0)
                assert batch, f"only {len(got)} of {count} arrived:\n{stderr_of(tmp_path)}"
                got.extend(batch)
            elapsed = loop.time() - started
        finally:
            assert await writer.wait() == 0, stderr_of(tmp_path)
        assert sorted(int(m.value.split()[0]) for m in got) == list(range(count))
        stats = reader.statistics()
        # While the appends came: reads to start the other partitions' cached runs, one
        # per tail window (0.2 s) in case a ring was lost, the polls the backoff still
        # allows (each at least twice as long as the one before, from 2 ms), and the
        # watch's: not one or two per gap between rings (some 200), however long it took.
        reads = stats.file_reads - first.file_reads
        tail_windows = elapsed / 0.2 + 1
        polls = math.log2(max(elapsed, 0.002) / 0.002) + 1
        assert reads <= PARTITIONS + tail_windows + polls + stats.watch_rings, (stats, elapsed)
        await reader.close()
    finally:
        await opened.close()


async def test_rows_in_the_cache_go_out_before_the_file_is_looked_at(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    reader = await broker.reader("t", "c")
    assert isinstance(reader, EmbeddedReader)
    await reader.receive(10, 0.05)
    writer = await run_script(
        tmp_path, "writer", WRITER_SCRIPT, str(tmp_path / "n.db"), "t", "8", "200", "-1"
    )
    await receive_while_writing(reader, 8, writer, tmp_path)
    writer = await run_script(
        tmp_path, "writer", WRITER_SCRIPT, str(tmp_path / "n.db"), "t", "4", "200", "-1"
    )
    assert await writer.wait() == 0, stderr_of(tmp_path)
    await wait_until_true(lambda: broker.bell_statistics().rows_received >= 12)
    before = reader.statistics()
    assert reader._tail_since is not None  # the one switch this test needs
    reader._tail_since -= 1.0  # the tail window (0.5 s here) is over: the file is due a look
    assert len(await reader.receive(500, 1.0)) == 4
    after = reader.statistics()
    # Served from the cache, with no trip to the read thread first...
    assert (after.cache_reads, after.file_reads) == (before.cache_reads + 1, before.file_reads)
    # ...and the look comes at once with the next receive, not at the next poll: one
    # that may not wait at all still reads the file.
    assert not await reader.receive(500, 0.0)
    assert reader.statistics().file_reads == before.file_reads + 1


async def test_rows_from_rings_are_what_the_file_holds(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    reader = await broker.reader("t", "c")
    await reader.receive(10, 0.05)
    count = 60
    writer = await run_script(
        tmp_path, "mixed", MIXED_WRITER_SCRIPT, str(tmp_path / "n.db"), str(count)
    )
    got = await receive_while_writing(reader, count, writer, tmp_path)
    # Read again, from the file alone, by a second consumer: field for field the same.
    from_file = await open_embedded(backend(tmp_path / "n.db"), wakeups=Wakeups(bells=False))
    try:
        await from_file.admin.create_topic(
            "t", partitions=PARTITIONS, consumers=[ConsumerSpec("again")], exist_ok=True
        )
        again_reader = await from_file.reader("t", "again")
        again: list[Message] = []
        while len(again) < count:
            again.extend(await again_reader.receive(500, 2.0))
        await again_reader.close()
    finally:
        await from_file.close()

    def fields(m: Message) -> tuple[object, ...]:
        return (
            m.partition,
            m.offset,
            m.value,
            m.key,
            dict(m.metadata),
            m.producer_id,
            m.seqno,
            m.created_at,
            m.written_at,
        )

    assert sorted(map(fields, got)) == sorted(map(fields, again))
    stats = reader.statistics()
    # Both paths were taken.
    assert stats.cache_reads > 0
    assert stats.file_reads > 0


async def test_rows_of_a_sender_that_cannot_be_vouched_for_are_not_taken(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    reader = await broker.reader("t", "c")
    await reader.receive(10, 0.05)
    bell = broker._bell  # the one switch this test needs
    assert bell is not None
    bell._credentials = False  # as on a system without SO_PASSCRED
    writer = await run_script(
        tmp_path, "writer", WRITER_SCRIPT, str(tmp_path / "n.db"), "t", "40", "500", "-1"
    )
    got = await receive_while_writing(reader, 40, writer, tmp_path)
    assert sorted(int(m.value.split()[0]) for m in got) == list(range(40))
    assert broker.bell_statistics().rows_received == 0
    assert reader.statistics().cache_reads == 0  # every append was read from the file


def test_a_ring_carries_small_appends_rows() -> None:
    inserted = [
        # log.append's layout: topic, partition, offset, written, created, seqno,
        # producer, key, metadata, value
        (1, 2, 10, 5.5, 5.0, 7, "p", "k", '{"a":"b"}', b"v1"),
        (1, 2, 11, 5.5, 5.0, 8, "p", None, None, b"v2"),
        (1, 0, 3, 5.5, 4.0, None, None, None, None, b""),
    ]
    ring = read_ring(encode_rows(9, inserted) or b"")
    assert ring == (
        9,
        frozenset({0, 2}),
        {
            2: [
                (10, b"v1", "k", '{"a":"b"}', "p", 7, 5.0, 5.5),
                (11, b"v2", None, None, "p", 8, 5.0, 5.5),
            ],
            0: [(3, b"", None, None, None, None, 4.0, 5.5)],
        },
    )
    too_big = [(1, 0, n, 1.0, 1.0, None, None, None, None, b"x" * 1024) for n in range(64)]
    assert encode_rows(9, too_big) is None
    # Cut short or damaged: still a ring, for every partition of the topic, without rows.
    whole = encode_rows(9, inserted) or b""
    assert read_ring(whole[:-3]) == (9, None, {})
    assert read_ring(encode(7, {1})) == (7, frozenset({1}), {})
    assert read_ring(b"short") is None


def test_the_cache_takes_ring_rows_only_as_a_continuation() -> None:
    tail = TailCache()

    def row(offset: int) -> ReadRow:
        return (offset, b"v", None, None, None, None, 1.0, 1.0)

    assert tail.extend(1, 4, {0: [row(5), row(6)]}) == frozenset()  # nothing held: a file read
    assert tail.extend(1, 4, {0: [row(7)]}) == frozenset({0})
    assert [r[0] for r in tail.get(1, 0, 5, 10)] == [5, 6, 7]
    # A gap (a lost ring, or an append too big to carry): a new run, and a file read.
    assert tail.extend(1, 4, {0: [row(9)], 1: [row(0)]}) == frozenset()
    assert tail.get(1, 0, 7, 10) == []
    assert [r[0] for r in tail.get(1, 0, 9, 10)] == [9]


async def test_a_lost_ring_costs_a_poll_never_a_message(tmp_path: Path) -> None:
    polling = Wakeups(poll_min_s=0.05, poll_max_s=0.05, belled_poll_max_s=0.05)
    broker = await open_embedded(backend(tmp_path / "n.db"), wakeups=polling)
    try:
        await broker.admin.create_topic("t", partitions=PARTITIONS, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("t", "c")
        address = broker.bell_statistics().address
        assert address is not None
        os.unlink(address)  # every ring now fails: the writer finds no socket there
        written = await write_from_another_process(tmp_path, "t", 50, rate=500)
        got: list[Message] = []
        while len(got) < 50:
            batch = await reader.receive(100, 1.0)
            assert batch, f"only {len(got)} of 50 arrived"
            got.extend(batch)
        assert sorted(int(m.value.split()[0]) for m in got) == list(range(50))
        assert written["sent"] == 0
        assert written["dead"] == 1
        assert reader.statistics().rings == 0
    finally:
        await broker.close()


@contextlib.asynccontextmanager
async def reader_and_other_writer(
    tmp_path: Path, wakeups: Wakeups
) -> AsyncIterator[tuple[EmbeddedReader, Callable[[], Awaitable[None]]]]:
    """A belled reader of a one-partition topic, and a write to it from another broker
    whose ring is lost (the reader's bell is gone): only a poll can find it."""
    broker = await open_embedded(backend(tmp_path / "n.db"), wakeups=wakeups)
    other = await open_embedded(backend(tmp_path / "n.db"))
    try:
        await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("t", "c")

        async def write_unannounced() -> None:
            address = broker.bell_statistics().address
            assert address is not None
            os.unlink(address)  # so the ring is lost
            writer = await other.writer("t")
            await writer.write([OutgoingMessage(value=b"unannounced")])

        yield reader, write_unannounced
    finally:
        await other.close()
        await broker.close()


async def test_an_idle_belled_reader_reads_the_file_only_when_a_poll_is_due(
    tmp_path: Path,
) -> None:
    """Receives that time out between polls end without a trip to the file."""
    polling = Wakeups(poll_min_s=0.4, poll_max_s=0.4, belled_poll_max_s=0.4)
    async with reader_and_other_writer(tmp_path, polling) as (reader, write_unannounced):
        assert reader.statistics().belled
        started = time.monotonic()
        for _ in range(10):
            assert await reader.receive(10, 0.05) == ()
        elapsed = time.monotonic() - started
        reads = reader.statistics().file_reads
        # The first receive reads (nothing was read yet), then one poll per 0.4 s: ten
        # reads if each receive ended with one.
        assert reads <= 1 + elapsed / 0.4 + 1, (reads, elapsed)
        # What no ring announced is still found when a poll comes due.
        await write_unannounced()
        got: list[Message] = []
        for _ in range(30):
            got.extend(await reader.receive(10, 0.05))
            if got:
                break
        assert [m.value for m in got] == [b"unannounced"]


async def test_a_reader_asked_without_waiting_still_polls(tmp_path: Path) -> None:
    polling = Wakeups(poll_min_s=0.02, poll_max_s=0.02, belled_poll_max_s=0.02)
    async with reader_and_other_writer(tmp_path, polling) as (reader, write_unannounced):
        assert await reader.receive(10, 0) == ()  # drained: the next read waits for a ring
        await write_unannounced()
        deadline = time.monotonic() + 2.0
        while not (got := await reader.receive(10, 0)):
            assert time.monotonic() < deadline, "a due poll never happened"
            await asyncio.sleep(0.005)
        assert [m.value for m in got] == [b"unannounced"]


async def test_a_killed_reader_leaves_a_bell_that_writers_clean_up(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    reader = await run_script(tmp_path, "reader", IDLE_READER_SCRIPT, str(tmp_path / "n.db"))
    try:
        address = bytes.fromhex((await next_report(reader, tmp_path))["bell"])
        reader.send_signal(signal.SIGKILL)
        await reader.wait()
    finally:
        if reader.returncode is None:
            reader.kill()
            await reader.wait()
    assert socket_file_exists(address)
    assert [row[2] for row in bell_rows(tmp_path / "n.db")] == [address]

    writer = await broker.writer("t")
    for n in range(5):
        await writer.write([OutgoingMessage(value=b"%d" % n)])
    rung = broker.bell_statistics().rung
    assert (rung.sent, rung.dead_removed) == (0, 1)
    assert not socket_file_exists(address)

    # Its row stays until its lease runs out; writers re-reading it skip it.
    await asyncio.sleep(REFRESH_S * 1.5)
    await writer.write([OutgoingMessage(value=b"later")])
    rung = broker.bell_statistics().rung
    assert (rung.sent, rung.dead_removed) == (0, 1)
    assert rung.refreshes >= 2


async def test_a_new_bell_sweeps_dead_sockets_from_the_folder(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    folder = tmp_path / "n.db.bells"
    folder.mkdir()
    dead, alive = folder / "1-dead.sock", folder / "2-alive.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as gone:
        gone.bind(os.fspath(dead))  # bound, then closed: what a killed process leaves
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as live:
        live.bind(os.fspath(alive))
        await broker.reader("t", "c")
        assert not dead.exists()
        assert alive.exists()


async def test_closing_removes_the_bell_and_its_rows(tmp_path: Path) -> None:
    broker = await open_embedded(backend(tmp_path / "n.db"))
    await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
    await broker.reader("t", "c")
    address = broker.bell_statistics().address
    assert address is not None
    assert socket_file_exists(address)
    assert len(bell_rows(tmp_path / "n.db")) == 1
    await broker.close()
    assert not socket_file_exists(address)
    assert bell_rows(tmp_path / "n.db") == []


async def test_a_writer_with_no_reader_to_ring_pays_nothing(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    writer = await broker.writer("t")
    started = time.monotonic()
    for n in range(300):
        await writer.write([OutgoingMessage(value=b"%d" % n)])
    elapsed = time.monotonic() - started
    stats = broker.bell_statistics()
    assert stats.address is None  # no reader here: no bell either
    assert stats.rung.sent == stats.rung.dropped == 0
    # The table is read once per refresh interval, not per append.
    assert stats.rung.refreshes <= 1 + elapsed / REFRESH_S
    assert not (tmp_path / "n.db.bells").exists()


async def test_bells_can_be_turned_off(tmp_path: Path) -> None:
    broker = await open_embedded(backend(tmp_path / "n.db"), wakeups=Wakeups(bells=False))
    try:
        await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("t", "c")
        assert broker.bell_statistics().address is None
        assert not reader.statistics().belled
        assert bell_rows(tmp_path / "n.db") == []
    finally:
        await broker.close()


# --- the message ----------------------------------------------------------------------------


def test_a_ring_names_the_topic_and_the_partitions() -> None:
    assert decode(encode(7, {3, 1})) == (7, frozenset({1, 3}))
    assert decode(encode(7, [])) == (7, None)
    assert decode(encode(7, range(MAX_PARTITIONS_PER_RING + 1))) == (7, None)
    assert decode(b"short") is None
    assert decode(encode(7, {1}) + b"x") is None


def test_poll_intervals_are_checked() -> None:
    with pytest.raises(ValueError, match="poll intervals"):
        Wakeups(poll_min_s=0)
    with pytest.raises(ValueError, match="poll intervals"):
        Wakeups(poll_min_s=1.0, poll_max_s=0.5)
