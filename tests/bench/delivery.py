"""Delivery benchmark: the proxy against a bare HTTP client, measured in the same run.

Prints, on the host it runs on:
  (a) messages/s through `nemesis run` (a subprocess) to a fast local handler, on
      Nemesis' own HTTP/1.1 transport (h1, the default) and on `target.transport:
      aiohttp` side by side,
  (b) the same handler driven by a bare aiohttp loop at the same concurrency, and
      the ratio a/b (target >= 3 per CPU second); also the loop without aiohttp's
      per-request timeout, and a against that,
  (b') a bare loop of the h1 transport (the ceiling of (a)), and a/b' (target >= 0.4),
  (c) (a) with batches of 100 per request (target >= 150,000 msg/s per CPU second),
  (d) embedded log append and read rates,
  (e) p50/p99 latency added by the proxy at 1,000 msg/s (target p99 <= 1.2 ms),
  (f) peak RSS of the proxy process,
  (s) with --only sqs: (a) from an SQS queue on moto's server mode (tests/sqs_servers.py,
      on the handler's core) beside (a) from the embedded log, round by round, and the
      ratio sqs / embedded (no target: moto is a test server, not SQS; its receive
      takes longer the more messages wait, so the figure is mostly moto's),
  (k) with --only kafka: (a) and (c) on the embedded log and on Apache Kafka
      (tests/kafka_broker.py, started on 127.0.0.1, the backend's default
      configuration), side by side, and a bare aiokafka consume-and-deliver loop
      on the same broker (the ceiling of (a) on Kafka); ratios per CPU second:
      Kafka / embedded (target >= 0.8) and Kafka / the bare loop (target >= 0.6).

With `--baseline-tree PATH` (a checkout of other code, today's main say, its
protos generated) it measures instead (a), (c) and (g) of this tree and of
that one's proxy, the two taking turns run by run and round by round, and
prints each one's median and the ratio of this tree to that one, per CPU
second and in rates.

The handler (tests/bench/fast_handler.py) and the proxy run pinned to different
cores when the machine has two. Usage: `make bench` or
`python tests/bench/delivery.py [--messages N] [--workers W] [--baseline-tree PATH]`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# Rates are timed from the 1/WARM_UP-th message on, for the proxy and the bare loop alike.
WARM_UP = 10
# (e): the topic the proxy delivers from, and the one the direct phase's producer appends to.
LATENCY_TOPIC = "latency"
DIRECT_TOPIC = "latency-direct"
# Pacing sleeps on the event loop until this close to a deadline (see _wait_until).
COARSE_SLEEP_S = 0.002
PAYLOAD = orjson.dumps(
    {
        "id": "order-000000",
        "city": "msk",
        "amount": 123.45,
        "items": [{"sku": "sku-1", "qty": 2}, {"sku": "sku-2", "qty": 1}],
        "customer": {"id": "c-1", "tier": "gold", "email": "someone@example.com"},
        "note": "x" * 120,
    }
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pin(core: int) -> list[str]:
    """taskset prefix pinning a child to one core, when there are several."""
    if (os.cpu_count() or 1) < 2:
        return []
    return ["taskset", "-c", str(core)]


class Handler:
    """tests/bench/fast_handler.py in its own process, on core 1."""

    def __init__(self, latency: bool = False) -> None:
        self.port = free_port()
        args = [sys.executable, str(HERE / "fast_handler.py"), "--port", str(self.port)]
        if latency:
            args.append("--latency")
        self.process = subprocess.Popen([*pin(1), *args])
        self.url = f"http://127.0.0.1:{self.port}/"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("benchmark handler did not start")

    async def stats(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(self.url + "stats") as response:
            result: dict[str, Any] = await response.json()
            return result

    async def count(self, session: aiohttp.ClientSession) -> int:
        """Events received so far; cheap (the samples stay in the handler)."""
        async with session.get(self.url + "count") as response:
            events: int = (await response.json())["events"]
            return events

    async def wait_for(self, session: aiohttp.ClientSession, events: int) -> None:
        """Returns once the handler has received ``events`` events."""
        while await self.count(session) < events:
            await asyncio.sleep(0.05)

    async def reset(self, session: aiohttp.ClientSession) -> None:
        async with session.post(self.url + "reset") as response:
            await response.read()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait()


class Workspace:
    """A folder with nemesis.yaml + one integration, and the log file (or a Kafka broker)."""

    def __init__(self, root: Path, kafka: str | None = None) -> None:
        self.root = root
        self.db = root / "bench.db"
        self.kafka = kafka
        (root / "integrations").mkdir(parents=True, exist_ok=True)
        backend = (
            f"{{kind: embedded, path: {self.db}}}"
            if kafka is None
            else f"{{kind: kafka, bootstrap_servers: ['{kafka}']}}"
        )
        (root / "nemesis.yaml").write_text(
            f"backend: {backend}\nsingle_host: true\ndata_dir: .\n"
            f"integrations_dir: integrations\npipelines_dir: {REPO / 'pipelines'}\n"
            # Ports of their own: another proxy on the host (a neighbour's run) has the defaults.
            f"admin: {{port: {free_port()}}}\nviewer: {{port: {free_port()}}}\n"
            # The viewer starts with every proxy, as in production; a secret made for this
            # run keeps it from warning at each start that it had to make one itself.
            f"auth: {{session_secret: '{secrets.token_urlsafe(48)}'}}\n"
        )

    def integration(
        self,
        topic: str,
        url: str,
        workers: int,
        batch: int,
        max_wait_ms: int,
        pipeline: str = "",
        transport: str = "h1",
    ) -> None:
        for old in (self.root / "integrations").glob("*.yaml"):
            old.unlink()
        (self.root / "integrations" / f"{topic}.yaml").write_text(
            f"name: {topic}\nowners: [bench]\n"
            f"source: {{topic: {topic}, consumer: {topic}}}\n"
            f"target: {{url: '{url}', timeout_s: 10, transport: {transport}}}\n"
            f"delivery: {{workers: {workers}, buffer: {max(2000, workers * batch * 2)}, "
            f"batch: {{size: {batch}, max_wait_ms: {max_wait_ms}}}}}\n"
            + (f"pipeline: {pipeline}\n" if pipeline else "")
        )

    def sqs_integration(self, name: str, queue: str, endpoint: str, url: str, workers: int) -> None:
        for old in (self.root / "integrations").glob("*.yaml"):
            old.unlink()
        (self.root / "integrations" / f"{name}.yaml").write_text(
            f"name: {name}\nowners: [bench]\n"
            f"source: {{kind: sqs, queue: {queue}, consumer: {name}, endpoint_url: '{endpoint}',"
            " region: eu-central-1, wait_time_s: 1}\n"
            f"target: {{url: '{url}', timeout_s: 10}}\n"
            f"delivery: {{workers: {workers}, buffer: 2000}}\n"
        )

    def start_proxy(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*pin(0), sys.executable, "-m", "nemesis", "--log-level", "warning", "run"],
            cwd=self.root,
        )


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def city_order(n: int) -> bytes:
    """An order for pipelines/city-filter.yaml: 1 in 4 is from msk/spb and above 1000."""
    city = ("msk", "spb", "kzn", "nsk")[n % 4]
    amount = 1500 if (n // 4) % 2 else 500
    return orjson.dumps({"order": {"id": n, "city": city, "amount": amount}, "note": "x" * 200})


async def fill(
    db: Path,
    topic: str,
    count: int,
    partitions: int = 4,
    make: Any = None,
    kafka: str | None = None,
) -> None:
    broker: Any
    if kafka is None:
        broker = await open_embedded(EmbeddedBackendConfig(path=str(db)))
    else:
        from nemesis.broker.kafka.broker import open_kafka
        from nemesis.broker.kafka.config import KafkaBackendConfig

        broker = await open_kafka(KafkaBackendConfig(bootstrap_servers=[kafka]))
    try:
        await broker.admin.create_topic(
            topic, partitions=partitions, consumers=[ConsumerSpec(topic)], exist_ok=True
        )
        writer = await broker.writer(topic)
        for start in range(0, count, 1000):
            await writer.write(
                [
                    OutgoingMessage(value=make(n) if make else PAYLOAD, partition=n % partitions)
                    for n in range(start, min(count, start + 1000))
                ]
            )
        await writer.close()
    finally:
        await broker.close()


@dataclass(frozen=True)
class ProxyRun:
    rate: float  # messages/s
    rss_mb: float  # peak RSS of the proxy process
    cpu_us: float  # CPU of the proxy process (every thread) per message, microseconds


async def through_proxy(
    space: Workspace,
    handler: Handler,
    topic: str,
    count: int,
    workers: int,
    batch: int,
    pipeline: str = "",
    transport: str = "h1",
    sqs_endpoint: str | None = None,
) -> ProxyRun:
    """Rate, peak RSS and CPU per message of `nemesis run` delivering `count` pre-published messages.

    With a pipeline that filters, the rate counts every message read (filtered
    ones included): the proxy is done when the handler has the passing quarter.
    With ``sqs_endpoint`` the messages wait in a queue named ``topic`` there.
    """
    if sqs_endpoint is not None:
        await fill_queue(sqs_endpoint, topic, count)
        space.sqs_integration(topic, topic, sqs_endpoint, handler.url, workers)
    else:
        await fill(space.db, topic, count, make=city_order if pipeline else None, kafka=space.kafka)
        space.integration(
            topic,
            handler.url,
            workers,
            batch,
            max_wait_ms=5 if batch > 1 else 0,
            pipeline=pipeline,
            transport=transport,
        )
    expected = count // 4 if pipeline else count
    async with aiohttp.ClientSession() as session:
        await handler.reset(session)
        proxy = space.start_proxy()
        try:
            first_at = first_count = None
            first_cpu = 0.0
            while True:
                events = await handler.count(session)
                now = time.perf_counter()
                # Timed from a tenth of the way in, as the bare loop is: start-up
                # (the admin API and the viewer start beside the runners) is not the rate.
                if first_at is None and events >= expected // WARM_UP:
                    first_at, first_count, first_cpu = now, events, cpu_seconds(proxy.pid)
                if events >= expected:
                    break
                if proxy.poll() is not None:
                    raise RuntimeError(f"nemesis run exited with {proxy.returncode} (see above)")
                await asyncio.sleep(0.02)
            cpu = cpu_seconds(proxy.pid) - first_cpu
            rss = peak_rss_mb(proxy.pid)
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(30)
    assert first_at is not None and first_count is not None
    read = (expected - first_count) * count / expected
    return ProxyRun(read / (now - first_at), rss, cpu / read * 1e6)


async def fill_queue(endpoint: str, queue: str, count: int) -> None:
    """Creates ``queue`` on the SQS-API server at ``endpoint`` and sends it ``count`` messages."""
    from aiobotocore.session import get_session

    body = PAYLOAD.decode()
    async with get_session().create_client(
        "sqs", region_name="eu-central-1", endpoint_url=endpoint
    ) as client:
        url = (await client.create_queue(QueueName=queue))["QueueUrl"]
        starts = iter(range(0, count, 10))

        async def sender() -> None:
            for start in starts:
                entries = [
                    {"Id": str(i), "MessageBody": body} for i in range(min(10, count - start))
                ]
                await client.send_message_batch(QueueUrl=url, Entries=entries)

        await asyncio.gather(*(sender() for _ in range(8)))


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bare_client(
    handler: Handler, count: int, concurrency: int, timed: bool = True
) -> tuple[float, float]:
    """(requests/s, CPU us per request) of a plain aiohttp loop: same payload, headers, concurrency.

    With aiohttp's default timeout, as a loop written for the job would have;
    ``timed=False`` takes it away (no deadline at all), for comparison with
    the proxy, which keeps its deadlines with one timer (nemesis.delivery.deadlines).
    """
    headers = {
        "content-type": "application/json",
        "ce-specversion": "1.0",
        "ce-id": "bench:0:0",
        "ce-source": "nemesis/bench",
        "ce-type": "nemesis.message",
        "ce-time": "2026-11-30T00:00:00Z",
        "ce-topic": "bench",
        "ce-partition": "0",
        "ce-offset": "0",
        "ce-attempt": "1",
    }
    connector = aiohttp.TCPConnector(limit=concurrency)
    no_timeout = aiohttp.ClientTimeout(total=None, sock_connect=None)
    timeout = aiohttp.client.DEFAULT_TIMEOUT if timed else no_timeout
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        remaining = count

        done, mark, started = 0, count // WARM_UP, time.perf_counter()
        cpu_started = time.process_time()

        async def worker() -> None:
            nonlocal remaining, done, started, cpu_started
            while remaining > 0:
                remaining -= 1
                async with session.post(handler.url, data=PAYLOAD, headers=headers) as response:
                    await response.read()
                done += 1
                if done == mark:
                    started = time.perf_counter()  # a tenth of the way in, as for (a)
                    cpu_started = time.process_time()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return (count - mark) / elapsed, cpu / (count - mark) * 1e6


async def bare_h1(port: int, count: int, concurrency: int) -> tuple[float, float]:
    """(requests/s, CPU us per request) of a bare loop of Nemesis' own HTTP/1.1 transport.

    The ceiling of (a): the transport's ``deliver`` with events made in
    advance, at the same concurrency, with no broker, runner or pipeline.
    """
    from nemesis.broker.port import Message
    from nemesis.config.models import TargetConfig
    from nemesis.delivery.h1 import H1Transport
    from nemesis.delivery.port import Event

    target = TargetConfig.model_validate({"url": f"http://127.0.0.1:{port}/", "timeout_s": 10})
    transport = H1Transport(target, integration="bench", max_connections=concurrency)
    events = [
        Event(Message("bench", n % 4, n, PAYLOAD, created_at=1764460800.0), f"bench:{n}", "t")
        for n in range(count)
    ]
    remaining = iter(events)
    done, mark, started = 0, count // WARM_UP, time.perf_counter()
    cpu_started = time.process_time()

    async def worker() -> None:
        nonlocal done, started, cpu_started
        for event in remaining:
            await transport.deliver(event)
            done += 1
            if done == mark:
                started = time.perf_counter()  # a tenth of the way in, as for (a)
                cpu_started = time.process_time()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    await transport.close()
    return (count - mark) / elapsed, cpu / (count - mark) * 1e6


async def bare_kafka(
    bootstrap: str, topic: str, port: int, count: int, concurrency: int, client: str
) -> tuple[float, float]:
    """(messages/s, CPU us per message) of a bare aiokafka consume-and-deliver loop.

    The ceiling of (k) on Kafka: one group member (``AIOKafkaConsumer``, offsets
    committed by hand) takes up to 500 records per ``getmany``, posts each one
    in a request of its own to the handler, ``concurrency`` at a time, with the
    headers the proxy sends, and commits a batch's offsets once every record
    of it is answered (every 100 ms, oldest batch first, as the proxy commits).
    ``client`` is ``aiohttp`` (a loop written for the job) or ``h1`` (Nemesis'
    own HTTP/1.1 transport, an event made per record: what is left of the
    proxy's work without its runner, pipeline and bookkeeping).
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=topic,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    post: Any
    closing: Any
    if client == "aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
        url = f"http://127.0.0.1:{port}/"

        async def post(record: Any) -> None:
            headers = {
                "content-type": "application/json",
                "ce-specversion": "1.0",
                "ce-id": f"{record.topic}:{record.partition}:{record.offset}",
                "ce-source": "nemesis/bench",
                "ce-type": "nemesis.message",
                "ce-time": "2026-11-30T00:00:00Z",
                "ce-topic": record.topic,
                "ce-partition": str(record.partition),
                "ce-offset": str(record.offset),
                "ce-attempt": "1",
            }
            async with session.post(url, data=record.value, headers=headers) as response:
                await response.read()

        closing = session.close
    else:
        from nemesis.broker.port import Message
        from nemesis.config.models import TargetConfig
        from nemesis.delivery.h1 import H1Transport
        from nemesis.delivery.port import Event

        target = TargetConfig.model_validate({"url": f"http://127.0.0.1:{port}/", "timeout_s": 10})
        transport = H1Transport(target, integration="bench", max_connections=concurrency)

        async def post(record: Any) -> None:
            message = Message(
                record.topic, record.partition, record.offset, record.value,
                created_at=record.timestamp / 1000, written_at=record.timestamp / 1000,
            )  # fmt: skip
            key = f"{record.topic}:{record.partition}:{record.offset}"
            await transport.deliver(Event(message, key, "nemesis.message"))

        closing = transport.close
    # Reads (one task) feed a bounded queue the workers take from; every 100 ms the
    # committer commits the batches read so far whose records are all answered, oldest first.
    queue: asyncio.Queue[tuple[Any, list[int]]] = asyncio.Queue(maxsize=2000)
    read: collections.deque[tuple[dict[Any, int], list[int]]] = collections.deque()
    done, first, mark = 0, 0, count // WARM_UP
    started, cpu_started = time.perf_counter(), time.process_time()
    finished = asyncio.Event()

    async def reader() -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=1000, max_records=500)
            if not batches:
                continue
            left = [sum(len(records) for records in batches.values())]
            ends = {
                TopicPartition(topic, tp.partition): rs[-1].offset + 1 for tp, rs in batches.items()
            }
            read.append((ends, left))
            for records in batches.values():
                for record in records:
                    await queue.put((record, left))

    async def worker() -> None:
        nonlocal done, first, started, cpu_started
        while True:
            record, left = await queue.get()
            await post(record)
            left[0] -= 1
            done += 1
            if done == mark:  # a tenth of the way in, as for (a)
                first, started, cpu_started = done, time.perf_counter(), time.process_time()
            if done == count:
                finished.set()

    async def committer() -> None:
        while True:
            await asyncio.sleep(0.1)
            offsets: dict[Any, int] = {}
            while read and read[0][1][0] == 0:
                offsets.update(read.popleft()[0])
            if offsets:
                await consumer.commit(offsets)

    tasks = [asyncio.create_task(job()) for job in (reader, committer)]
    tasks += [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await finished.wait()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await consumer.stop()
        await closing()
    measured = count - first
    return measured / elapsed, cpu / measured * 1e6


class TransportComparison:
    """(a) on the aiohttp transport beside (a) on h1, and (b'): a bare loop of h1 (its ceiling)."""

    def __init__(self) -> None:
        self.aiohttp_runs: list[ProxyRun] = []
        self.bare_h1: list[tuple[float, float]] = []

    async def measure(
        self, space: Workspace, handler: Handler, args: argparse.Namespace, n: int
    ) -> None:
        self.aiohttp_runs.append(
            await through_proxy(
                space, handler, f"aiohttp{n}", args.messages, args.workers, 1, transport="aiohttp"
            )
        )
        loop_args = (str(handler.port), str(args.messages), str(args.workers))
        self.bare_h1.append(tuple(run_pinned("bare-h1", *loop_args)))

    def report(self, runs: Sequence[ProxyRun], bare: Sequence[tuple[float, float]]) -> None:
        a_rate = statistics.median(run.rate for run in runs)
        a_cpu = statistics.median(run.cpu_us for run in runs)
        old_rate = statistics.median(run.rate for run in self.aiohttp_runs)
        old_cpu = statistics.median(run.cpu_us for run in self.aiohttp_runs)
        b_rate = statistics.median(r for r, _ in bare)
        b_cpu = statistics.median(c for _, c in bare)
        h1_rate = statistics.median(r for r, _ in self.bare_h1)
        h1_cpu = statistics.median(c for _, c in self.bare_h1)
        print(
            f"      (a) on target.transport aiohttp:      {old_rate:>10,.0f} msg/s"
            f"  ({old_cpu:.0f} us CPU each)  {fmt([run.rate for run in self.aiohttp_runs])}"
        )
        print(
            f"      (a) on h1 / on aiohttp:               {a_rate / old_rate:>10.2f}"
            f"   (per CPU second: {old_cpu / a_cpu:.2f})"
        )
        print(
            f"      ratio a/b, per CPU second:            {b_cpu / a_cpu:>10.2f}"
            f"   (target >= 3; rates: {a_rate / b_rate:.2f})"
        )
        print(
            f"  (b') bare loop of h1, same concurrency:   {h1_rate:>10,.0f} req/s"
            f"  ({h1_cpu:.0f} us CPU each)  {fmt([r for r, _ in self.bare_h1])}"
        )
        print(
            f"      ratio a/b', per CPU second:           {h1_cpu / a_cpu:>10.2f}"
            f"   (target >= 0.4; rates: {a_rate / h1_rate:.2f})"
        )


def run_pinned(coroutine_name: str, *args: str) -> Any:
    """Runs one of this file's measurements in a child pinned to core 0 (as the proxy is)."""
    output = subprocess.run(
        [*pin(0), sys.executable, __file__, "--child", coroutine_name, *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(output.stdout.strip().splitlines()[-1])


async def log_rates(root: Path, count: int) -> dict[str, float]:
    """Append rate (batches of 100 and 1000) and read rate of the embedded log."""
    results: dict[str, float] = {}
    broker = await open_embedded(EmbeddedBackendConfig(path=str(root / "log.db")))
    try:
        for batch in (100, 1000):
            topic = f"append-{batch}"
            await broker.admin.create_topic(topic, partitions=4, consumers=[ConsumerSpec("r")])
            writer = await broker.writer(topic)
            started = time.perf_counter()
            for start in range(0, count, batch):
                await writer.write(
                    [
                        OutgoingMessage(value=PAYLOAD, partition=n % 4)
                        for n in range(start, start + batch)
                    ]
                )
            results[f"append_batch_{batch}"] = count / (time.perf_counter() - started)
            await writer.close()
        reader = await broker.reader("append-1000", "r")
        got = 0
        started = time.perf_counter()
        while got < count:
            got += len(await reader.receive(1000, 1.0))
        results["read"] = count / (time.perf_counter() - started)
        await reader.close()
    finally:
        await broker.close()
    return results


async def latency(
    space: Workspace, rate: float, seconds: float, workers: int, rounds: int
) -> dict[str, Any]:
    """Latency added by the proxy at `rate` msg/s, against a direct client in the same conditions.

    Both phases run the same producer beside the handler on core 1: it stamps
    `ts` and appends to the log at `rate`. In the direct phase nobody reads
    what it appends, and a client on core 0 posts to the handler at the same
    rate (a producer calling its handler itself); in the proxied phase core 0
    runs `nemesis run`, which delivers what the producer appends. So the two
    differ only in the path a message takes. The handler records the latency
    from `ts` (end to end) and from the append (`ce-time`, the broker's time).

    The phases alternate in `rounds` rounds of `seconds / rounds` each (direct
    first in even rounds, proxied first in odd ones), and each phase's samples
    are pooled over the rounds. The machine is shared: a neighbour busy for a
    few seconds lands in both phases rather than in one of them, as (a) and
    (b) alternate for the same reason.
    """
    handler = Handler(latency=True)
    cores = os.sched_getaffinity(0)
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {1})
    direct: list[float] = []
    proxied: list[float] = []
    from_log: list[float] = []
    added_p99: list[float] = []
    try:
        await fill(space.db, LATENCY_TOPIC, 0)
        await fill(space.db, DIRECT_TOPIC, 0)  # the direct phase's appends: nobody reads them
        space.integration(LATENCY_TOPIC, handler.url, workers, 1, 0)
        broker = await open_embedded(EmbeddedBackendConfig(path=str(space.db)))
        try:
            async with aiohttp.ClientSession() as session:
                phase = seconds / rounds
                for n in range(rounds):
                    if n % 2:
                        via_proxy = await _proxied_phase(
                            space, broker, handler, session, rate, phase
                        )
                        straight = await _direct_phase(broker, handler, session, rate, phase)
                    else:
                        straight = await _direct_phase(broker, handler, session, rate, phase)
                        via_proxy = await _proxied_phase(
                            space, broker, handler, session, rate, phase
                        )
                    direct += straight
                    proxied += via_proxy[0]
                    from_log += via_proxy[1]
                    added_p99.append(percentile(via_proxy[1], 99) - percentile(straight, 99))
        finally:
            await broker.close()
    finally:
        handler.close()
        os.sched_setaffinity(0, cores)
    return {
        "direct_p50": percentile(direct, 50),
        "direct_p99": percentile(direct, 99),
        "proxy_p50": percentile(proxied, 50),
        "proxy_p99": percentile(proxied, 99),
        "log_p50": percentile(from_log, 50),
        "log_p99": percentile(from_log, 99),
        "rounds_added_p99": added_p99,
    }


async def _direct_phase(
    broker: Any, handler: Handler, session: aiohttp.ClientSession, rate: float, seconds: float
) -> list[float]:
    """A client on core 0 posts at `rate` while the producer appends where nobody reads."""
    await handler.reset(session)
    client = await asyncio.create_subprocess_exec(
        *pin(0), sys.executable, __file__, "--child", "direct",
        str(handler.port), str(rate), str(seconds),
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    await produce(await broker.writer(DIRECT_TOPIC), rate, seconds)
    await client.wait()
    await handler.wait_for(session, int(rate * seconds))
    latencies: list[float] = (await handler.stats(session))["latencies_ms"]
    return latencies


async def _proxied_phase(
    space: Workspace,
    broker: Any,
    handler: Handler,
    session: aiohttp.ClientSession,
    rate: float,
    seconds: float,
) -> tuple[list[float], list[float]]:
    """`nemesis run` on core 0 delivers what the producer appends: (end to end, from the append)."""
    await handler.reset(session)
    proxy = space.start_proxy()
    try:
        writer = await broker.writer(LATENCY_TOPIC)
        # Warm up: the proxy has started (admin API, viewer, imports), holds its
        # partitions and has delivered on every partition before we measure.
        await writer.write(
            [
                OutgoingMessage(value=orjson.dumps({"ts": time.time()}), partition=p)
                for p in range(4)
            ]
        )
        await handler.wait_for(session, 4)
        await asyncio.sleep(1.0)
        await handler.reset(session)
        await handler.wait_for(session, await produce(writer, rate, seconds))
        stats = await handler.stats(session)
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(30)
    return stats["latencies_ms"], stats["from_log_ms"]


async def produce(writer: Any, rate: float, seconds: float) -> int:
    """Appends `rate` messages a second for `seconds`, one per write, each stamped `ts`."""
    interval = 1 / rate
    total = int(rate * seconds)
    started = time.perf_counter()
    for n in range(total):
        await _wait_until(started + n * interval)
        stamped = orjson.dumps({"ts": time.time(), "n": n})
        await writer.write([OutgoingMessage(value=stamped, partition=n % 4)])
    await writer.close()
    return total


async def _wait_until(deadline: float) -> None:
    """Returns at ``deadline`` (perf_counter), give or take the kernel's timer slack.

    The event loop's timers are millisecond-grained: paced with them alone,
    1,000 writes a second came in pairs about 0.4 ms apart, every 2 ms. So
    the loop sleeps only to within 2 ms of the deadline and the rest is a
    blocking sleep: nothing else runs in the producer while it paces.
    """
    delay = deadline - time.perf_counter()
    if delay > COARSE_SLEEP_S:
        await asyncio.sleep(delay - COARSE_SLEEP_S)
        delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)  # noqa: ASYNC251  # on purpose: see above


def percentile(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


PARTS = ("delivery", "log", "latency")
# Not in the default run: kafka starts Apache Kafka (Maven and a JDK; see tests/kafka_broker.py),
# sqs moto's server (the dev extra).
OPTIONAL_PARTS = ("kafka", "sqs")


async def main(args: argparse.Namespace) -> None:
    parts = args.only or PARTS
    print(f"\nNemesis delivery benchmark ({os.cpu_count()} cores, proxy and handler pinned apart)")
    with tempfile.TemporaryDirectory(prefix="nemesis-bench-") as tmp:
        space = Workspace(Path(tmp))
        if args.baseline_tree is not None:
            await compare_trees(space, args)
            return
        if "delivery" in parts:
            await delivery_part(space, args)
        if "log" in parts:
            log = await log_rates(Path(tmp), args.log_messages)
            print(
                f"  (d) embedded log append, batch 100:       {log['append_batch_100']:>10,.0f} msg/s"
            )
            print(
                f"      embedded log append, batch 1000:      {log['append_batch_1000']:>10,.0f} msg/s"
            )
            print(f"      embedded log read:                    {log['read']:>10,.0f} msg/s")
        if "latency" in parts:
            print_latency(
                await latency(space, 1000.0, args.latency_seconds, 16, args.latency_rounds)
            )
        if "kafka" in parts:
            await kafka_part(Path(tmp), args)
        if "sqs" in parts:
            await sqs_part(Path(tmp), args)


async def sqs_part(root: Path, args: argparse.Namespace) -> None:
    """(s): (a) from a queue on moto beside (a) from the embedded log, in alternating rounds."""
    sys.path.insert(0, str(REPO))  # the test servers' starters live in tests/
    from tests.sqs_servers import start_moto

    # moto checks no keys, but the AWS chain needs some; never a real account's.
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    moto = start_moto(root / "moto")
    handler = Handler()
    cores = os.sched_getaffinity(0)
    if (os.cpu_count() or 1) >= 2:
        # moto and this process beside the handler: the proxy has core 0 alone.
        os.sched_setaffinity(moto.process.pid, {1})
        os.sched_setaffinity(0, {1})
    space = Workspace(root / "s-embedded")
    runs: dict[str, list[ProxyRun]] = {"embedded": [], "sqs": []}
    try:
        for n in range(args.repeat):
            runs["embedded"].append(
                await through_proxy(space, handler, f"e{n}", args.sqs_messages, args.workers, 1)
            )
            runs["sqs"].append(
                await through_proxy(
                    space,
                    handler,
                    f"q{n}",
                    args.sqs_messages,
                    args.workers,
                    1,
                    sqs_endpoint=moto.endpoint,
                )
            )
    finally:
        handler.close()
        moto.stop()
        os.sched_setaffinity(0, cores)
    print(f"  (s) {args.sqs_messages:,} messages from a queue on moto and from the embedded log:")
    for kind, kind_runs in runs.items():
        rates = [run.rate for run in kind_runs]
        cpu = statistics.median(run.cpu_us for run in kind_runs)
        print(
            f"      {kind:<9} (a) 1 msg/request: {statistics.median(rates):>10,.0f} msg/s"
            f"  ({cpu:.0f} us CPU each)  {fmt(rates)}"
        )
    ratios = [q.rate / e.rate for e, q in zip(runs["embedded"], runs["sqs"], strict=True)]
    print(
        f"      sqs (moto) / embedded, rates:          {statistics.median(ratios):>10.4f}"
        f"   (round by round: {', '.join(f'{r:.4f}' for r in ratios)})"
    )


async def kafka_part(root: Path, args: argparse.Namespace) -> None:
    """(k): the proxy on the embedded log and on Apache Kafka, and bare aiokafka loops.

    Each round runs, one after the other, (a) on the embedded log, (a) on
    Kafka (the backend's default configuration), and the bare aiokafka loop
    on the same broker with each HTTP client (``bare_kafka``): a neighbour's
    load lands on all of them rather than on one. Ratios are per CPU second
    of the delivering process (the proxy, or the bare loop's).
    """
    sys.path.insert(0, str(REPO))  # the test broker's starter lives in tests/
    from tests.kafka_broker import start_kafka

    (root / "kafka").mkdir()
    kafka_broker = start_kafka(root / "kafka")
    handler = Handler()
    cores = os.sched_getaffinity(0)
    if (os.cpu_count() or 1) >= 2:
        # The broker and this process beside the handler: the proxy has core 0 alone.
        assert kafka_broker.process is not None
        os.sched_setaffinity(kafka_broker.process.pid, {1})
        os.sched_setaffinity(0, {1})
    spaces = {
        "embedded": Workspace(root / "k-embedded"),
        "kafka": Workspace(root / "k-kafka", kafka=kafka_broker.bootstrap),
    }
    single: dict[str, list[ProxyRun]] = {kind: [] for kind in spaces}
    bare: dict[str, list[tuple[float, float]]] = {"aiohttp": [], "h1": []}
    batched: dict[str, ProxyRun] = {}
    messages = args.kafka_messages
    try:
        for n in range(args.repeat):
            for kind, space in spaces.items():
                single[kind].append(
                    await through_proxy(space, handler, f"k{n}", messages, args.workers, 1)
                )
            for client, runs in bare.items():
                topic = f"bare-{client}{n}"
                await fill(spaces["kafka"].db, topic, messages, kafka=kafka_broker.bootstrap)
                loop_args = (str(handler.port), str(messages), str(args.workers), client)
                runs.append(
                    tuple(run_pinned("bare-kafka", kafka_broker.bootstrap, topic, *loop_args))
                )
        for kind, space in spaces.items():
            batched[kind] = await through_proxy(space, handler, "kb", messages * 5, 8, 100)
    finally:
        handler.close()
        kafka_broker.stop()
        os.sched_setaffinity(0, cores)
    print(
        "  (k) the same proxy on each backend (Apache Kafka, one broker, default configuration,"
        " on the handler's core):"
    )
    cpu = {kind: statistics.median(run.cpu_us for run in rs) for kind, rs in single.items()}
    for kind, proxy_runs in single.items():
        rates = [run.rate for run in proxy_runs]
        print(
            f"      {kind:<9} (a) 1 msg/request: {statistics.median(rates):>10,.0f} msg/s"
            f"  ({cpu[kind]:.0f} us CPU each)  {fmt(rates)}   (c) batches of 100:"
            f" {batched[kind].rate:>10,.0f} msg/s  ({1e6 / batched[kind].cpu_us:,.0f} per CPU second)"
        )
    spread = ", ".join(
        f"{e.cpu_us / k.cpu_us:.2f}"
        for e, k in zip(single["embedded"], single["kafka"], strict=True)
    )
    print(
        f"      kafka / embedded, per CPU second:      {cpu['embedded'] / cpu['kafka']:>10.2f}"
        f"   (target >= 0.8; round by round: {spread})"
    )
    for client, loops in bare.items():
        rate = statistics.median(r for r, _ in loops)
        bare_cpu = statistics.median(c for _, c in loops)
        print(
            f"      bare aiokafka loop, {client:<7} posts: {rate:>10,.0f} msg/s"
            f"  ({bare_cpu:.0f} us CPU each)  {fmt([r for r, _ in loops])}"
        )
        print(
            f"      kafka / that, per CPU second:          {bare_cpu / cpu['kafka']:>10.2f}"
            + ("   (target >= 0.6)" if client == "aiohttp" else "")
        )


async def delivery_part(space: Workspace, args: argparse.Namespace) -> None:
    """(a), (b), (c), (g) and (f): throughput through the proxy against the bare loop."""
    handler = Handler()
    cores = os.sched_getaffinity(0)
    if (os.cpu_count() or 1) >= 2:
        # This process fills the log and polls the handler while the proxy runs: beside
        # the handler, not on the proxy's core (the bare loops have that core alone too).
        os.sched_setaffinity(0, {1})
    try:
        runs: list[ProxyRun] = []
        bare: list[tuple[float, float]] = []
        untimed: list[tuple[float, float]] = []
        versus = TransportComparison()
        for _ in range(args.repeat):
            await versus.measure(space, handler, args, _)
            runs.append(
                await through_proxy(space, handler, f"single{_}", args.messages, args.workers, 1)
            )
            loop_args = (str(handler.port), str(args.messages), str(args.workers))
            bare.append(tuple(run_pinned("bare", *loop_args)))
            untimed.append(tuple(run_pinned("bare-untimed", *loop_args)))
        batched = await through_proxy(space, handler, "batched", args.messages * 5, 8, 100)
        filtered = await through_proxy(
            space, handler, "filtered", args.messages * 2, args.workers, 1, "city-filter"
        )
    finally:
        handler.close()
        os.sched_setaffinity(0, cores)
    proxy_rates = [run.rate for run in runs]
    a, b = statistics.median(proxy_rates), statistics.median(r for r, _ in bare)
    b_untimed = statistics.median(r for r, _ in untimed)
    # Per CPU second: the machine is shared, and a neighbour's load moves the rates
    # of (a) and (b), measured one after the other, more than what each one costs.
    a_cpu = statistics.median(run.cpu_us for run in runs)
    b_cpu = statistics.median(c for _, c in bare)
    untimed_cpu = statistics.median(c for _, c in untimed)
    print(
        f"  (a) nemesis run, 1 msg/request, {args.workers} workers: {a:>10,.0f} msg/s  {fmt(proxy_rates)}"
    )
    print(
        f"  (b) bare aiohttp loop, same concurrency:  {b:>10,.0f} req/s  {fmt([r for r, _ in bare])}"
    )
    print(f"      ratio a/b:                            {a / b:>10.2f}   (target >= 0.8)")
    print(
        f"      per CPU second: (a) {1e6 / a_cpu:,.0f} msg ({a_cpu:.0f} us each),"
        f" (b) {1e6 / b_cpu:,.0f} req ({b_cpu:.0f} us each): ratio {b_cpu / a_cpu:.2f}"
    )
    print(
        f"      (b) with no timeout at all:           {b_untimed:>10,.0f} req/s"
        f"  {fmt([r for r, _ in untimed])}"
    )
    print(
        f"      ratio a / that:                       {a / b_untimed:>10.2f}"
        f"   (per CPU second: {untimed_cpu / a_cpu:.2f})"
    )
    versus.report(runs, bare)
    print(
        f"  (c) nemesis run, batches of 100:          {batched.rate:>10,.0f} msg/s"
        f"  ({1e6 / batched.cpu_us:,.0f} per CPU second; target >= 150,000)"
    )
    print(
        f"  (g) city-filter pipeline dropping 75%:    {filtered.rate:>10,.0f} msg/s read"
        f"  ({filtered.rate / a:.1f}x (a))"
    )
    print(
        f"  (f) peak RSS of the proxy: {max(run.rss_mb for run in runs):.0f} MB (single),"
        f" {batched.rss_mb:.0f} MB (batched)"
    )


# With --baseline-tree: the figures compared, each as through_proxy's (messages, workers,
# batch, pipeline) for a run of --messages.
COMPARED: dict[str, tuple[int, int, int, str]] = {
    "(a) 1 msg/request": (1, 0, 1, ""),
    "(c) batches of 100": (5, 8, 100, ""),
    "(g) city-filter": (2, 0, 1, "city-filter"),
}
THIS, BASELINE = "this tree", "baseline"


async def compare_trees(space: Workspace, args: argparse.Namespace) -> None:
    """(a), (c) and (g) of this tree beside those of ``--baseline-tree``, taking turns.

    Each round runs every figure on both trees, one after the other, the tree
    that goes first changing from round to round: a neighbour's load, or the
    log file growing, lands on both. The baseline's proxy imports its own
    ``nemesis`` (``PYTHONPATH``); this process fills the log with this tree's.
    """
    tree: Path = args.baseline_tree
    handler = Handler()
    cores = os.sched_getaffinity(0)
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {1})  # beside the handler, as in delivery_part
    runs: dict[tuple[str, str], list[ProxyRun]] = {
        (figure, who): [] for figure in COMPARED for who in (THIS, BASELINE)
    }
    try:
        for round_ in range(args.repeat):
            order = (THIS, BASELINE) if round_ % 2 == 0 else (BASELINE, THIS)
            for number, (figure, (times, workers, batch, pipeline)) in enumerate(COMPARED.items()):
                for who in order:
                    if who == BASELINE:
                        os.environ["PYTHONPATH"] = str(tree)
                    try:
                        run = await through_proxy(
                            space,
                            handler,
                            f"cmp{round_}f{number}{'b' if who == BASELINE else 't'}",
                            args.messages * times,
                            workers or args.workers,
                            batch,
                            pipeline,
                        )
                    finally:
                        os.environ.pop("PYTHONPATH", None)
                    runs[figure, who].append(run)
    finally:
        handler.close()
        os.sched_setaffinity(0, cores)
    print(f"  this tree against {tree}, {args.repeat} rounds, taking turns:")
    for figure in COMPARED:
        ours, theirs = runs[figure, THIS], runs[figure, BASELINE]
        rate = {
            who: statistics.median(r.rate for r in runs[figure, who]) for who in (THIS, BASELINE)
        }
        cpu = {
            who: statistics.median(r.cpu_us for r in runs[figure, who]) for who in (THIS, BASELINE)
        }
        spread = ", ".join(f"{b.cpu_us / t.cpu_us:.2f}" for t, b in zip(ours, theirs, strict=True))
        print(
            f"  {figure:<19} this {rate[THIS]:>9,.0f} msg/s ({cpu[THIS]:.1f} us CPU each)"
            f"  baseline {rate[BASELINE]:>9,.0f} msg/s ({cpu[BASELINE]:.1f} us CPU each)"
        )
        print(
            f"  {'':<19} this / baseline: per CPU second {cpu[BASELINE] / cpu[THIS]:.2f}"
            f" (round by round: {spread}), rates {rate[THIS] / rate[BASELINE]:.2f}"
            f"  (this {fmt([r.rate for r in ours])}; baseline {fmt([r.rate for r in theirs])})"
        )


def source_tree(text: str) -> Path:
    """``--baseline-tree``: a folder holding a ``nemesis`` package."""
    tree = Path(text).resolve()
    if not (tree / "nemesis" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{tree}: no nemesis package there")
    return tree


def print_latency(lat: dict[str, Any]) -> None:
    added_p50 = lat["log_p50"] - lat["direct_p50"]
    added_p99 = lat["log_p99"] - lat["direct_p99"]
    print(
        f"  (e) latency at 1,000 msg/s, direct client -> handler:   "
        f"p50 {lat['direct_p50']:.2f} ms  p99 {lat['direct_p99']:.2f} ms"
    )
    print(
        f"      producer -> append -> proxy -> handler:     "
        f"p50 {lat['proxy_p50']:.2f} ms  p99 {lat['proxy_p99']:.2f} ms"
    )
    print(
        f"      from the append (broker time) to the handler: "
        f"p50 {lat['log_p50']:.2f} ms  p99 {lat['log_p99']:.2f} ms"
    )
    print(
        f"      added by the proxy (that minus direct):       "
        f"p50 {added_p50:.2f} ms  p99 {added_p99:.2f} ms  (target p99 <= 1.2 ms)"
    )
    print(
        f"      the same, round by round:                     "
        f"p99 {', '.join(f'{v:.2f}' for v in lat['rounds_added_p99'])} ms"
    )


def fmt(values: Sequence[float]) -> str:
    return "runs: " + ", ".join(f"{v:,.0f}" for v in values)


async def direct_client(port: int, rate: float, seconds: float) -> None:
    """Posts at ``rate`` msg/s for ``seconds``, each body stamped with its send time."""
    url = f"http://127.0.0.1:{port}/"
    interval = 1 / rate
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        for n in range(int(rate * seconds)):
            await _wait_until(started + n * interval)
            async with session.post(url, data=orjson.dumps({"ts": time.time(), "n": n})) as answer:
                await answer.read()


def child(name: str, args: Sequence[str]) -> None:
    if name == "direct":
        _run(direct_client(int(args[0]), float(args[1]), float(args[2])))
        print("null")
    if name in ("bare", "bare-untimed"):
        port, count, concurrency = (int(a) for a in args)
        handler = Handler.__new__(Handler)
        handler.url = f"http://127.0.0.1:{port}/"
        print(json.dumps(_run(bare_client(handler, count, concurrency, timed=name == "bare"))))
    if name == "bare-h1":
        port, count, concurrency = (int(a) for a in args)
        print(json.dumps(_run(bare_h1(port, count, concurrency))))
    if name == "bare-kafka":
        bootstrap, topic, client = args[0], args[1], args[5]
        port, count, concurrency = (int(a) for a in args[2:5])
        print(json.dumps(_run(bare_kafka(bootstrap, topic, port, count, concurrency, client))))


def _run(coroutine: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
        sys.exit(0)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    # More than --messages: a Kafka reader's start (its group's join, the internal
    # flows' members joining beside it) would otherwise fall inside the timed part.
    parser.add_argument("--kafka-messages", type=int, default=60_000)
    parser.add_argument("--log-messages", type=int, default=100_000)
    # moto answers each call in Python: a few thousand messages take it tens of seconds.
    parser.add_argument("--sqs-messages", type=int, default=5_000)
    # Long enough that the p99 is not decided by one slow moment of a shared machine.
    parser.add_argument("--latency-seconds", type=float, default=20.0)
    parser.add_argument(
        "--latency-rounds",
        type=int,
        default=4,
        help="(e) alternates the direct and the proxied phase in this many rounds",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=PARTS + OPTIONAL_PARTS,
        help="run only this part (repeatable): delivery = (a)-(c), (f), (g); log = (d);"
        " latency = (e); kafka = (k); sqs = (s). Default: all but kafka and sqs, in that order",
    )
    parser.add_argument(
        "--baseline-tree",
        type=source_tree,
        help="a source tree (its protos generated): compare (a), (c) and (g) of its proxy"
        " with this tree's, taking turns, instead of the parts",
    )
    _run(main(parser.parse_args()))
