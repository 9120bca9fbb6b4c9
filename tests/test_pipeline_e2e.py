"""A pipeline in the running proxy: filtered messages cost no HTTP and are committed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig
from nemesis.metrics import Metrics
from nemesis.runtime.app import Proxy
from nemesis.runtime.runner import RunnerOptions
from nemesis.testing import HandlerServer
from tests.conftest import REPO

CITIES = ["msk", "spb", "kzn", "nsk"]


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


def order(n: int) -> dict[str, object]:
    # City cycles through four; amount is above 1000 for every second order of msk/spb:
    # msk/spb (1 in 2) x amount > 1000 (1 in 2) = 1 in 4 passes the city filter.
    return {"order": {"id": n, "city": CITIES[n % 4], "amount": 1500 if (n // 4) % 2 else 500}}


async def test_city_filter_delivers_exactly_the_matching_quarter(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    count = 2000
    await broker.admin.create_topic("orders", partitions=4, consumers=[ConsumerSpec("loyalty")])
    writer = await broker.writer("orders")
    await writer.write([OutgoingMessage(value=orjson.dumps(order(n))) for n in range(count)])
    await writer.close()
    expected = {
        n
        for n in range(count)
        if order(n)["order"]["city"] in ("msk", "spb")  # type: ignore[index]
        and order(n)["order"]["amount"] > 1000  # type: ignore[index]
    }
    assert len(expected) == count // 4
    metrics = Metrics()
    async with HandlerServer() as handler:
        config = IntegrationConfig.model_validate(
            {
                "name": "loyalty",
                "owners": ["team-loyalty"],
                "source": {"topic": "orders", "consumer": "loyalty"},
                "pipeline": "city-filter",
                "target": {"url": handler.url},
            }
        )
        proxy = Proxy(
            broker,
            {"loyalty": config},
            pipelines_dir=REPO / "pipelines",
            metrics=metrics,
            runner_options=RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02),
        )
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_for(len(expected), timeout_s=30)
        # Everything read is committed, the filtered three quarters included.
        for _ in range(100):
            description = await broker.admin.describe_topic("orders")
            if all(p.committed.get("loyalty") == p.end_offset for p in description.partitions):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"not all committed: {description}")
        proxy.stop()
        await task
    delivered = {json.loads(e.body)["order"]["id"] for e in handler.ledger}
    assert delivered == expected
    assert handler.requests == len(expected)  # a filtered message costs no HTTP request
    sample = metrics.registry.get_sample_value

    def stage(outcome: str) -> float:
        value = sample(
            "nemesis_stage_messages_total",
            {"integration": "loyalty", "stage": "msk-spb-over-1000", "outcome": outcome},
        )
        return value or 0.0

    assert stage("filtered") / (stage("filtered") + stage("passed")) == 0.75
    assert stage("failed") == 0


async def test_undecodable_message_is_not_delivered_and_not_lost(
    broker: EmbeddedBroker,
) -> None:
    """Until the DLQ exists, a decode error is kept (retried in place), never skipped."""
    await broker.admin.create_topic("orders", partitions=1, consumers=[ConsumerSpec("loyalty")])
    writer = await broker.writer("orders")
    await writer.write(
        [
            OutgoingMessage(value=orjson.dumps(order(4))),
            OutgoingMessage(value=b"{not json"),
            OutgoingMessage(value=orjson.dumps(order(5))),
        ]
    )
    await writer.close()
    async with HandlerServer() as handler:
        config = IntegrationConfig.model_validate(
            {
                "name": "loyalty",
                "owners": ["team-loyalty"],
                "source": {"topic": "orders", "consumer": "loyalty"},
                "pipeline": "city-filter",
                "target": {"url": handler.url},
                "retry": {"tiers": ["50ms"]},
            }
        )
        proxy = Proxy(
            broker,
            {"loyalty": config},
            pipelines_dir=REPO / "pipelines",
            runner_options=RunnerOptions(
                receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=0.5
            ),
        )
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_for(1, timeout_s=10)
        await asyncio.sleep(0.3)
        description = await broker.admin.describe_topic("orders")
        # Offset 0 passed and was delivered; offset 1 cannot be decoded and holds the commit.
        assert description.partitions[0].committed["loyalty"] == 1
        proxy.stop()
        await task
