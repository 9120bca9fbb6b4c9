"""Broker failures on a three-broker Apache Kafka cluster, through the real proxy.

One cluster for the module (``start_kafka_cluster``: three KRaft nodes, each
a broker and a controller, replication factor 3, ``min.insync.replicas=2``);
each case has topics and an integration of its own. The proxy is the real
``nemesis run`` in a subprocess with the default Kafka settings (idempotent
producer on, ``acks=all``), delivering to a ledger handler on 127.0.0.1,
while a second ``nemesis publish`` writes more orders. A case brings the
cluster back whole before it ends.

What counts is the ledger: every order delivered, duplicates within the
bound docs/kafka.md states (what was read and not committed when a group
rebalances: at most ``delivery.buffer`` per partition), the committed offsets
at the end of the topic. Nothing is timed; every wait polls until a generous
deadline.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from nemesis.testing import HandlerServer, LedgerEntry
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import KafkaCluster, Namespace, start_kafka_cluster
from tests.test_kafka_e2e import committed, init, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PARTITIONS = 4
BUFFER = 500


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    started = start_kafka_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
async def admin(cluster: KafkaCluster) -> AsyncIterator[AIOKafkaAdminClient]:
    client = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap_servers)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def cluster_config(space: Workspace, cluster: KafkaCluster) -> None:
    servers = ", ".join(f"'{server}'" for server in cluster.bootstrap_servers)
    (space.root / "nemesis.yaml").write_text(
        "backend:\n"
        "  kind: kafka\n"
        f"  bootstrap_servers: [{servers}]\n"
        "  replication_factor: 3\n"
        "  session_timeout_s: 6\n"
        "  heartbeat_interval_s: 1\n"
        "  connect_timeout_s: 10\n"
        "  request_timeout_s: 30\n"
        "single_host: true\n"  # one process: its state and DLQ files are enough
        "data_dir: .\n"
        "integrations_dir: integrations\n"
        "admin: {port: 0}\n"
        "viewer: {port: 0, enabled: false}\n"
    )
    (space.root / "integrations").mkdir(exist_ok=True)


def write_orders(path: Path, first: int, count: int) -> set[str]:
    with path.open("wb") as out:
        for n in range(first, first + count):
            out.write(orjson.dumps({"id": f"order-{n}", "n": n}) + b"\n")
    return {f"order-{n}" for n in range(first, first + count)}


def order_id(entry: LedgerEntry) -> str:
    return str(json.loads(entry.body)["id"])


async def publish(space: Workspace, topic: str, name: str) -> None:
    """``nemesis publish`` of ``name``.jsonl, as a producer beside the proxy would."""
    done = await asyncio.to_thread(
        space.cli,
        "publish",
        topic,
        "--file",
        f"{name}.jsonl",
        "--lines",
        "--key-field",
        "id",
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


async def leaders(admin: AIOKafkaAdminClient, topic: str) -> dict[int, int]:
    """Partition -> the node that leads it now."""
    (described,) = await admin.describe_topics([topic])
    return {p["partition"]: p["leader"] for p in described["partitions"]}


async def wait_fully_replicated(admin: AIOKafkaAdminClient, timeout_s: float = 180) -> None:
    """Until every partition of every topic has its three replicas in sync, with a leader."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    lagging: list[tuple[str, int]] = []
    while asyncio.get_running_loop().time() < deadline:
        try:
            topics = await admin.describe_topics(await admin.list_topics())
        except (KafkaError, OSError) as exc:  # a node still starting: ask again
            lagging = [(repr(exc), -1)]
        else:
            lagging = [
                (t["topic"], p["partition"])
                for t in topics
                for p in t["partitions"]
                if len(p["isr"]) < 3 or p["leader"] < 0
            ]
            if not lagging:
                return
        await asyncio.sleep(0.5)
    raise AssertionError(f"partitions not fully replicated: {lagging[:10]}")


