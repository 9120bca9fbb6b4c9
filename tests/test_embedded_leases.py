"""Readers in separate processes share one consumer through leases; a killed one is replaced."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nemesis.broker.embedded import EmbeddedBroker, leases, open_embedded
from nemesis.broker.embedded.reader import EmbeddedSession
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig
from tests.test_processes import dead_pid

PARTITIONS = 4

# A reader process: reads, reports what it owns and what it got (one JSON object
# per line), commits every batch, and closes gracefully on SIGTERM.
READER_SCRIPT = """
import asyncio, json, signal, sys
from itertools import groupby
from nemesis.broker.embedded import open_embedded
from nemesis.config.models import EmbeddedBackendConfig

def emit(**event):
    print(json.dumps(event), flush=True)

async def main(path, member_id, lease_s):
    config = EmbeddedBackendConfig(path=path, lease_s=lease_s)
    broker = await open_embedded(config, member_id=member_id)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    reader = await broker.reader("t", "c")
    owned = None
    try:
        while not stop.is_set():
            now_owned = [s.partition for s in reader.sessions()]
            if now_owned != owned:
                owned = now_owned
                emit(owns=owned)
            messages = await reader.receive(50, 0.05)
            if messages:
                emit(got=[m.value.decode() for m in messages])
                for _, run in groupby(messages, key=lambda m: m.session):
                    await reader.commit(list(run))
    finally:
        await broker.close()
        emit(closed=True)

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""

# A writer process: appends batches of ten forever, reporting each acknowledged one.
WRITER_SCRIPT = """
import asyncio, sys
from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import OutgoingMessage

async def main(path):
    broker = await open_embedded(path)
    writer = await broker.writer("t", producer_id="w")
    seqno = 0
    while True:
        batch = [OutgoingMessage(value=b"%d" % (seqno + i), seqno=seqno + i) for i in range(10)]
        await writer.write(batch)
        seqno += 10
        print(seqno, flush=True)

asyncio.run(main(sys.argv[1]))
"""


@dataclass
class ReaderProcess:
    """A reader script running in its own process, and what it reported."""

    name: str
    process: asyncio.subprocess.Process
    owns: list[int] = field(default_factory=list)
    got: set[str] = field(default_factory=set)
    closed: bool = False
    pump: asyncio.Task[None] | None = None

    async def read_reports(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            event = json.loads(line)
            if "owns" in event:
                self.owns = event["owns"]
            if "got" in event:
                self.got.update(event["got"])
            if event.get("closed"):
                self.closed = True


StartReader = Callable[[str, float], Awaitable[ReaderProcess]]


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[StartReader]:
    script = tmp_path / "reader.py"
    script.write_text(READER_SCRIPT)
    started: list[ReaderProcess] = []

    async def start(name: str, lease_s: float) -> ReaderProcess:
        stderr = (tmp_path / f"{name}.stderr").open("wb")
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(script),
                str(tmp_path / "n.db"),
                name,
                str(lease_s),
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
            )
        finally:
            stderr.close()
        reader = ReaderProcess(name, process)
        reader.pump = asyncio.create_task(reader.read_reports())
        started.append(reader)
        return reader

    try:
        yield start
    finally:
        for reader in started:
            if reader.process.returncode is None:
                reader.process.kill()
            await reader.process.wait()
            if reader.pump is not None:
                await reader.pump


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "n.db")))
    try:
        await opened.admin.create_topic("t", partitions=PARTITIONS, consumers=[ConsumerSpec("c")])
        yield opened
    finally:
        await opened.close()


async def until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Waits for ``check``; returns how long it took."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what}: not reached within {timeout_s}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def write(broker: EmbeddedBroker, first: int, count: int) -> set[str]:
    writer = await broker.writer("t")
    batch = [f"m{i}" for i in range(first, first + count)]
    await writer.write([OutgoingMessage(value=v.encode()) for v in batch])
    await writer.close()
    return set(batch)


async def all_committed(broker: EmbeddedBroker) -> bool:
    described = await broker.admin.describe_topic("t")
    return all(p.committed["c"] == p.end_offset for p in described.partitions)


