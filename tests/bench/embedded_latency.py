"""Write -> receive latency of the embedded log across processes, with and without bells.

A writer process appends one message per write at a steady rate, stamping
each with the monotonic clock (shared by the processes of one machine) just
before ``write``; a reader in this process takes the difference on receipt.
So the figures include the append transaction itself, which the writer's
own ``write`` durations show apart. Rows:

  bells            the default: a ring after each commit, polling as the fallback
  polling only     bells off: the reader polls (2 ms after data, up to 50 ms idle)
  bells, slow poll bells with polling every 500 ms: what the rings alone achieve

Usage: `python tests/bench/embedded_latency.py [--rate 1000] [--seconds 5]`. The
reader and the writer run pinned to different cores when there are two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemesis.broker.embedded import Wakeups, open_embedded
from nemesis.broker.port import ConsumerSpec, OutgoingMessage

PARTITIONS = 4
WARMUP = 100  # messages left out of the figures: the writer's first look-ups, caches
STAMP = struct.Struct("<q")
MODES = {
    "bells": Wakeups(),
    "polling only": Wakeups(bells=False),
    "bells, slow poll": Wakeups(poll_min_s=0.5, poll_max_s=0.5, belled_poll_max_s=0.5),
}


def percentile(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))] if ordered else float("nan")
    )


def pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if (os.cpu_count() or 1) >= 2 else []


async def writer_process(path: str, topic: str, count: int, rate: float) -> None:
    """The child: appends ``count`` stamped messages at ``rate`` once told to start."""
    broker = await open_embedded(path)
    durations = []
    try:
        writer = await broker.writer(topic)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        interval = 1 / rate
        started = time.perf_counter()
        for n in range(count):
            delay = started + n * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            stamp = time.monotonic_ns()
            await writer.write(
                [OutgoingMessage(value=STAMP.pack(stamp) + b"x" * 300, partition=n % PARTITIONS)]
            )
            durations.append((time.monotonic_ns() - stamp) / 1e6)
        rung = broker.bell_statistics().rung
    finally:
        await broker.close()
    print(
        json.dumps(
            {
                "write_p50": percentile(durations[WARMUP:], 50),
                "write_p99": percentile(durations[WARMUP:], 99),
                "rings_sent": rung.sent,
                "rings_dropped": rung.dropped,
            }
        ),
        flush=True,
    )


async def measure(
    root: Path, topic: str, wakeups: Wakeups, rate: float, seconds: float
) -> dict[str, Any]:
    """Write -> receive latencies of one run, in ms, and what the writer reported."""
    path = str(root / "latency.db")
    count = int(rate * seconds)
    broker = await open_embedded(path, wakeups=wakeups)
    try:
        await broker.admin.create_topic(topic, partitions=PARTITIONS, consumers=[ConsumerSpec("c")])
        reader = await broker.reader(topic, "c")
        child = await asyncio.create_subprocess_exec(
            *pinned(1),
            sys.executable,
            __file__,
            "--writer",
            path,
            topic,
            str(count),
            str(rate),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert child.stdin is not None and child.stdout is not None
        await asyncio.sleep(0.5)  # the child has opened the file
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        latencies: list[float] = []
        while len(latencies) < count:
            batch = await reader.receive(1000, 5.0)
            now = time.monotonic_ns()
            latencies.extend((now - STAMP.unpack_from(m.value)[0]) / 1e6 for m in batch)
        written = json.loads(await child.stdout.readline())
        await child.wait()
        rings = reader.statistics().rings
    finally:
        await broker.close()
    kept = latencies[WARMUP:]
    return {
        "p50": percentile(kept, 50),
        "p90": percentile(kept, 90),
        "p99": percentile(kept, 99),
        "max": max(kept),
        "mean": statistics.fmean(kept),
        "rings": rings,
        **written,
    }


async def main(args: argparse.Namespace) -> None:
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    rows = []
    with tempfile.TemporaryDirectory(prefix="nemesis-latency-") as tmp:
        runs = [(mode, wakeups) for _ in range(args.repeat) for mode, wakeups in MODES.items()]
        for number, (mode, wakeups) in enumerate(runs):
            row = await measure(Path(tmp), f"t{number}", wakeups, args.rate, args.seconds)
            rows.append({"mode": mode, **row})
    print(f"\nEmbedded log, write -> receive across processes at {args.rate:,.0f} msg/s (ms)")
    print(
        f"  {'mode':<18} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7}   {'write p50/p99':>13}  rings"
    )
    for row in rows:
        print(
            f"  {row['mode']:<18} {row['p50']:>7.3f} {row['p90']:>7.3f} {row['p99']:>7.3f} {row['max']:>7.2f}"
            f"   {row['write_p50']:>6.3f}/{row['write_p99']:<6.3f}  {row['rings']} received,"
            f" {row['rings_sent']} sent, {row['rings_dropped']} dropped"
        )


def run(coroutine: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        path, topic, count, rate = sys.argv[2:6]
        run(writer_process(path, topic, int(count), float(rate)))
        sys.exit(0)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=1)
    run(main(parser.parse_args()))
