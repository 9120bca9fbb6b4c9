"""Consumer groups on Kafka: the internal flows' group of their own, and registrations refused.

On Kafka a consumer is a group across topics, and a group that has members
takes no commit from outside it, so a registration (``nemesis init``, a
flow's start) of a group whose members read other topics is refused. The
internal flows (retry tiers, replay) read as ``nemesis.internal.<name>``,
so an integration's main consumer (its name, by default) never meets them;
a registration the broker refuses is an error, and a flow that cannot start
is counted in ``nemesis_flow_restarts_total``. Through the real CLI, against
a real Kafka-protocol broker.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import KafkaNode, Namespace
from tests.operability import samples, wait_until_true
from tests.test_kafka_stall import kafka_workspace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def name() -> Namespace:
    return Namespace()


@pytest.fixture
async def other_application(kafka: KafkaNode, name: Namespace) -> AsyncIterator[AIOKafkaConsumer]:
    """Another application's live member of group ``shared``, reading topic ``other``."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name("other"), 1, 1)])
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(
        name("other"),
        bootstrap_servers=kafka.bootstrap,
        group_id=name("shared"),
        enable_auto_commit=False,
    )
    await consumer.start()
    # Joined: the group has a member now.
    await wait_until_true(lambda: bool(consumer.assignment()), timeout_s=30, step_s=0.1)
    yield consumer
    await consumer.stop()


def status(admin: str, name: str) -> dict[str, object]:
    try:
        return dict(httpx.get(f"{admin}/integrations/{name}", timeout=5).json())
    except httpx.HTTPError:
        return {}


def flow_stats(admin: str, name: str, flow: str) -> dict[str, object]:
    flows = status(admin, name).get("flows", [])
    assert isinstance(flows, list)
    return next((f for f in flows if f["flow"] == flow), {})


def restarts(admin: str, name: str, flow: str) -> float:
    try:
        scrape = samples(httpx.get(f"{admin}/metrics", timeout=5).text)
    except httpx.HTTPError:
        return 0.0
    return sum(
        value
        for labels, value in scrape.get("nemesis_flow_restarts_total", [])
        if labels.get("integration") == name and labels.get("flow") == flow
    )


def shared_consumer_yaml(name: Namespace, url: str) -> str:
    return (
        f"name: {name('loyalty')}\n"
        "owners: [team-test]\n"
        f"source: {{topic: {name('orders')}, consumer: {name('shared')}}}\n"
        f"target: {{url: '{url}', timeout_s: 5}}\n"
    )


async def test_an_integration_added_to_a_running_proxy_starts_beside_its_internal_flows(
    workspace: Workspace, kafka: KafkaNode, name: Namespace
) -> None:
    """The internal flows read before the source topic exists; the main flow starts after."""
    admin = kafka_workspace(workspace, kafka.bootstrap)
    integration, topic = name("loyalty"), name("orders")
    async with HandlerServer() as handler:
        yaml = integration_yaml(integration, handler.url, topic=topic, workers=4)
        workspace.write_integration(integration, yaml)
        proxy = await workspace.start("run")

        def replay_reads() -> bool:
            stats = flow_stats(admin, integration, "replay")
            return int(str(stats.get("assigned_partitions", 0))) > 0

        # The replay flow (the integration's own topic) reads, its group joined.
        await wait_until_true(replay_reads, timeout_s=90, step_s=0.5)
        created = await asyncio.to_thread(
            workspace.cli, "topics", "create", topic, "--partitions", "2"
        )
        assert created.returncode == 0, created.stderr
        lines = b"".join(json.dumps({"n": n}).encode() + b"\n" for n in range(20))
        (workspace.root / "orders.jsonl").write_bytes(lines)
        published = await asyncio.to_thread(
            workspace.cli, "publish", topic, "--file", "orders.jsonl", "--lines"
        )
        assert published.returncode == 0, published.stderr
        done = await asyncio.to_thread(workspace.cli, "init")
        assert done.returncode == 0, done.stdout + done.stderr
        await handler.ledger.wait_for(20, timeout_s=90)
        assert {json.loads(e.body)["n"] for e in handler.ledger if e.done} == set(range(20))
        assert (
            f"consumer nemesis.replay.{integration}/nemesis.internal.{integration}" in done.stdout
        )
        assert await stop_gracefully(proxy) == 0, workspace.logs()


async def test_init_reports_a_registration_the_broker_refuses(
    workspace: Workspace, kafka: KafkaNode, name: Namespace, other_application: AIOKafkaConsumer
) -> None:
    kafka_workspace(workspace, kafka.bootstrap)
    created = await asyncio.to_thread(
        workspace.cli, "topics", "create", name("orders"), "--partitions", "2"
    )
    assert created.returncode == 0, created.stderr
    workspace.write_integration(name("loyalty"), shared_consumer_yaml(name, "http://127.0.0.1:9/"))
    # In a thread: the other application's member keeps its heartbeats meanwhile.
    done = await asyncio.to_thread(workspace.cli, "init")
    assert done.returncode != 0, done.stdout
    assert f"consumer {name('orders')}/{name('shared')}: added" not in done.stdout
    refused = f"cannot register consumer {name('shared')} on topic {name('orders')}"
    assert refused in done.stderr, done.stderr
    assert "live members reading other topics" in done.stderr, done.stderr


async def test_a_flow_that_cannot_start_counts_its_restarts(
    workspace: Workspace, kafka: KafkaNode, name: Namespace, other_application: AIOKafkaConsumer
) -> None:
    admin = kafka_workspace(workspace, kafka.bootstrap)
    created = await asyncio.to_thread(
        workspace.cli, "topics", "create", name("orders"), "--partitions", "2"
    )
    assert created.returncode == 0, created.stderr
    async with HandlerServer() as handler:
        workspace.write_integration(name("loyalty"), shared_consumer_yaml(name, handler.url))
        proxy = await workspace.start("run")
        integration = name("loyalty")
        await wait_until_true(
            lambda: restarts(admin, integration, "main") >= 2, timeout_s=90, step_s=0.5
        )
        issues = status(admin, integration).get("issues", {})
        assert isinstance(issues, dict)
        refused = f"cannot register consumer {name('shared')} on topic {name('orders')}"
        assert refused in str(issues.get("main")), issues
        assert await stop_gracefully(proxy) == 0, workspace.logs()
