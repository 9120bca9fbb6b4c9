"""DLQ viewer benchmark: its pages on a million dead letters, and the UI during a 100k requeue.

Fills a DLQ file with 1,000,000 rows (tests/bench/dlq.py's fill: 200 integrations,
Zipf-sized, 180 days), serves the viewer with uvicorn on 127.0.0.1 in a
subprocess (its own core when the machine has two), and drives it with
httpx like a browser would (signed-in session, whole HTML pages). Prints:
  (a) median / p95 ms of the list page under several filters, the overview,
      the groups page, one message, and the JSON API; and, as the baseline
      measured in the same run, the store calls the list page makes (one
      page of rows + a count that stops at 10,001) without HTTP or HTML,
      and the floor of any request (GET /healthz), with the ratio page /
      store; then the exact counts the page fetches after it arrives when
      a filter matches more than 10,000 rows (or searches text);
  (b) a bulk requeue of exactly 100,000 dead rows (one integration, by a
      time range): how long the background job takes to hand them to the
      replay topic, and the list page's latency while it runs against the
      same page idle;
  (c) the replay flow's delivery rate afterwards: a real proxy delivers
      from that replay topic to a handler process at the integration's
      replay rate limit; the busiest 1- and 5-second windows against what
      the limiter allows (its 50 ms burst plus the rate).

Usage: `python tests/bench/viewer.py [--rows N] [--path FILE] [--reuse] [--replay-rate R]
[--replay-seconds S]`
(`--reuse` skips the fill when FILE already holds the rows; the requeue
changes the file, so reuse a copy if the run must be repeated exactly).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import functools
import importlib.util
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # dlq_viewer, when run from a checkout without reinstalling

from dlq_viewer.testing import TEST_SECRET, Access, Client, Person  # noqa: E402
from nemesis.dlq import DeadLetterFilter, Reason, Status, open_sqlite_dlq  # noqa: E402


def _bench_dlq() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_dlq", HERE / "dlq.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH_DLQ = _bench_dlq()
NOW: float = BENCH_DLQ.NOW
INTEGRATIONS: list[str] = BENCH_DLQ.INTEGRATIONS
BIG = INTEGRATIONS[0]
TEAM = INTEGRATIONS[3:8]  # five integrations owned by one team
PEOPLE = Access(
    people=(
        Person("oncall", "oncall-password", ("team-x",)),
        Person("root", "root-pw", admin=True),
    ),
    clients=(Client("bench", "nmsv_bench-token", admin=True),),
)
TOKEN = {"authorization": "Bearer nmsv_bench-token"}
COUNT_CAP = 10_000  # create_app's default: the list page counts this far before answering


class BenchClock:
    """Wall time that starts at the fill's NOW (its rows end there), monotonic as usual."""

    def __init__(self) -> None:
        self._offset = NOW - time.time()

    def time(self) -> float:
        return time.time() + self._offset

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def integrations(replay_rate: float) -> dict[str, Any]:
    from nemesis.config.models import IntegrationConfig

    return {
        name: IntegrationConfig.model_validate(
            {
                "name": name,
                "owners": ["team-x"] if name in TEAM else [f"owner-{name}"],
                "source": {"topic": "orders", "consumer": name},
                "target": {"url": "http://127.0.0.1:9/", "timeout_s": 5},
                "rate_limits": {"replay": replay_rate},
            }
        )
        for name in INTEGRATIONS
    }


# --- the server process ------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    """The viewer over the DLQ file and an embedded log, until stdin closes."""
    from dlq_viewer import create_app, replay_requeuer
    from dlq_viewer.server import viewer_server
    from nemesis.broker.embedded import open_embedded
    from nemesis.config.models import EmbeddedBackendConfig

    clock = BenchClock()
    store = await open_sqlite_dlq(args.path, retention_s=None, clock=clock)
    broker = await open_embedded(EmbeddedBackendConfig(path=str(args.log)))
    try:
        app = create_app(
            store,
            integrations=integrations(args.replay_rate),
            auth=PEOPLE.config(),
            requeue=replay_requeuer(store, broker, clock=clock),
            clock=clock,
        )
        server = viewer_server(app, "127.0.0.1", args.port)
        task = asyncio.create_task(server.serve())
        # The parent closes our stdin to stop us.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        server.stop()
        await task
    finally:
        await broker.close()
        await store.close()


# --- measuring -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pin(core: int) -> list[str]:
    if (os.cpu_count() or 1) >= 2 and Path("/usr/bin/taskset").exists():
        return ["taskset", "-c", str(core)]
    return []


