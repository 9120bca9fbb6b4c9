"""Bells: readers in one process woken by appends in another, over real sockets and processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from nemesis.broker.embedded import EmbeddedBroker, Wakeups, open_embedded
from nemesis.broker.embedded.bells import MAX_PARTITIONS_PER_RING, REFRESH_S, decode, encode
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig

PARTITIONS = 4
# Polling alone would find an append after 250 ms on average: anything much
# faster was woken by a ring.
SLOW_POLL = Wakeups(poll_min_s=0.5, poll_max_s=0.5, belled_poll_max_s=0.5)

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

# A reader process on the given event loop: reports its bell's address once it
# holds the topic's partitions, then the write -> receive latency of `count`
# messages in ms (or, with count 0, just waits to be killed).
READER_SCRIPT = """
import asyncio, json, sys, time
from nemesis.broker.embedded import Wakeups, open_embedded
from nemesis.config.models import EmbeddedBackendConfig

async def main(path, count):
    slow_poll = Wakeups(poll_min_s=0.5, poll_max_s=0.5, belled_poll_max_s=0.5)
    broker = await open_embedded(EmbeddedBackendConfig(path=path, lease_s=30), wakeups=slow_poll)
    try:
        reader = await broker.reader("t", "c")
        print(json.dumps({"bell": broker.bell_statistics().address.hex()}), flush=True)
        if not count:
            await asyncio.Event().wait()
        latencies, order = [], []
        while len(latencies) < count:
            for message in await reader.receive(500, 5.0):
                n, stamp = message.value.split()
                latencies.append((time.monotonic_ns() - int(stamp)) / 1e6)
                order.append(int(n))
        print(json.dumps({"latencies_ms": latencies, "order": order,
                          "rings": reader.statistics().rings}), flush=True)
    finally:
        await broker.close()

loop = sys.argv[3]
if loop == "uvloop":
    import uvloop
    uvloop.run(main(sys.argv[1], int(sys.argv[2])))
else:
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def backend(path: Path) -> EmbeddedBackendConfig:
    return EmbeddedBackendConfig(path=str(path), lease_s=30.0)


async def run_script(
    tmp_path: Path, name: str, script: str, *args: str
) -> asyncio.subprocess.Process:
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    stderr = (tmp_path / f"{name}.stderr").open("wb")
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, str(path), *args, stdout=asyncio.subprocess.PIPE, stderr=stderr
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


def socket_file_exists(address: bytes) -> bool:
    return os.path.exists(address)


def bell_rows(path: Path) -> list[tuple[int, str, bytes]]:
    with sqlite3.connect(path) as conn:
        return [
            (r[0], r[1], bytes(r[2]))
            for r in conn.execute("SELECT topic_id, member_id, address FROM bells")
        ]


# --- the fast path --------------------------------------------------------------------------


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_ring_wakes_a_reader_in_another_process_at_once(
    broker: EmbeddedBroker, tmp_path: Path, loop: str
) -> None:
    count = 300
    reader = await run_script(
        tmp_path, "reader", READER_SCRIPT, str(tmp_path / "n.db"), str(count), loop
    )
    try:
        await next_report(reader, tmp_path)  # registered and holding every partition
        written = await write_from_another_process(tmp_path, "t", count)
        received = await next_report(reader, tmp_path)
    finally:
        if reader.returncode is None:
            reader.kill()
        await reader.wait()
    # Every message, each partition in order (round robin: n % 4 is the partition).
    assert sorted(received["order"]) == list(range(count))
    for partition in range(PARTITIONS):
        mine = [n for n in received["order"] if n % PARTITIONS == partition]
        assert mine == sorted(mine)
    assert written["sent"] >= count - 1
    assert received["rings"] > 0
    # A functional check, not a benchmark: polled every 500 ms, the median
    # would be about 250 ms; rung, it is well under a millisecond.
    median = statistics.median(received["latencies_ms"][10:])
    assert median < 2.0, sorted(received["latencies_ms"])[::30]


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
    broker = await open_embedded(backend(deep / "n.db"), wakeups=SLOW_POLL)
    try:
        await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("t", "c")
        address = broker.bell_statistics().address
        assert address is not None
        assert address.startswith(b"\0")
        waiting = asyncio.create_task(reader.receive(10, 5.0))
        await asyncio.sleep(0.05)
        other = await open_embedded(backend(deep / "n.db"))
        try:
            writer = await other.writer("t")
            started = time.monotonic()
            await writer.write([OutgoingMessage(value=b"far")])
            assert [m.value for m in await waiting] == [b"far"]
            assert time.monotonic() - started < 0.25  # not the 500 ms poll
            assert other.bell_statistics().rung.sent == 1
        finally:
            await other.close()
    finally:
        await broker.close()


# --- the fallback and the clean-up ---------------------------------------------------------


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


async def test_a_reader_asked_without_waiting_still_polls(tmp_path: Path) -> None:
    polling = Wakeups(poll_min_s=0.02, poll_max_s=0.02, belled_poll_max_s=0.02)
    broker = await open_embedded(backend(tmp_path / "n.db"), wakeups=polling)
    other = await open_embedded(backend(tmp_path / "n.db"))
    try:
        await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("t", "c")
        assert await reader.receive(10, 0) == ()  # drained: the next read waits for a ring
        address = broker.bell_statistics().address
        assert address is not None
        os.unlink(address)  # so the ring is lost
        writer = await other.writer("t")
        await writer.write([OutgoingMessage(value=b"unannounced")])
        deadline = time.monotonic() + 2.0
        while not (got := await reader.receive(10, 0)):
            assert time.monotonic() < deadline, "a due poll never happened"
            await asyncio.sleep(0.005)
        assert [m.value for m in got] == [b"unannounced"]
    finally:
        await other.close()
        await broker.close()


async def test_a_killed_reader_leaves_a_bell_that_writers_clean_up(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    reader = await run_script(
        tmp_path, "reader", READER_SCRIPT, str(tmp_path / "n.db"), "0", "asyncio"
    )
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