async def start_run(
    space: Workspace, cluster: KafkaCluster, handler: HandlerServer, ns: Namespace
) -> tuple[str, str, set[str]]:
    """The case's topic with 10,000 orders, its integration initialised; the proxy started."""
    topic, name = ns("orders"), ns("loyalty")
    cluster_config(space, cluster)
    created = space.cli("topics", "create", topic, "--partitions", str(PARTITIONS))
    assert created.returncode == 0, created.stderr
    first = write_orders(space.root / "first.jsonl", 0, 10_000)
    await publish(space, topic, "first")
    space.write_integration(
        name, integration_yaml(name, handler.url, topic=topic, workers=32, buffer=BUFFER)
    )
    init(space)
    await space.start("run")
    return topic, name, first


async def finish(
    space: Workspace, handler: HandlerServer, topic: str, name: str, ids: set[str], events: int
) -> None:
    """Waits for every order, stops the proxy, and checks the ledger and the commits."""
    # One ce-id per source record: every order's arrived once this many are done.
    await handler.ledger.wait_for(len(ids), timeout_s=400)
    await wait_committed(space, topic, name, timeout_s=120)
    (proxy,) = space.processes
    assert await stop_gracefully(proxy) == 0, space.logs()
    delivered = Counter(order_id(e) for e in handler.ledger if e.done)
    assert set(delivered) == ids, f"lost {len(ids - set(delivered))}"
    duplicates = sum(n - 1 for n in delivered.values())
    # A rebalance redelivers only what was read and not committed: `buffer` per partition.
    assert duplicates <= events * PARTITIONS * BUFFER, duplicates
    offsets = committed(space, topic, name)
    assert sum(end for _, end in offsets) == len(ids)


async def test_kill_9_of_a_partition_leader_loses_nothing(
    workspace: Workspace, cluster: KafkaCluster, admin: AIOKafkaAdminClient
) -> None:
    ns = Namespace()
    async with HandlerServer(seed=3) as handler:
        handler.delay(0.0, 0.003)
        topic, name, ids = await start_run(workspace, cluster, handler, ns)
        await handler.ledger.wait_for(2000, timeout_s=180)
        # More orders are written while the leader dies: producer and proxy both fail over.
        ids |= write_orders(workspace.root / "second.jsonl", 10_000, 10_000)
        publishing = asyncio.create_task(publish(workspace, topic, "second"))
        await handler.ledger.wait_for(4000, timeout_s=180)
        victim = cluster.node((await leaders(admin, topic))[0])
        victim.kill()
        try:
            await publishing
            # Delivery goes on with the leader dead: the other two took its partitions.
            await handler.ledger.wait_for(len(ids) - 1000, timeout_s=400)
        finally:
            if not victim.running:
                victim.start()
        await finish(workspace, handler, topic, name, ids, events=2)
    await wait_fully_replicated(admin)


async def test_a_rolling_restart_of_every_broker_under_load_loses_nothing(
    workspace: Workspace, cluster: KafkaCluster, admin: AIOKafkaAdminClient
) -> None:
    ns = Namespace()
    async with HandlerServer(seed=4) as handler:
        handler.delay(0.0, 0.003)
        topic, name, ids = await start_run(workspace, cluster, handler, ns)
        await handler.ledger.wait_for(1000, timeout_s=180)
        ids |= write_orders(workspace.root / "second.jsonl", 10_000, 10_000)
        publishing = asyncio.create_task(publish(workspace, topic, "second"))
        for node in cluster.nodes:
            # As an operator does it: one broker at a time, the next once all is in sync.
            await wait_fully_replicated(admin)
            before = len(handler.ledger.done_ids())
            await asyncio.to_thread(node.stop)
            await asyncio.to_thread(node.start)

            def moved_on(_: object, before: int = before) -> bool:
                done = len(handler.ledger.done_ids())
                return done > before + 200 or done >= len(ids)

            await handler.ledger.wait_until(moved_on, timeout_s=300)
        await publishing
        await finish(workspace, handler, topic, name, ids, events=2 * len(cluster.nodes))
    await wait_fully_replicated(admin)
