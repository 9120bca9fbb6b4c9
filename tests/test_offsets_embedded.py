"""The embedded backend's side of offsets for operators: what the contract leaves to backends.

A seek takes the partition from the reader holding it (its commits are
fenced off), and a start other than earliest is committed at once, so a
restart before the first commit starts at the same place.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import ConsumerSpec, OutgoingMessage, StartFrom
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.testing.clock import FakeClock
from tests.contract.test_broker import eventually, receive_all

pytestmark = pytest.mark.timeout(60)


def config(tmp_path: Path) -> EmbeddedBackendConfig:
    return EmbeddedBackendConfig(path=str(tmp_path / "nemesis.db"), lease_s=30.0)


async def test_a_seek_takes_the_partition_from_its_reader_which_reads_on_from_the_seek(
    tmp_path: Path,
) -> None:
    broker = await open_embedded(config(tmp_path))
    try:
        await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
        writer = await broker.writer("t")
        await writer.write([OutgoingMessage(value=b"%d" % i) for i in range(5)])
        reader = await broker.reader("t", "c")
        held = await receive_all(reader, 5)
        await reader.commit(held[:1])

        # The seek returns once the reader took the partition back (its next heartbeat).
        seeking = asyncio.create_task(broker.admin.seek("t", "c", 0, 3))

        async def committed_moved() -> bool:
            return (await broker.admin.describe_topic("t")).partitions[0].committed["c"] == 3

        await eventually(committed_moved)
        assert not seeking.done()
        await reader.heartbeat()
        moved = await seeking
        assert (moved.before, moved.after) == (1, 3)
        # The reader's session ended when its heartbeat found the lease gone...
        assert not held[1].alive
        # ...so its commit of what it had read cannot move the offset the seek set,
        await reader.commit(held[1:2])
        assert (await broker.admin.describe_topic("t")).partitions[0].committed["c"] == 3
        # and it took the partition again, from the seek.
        assert [m.value for m in await receive_all(reader, 2)] == [b"3", b"4"]
    finally:
        await broker.close()


async def test_latest_is_committed_when_taken_so_a_restart_starts_there_too(
    tmp_path: Path,
) -> None:
    broker = await open_embedded(config(tmp_path))
    await broker.admin.create_topic("t", partitions=1, consumers=[ConsumerSpec("c")])
    writer = await broker.writer("t")
    await writer.write([OutgoingMessage(value=b"before")])
    reader = await broker.reader("t", "c", start_from=StartFrom("latest"))
    assert (await broker.admin.describe_topic("t")).partitions[0].committed["c"] == 1
    await reader.close()
    await writer.write([OutgoingMessage(value=b"between")])
    await broker.close()

    restarted = await open_embedded(config(tmp_path))
    try:
        again = await restarted.reader("t", "c", start_from=StartFrom("latest"))
        assert [m.value for m in await receive_all(again, 1)] == [b"between"]
    finally:
        await restarted.close()


async def test_offsets_for_time_finds_the_boundary_in_a_long_partition(tmp_path: Path) -> None:
    clock = FakeClock(wall_start=1_800_000_000.0)
    broker = await open_embedded(config(tmp_path), clock=clock)
    try:
        await broker.admin.create_topic("t", partitions=2, retention_s=0)
        writer = await broker.writer("t")
        # Partition 0: offset n written at wall_start + n, three messages per second
        # from 100 on; partition 1 stays empty.
        for n in range(100):
            await writer.write([OutgoingMessage(value=b"%d" % n, partition=0)])
            clock.advance(1.0)
        for _ in range(3):
            await writer.write([OutgoingMessage(value=b"same", partition=0)])
        t0 = 1_800_000_000.0

        async def at(seconds: float) -> dict[int, int]:
            return dict(await broker.admin.offsets_for_time("t", t0 + seconds))

        assert await at(-5) == {0: 0, 1: 0}
        assert await at(0) == {0: 0, 1: 0}
        assert await at(37) == {0: 37, 1: 0}
        assert await at(37.5) == {0: 38, 1: 0}
        assert await at(99) == {0: 99, 1: 0}
        assert await at(100) == {0: 100, 1: 0}  # the first of three written at once
        assert await at(100.5) == {0: 103, 1: 0}  # after everything: the end
        times = await broker.admin.write_times("t", {0: 37, 1: 0})
        assert times == {0: t0 + 37}  # partition 1 has no message 0
    finally:
        await broker.close()
