"""End to end on Kafka: the real CLI in subprocesses, Apache Kafka, real handlers.

Each case writes a ``nemesis.yaml`` whose backend is an Apache Kafka broker on
127.0.0.1 (``tests/kafka_broker.py``) with the default settings (idempotent
producer on), and drives ``nemesis topics``, ``publish``, ``init``, ``run`` and
``dlq`` as a user would. Cases share the session's broker under names of their
own (``Namespace``). The kill -9 bound on redeliveries is in
``test_kafka_crash.py``, broker outages in ``test_kafka_outage.py`` (modules
apart, so that xdist spreads them over its workers).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from nemesis.dlq import DeadLetterFilter, open_sqlite_dlq
from nemesis.testing import HandlerServer, Ledger, LedgerEntry
from tests.conftest import Workspace, integration_yaml, kill_hard, stop_gracefully
from tests.kafka_broker import KafkaBroker, Namespace, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def kafka_config(space: Workspace, bootstrap: str, *, admin_port: int = 0) -> int:
    """Points the workspace at the broker; returns the admin API's port."""
    port = admin_port or free_port()
    (space.root / "nemesis.yaml").write_text(
        "backend:\n"
        "  kind: kafka\n"
        f"  bootstrap_servers: ['{bootstrap}']\n"
        "  heartbeat_interval_s: 1\n"
        "  connect_timeout_s: 5\n"
        "  request_timeout_s: 15\n"
        "single_host: true   # one host: the state and DLQ files are enough\n"
        "data_dir: .\n"
        "integrations_dir: integrations\n"
        f"admin: {{port: {port}}}\n"
        "viewer: {port: 0, enabled: false}\n"
        "metrics: {lag_refresh_s: 1}\n"
    )
    (space.root / "integrations").mkdir(exist_ok=True)
    return port


def write_orders(path: Path, count: int) -> set[str]:
    ids = set()
    with path.open("wb") as out:
        for n in range(count):
            ids.add(f"order-{n}")
            out.write(orjson.dumps({"id": f"order-{n}", "n": n}) + b"\n")
    return ids


def order_id(entry: LedgerEntry) -> str:
    return str(json.loads(entry.body)["id"])


def n_of(entry: LedgerEntry) -> int:
    return int(json.loads(entry.body)["n"])


def publish(space: Workspace, topic: str, count: int, partitions: int = 4) -> set[str]:
    created = space.cli("topics", "create", topic, "--partitions", str(partitions))
    assert created.returncode == 0, created.stderr
    ids = write_orders(space.root / "orders.jsonl", count)
    published = space.cli(
        "publish", topic, "--file", "orders.jsonl", "--lines", "--key-field", "id", timeout=180
    )
    assert published.returncode == 0, published.stderr
    assert f"written {count} message(s)" in published.stdout
    return ids


def init(space: Workspace) -> None:
    done = space.cli("init")
    assert done.returncode == 0, done.stdout + done.stderr


def committed(space: Workspace, topic: str, consumer: str) -> list[tuple[int, int]]:
    """(committed, end) offsets per partition, as ``nemesis topics describe`` reports them."""
    described = space.cli("topics", "describe", topic, "--json")
    assert described.returncode == 0, described.stderr
    partitions = json.loads(described.stdout)["partitions"]
    return [(p["committed"].get(consumer, -1), p["end_offset"]) for p in partitions]


