"""Isolation benchmark: do heavy integrations hurt the ordinary ones of the same replica?

One `nemesis run` (embedded backend, pinned to core 0) runs 20 ordinary
integrations (one topic each, no pipeline) to a fast handler, and beside
them two heavy ones to a second handler: `heavy-cpu`, whose pipeline
reshapes ~2 MB JSON messages (parsing and writing them again is CPU on the
event loop), and `heavy-big`, which delivers ~10 MB messages. The heavy
ones are always configured; what alternates is whether their topics get
messages. Rounds alternate quiet and heavy phases in one run (quiet first
in even rounds, heavy first in odd ones), so a busy neighbour lands in both.

Per phase:
  latency     the producer (core 1, beside the handlers) stamps `ts` and appends
              --rate messages/s spread over the ordinary topics; the handler turns
              `ts` into the latency from the append to the delivery; p50 and p99
              pooled over the rounds;
  throughput  then --backlog messages are appended to each ordinary topic at once
              and the drain rate (events/s at the handler) is measured.

Prints both phases and the ratios heavy/quiet: targets p99 <= 2x, and
throughput cut by at most 20% (ratio >= 0.8). Usage:

    python tests/bench/isolation.py [--rounds 4] [--seconds 10] [--rate 200] [--backlog 500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from nemesis.broker.embedded import open_embedded  # noqa: E402
from nemesis.broker.port import ConsumerSpec, OutgoingMessage  # noqa: E402
from nemesis.config.models import EmbeddedBackendConfig  # noqa: E402
from nemesis.errors import NemesisError  # noqa: E402
from tests.bench.delivery import Handler, free_port, percentile, pin  # noqa: E402

ORDINARY = 20
PARTITIONS = 2
CPU_ITEMS = 50_000  # ~2 MB of JSON per heavy-cpu message
BIG_BYTES = 10 * 1024 * 1024


def ordinary(n: int) -> str:
    return f"ord-{n:02d}"


def write_workspace(root: Path, db: Path, fast_url: str, heavy_url: str) -> None:
    (root / "integrations").mkdir(parents=True, exist_ok=True)
    (root / "nemesis.yaml").write_text(
        f"backend: {{kind: embedded, path: {db}}}\nsingle_host: true\ndata_dir: .\n"
        f"integrations_dir: integrations\nadmin: {{port: {free_port()}}}\n"
        "viewer: {enabled: false}\n"
    )
    for n in range(ORDINARY):
        name = ordinary(n)
        (root / "integrations" / f"{name}.yaml").write_text(
            f"name: {name}\nowners: [team-{n % 5}]\n"
            f"source: {{topic: {name}, consumer: {name}}}\n"
            f"target: {{url: '{fast_url}', timeout_s: 30}}\n"
            "delivery: {workers: 8, buffer: 1000}\n"
        )
    (root / "integrations" / "heavy-cpu.yaml").write_text(
        "name: heavy-cpu\nowners: [team-heavy]\n"
        "source: {topic: heavy-cpu, consumer: heavy-cpu}\n"
        f"target: {{url: '{heavy_url}', timeout_s: 60}}\n"
        "pipeline:\n  - transform: {set: {seen: true}, rename: {k: key}}\n"
        "delivery: {workers: 8, buffer: 64}\n"
    )
    (root / "integrations" / "heavy-big.yaml").write_text(
        "name: heavy-big\nowners: [team-heavy]\n"
        "source: {topic: heavy-big, consumer: heavy-big}\n"
        f"target: {{url: '{heavy_url}', timeout_s: 60, format: bytes}}\n"
        "delivery: {workers: 4, buffer: 8}\n"
    )


async def heavy_load(db: Path, kinds: str) -> None:
    """Keeps the heavy topics fed until SIGTERM (run as ``--feed DB``, a process of its own)."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    broker = await open_embedded(EmbeddedBackendConfig(path=str(db)))
    cpu_value = orjson.dumps(
        {"k": 1, "items": [{"i": i, "s": "abcdefgh"} for i in range(CPU_ITEMS)]}
    )
    big_value = os.urandom(BIG_BYTES)
    try:
        cpu = await broker.writer("heavy-cpu")
        big = await broker.writer("heavy-big")
        turn = 0
        while not stop.is_set():
            try:
                if kinds in ("cpu", "both"):
                    await cpu.write([OutgoingMessage(value=cpu_value) for _ in range(4)])
                if kinds in ("big", "both") and turn % 4 == 0:  # one 10 MB message a second
                    await big.write([OutgoingMessage(value=big_value)])
            except NemesisError as exc:  # the log's file is locked: try again next turn
                print(f"feeder: {exc}", file=sys.stderr)
            turn += 1
            await asyncio.sleep(0.25)
        await cpu.close()
        await big.close()
    finally:
        await broker.close()


async def paced(broker: object, rate: float, seconds: float) -> int:
    """``rate`` stamped messages a second for ``seconds``, round-robin over the ordinary topics."""
    writers = [await broker.writer(ordinary(n)) for n in range(ORDINARY)]  # type: ignore[attr-defined]
    total = int(rate * seconds)
    started = time.perf_counter()
    for n in range(total):
        delay = started + n / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        stamped = orjson.dumps({"ts": time.time(), "n": n})
        await writers[n % ORDINARY].write([OutgoingMessage(value=stamped)])
    for writer in writers:
        await writer.close()
    return total


