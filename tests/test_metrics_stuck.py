"""A handler that never answers: the stuck-consumer alert fires while commit lag looks flat.

The proxy runs for real against a handler that holds every request. Its
clock is the system clock moved forward a minute at a time (the deliveries
stay in flight meanwhile: their timeout is real time), and ``/metrics`` is
scraped after each minute. The scrapes become promtool's input series at
one-minute steps, and ``promtool test rules`` evaluates the shipped
``NemesisConsumerStuck`` rule over them as Prometheus would: it must fire,
while the lag series it saw stayed flat.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.runtime.app import Proxy, SupervisorOptions
from nemesis.testing import HandlerServer
from tests.operability import (
    DEPLOY,
    FAST,
    SkewClock,
    admin_client,
    humanize_duration,
    integration,
    publish,
    run_promtool,
    running,
    samples,
    value_of,
    wait_until_true,
)

MINUTES = 12
STUCK_FAMILIES = (
    "nemesis_seconds_since_last_read",
    "nemesis_assigned_partitions",
    "nemesis_commit_lag_messages",
    "nemesis_integration_paused",
    "nemesis_breaker_state",
    "nemesis_integration_info",
)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


def series_name(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def render(template: str, labels: dict[str, str], value: float) -> str:
    """The two template forms the stuck alert uses, as Prometheus renders them."""
    text = template.replace("{{ $value | humanizeDuration }}", humanize_duration(value))
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)


async def test_a_handler_that_never_answers_fires_the_stuck_alert_while_lag_is_flat(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    await publish(broker, 200, consumers=["orders"])
    clock = SkewClock()
    scrapes: list[dict[str, list[tuple[dict[str, str], float]]]] = []
    async with HandlerServer() as handler:
        handler.hang()
        config = integration(
            "orders",
            handler.url,
            target={"url": handler.url, "timeout_s": 600},
            delivery={"workers": 4, "buffer": 20},
        )
        proxy = Proxy(
            broker,
            {"orders": config},
            clock=clock,
            runner_options=FAST,
            supervisor_options=SupervisorOptions(lag_refresh_s=3600),  # refreshed by the test
        )
        async with running(proxy), admin_client(proxy) as admin:
            await wait_until_true(lambda: "orders" in proxy.runners)
            runner = proxy.runners["orders"]
            # The workers hold 4 messages the handler never answers; the buffer fills.
            await wait_until_true(lambda: runner.statistics().unfinished == 20)
            await wait_until_true(lambda: handler.pending == 4)
            for _ in range(MINUTES + 1):
                await proxy.lag_monitor.refresh()
                scrapes.append(samples((await admin.get("/metrics")).text))
                clock.skip(60)
                await asyncio.sleep(0.05)
            assert runner.statistics().messages_read == 20  # nothing read in twelve minutes
            handler.release()

    main = {"integration": "orders", "flow": "main"}
    since = [value_of(s, "nemesis_seconds_since_last_read", **main) for s in scrapes]
    lag = [
        sum(v for labels, v in s["nemesis_commit_lag_messages"] if labels["flow"] == "main")
        for s in scrapes
    ]
    # Commit lag looks flat: nothing new is written, nothing is committed.
    assert lag == [200.0] * len(scrapes)
    # Seconds since the last read grow by the minute.
    assert all(later - earlier >= 59 for earlier, later in itertools.pairwise(since))

    # The shipped rule, evaluated by promtool over exactly these scrapes.
    series: dict[str, list[float]] = {}
    for scrape in scrapes:
        for name in STUCK_FAMILIES:
            for labels, value in scrape.get(name, []):
                if labels.get("flow", "main") == "main":
                    series.setdefault(series_name(name, {**labels, "instance": "a"}), []).append(
                        value
                    )
    assert all(len(values) == len(scrapes) for values in series.values()), series
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yaml").read_text())
    [stuck] = [
        r for g in rules["groups"] for r in g["rules"] if r["alert"] == "NemesisConsumerStuck"
    ]
    at = MINUTES
    labels = {"integration": "orders", "flow": "main"}
    expected: dict[str, Any] = {
        # The team comes from the scraped nemesis_integration_info: the YAML's owner.
        "exp_labels": {**labels, "team": "team-orders", **stuck["labels"]},
        "exp_annotations": {
            key: render(text, labels, since[at]) for key, text in stuck["annotations"].items()
        },
    }
    test_file = tmp_path / "stuck.test.yaml"
    test_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(DEPLOY / "prometheus/alerts.yaml")],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [
                            {"series": name, "values": " ".join(repr(v) for v in values)}
                            for name, values in series.items()
                        ],
                        "alert_rule_test": [
                            # Pending (not firing) while under five minutes without a read.
                            {
                                "eval_time": "3m",
                                "alertname": "NemesisConsumerStuck",
                                "exp_alerts": [],
                            },
                            {
                                "eval_time": f"{at}m",
                                "alertname": "NemesisConsumerStuck",
                                "exp_alerts": [expected],
                            },
                        ],
                    }
                ],
            },
            width=10_000,
        )
    )
    tested = run_promtool("test", "rules", str(test_file))
    assert tested.returncode == 0, tested.stdout + tested.stderr


async def test_a_stalled_partition_shows_in_the_flow_status_its_issues_and_a_gauge(
    broker: EmbeddedBroker,
) -> None:
    # The embedded log never stalls a partition; YDB parks one it cannot decode
    # (tests/test_ydb_streams.py). Here its reader says so, and everything above shows it.
    await publish(broker, 10, consumers=["orders"])
    async with HandlerServer() as handler:
        proxy = Proxy(broker, {"orders": integration("orders", handler.url)}, runner_options=FAST)
        async with running(proxy), admin_client(proxy) as admin:
            await wait_until_true(lambda: "orders" in proxy.runners)
            await handler.ledger.wait_for(10, timeout_s=10)
            reader = proxy.runners["orders"]._source
            assert reader is not None
            why = "orders[2] offset 7 is compressed with LZOP: the partition is parked"
            reader.stalled = lambda: {("orders", 2): why}  # type: ignore[method-assign]
            status = (await admin.get("/integrations/orders")).json()
            scrape = samples((await admin.get("/metrics")).text)
    [main] = [flow for flow in status["flows"] if flow["flow"] == "main"]
    assert main["stalled_partitions"] == [{"topic": "orders", "partition": 2, "reason": why}]
    assert status["issues"] == {"main": why}
    assert value_of(scrape, "nemesis_stalled_partitions", integration="orders", flow="main") == 1
