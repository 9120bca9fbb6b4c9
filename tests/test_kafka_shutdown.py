"""A clean stop on Apache Kafka leaves a clean log: no commit the group refused.

The real CLI in a subprocess (``nemesis run``) on the session's Apache Kafka
broker, with the backend's default group settings: it delivers, takes SIGTERM
(once with every message delivered, once with deliveries in flight) and
exits 0. Its log must hold no ``OffsetCommit failed`` line (aiokafka logs
one at ERROR for each partition of a commit the coordinator refuses) and no
``UnknownMemberIdError``: such a line is what an operator's alert on ERROR
lines would page for on every restart.

No ``nemesis init`` here: ``run`` registers each flow's consumer itself, as
it does for an integration added to a running proxy.
"""

from __future__ import annotations

import re

import pytest

from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import KafkaBroker, Namespace, free_port
from tests.test_kafka_e2e import publish, wait_committed, write_orders

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REFUSED = re.compile(r"OffsetCommit failed|UnknownMemberId|IllegalGeneration")


def default_kafka_config(space: Workspace, bootstrap: str) -> None:
    """The backend block a user starts from: the servers, every group setting at its default."""
    (space.root / "nemesis.yaml").write_text(
        f"backend: {{kind: kafka, bootstrap_servers: ['{bootstrap}']}}\n"
        "single_host: true\n"  # one process: its state and DLQ files are enough
        "data_dir: .\n"
        "integrations_dir: integrations\n"
        f"admin: {{port: {free_port()}}}\n"
        "viewer: {port: 0, enabled: false}\n"
    )
    (space.root / "integrations").mkdir(exist_ok=True)


async def test_clean_shutdown_logs_no_refused_commit(
    workspace: Workspace, kafka: KafkaBroker
) -> None:
    ns = Namespace()
    topic, name = ns("orders"), ns("loyalty")
    default_kafka_config(workspace, kafka.bootstrap)
    publish(workspace, topic, 3_000)
    async with HandlerServer() as handler:
        workspace.write_integration(
            name, integration_yaml(name, handler.url, topic=topic, workers=32)
        )
        # Everything delivered and committed, then a stop.
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(3_000, timeout_s=180)
        await wait_committed(workspace, topic, name, timeout_s=60)
        assert await stop_gracefully(proxy) == 0, workspace.logs()

        # A second start of the same integration, stopped while deliveries are in flight.
        handler.delay(0.001, 0.004)
        write_orders(workspace.root / "more.jsonl", 3_000)
        published = workspace.cli("publish", topic, "--file", "more.jsonl", "--lines", timeout=180)
        assert published.returncode == 0, published.stderr
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(3_500, timeout_s=180)
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    refused = [line for line in workspace.logs().splitlines() if REFUSED.search(line)]
    assert not refused, "\n".join(refused)