@pytest.mark.slow
async def test_a_killed_reader_process_is_replaced_within_the_lease(
    broker: EmbeddedBroker,
    processes: StartReader,
) -> None:
    lease_s = 1.0
    sent = await write(broker, 0, 200)
    doomed, survivor = await processes("a-doomed", lease_s), await processes("b-survivor", lease_s)
    await until(
        lambda: (
            sorted(doomed.owns + survivor.owns) == list(range(PARTITIONS))
            and len(doomed.owns) == len(survivor.owns)
        ),
        20,
        "an even split between the two processes",
    )
    sent |= await write(broker, 200, 200)
    await until(lambda: bool(doomed.got), 10, "the doomed reader reading")

    doomed.process.send_signal(signal.SIGKILL)
    await doomed.process.wait()
    sent |= await write(broker, 400, 200)
    takeover_s = await until(
        lambda: survivor.owns == list(range(PARTITIONS)), 10, "the survivor taking over"
    )
    # Its leases expire at most lease_s after the kill; the survivor notices at
    # its next heartbeat (every lease_s / 3). Generous for a busy machine.
    assert takeover_s < 3 * lease_s

    deadline = time.monotonic() + 20
    while not await all_committed(broker):
        assert time.monotonic() < deadline, "the survivor did not commit everything"
        await asyncio.sleep(0.05)
    # Nothing lost: what the dead reader had not committed, the survivor read again.
    assert doomed.got | survivor.got == sent
    assert not doomed.closed

    survivor.process.send_signal(signal.SIGTERM)
    assert await survivor.process.wait() == 0


@pytest.mark.slow
async def test_a_reader_process_that_stops_hands_over_before_its_lease_expires(
    broker: EmbeddedBroker,
    processes: StartReader,
) -> None:
    # Heartbeats every 2 s; an unreleased lease would last up to 6 s after the stop.
    lease_s = 6.0
    leaving, staying = await processes("a-leaving", lease_s), await processes("b-staying", lease_s)
    await until(
        lambda: len(leaving.owns) == len(staying.owns) == PARTITIONS // 2,
        30,
        "an even split between the two processes",
    )
    leaving.process.send_signal(signal.SIGTERM)
    assert await leaving.process.wait() == 0
    assert leaving.pump is not None
    await leaving.pump
    assert leaving.closed
    takeover_s = await until(
        lambda: staying.owns == list(range(PARTITIONS)), 10, "the other process taking over"
    )
    # At most one heartbeat interval (lease_s / 3), well before the lease ran out.
    assert takeover_s < lease_s / 2

    sent = await write(broker, 0, 100)
    await until(lambda: staying.got == sent, 10, "the remaining reader reading everything")
    staying.process.send_signal(signal.SIGTERM)
    assert await staying.process.wait() == 0


async def test_acknowledged_writes_survive_kill_9(broker: EmbeddedBroker, tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT)
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(script), str(tmp_path / "n.db"), stdout=asyncio.subprocess.PIPE
    )
    acknowledged = 0
    try:
        assert process.stdout is not None
        while acknowledged < 500:
            line = await asyncio.wait_for(process.stdout.readline(), 20)
            assert line, "the writer process ended early"
            acknowledged = int(line)
        process.send_signal(signal.SIGKILL)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        assert process.stdout is not None
        await process.stdout.read()

    described = await broker.admin.describe_topic("t")
    assert sum(p.end_offset for p in described.partitions) >= acknowledged
    await broker.admin.add_consumer("t", ConsumerSpec("check"))
    reader = await broker.reader("t", "check")
    seen: set[int] = set()
    while len(seen) < acknowledged:
        batch = await reader.receive(1000, 1.0)
        assert batch, f"only {len(seen)} of {acknowledged} acknowledged messages survived"
        seen.update(int(m.value) for m in batch)
    assert set(range(acknowledged)) <= seen
    # The seqno survived too: a retry of an acknowledged batch is a duplicate.
    writer = await broker.writer("t", producer_id="w")
    results = await writer.write([OutgoingMessage(value=b"again", seqno=acknowledged - 1)])
    assert results[0].status.value == "duplicate"


