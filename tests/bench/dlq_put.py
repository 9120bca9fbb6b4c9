"""DLQ ``put`` throughput on the SQLite store: one writer at a time, and many at once.

Runs ``put`` of one dead letter per call through the store's async API, first
back to back from one task (each put waits for the one before), then from
``--writers`` tasks at once (as the flows of a busy proxy dead-letter
together: concurrent puts may share a transaction). The baseline, measured in
the same run on the same disk: plain sqlite3 transactions of one INSERT each,
in WAL with ``synchronous=NORMAL`` and in a rollback journal with
``synchronous=FULL``, with no thread hop: what one commit costs on this disk.

Prints puts per second and the ratios against the baselines.

Usage: `python tests/bench/dlq_put.py [--seconds S] [--writers N] [--dir DIR]`
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import tempfile
import time
from pathlib import Path

from nemesis.dlq import DeadLetter, Reason, open_sqlite_dlq


def letter(n: int, writer: int) -> DeadLetter:
    return DeadLetter(
        integration=f"bench-{writer % 8}",
        event_id=f"bench-{writer}-{n}",
        payload=os.urandom(512),
        reason=Reason.HTTP_4XX,
        error=f"422 missing field `city` in order {n}",
        source_topic="orders",
        source_partition=writer,
        source_offset=n,
        attempts=1,
        http_status=422,
        key=f"k{n}",
        metadata={"ce-type": "order.created"},
    )


async def sequential(path: Path, seconds: float) -> float:
    store = await open_sqlite_dlq(path)
    try:
        count = 0
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()
        while time.perf_counter() < deadline:
            await store.put([letter(count, 0)])
            count += 1
        return count / (time.perf_counter() - started)
    finally:
        await store.close()


async def concurrent(path: Path, seconds: float, writers: int) -> float:
    store = await open_sqlite_dlq(path)
    try:
        counts = [0] * writers
        deadline = time.perf_counter() + seconds

        async def write(writer: int) -> None:
            while time.perf_counter() < deadline:
                await store.put([letter(counts[writer], writer)])
                counts[writer] += 1

        started = time.perf_counter()
        async with asyncio.TaskGroup() as tasks:
            for writer in range(writers):
                tasks.create_task(write(writer))
        return sum(counts) / (time.perf_counter() - started)
    finally:
        await store.close()


def raw(path: Path, seconds: float, *, wal: bool) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL" if wal else "PRAGMA journal_mode=TRUNCATE")
        conn.execute("PRAGMA synchronous=NORMAL" if wal else "PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, payload BLOB)")
        count = 0
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()
        while time.perf_counter() < deadline:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t (payload) VALUES (?)", (os.urandom(512),))
            conn.execute("COMMIT")
            count += 1
        return count / (time.perf_counter() - started)
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--writers", type=int, default=32, help="concurrent putting tasks")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = Path(folder)
        wal = raw(root / "raw-wal.db", args.seconds, wal=True)
        rollback = raw(root / "raw-rollback.db", args.seconds, wal=False)
        one = asyncio.run(sequential(root / "sequential.db", args.seconds))
        many = asyncio.run(concurrent(root / "concurrent.db", args.seconds, args.writers))
    print(f"baseline: raw sqlite3, WAL + synchronous=NORMAL   {wal:9.0f} commits/s")
    print(f"baseline: raw sqlite3, rollback + synchronous=FULL {rollback:8.0f} commits/s")
    print(f"store put, one task                               {one:9.0f} puts/s")
    print(f"store put, {args.writers} tasks at once {'':<19}{many:9.0f} puts/s")
    print(f"ratios: one task / raw WAL {one / wal:.2f}, / raw rollback {one / rollback:.2f};")
    print(
        f"        {args.writers} tasks / one task {many / one:.2f}, / raw rollback {many / rollback:.2f}"
    )


if __name__ == "__main__":
    main()