async def wait_committed(space: Workspace, topic: str, consumer: str, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        offsets = await asyncio.to_thread(committed, space, topic, consumer)
        if all(c == end for c, end in offsets):
            return
        assert asyncio.get_running_loop().time() < deadline, offsets
        await asyncio.sleep(0.5)


async def test_run_delivers_and_commits_every_message(
    workspace: Workspace, kafka: KafkaBroker
) -> None:
    ns = Namespace()
    topic, name = ns("orders"), ns("loyalty")
    kafka_config(workspace, kafka.bootstrap)
    ids = publish(workspace, topic, 10_000)
    async with HandlerServer() as handler:
        workspace.write_integration(
            name, integration_yaml(name, handler.url, topic=topic, workers=32)
        )
        init(workspace)
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(10_000, timeout_s=180)
        await wait_committed(workspace, topic, name, timeout_s=60)
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    assert {order_id(e) for e in handler.ledger if e.done} == ids
    offsets = committed(workspace, topic, name)
    assert sum(end for _, end in offsets) == 10_000
    assert all(c == end for c, end in offsets), offsets


async def test_kill_9_loses_nothing(workspace: Workspace, kafka: KafkaBroker) -> None:
    ns = Namespace()
    topic, name = ns("orders"), ns("loyalty")
    count, kills, buffer, partitions = 20_000, 3, 500, 4
    kafka_config(workspace, kafka.bootstrap)
    ids = publish(workspace, topic, count, partitions)
    rng = random.Random(11)
    async with HandlerServer(seed=5) as handler:
        handler.delay(0.0, 0.004)
        workspace.write_integration(
            name, integration_yaml(name, handler.url, topic=topic, workers=32, buffer=buffer)
        )
        init(workspace)
        for _ in range(kills):
            proxy = await workspace.start("run")
            before = len(handler.ledger)

            def delivering(ledger: Ledger, before: int = before) -> bool:
                return len(ledger) > before + 500

            await handler.ledger.wait_until(delivering, timeout_s=90)
            await asyncio.sleep(rng.uniform(0.1, 1.0))
            kill_hard(proxy)
            await proxy.wait()
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(count, timeout_s=240)
        await wait_committed(workspace, topic, name, timeout_s=60)
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    delivered = Counter(order_id(e) for e in handler.ledger if e.done)
    assert set(delivered) == ids, f"lost {len(ids - set(delivered))}"
    duplicates = sum(n - 1 for n in delivered.values())
    # A kill redelivers only what was read and not committed: at most `buffer` per partition.
    assert duplicates <= kills * partitions * buffer, duplicates


async def test_a_survivor_takes_over_a_killed_members_partitions(
    tmp_path: Path, kafka: KafkaBroker
) -> None:
    ns = Namespace()
    topic, shared = ns("orders"), ns("shared")
    count = 4000
    a, b = Workspace(tmp_path / "a"), Workspace(tmp_path / "b")
    for space in (a, b):
        space.root.mkdir()
        kafka_config(space, kafka.bootstrap)
    ids = publish(a, topic, count)
    try:
        async with HandlerServer(seed=9) as handler:
            handler.delay(0.01)
            for name, space in (("a", a), ("b", b)):
                space.write_integration(
                    shared,
                    integration_yaml(
                        shared,
                        handler.url,
                        topic=topic,
                        workers=2,
                        buffer=20,
                        headers={"x-proxy": name},
                    ),
                )
            init(a)
            proxy_a = await a.start("run")
            proxy_b = await b.start("run")

            def by(name: str) -> set[int]:
                return {
                    e.partition
                    for e in handler.ledger
                    if e.headers.get("x-proxy") == name and e.partition is not None
                }

            # One group, two members: the partitions are split between them.
            await handler.ledger.wait_until(lambda _: bool(by("a")) and bool(by("b")), 60)
            owned_by_a = by("a")
            killed_at = time.monotonic()
            kill_hard(proxy_a)
            await proxy_a.wait()

            # The group expires the dead member after its session (10 s) and gives its
            # partitions to the survivor, which reads on from the last commit.
            def taken_over(_: Ledger) -> dict[int, float]:
                first: dict[int, float] = {}
                for e in handler.ledger:
                    if (
                        e.headers.get("x-proxy") == "b"
                        and e.partition in owned_by_a
                        and e.received_monotonic > killed_at
                    ):
                        first.setdefault(e.partition, e.received_monotonic - killed_at)
                return first

            await handler.ledger.wait_until(
                lambda ledger: taken_over(ledger).keys() >= owned_by_a, timeout_s=60
            )
            after_s = sorted(taken_over(handler.ledger).values())
            print(f"takeover: the dead member's partitions read again after {after_s} s")
            await handler.ledger.wait_for(count, timeout_s=180)
            await wait_committed(b, topic, shared, timeout_s=60)
            assert await stop_gracefully(proxy_b) == 0, b.logs()
        assert {order_id(e) for e in handler.ledger if e.done} == ids
    finally:
        for space in (a, b):
            for process in space.processes:
                if process.returncode is None:
                    kill_hard(process)
                    await process.wait()
            for log_file in space.log_files:
                log_file.close()


async def test_retry_tiers_the_dlq_and_a_requeue_that_reaches_only_its_integration(
    workspace: Workspace, kafka: KafkaBroker
) -> None:
    ns = Namespace()
    topic = ns("orders")
    count = 200
    kafka_config(workspace, kafka.bootstrap)
    publish(workspace, topic, count, partitions=2)
    rejected = {n for n in range(count) if n % 7 == 0}  # 422: straight to the DLQ
    # Fail twice: two trips through the tiers.
    retried = {n for n in range(count) if n % 5 == 1} - rejected
    async with HandlerServer() as alpha, HandlerServer() as beta:
        alpha.when(lambda e: n_of(e) in rejected, status=422)
        alpha.when(lambda e: n_of(e) in retried and e.receipt <= 2, status=503)
        for name, handler in ((ns("alpha"), alpha), (ns("beta"), beta)):
            workspace.write_integration(
                name,
                integration_yaml(
                    name,
                    handler.url,
                    topic=topic,
                    workers=8,
                    buffer=100,
                    tiers=("300ms", "600ms"),
                    extra="breaker: {min_requests: 100000}\n",
                ),
            )
        init(workspace)
        proxy = await workspace.start("run")
        try:
            await alpha.ledger.wait_for(count - len(rejected), timeout_s=120)
            await beta.ledger.wait_for(count, timeout_s=120)
            store = await open_sqlite_dlq(workspace.root / "dlq.db")
            try:
                for _ in range(300):
                    if await store.count(DeadLetterFilter()) >= len(rejected):
                        break
                    await asyncio.sleep(0.1)
                rows = (await store.query(DeadLetterFilter(), None)).rows
            finally:
                await store.close()
            assert sorted(json.loads(row.payload)["n"] for row in rows) == sorted(rejected)
            assert {row.integration for row in rows} == {ns("alpha")}

            # The retried ones went through both tiers, under one ce-id, at their source.
            for n in retried:
                arrivals = [e for e in alpha.ledger if n_of(e) == n]
                assert [e.attempt for e in arrivals] == [1, 2, 3], n
                assert len({(e.id, e.topic, e.partition, e.offset) for e in arrivals}) == 1

            alpha.reset()  # the fix is deployed
            requeued = workspace.cli("dlq", "requeue", "--all-matching", "--yes", "--by", "ops")
            assert requeued.returncode == 0, requeued.stderr
            await alpha.ledger.wait_for(count, timeout_s=120)
        finally:
            assert await stop_gracefully(proxy) == 0, workspace.logs()
    # The replay reached alpha alone: beta saw every message exactly once.
    assert sorted(Counter(n_of(e) for e in beta.ledger).values()) == [1] * count
    assert {n_of(e) for e in alpha.ledger if e.done} == set(range(count))
