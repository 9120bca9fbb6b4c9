"""The shipped Kafka configuration, run as two real replicas, forms one fleet.

``deploy/config/nemesis.kafka.yaml`` is what ``compose.kafka.yaml`` and
``kubernetes/kafka`` run: Kafka, with the fleet's state and the DLQ in
PostgreSQL. Here two ``nemesis run`` processes read it, changed only where a
test host differs from a cluster (addresses, folders, the test broker's
limits), against a real Apache Kafka broker and a real PostgreSQL
server. They find each other in the database and split the integrations:
each runs on one replica, and each replica runs some.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from nemesis.testing import HandlerServer
from tests.conftest import REPO, Workspace, stop_gracefully
from tests.kafka_broker import KafkaBroker, Namespace
from tests.operability import DEPLOY
from tests.test_fleet_e2e import TOKEN, Fleet, eventually, free_port

pytestmark = pytest.mark.slow

INTEGRATIONS = [f"team-{n}" for n in range(4)]


class ShippedKafkaFleet(Fleet):
    """Replicas of the shipped Kafka configuration, each with an admin port of its own."""

    def config(self, n: int) -> str:
        while len(self.ports) <= n:
            self.ports.append(free_port())
        document: dict[str, Any] = yaml.safe_load(
            (DEPLOY / "config/nemesis.kafka.yaml").read_text()
        )
        # What differs on a test host; the broker, the stores and the rest are as shipped.
        document["backend"].update(
            session_timeout_s=6,
            heartbeat_interval_s=1,
            request_timeout_s=10,
        )
        document.update(
            data_dir=".",
            integrations_dir="integrations",
            pipelines_dir=str(REPO / "pipelines"),
            shutdown_grace_s=5,
        )
        document["admin"].update(host="127.0.0.1", port=self.ports[n])
        document["viewer"] = {"enabled": False}
        path = self.workspace.root / f"nemesis.replica-{n}.yaml"  # validate: process config
        path.write_text(yaml.safe_dump(document))
        return path.name


@pytest.fixture
def shipped_env(
    monkeypatch: pytest.MonkeyPatch, kafka: KafkaBroker, postgres_dsn: str
) -> dict[str, str]:
    """The variables the shipped file reads, as a pod's environment gives them."""
    env = {
        "NEMESIS_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "NEMESIS_KAFKA_REPLICATION_FACTOR": "1",
        "NEMESIS_DB_DSN": postgres_dsn,
        "NEMESIS_ADMIN_TOKEN": TOKEN,
        "NEMESIS_SESSION_SECRET": "a-session-secret-shared-by-every-replica-0123",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


async def test_two_replicas_of_the_shipped_kafka_configuration_share_the_work(
    workspace: Workspace, shipped_env: dict[str, str]
) -> None:
    fleet = ShippedKafkaFleet(workspace)
    ns = Namespace()  # the broker is shared by the session's Kafka cases
    topic = ns("orders")
    async with HandlerServer() as handler:
        for name in INTEGRATIONS:
            workspace.write_integration(
                name,
                f"name: {name}\nowners: [team-test]\n"
                f"source: {{topic: {topic}, consumer: {ns(name)}}}\n"
                f"target: {{url: '{handler.url}{name}', timeout_s: 5}}\n"
                "delivery: {workers: 4, buffer: 100}\n",
            )
        config = fleet.config(0)
        checked = workspace.cli("validate", config)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        created = workspace.cli(
            "topics", "create", topic, "--partitions", "4", "--exist-ok", "-c", config
        )
        assert created.returncode == 0, created.stderr
        for n in range(2):
            await fleet.start(n)
        views = []
        for n in range(2):

            async def settled(n: int = n) -> dict[str, Any] | None:
                return await fleet.settled(n, 2)

            views.append(
                await eventually(
                    settled,
                    timeout_s=120,
                    what=f"replica {n} sees 2 members, each integration placed",
                    logs=workspace.logs,
                )
            )
        for view in views:
            running = {i["name"]: i["running"] for i in view["integrations"]}
            assert sorted(running) == INTEGRATIONS
            # Each integration on one replica, and each replica runs some of them.
            assert all(len(members) == 1 for members in running.values()), running
            per_member = {m["member_id"]: m["running"] for m in view["members"]}
            assert sum(per_member.values()) == len(INTEGRATIONS)
            assert min(per_member.values()) > 0, per_member

        lines = workspace.root / "orders.jsonl"
        lines.write_text("".join(json.dumps({"id": f"order-{n}"}) + "\n" for n in range(8)))
        published = workspace.cli(
            "publish", topic, "--file", lines.name, "--lines", "--key-field", "id", "-c", config
        )
        assert published.returncode == 0, published.stderr
        expected = {(f"/{name}", f"order-{n}") for name in INTEGRATIONS for n in range(8)}

        async def everything() -> bool:
            done = {(e.path, json.loads(e.body)["id"]) for e in handler.ledger if e.done}
            return done >= expected

        await eventually(everything, timeout_s=120, what="every message", logs=workspace.logs)
        for process in fleet.processes:
            assert await stop_gracefully(process) == 0, workspace.logs()[-4000:]
    status = workspace.cli("fleet", "status", "-c", config, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["members"] == []