@contextlib.contextmanager
def server_process(path: Path, log: Path, replay_rate: float) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [
            *pin(1),
            sys.executable,
            __file__,
            "serve",
            "--path",
            str(path),
            "--log",
            str(log),
            "--port",
            str(port),
            "--replay-rate",
            str(replay_rate),
        ],
        stdin=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(base + "/healthz", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the viewer did not start") from None
                time.sleep(0.1)
        yield base
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=30)


def sign_in(client: httpx.Client, name: str, password: str) -> None:
    form = client.get("/login").text
    token = re.search(r'name="csrf_token" value="([^"]+)"', form)
    assert token is not None
    answer = client.post(
        "/login", data={"username": name, "password": password, "csrf_token": token.group(1)}
    )
    assert answer.status_code == 303, answer.status_code


def timed(call: Callable[[], httpx.Response], runs: int = 15) -> tuple[float, float, int]:
    """Median and p95 ms over ``runs`` after a warm-up, and the last answer's size."""
    answer = call()
    assert answer.status_code == 200, (answer.status_code, answer.text[:300])
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        answer = call()
        samples.append((time.perf_counter() - started) * 1000)
        assert answer.status_code == 200
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.95) - 1], len(answer.content)


async def store_baseline(path: Path, where: DeadLetterFilter) -> float:
    """The store calls the list page makes, without HTTP or HTML: median ms."""
    from nemesis.dlq import PageRequest

    store = await open_sqlite_dlq(path, retention_s=None)
    try:
        samples = []
        for i in range(16):
            started = time.perf_counter()
            await store.query(where, PageRequest(limit=50), preview_bytes=160)
            if where.text is None:
                await store.count(where, limit=COUNT_CAP + 1)
            if i:
                samples.append((time.perf_counter() - started) * 1000)
        return statistics.median(samples)
    finally:
        await store.close()


def list_pages(base: str, path: Path) -> None:
    print("\n(a) pages through uvicorn + httpx, signed in (ms: median / p95 / KB):")
    since_day = NOW - 86400
    team = frozenset(TEAM)
    cases: list[tuple[str, str, str, DeadLetterFilter | None]] = [
        ("admin: dead, no filter", "root", "/messages", DeadLetterFilter(status=Status.DEAD)),
        (
            "admin: big integration, 422, dead",
            "root",
            f"/messages?integration={BIG}&http_status=422",
            DeadLetterFilter(integrations=frozenset({BIG}), http_status=422, status=Status.DEAD),
        ),
        (
            "admin: reason decode_error, last 24 h",
            "root",
            "/messages?reason=decode_error&range=24h",
            DeadLetterFilter(reason=Reason.DECODE_ERROR, status=Status.DEAD, since=since_day),
        ),
        (
            "team (5 integrations): dead",
            "oncall",
            "/messages",
            DeadLetterFilter(integrations=team, status=Status.DEAD),
        ),
        (
            "team: any status, last 7 days",
            "oncall",
            "/messages?status=any&range=7d",
            DeadLetterFilter(integrations=team, since=NOW - 7 * 86400),
        ),
        (
            "team: text search 'needle-7f3a' (rare)",
            "oncall",
            "/messages?q=needle-7f3a",
            DeadLetterFilter(integrations=team, status=Status.DEAD, text="needle-7f3a"),
        ),
        ("admin: overview (stats + top groups)", "root", "/", None),
        ("team: overview", "oncall", "/", None),
        ("admin: groups, dead", "root", "/groups", None),
        ("team: groups, dead", "oncall", "/groups", None),
    ]
    clients = {
        "root": httpx.Client(base_url=base, timeout=30),
        "oncall": httpx.Client(base_url=base, timeout=30),
    }
    try:
        sign_in(clients["root"], "root", "root-pw")
        sign_in(clients["oncall"], "oncall", "oncall-password")
        floor, _, _ = timed(lambda: clients["root"].get("/healthz"))
        print(f"  {'GET /healthz (HTTP floor, no sign-in, no store)':<48} {floor:7.1f}")
        for label, who, url, where in cases:
            client = clients[who]
            median, p95, size = timed(functools.partial(client.get, url))
            line = f"  {label:<48} {median:7.1f} / {p95:6.1f} / {size / 1024:5.0f}"
            if where is not None:
                store_ms = asyncio.run(store_baseline(path, where))
                line += f"   store alone {store_ms:6.1f}  page/store {median / store_ms:4.1f}x"
            print(line)
        print("  counts past the page's cap, fetched by the page after it arrives:")
        for label, url in (
            ("admin: dead, no filter", "/api/messages/count?status=dead"),
            (
                "admin: big integration, 422, dead",
                f"/api/messages/count?integration={BIG}&http_status=422&status=dead",
            ),
            (
                "team: text search 'needle-7f3a'",
                "/api/messages/count?q=needle-7f3a&status=dead&"
                + "&".join(f"integration={n}" for n in TEAM),
            ),
        ):
            median, p95, _ = timed(
                functools.partial(clients["root"].get, url, headers=TOKEN), runs=5
            )
            count = clients["root"].get(url, headers=TOKEN).json()["count"]
            print(f"    {label:<46} {median:7.1f} / {p95:6.1f}   ({count:,})")
        rows = clients["root"].get(f"/api/messages?integration={BIG}&limit=1", headers=TOKEN)
        one = rows.json()["rows"][0]["id"]
        median, p95, size = timed(lambda: clients["root"].get(f"/messages/{one}"))
        print(
            f"  {'one message (detail page)':<48} {median:7.1f} / {p95:6.1f} / {size / 1024:5.0f}"
        )
        median, p95, size = timed(
            lambda: clients["root"].get(f"/api/messages?integration={BIG}&limit=50", headers=TOKEN)
        )
        print(
            f"  {'API: 50 rows of one integration (JSON)':<48} {median:7.1f} / {p95:6.1f} / {size / 1024:5.0f}"
        )
    finally:
        for client in clients.values():
            client.close()


