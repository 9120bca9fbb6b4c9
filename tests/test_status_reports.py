"""A replica's reports for the team console, from a real proxy over the embedded log.

The counts behind the rates are the ones ``/metrics`` shows; a message of a
disabled type counts as filtered; a second report has rates, the first none.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from dlq_viewer.testing import eventually, integration
from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.fleet.sqlite import open_sqlite_state
from nemesis.runtime.app import Proxy
from nemesis.runtime.reports import StatusReporter
from nemesis.runtime.runner import RunnerOptions
from nemesis.testing import HandlerServer

FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2)


async def test_reports_count_deliveries_and_filtered_types_and_reach_the_store(
    tmp_path: Path,
) -> None:
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    state = await open_sqlite_state(tmp_path / "state.db")
    try:
        async with HandlerServer() as handler:
            config = integration(
                "orders-a", ["team-a"], url=handler.url, flags={"disabled_types": ["order.test"]}
            )
            await broker.admin.create_topic(
                "orders", partitions=1, consumers=[ConsumerSpec("orders-a")]
            )
            proxy = Proxy(broker, {"orders-a": config}, runner_options=FAST)
            reporter = StatusReporter(proxy, state, "replica-1", every_s=60)
            running = asyncio.create_task(proxy.run())
            try:
                await eventually(lambda: bool(proxy.snapshot().integrations), timeout_s=30)
                first = reporter.reports()["orders-a"]
                assert first["rates"] is None
                writer = await broker.writer("orders")
                try:
                    await writer.write(
                        [
                            OutgoingMessage(
                                value=orjson.dumps({"n": n}),
                                metadata={"type": "order.test" if n % 3 == 0 else "order.new"},
                            )
                            for n in range(12)
                        ]
                    )
                finally:
                    await writer.close()
                await handler.ledger.wait_for(8, timeout_s=30)
                await eventually(
                    lambda: proxy.metrics.totals("orders-a")["delivered"] == 8, timeout_s=30
                )
                await eventually(
                    lambda: sum(s.skipped for s in proxy.snapshot().integrations[0].flows) == 4,
                    timeout_s=30,
                )
                await reporter.publish()
            finally:
                proxy.stop()
                await running
        [stored] = await state.reports()
        assert (stored.integration, stored.member_id) == ("orders-a", "replica-1")
        report = stored.body
        assert report["state"] == "running"
        assert report["breaker"] == "closed"
        assert report["rates"]["delivered"] > 0
        assert report["rates"]["filtered"] > 0
        assert report["rates"]["dead_lettered"] == 0
        assert proxy.metrics.totals("orders-a") == {
            "delivered": 8.0,
            "filtered": 0.0,  # no pipeline; the 4 disabled ones are the runner's skipped
            "retried": 0.0,
            "dead_lettered": 0.0,
        }
    finally:
        await state.close()
        await broker.close()
