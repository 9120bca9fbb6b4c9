"""CPU per job of the embedded backend's SQLite threads, against a single-thread executor.

Every read, append and commit of the embedded backend is a job that leaves
the event loop for the thread owning a connection (``db.SqliteThread``) and
comes back. This measures what that trip costs, without SQLite: a job that
does nothing, sent ``--jobs`` times, one after another (as an append at a
time is), at ``--rate`` jobs a second and as fast as they go. The baseline,
measured in the same run, is what the threads used before: a single-thread
``ThreadPoolExecutor`` via ``run_in_executor``, under ``asyncio.timeout``.
The process runs pinned to one core, as `nemesis run` is in tests/bench/delivery.py.

Usage: `python tests/bench/sqlite_thread.py [--jobs 3000] [--rate 1000]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nemesis.broker.embedded.db import SqliteThread


def nothing(conn: sqlite3.Connection | None = None) -> None:
    return None


async def cpu_per_job(send: Callable[[], Awaitable[None]], jobs: int, rate: float | None) -> float:
    """Microseconds of CPU (every thread of the process) per job."""
    interval = 1 / rate if rate else 0.0
    started_cpu = time.process_time()
    next_at = time.perf_counter()
    for _ in range(jobs):
        await send()
        if interval:
            next_at += interval
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # noqa: ASYNC251  # pacing: the loop has nothing else to do
    return (time.process_time() - started_cpu) / jobs * 1e6


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="nemesis-bench-") as tmp:
        thread = SqliteThread(Path(tmp) / "jobs.db", "bench", busy_timeout_s=5.0)
        await thread.open(5.0)
        executor = ThreadPoolExecutor(max_workers=1)
        loop = asyncio.get_running_loop()

        async def ours() -> None:
            await thread.run(nothing, timeout_s=10.0)

        async def baseline() -> None:
            async with asyncio.timeout(10.0):
                await loop.run_in_executor(executor, nothing)

        try:
            print(f"\nEmbedded backend: CPU per job on a SQLite thread ({args.jobs:,} empty jobs)")
            for rate in (args.rate, None):
                label = f"at {rate:,.0f} jobs/s" if rate else "back to back"
                ours_us: list[float] = []
                base_us: list[float] = []
                for _ in range(args.repeat):  # alternated: the machine is shared
                    base_us.append(await cpu_per_job(baseline, args.jobs, rate))
                    ours_us.append(await cpu_per_job(ours, args.jobs, rate))
                base, mine = statistics.median(base_us), statistics.median(ours_us)
                print(
                    f"  {label:>18}: SqliteThread {mine:6.0f} us,"
                    f" executor + asyncio.timeout {base:6.0f} us: {base / mine:.1f}x less"
                )
        finally:
            executor.shutdown()
            await thread.close()


def run() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(args))
    else:
        uvloop.run(main(args))


if __name__ == "__main__":
    run()