async def hundred_thousand_since(path: Path) -> float:
    """A start time after which the big integration has exactly 100,000 dead rows."""
    store = await open_sqlite_dlq(path, retention_s=None)
    try:
        where = DeadLetterFilter(integrations=frozenset({BIG}), status=Status.DEAD, until=NOW)
        ids = await store.select_ids(where, 100_000)
        if len(ids) < 100_000:
            raise SystemExit(f"{BIG} has only {len(ids):,} dead rows; fill a fresh file")
        row = await store.get(ids[-1])
        assert row is not None
        return row.dead_lettered_at
    finally:
        await store.close()


def bulk_requeue(base: str, path: Path) -> None:
    since = asyncio.run(hundred_thousand_since(path))
    print("\n(b) bulk requeue of 100,000 dead rows of one integration, in the background:")
    with (
        httpx.Client(base_url=base, timeout=30) as ui,
        httpx.Client(base_url=base, timeout=30) as api,
    ):
        sign_in(ui, "oncall", "oncall-password")
        page = "/messages"  # another team's list: what someone else sees meanwhile
        idle = latencies(ui, page, seconds=4.0)
        print(f"  list page, idle:                 {summary(idle)}")
        started = time.perf_counter()
        job = api.post(
            "/api/jobs",
            json={
                "action": "requeue",
                "filter": {"integrations": [BIG], "since": since, "until": NOW},
            },
            headers=TOKEN,
        ).json()
        print(f"  job {job['id']}: {job['expected']:,} rows confirmed")
        busy: list[float] = []
        while True:
            busy += latencies(ui, page, seconds=0.5)
            state = api.get(f"/api/jobs/{job['id']}", headers=TOKEN).json()
            if state["finished"]:
                break
        seconds = time.perf_counter() - started
        print(
            f"  job {state['state']}: {state['done']:,} rows in {seconds:.1f} s"
            f" ({state['done'] / seconds:,.0f} rows/s, {state['rounds']} rounds)"
        )
        print(f"  list page, during the job:       {summary(busy)}")
        print(
            f"  slowdown of the median:          {statistics.median(busy) / statistics.median(idle):.1f}x"
        )


def latencies(client: httpx.Client, path: str, seconds: float) -> list[float]:
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        answer = client.get(path)
        samples.append((time.perf_counter() - started) * 1000)
        assert answer.status_code == 200
        time.sleep(0.02)
    return samples


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[max(0, int(len(ordered) * 0.95) - 1)]
    return (
        f"median {statistics.median(ordered):6.1f} ms, p95 {p95:6.1f} ms,"
        f" max {ordered[-1]:6.1f} ms ({len(ordered)} requests)"
    )