async def backlog(broker: object, per_topic: int) -> int:
    for n in range(ORDINARY):
        writer = await broker.writer(ordinary(n))  # type: ignore[attr-defined]
        stamped = orjson.dumps({"ts": time.time()})
        for first in range(0, per_topic, 500):
            count = min(500, per_topic - first)
            await writer.write([OutgoingMessage(value=stamped) for _ in range(count)])
        await writer.close()
    return per_topic * ORDINARY


async def phase(
    db: Path,
    handler: Handler,
    session: aiohttp.ClientSession,
    heavy: bool,
    args: argparse.Namespace,
) -> tuple[list[float], float]:
    """One phase: (latency samples in ms, backlog drain rate in events/s)."""
    feeder = None
    if heavy:
        # Its own process: its writes must not hold up the paced producer's loop.
        feeder = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--feed",
            str(db),
            "--heavy",
            args.heavy,
            stdout=subprocess.DEVNULL,
        )
    broker = await open_embedded(EmbeddedBackendConfig(path=str(db)))
    try:
        if heavy:
            await asyncio.sleep(2.0)  # the heavy ones are busy before we measure
        await handler.reset(session)
        await handler.wait_for(session, await paced(broker, args.rate, args.seconds))
        latencies: list[float] = (await handler.stats(session))["latencies_ms"]
        await handler.reset(session)
        started = time.perf_counter()
        total = await backlog(broker, args.backlog)
        await handler.wait_for(session, total)
        rate = total / (time.perf_counter() - started)
    finally:
        await broker.close()
        if feeder is not None:
            feeder.send_signal(signal.SIGTERM)
            await feeder.wait()
    if heavy:
        await asyncio.sleep(3.0)  # let the heavy topics drain before a quiet phase
    return latencies, rate


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="nemesis-isolation-") as tmp:
        root = Path(tmp)
        db = root / "bench.db"
        fast = Handler(latency=True)
        heavy_handler = Handler()
        broker = await open_embedded(EmbeddedBackendConfig(path=str(db)))
        for name in [*(ordinary(n) for n in range(ORDINARY)), "heavy-cpu", "heavy-big"]:
            await broker.admin.create_topic(
                name, partitions=PARTITIONS, consumers=[ConsumerSpec(name)], exist_ok=True
            )
        await broker.close()
        write_workspace(root, db, fast.url, heavy_handler.url)
        if (os.cpu_count() or 1) >= 2:
            os.sched_setaffinity(0, {1})
        proxy = subprocess.Popen(  # noqa: ASYNC220  (started once, before any measuring)
            [*pin(0), sys.executable, "-m", "nemesis", "--log-level", "warning", "run"], cwd=root
        )
        quiet_lat: list[float] = []
        heavy_lat: list[float] = []
        quiet_rates: list[float] = []
        heavy_rates: list[float] = []
        try:
            async with aiohttp.ClientSession() as session:
                # Warm up: every ordinary integration has delivered once.
                warm = await open_embedded(EmbeddedBackendConfig(path=str(db)))
                await paced(warm, 100, 1)
                await warm.close()
                await fast.wait_for(session, 100)
                for n in range(args.rounds):
                    for heavy in (False, True) if n % 2 == 0 else (True, False):
                        lat, rate = await phase(db, fast, session, heavy, args)
                        (heavy_lat if heavy else quiet_lat).extend(lat)
                        (heavy_rates if heavy else quiet_rates).append(rate)
                        print(
                            f"round {n} {'heavy' if heavy else 'quiet'}: p99"
                            f" {percentile(lat, 99):.1f} ms, drain {rate:,.0f} msg/s",
                            flush=True,
                        )
                heavy_seen = (await heavy_handler.stats(session))["events"]
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(60)
            fast.close()
            heavy_handler.close()
    q50, q99 = percentile(quiet_lat, 50), percentile(quiet_lat, 99)
    h50, h99 = percentile(heavy_lat, 50), percentile(heavy_lat, 99)
    qr, hr = statistics.median(quiet_rates), statistics.median(heavy_rates)
    print(f"heavy messages delivered: {heavy_seen}")
    print(f"ordinary latency quiet: p50 {q50:.1f} ms, p99 {q99:.1f} ms")
    print(f"ordinary latency heavy: p50 {h50:.1f} ms, p99 {h99:.1f} ms")
    print(f"p99 heavy/quiet: {h99 / q99:.2f}x (target <= 2)")
    print(f"ordinary drain quiet {qr:,.0f} msg/s, heavy {hr:,.0f} msg/s")
    print(f"throughput heavy/quiet: {hr / qr:.2f} (target >= 0.8)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0, help="latency part of a phase")
    parser.add_argument("--rate", type=float, default=200.0, help="ordinary messages/s in all")
    parser.add_argument("--backlog", type=int, default=500, help="messages per ordinary topic")
    parser.add_argument(
        "--heavy", choices=["both", "cpu", "big"], default="both", help="which heavy ones get load"
    )
    parser.add_argument("--feed", type=Path, help=argparse.SUPPRESS)  # the heavy feeder's child
    options = parser.parse_args()
    asyncio.run(main(options) if options.feed is None else heavy_load(options.feed, options.heavy))