async def test_a_commit_is_fenced_by_the_lease_and_never_moves_back(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    broker = await open_embedded(EmbeddedBackendConfig(path=str(path), lease_s=30))
    try:
        await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("t", "c")
        [session] = reader.sessions()
        assert isinstance(session, EmbeddedSession)
        topic_id = reader.topic_id
        conn = sqlite3.connect(path, isolation_level=None)
        try:

            def commit(
                offset: int, generation: int = session.id, owner: str = session.holder
            ) -> bool:
                return leases.commit_offset(
                    conn,
                    topic_id=topic_id,
                    consumer="c",
                    partition=0,
                    owner=owner,
                    generation=generation,
                    offset=offset,
                    now=time.time(),
                )

            def committed() -> int | None:
                row = conn.execute(
                    "SELECT committed FROM offsets WHERE topic_id = ? AND partition_id = 0",
                    (topic_id,),
                ).fetchone()
                return None if row is None else int(row[0])

            assert commit(5)
            assert committed() == 5
            assert commit(3)  # the lease holds; the offset stays where it was
            assert committed() == 5
            assert commit(9)
            assert committed() == 9
            assert not commit(12, generation=session.id + 1)  # a lease taken over
            assert not commit(12, owner="someone-else")
            assert committed() == 9
            assert not conn.in_transaction  # committed on its own, nothing left open
        finally:
            conn.close()
        await reader.close()
    finally:
        await broker.close()


def _neighbour_id(pid: int, node: str | None = None) -> str:
    """A member id as another broker process of this host, boot and pid namespace writes it."""
    host, _pid, _random, own_node = leases.local_member_id().split(":")
    return f"{host}:{pid}:abcdef:{node or own_node}/1"


@pytest.mark.parametrize(
    ("predecessor", "taken_at_once"),
    [
        (lambda: _neighbour_id(dead_pid()), True),  # killed: its pid is gone
        (lambda: _neighbour_id(os.getppid()), False),  # alive
        (lambda: _neighbour_id(dead_pid(), node="0badc0de"), False),  # another container
        (lambda: f"elsewhere:{dead_pid()}:abcdef:0badc0de/1", False),  # another host
        (lambda: "a-named-member", False),  # an id that says nothing of where it runs
    ],
)
async def test_a_dead_predecessor_on_this_host_is_taken_over_at_once(
    tmp_path: Path, predecessor: Callable[[], str], taken_at_once: bool
) -> None:
    """A restart after kill -9 takes its partitions back without waiting out the lease."""
    path = tmp_path / "n.db"
    broker = await open_embedded(EmbeddedBackendConfig(path=str(path), lease_s=60))
    try:
        await broker.admin.create_topic("t", partitions=2, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("t", "c")
        topic_id = reader.topic_id
        await reader.close()
    finally:
        await broker.close()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        now = time.time()

        def beat(member: str) -> leases.HeartbeatResult:
            return leases.heartbeat(
                conn,
                topic_id=topic_id,
                consumer="c",
                member_id=member,
                held={},
                now=now,
                lease_s=60,
            )

        old = predecessor()
        assert {a.partition for a in beat(old).acquired} == {0, 1}
        restarted = beat(leases.local_member_id() + "/1")
        if taken_at_once:
            assert {a.partition for a in restarted.acquired} == {0, 1}
            assert restarted.members == 1
            owners = {r[0] for r in conn.execute("SELECT owner FROM leases")}
            assert old not in owners
        else:
            # Two members now; the old one keeps its live lease until it expires.
            assert restarted.members == 2
            assert restarted.settled is False
            owned = {a.partition for a in restarted.acquired}
            assert owned.isdisjoint(
                {
                    r[0]
                    for r in conn.execute("SELECT partition_id FROM leases WHERE owner = ?", (old,))
                }
            )
    finally:
        conn.close()


def test_a_member_id_says_where_it_runs() -> None:
    import socket

    host, pid, random, node = leases.local_member_id().split(":")
    assert host == socket.gethostname()
    assert int(pid) == os.getpid()
    assert len(random) == 6
    assert len(node) == 8
    assert not leases.is_dead_neighbour(leases.local_member_id())  # itself: alive