async def replay_delivery(path: Path, log: Path, replay_rate: float, seconds: float) -> None:
    """A proxy with only the big integration delivers its replay topic to a handler process.

    The handler runs in its own process (on the other core), so the arrival
    times it records are not bunched by pauses of the proxy's event loop.
    """
    from nemesis.broker.embedded import open_embedded
    from nemesis.broker.port import ConsumerSpec
    from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig
    from nemesis.runtime.app import Proxy
    from nemesis.runtime.runner import RunnerOptions
    from nemesis.testing import Ledger

    print(f"\n(c) the replay flow delivering those rows (replay rate limit {replay_rate:g}/s):")
    ledger_path = log.with_name("ledger.jsonl")
    port = free_port()
    handler = await asyncio.create_subprocess_exec(
        *pin(1),
        sys.executable,
        "-m",
        "nemesis.testing.handler",
        "--port",
        str(port),
        "--ledger",
        str(ledger_path),
        stdout=asyncio.subprocess.PIPE,
    )
    assert handler.stdout is not None
    await handler.stdout.readline()  # "listening on ..."
    broker = await open_embedded(EmbeddedBackendConfig(path=str(log)))
    # The replay flow runs only beside a DLQ store (a failed replay goes back there).
    store = await open_sqlite_dlq(path, retention_s=None)
    try:
        await broker.admin.create_topic(
            "orders", partitions=4, consumers=[ConsumerSpec(BIG)], exist_ok=True
        )
        config = IntegrationConfig.model_validate(
            {
                "name": BIG,
                "owners": ["x"],
                "source": {"topic": "orders", "consumer": BIG},
                "target": {"url": f"http://127.0.0.1:{port}/", "timeout_s": 5},
                "delivery": {"workers": 64, "buffer": 2000},
                "rate_limits": {"replay": replay_rate},
            }
        )
        proxy = Proxy(
            broker, {BIG: config}, dlq=store, runner_options=RunnerOptions(receive_timeout_s=0.05)
        )
        task = asyncio.create_task(proxy.run())
        await asyncio.sleep(seconds)
        proxy.stop()
        await task
    finally:
        await store.close()
        await broker.close()
        handler.terminate()
        await handler.wait()
    arrivals = sorted(entry.received_monotonic for entry in Ledger.load(ledger_path))
    if len(arrivals) < 2:
        print("  nothing was delivered")
        return
    span = arrivals[-1] - arrivals[0]
    burst = max(1.0, replay_rate * 0.05)
    print(
        f"  {len(arrivals):,} delivered in {span:.1f} s: {(len(arrivals) - 1) / span:,.1f}/s overall"
        f" (the limiter allows {burst:g} + {replay_rate:g}/s x {span:.1f} s"
        f" = {burst + replay_rate * span:,.0f})"
    )
    for window in (1.0, 5.0):
        busiest = max(
            bisect.bisect_left(arrivals, start + window) - i for i, start in enumerate(arrivals)
        )
        allowed = burst + replay_rate * window
        print(
            f"  busiest {window:g}-second window at the handler: {busiest}"
            f" = {busiest / allowed:.3f} x what the limiter allows ({allowed:g})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    serving = sub.add_parser("serve")
    serving.add_argument("--path", type=Path, required=True)
    serving.add_argument("--log", type=Path, required=True)
    serving.add_argument("--port", type=int, required=True)
    serving.add_argument("--replay-rate", type=float, default=500.0)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--path", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--replay-rate", type=float, default=500.0)
    parser.add_argument("--replay-seconds", type=float, default=20.0)
    args = parser.parse_args()
    if args.command == "serve":
        asyncio.run(serve(args))
        return
    assert PEOPLE.config().session_secret == TEST_SECRET
    with tempfile.TemporaryDirectory(prefix="nemesis-viewer-bench-") as directory:
        path: Path = args.path or Path(directory) / "dlq.db"
        log = Path(directory) / "log.db"
        asyncio.run(BENCH_DLQ.create_schema(path))
        if not (args.reuse and path.stat().st_size > 1_000_000):
            seconds = BENCH_DLQ.fill(path, args.rows)
            print(f"fill: {args.rows:,} rows in {seconds:.1f}s")
            asyncio.run(BENCH_DLQ.create_schema(path))  # builds the indexes
        print(f"file: {path} ({path.stat().st_size / 1e6:,.0f} MB)")
        with server_process(path, log, args.replay_rate) as base:
            list_pages(base, path)
            bulk_requeue(base, path)
        asyncio.run(replay_delivery(path, log, args.replay_rate, args.replay_seconds))


if __name__ == "__main__":
    main()
