"""Isolation benchmark: do heavy integrations hurt the ordinary ones of the same replica?

One `nemesis run` (embedded backend, pinned to core 0) runs 20 ordinary
integrations (one topic each, no pipeline) to a fast handler, and beside
them two heavy ones, each to a handler of its own: `heavy-cpu`, whose
pipeline reshapes ~1.3 MB JSON messages (parsing and writing them again is
~25 ms of CPU each), and `heavy-big`, which delivers ~10 MB messages. The
heavy ones are always configured; what alternates is whether their topics
get messages. During a heavy phase a feeder process keeps them busy: it
appends whenever fewer than HEAVY_LAG of its messages wait undelivered
(heavy-big at most 2 a second, HEAVY_INTERVAL_S), so they always have work
and never build a backlog that would spill into the next quiet phase
(which starts only once they have delivered all). The feeder and the heavy
handlers run at niceness 19 beside the instruments on core 1.
Rounds alternate quiet and heavy phases in one run (quiet first in even
rounds, heavy first in odd ones), so a busy neighbour lands in both.

Per phase:
  latency     the producer (core 1, beside the handlers) appends --rate messages/s
              spread over the ordinary topics; the handler turns each event's
              `ce-time` (the time of the append, taken under the log's write lock)
              into the latency the proxy added, from the append to the delivery,
              and the `ts` the producer stamped before it into the latency end to
              end (it includes the producer's wait for the log's write lock, which
              the feeder's large appends hold); p50 and p99 pooled over the rounds;
  throughput  then --backlog messages are appended to each ordinary topic at once
              and the drain rate (events/s at the handler) is measured.

Prints both phases and the ratios heavy/quiet: targets added p99 <= 2x, and
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
CPU_ITEMS = 50_000  # ~1.3 MB of JSON per heavy-cpu message
BIG_BYTES = 10 * 1024 * 1024
# Messages of a heavy integration the feeder keeps waiting for it, undelivered.
HEAVY_LAG = {"heavy-cpu": 16, "heavy-big": 4}
# And the least time between two appends: heavy-cpu is held back by its own CPU, but
# 10 MB messages are cheap to deliver over loopback, and unpaced their appends would
# measure the log's one file (every topic's) rather than the proxy: 2 a second, 20 MB/s.
HEAVY_INTERVAL_S = {"heavy-cpu": 0.0, "heavy-big": 0.5}
# The heavy ones' feeder and handlers share core 1 with the instruments (the paced producer,
# the ordinary handler): at this niceness they take what those leave, and what is measured
# is what the heavy ones cost the proxy, not the bench's own core.
BENCH_NICENESS = 19


def ordinary(n: int) -> str:
    return f"ord-{n:02d}"


def write_workspace(root: Path, db: Path, fast_url: str, cpu_url: str, big_url: str) -> None:
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
        f"target: {{url: '{cpu_url}', timeout_s: 60}}\n"
        "pipeline:\n  - transform: {set: {seen: true}, rename: {k: key}}\n"
        "delivery: {workers: 8, buffer: 64}\n"
    )
    (root / "integrations" / "heavy-big.yaml").write_text(
        "name: heavy-big\nowners: [team-heavy]\n"
        "source: {topic: heavy-big, consumer: heavy-big}\n"
        f"target: {{url: '{big_url}', timeout_s: 60, format: bytes}}\n"
        "delivery: {workers: 4, buffer: 8}\n"
    )


async def heavy_load(db: Path, kinds: str, cpu_url: str, big_url: str) -> None:
    """Keeps the heavy topics saturated until SIGTERM (``--feed DB``, a process of its own).

    Prints what it appended to each, as ``heavy-cpu N heavy-big M``, when it ends.
    """
    os.nice(BENCH_NICENESS)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    broker = await open_embedded(EmbeddedBackendConfig(path=str(db)))
    values = {
        "heavy-cpu": orjson.dumps(
            {"k": 1, "items": [{"i": i, "s": "abcdefgh"} for i in range(CPU_ITEMS)]}
        ),
        "heavy-big": os.urandom(BIG_BYTES),
    }
    urls = {"heavy-cpu": cpu_url, "heavy-big": big_url}
    fed = [name for name in values if kinds in ("both", name.removeprefix("heavy-"))]
    written = dict.fromkeys(values, 0)
    last = dict.fromkeys(values, 0.0)
    try:
        writers = {name: await broker.writer(name) for name in fed}
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                for name in fed:
                    async with session.get(urls[name] + "count") as response:
                        delivered = (await response.json())["events"]
                    missing = HEAVY_LAG[name] - (written[name] - delivered)
                    if missing <= 0:
                        continue
                    # One message an append: the log's write lock is held for one at a time.
                    for _ in range(missing):
                        if time.monotonic() < last[name] + HEAVY_INTERVAL_S[name]:
                            break
                        try:
                            await writers[name].write([OutgoingMessage(value=values[name])])
                            written[name] += 1
                            last[name] = time.monotonic()
                        except NemesisError as exc:  # the log's file is locked: next turn
                            print(f"feeder: {exc}", file=sys.stderr)
                            break
                await asyncio.sleep(0.05)
        for writer in writers.values():
            await writer.close()
    finally:
        await broker.close()
        print(" ".join(f"{name} {count}" for name, count in written.items()), flush=True)


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
    handlers: dict[str, Handler],
    session: aiohttp.ClientSession,
    heavy: bool,
    args: argparse.Namespace,
) -> tuple[list[float], list[float], float]:
    """One phase: (added latencies in ms, end-to-end latencies in ms, drain rate in events/s)."""
    fast = handlers["fast"]
    feeder = None
    if heavy:
        # Its own process: its writes must not hold up the paced producer's loop.
        for name in HEAVY_LAG:
            await handlers[name].reset(session)
        feeder = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--feed",
            str(db),
            "--heavy",
            args.heavy,
            "--urls",
            handlers["heavy-cpu"].url,
            handlers["heavy-big"].url,
            stdout=subprocess.PIPE,
        )
    broker = await open_embedded(EmbeddedBackendConfig(path=str(db)))
    try:
        if heavy:
            await asyncio.sleep(2.0)  # the heavy ones are busy before we measure
        await fast.reset(session)
        await fast.wait_for(session, await paced(broker, args.rate, args.seconds))
        stats = await fast.stats(session)
        await fast.reset(session)
        started = time.perf_counter()
        total = await backlog(broker, args.backlog)
        await fast.wait_for(session, total)
        rate = total / (time.perf_counter() - started)
    finally:
        await broker.close()
        if feeder is not None:
            feeder.send_signal(signal.SIGTERM)
            out, _ = await feeder.communicate()
    if feeder is not None:
        # The next quiet phase starts once the heavy ones have delivered all they were given.
        words = out.decode().split()
        for name, count in zip(words[::2], words[1::2], strict=True):
            await asyncio.wait_for(handlers[name].wait_for(session, int(count)), 300)
    return stats["from_log_ms"], stats["latencies_ms"], rate


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="nemesis-isolation-", dir=args.dir) as tmp:
        root = Path(tmp)
        db = root / "bench.db"
        handlers = {
            "fast": Handler(latency=True),
            "heavy-cpu": Handler(),
            "heavy-big": Handler(),
        }
        for name in HEAVY_LAG:
            os.setpriority(os.PRIO_PROCESS, handlers[name].process.pid, BENCH_NICENESS)
        broker = await open_embedded(EmbeddedBackendConfig(path=str(db)))
        for name in [*(ordinary(n) for n in range(ORDINARY)), *HEAVY_LAG]:
            await broker.admin.create_topic(
                name, partitions=PARTITIONS, consumers=[ConsumerSpec(name)], exist_ok=True
            )
        await broker.close()
        write_workspace(
            root, db, handlers["fast"].url, handlers["heavy-cpu"].url, handlers["heavy-big"].url
        )
        if (os.cpu_count() or 1) >= 2:
            os.sched_setaffinity(0, {1})
        proxy = subprocess.Popen(  # noqa: ASYNC220  (started once, before any measuring)
            [*pin(0), sys.executable, "-m", "nemesis", "--log-level", "warning", "run"], cwd=root
        )
        added: dict[bool, list[float]] = {False: [], True: []}
        end_to_end: dict[bool, list[float]] = {False: [], True: []}
        rates: dict[bool, list[float]] = {False: [], True: []}
        heavy_seen = 0
        try:
            async with aiohttp.ClientSession() as session:
                # Warm up: every ordinary integration has delivered once.
                warm = await open_embedded(EmbeddedBackendConfig(path=str(db)))
                await paced(warm, 100, 1)
                await warm.close()
                await handlers["fast"].wait_for(session, 100)
                for n in range(args.rounds):
                    for heavy in (False, True) if n % 2 == 0 else (True, False):
                        lat, e2e, rate = await phase(db, handlers, session, heavy, args)
                        added[heavy].extend(lat)
                        end_to_end[heavy].extend(e2e)
                        rates[heavy].append(rate)
                        if heavy:
                            for name in HEAVY_LAG:
                                heavy_seen += await handlers[name].count(session)
                        print(
                            f"round {n} {'heavy' if heavy else 'quiet'}: added p99"
                            f" {percentile(lat, 99):.1f} ms, drain {rate:,.0f} msg/s",
                            flush=True,
                        )
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(60)
            for handler in handlers.values():
                handler.close()
    q99, h99 = percentile(added[False], 99), percentile(added[True], 99)
    qr, hr = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"heavy messages delivered: {heavy_seen}")
    for heavy, label in ((False, "quiet"), (True, "heavy")):
        print(
            f"ordinary latency {label}: added p50 {percentile(added[heavy], 50):.1f} ms,"
            f" p99 {percentile(added[heavy], 99):.1f} ms; end to end"
            f" p99 {percentile(end_to_end[heavy], 99):.1f} ms"
        )
    q50, h50 = percentile(added[False], 50), percentile(added[True], 50)
    print(f"added p50 heavy/quiet: {h50 / q50:.2f}x")
    print(f"added p99 heavy/quiet: {h99 / q99:.2f}x (target <= 2)")
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
    parser.add_argument(
        "--dir", help="where the log's file goes (default: the system's temporary folder)"
    )
    # The heavy feeder's child: the log's file and the heavy handlers' URLs.
    parser.add_argument("--feed", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--urls", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    asyncio.run(
        main(options)
        if options.feed is None
        else heavy_load(options.feed, options.heavy, *options.urls)
    )
