"""``/metrics`` scraped while traffic flows: every family of docs/design.md (section 8), sane.

Also checked against the scrape: ``promtool check metrics``; the Grafana
dashboard (it parses, has a row per concern, and every expression is valid
PromQL naming only metrics the proxy exports); the alert rules
(``promtool check rules`` and their unit tests, and every metric they name
is exported).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from nemesis.broker.embedded import open_embedded
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.dlq import open_sqlite_dlq
from nemesis.fleet.member import FleetMember
from nemesis.fleet.sqlite import open_sqlite_state
from nemesis.metrics import FLEET_STATE_OPERATIONS, Metrics
from nemesis.runtime.app import Proxy, SupervisorOptions
from nemesis.runtime.reload import ConfigReloader
from nemesis.testing import HandlerServer, LedgerEntry
from tests.operability import (
    DEPLOY,
    FAST,
    admin_client,
    integration,
    publish,
    run_promtool,
    running,
    samples,
    value_of,
)

COUNT = 2000
BUFFER = 300
RATE_MAIN = 5000.0

# Every family a running proxy exports, by the concern it covers (docs/design.md, section 8).
FAMILIES = {
    "reads": ["nemesis_messages_read", "nemesis_seconds_since_last_read"],
    "lag": ["nemesis_commit_lag_messages", "nemesis_commit_lag_seconds"],
    "buffers": [
        "nemesis_buffered_messages",
        "nemesis_in_flight_messages",
        "nemesis_delayed_messages",
        "nemesis_keys_halted",
        "nemesis_unfinished_messages",
        "nemesis_uncommitted_messages",
        "nemesis_buffer_capacity",
        "nemesis_paused_partitions",
        "nemesis_assigned_partitions",
    ],
    "stages": ["nemesis_stage_duration_seconds", "nemesis_stage_messages"],
    "delivery": [
        "nemesis_delivery_duration_seconds",
        "nemesis_delivery_age_seconds",
        "nemesis_deliveries",
        "nemesis_delivery_batch_size",
        "nemesis_retries_in_place",
    ],
    "retries and dlq": [
        "nemesis_retry_publishes",
        "nemesis_dlq_writes",
        "nemesis_dlq_waiting_messages",
        "nemesis_retry_tier_delay_seconds",
    ],
    "breaker": [
        "nemesis_breaker_state",
        "nemesis_breaker_transitions",
        "nemesis_breaker_state_seconds",
    ],
    "rate limits": [
        "nemesis_rate_limit_wait_seconds",
        "nemesis_rate_limit_messages_per_second",
        "nemesis_rate_limit_waiting",
    ],
    "workers": [
        "nemesis_workers",
        "nemesis_workers_busy",
        "nemesis_workers_configured",
        "nemesis_runner_state",
        "nemesis_flow_restarts",
    ],
    "commits": [
        "nemesis_commits",
        "nemesis_committed_messages",
        "nemesis_seconds_since_last_commit",
    ],
    "configuration": [
        "nemesis_config_reloads",
        "nemesis_config_invalid_files",
        "nemesis_config_last_reload_success_timestamp_seconds",
        "nemesis_config_override",
        "nemesis_integration_paused",
        "nemesis_integration_info",
        "nemesis_disabled_type_skips",
        "nemesis_workers_recommended",
        "nemesis_lag_refresh_age_seconds",
        "nemesis_lag_refresh_failures",
    ],
    "process": [
        "process_cpu_seconds",
        "process_resident_memory_bytes",
        "process_open_fds",
        "python_info",
        "nemesis_build_info",
    ],
}


def n_of(entry: LedgerEntry) -> int:
    return int(json.loads(entry.body)["n"])


class Scrapes(NamedTuple):
    """Two scrapes of a proxy delivering messages: while they flow, and after they finished."""

    flowing: str
    after: str
    running_s: float  # how long the proxy had run at the first scrape

    def texts(self) -> tuple[str, str]:
        return self.flowing, self.after


async def _scrape_under_traffic(root: Path) -> Scrapes:
    """Two scrapes of a proxy delivering messages: while they flow, and after they finished."""
    broker = await open_embedded(EmbeddedBackendConfig(path=str(root / "log.db")))
    dlq = await open_sqlite_dlq(root / "dlq.db")
    try:
        await publish(broker, COUNT, consumers=["it"])
        async with HandlerServer() as handler:
            handler.delay(0.01)
            # A tenth fails once (retry tier 1), a fiftieth breaks the contract (DLQ).
            handler.when(lambda e: e.id is not None and n_of(e) % 50 == 1, status=422)
            handler.when(lambda e: n_of(e) % 10 == 0 and e.receipt == 1, status=503)
            config = integration(
                "it",
                handler.url,
                delivery={"workers": 4, "buffer": BUFFER},
                pipeline=[{"filter": {"name": "below-1800", "match": {"n": {"lt": 1800}}}}],
                rate_limits={"main": RATE_MAIN, "retry": 100},
                breaker={"min_requests": 100_000},
            )
            proxy = Proxy(
                broker,
                {"it": config},
                dlq=dlq,
                metrics=Metrics(process=True),
                runner_options=FAST,
                supervisor_options=SupervisorOptions(lag_refresh_s=0.2),
            )
            # As in `nemesis run`: its reload and fleet metrics are on the same registry.
            reloader = ConfigReloader(proxy, root / "integrations", watch=False)
            state = await open_sqlite_state(root / "state.db")
            fleet = FleetMember(state, proxy, metrics=proxy.metrics)
            await fleet.join()
            started = time.monotonic()
            async with running(proxy), admin_client(proxy, reloader=reloader) as admin:
                await handler.ledger.wait_until(lambda led: len(led) >= 300, timeout_s=30)
                await proxy.lag_monitor.refresh()
                flowing = (await admin.get("/metrics")).text
                running_s = time.monotonic() - started
                assert len(handler.ledger.done_ids()) < COUNT * 0.9, "traffic was over"
                await handler.ledger.wait_until(
                    lambda led: len(led.done_ids()) >= 1800 - 1800 // 50, timeout_s=60
                )
                await asyncio.sleep(0.5)
                await proxy.lag_monitor.refresh()
                after = (await admin.get("/metrics")).text
            await fleet.leave()
            await state.close()
        return Scrapes(flowing, after, running_s)
    finally:
        await dlq.close()
        await broker.close()


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Scrapes:
    return asyncio.run(_scrape_under_traffic(tmp_path_factory.mktemp("scrape")))


@pytest.fixture(scope="module")
def exported(scrapes: Scrapes) -> set[str]:
    """Every metric name the proxy exports: families and their sample suffixes."""
    names: set[str] = set()
    for family in text_string_to_metric_families(scrapes.flowing):
        names.add(family.name)
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"),
            "info": ("_info",),
        }.get(family.type, ())
        names.update(family.name + suffix for suffix in suffixes)
    return names


@pytest.mark.slow
def test_every_family_is_exported_while_traffic_flows(exported: set[str]) -> None:
    missing = {
        concern: [name for name in names if name not in exported]
        for concern, names in FAMILIES.items()
    }
    assert {concern: names for concern, names in missing.items() if names} == {}


def test_the_values_are_sane(scrapes: Scrapes) -> None:
    flowing, after = (samples(text) for text in scrapes.texts())
    main = {"integration": "it", "flow": "main"}
    read = value_of(flowing, "nemesis_messages_read_total", integration="it", topic="orders")
    assert 0 < read <= COUNT
    assert value_of(flowing, "nemesis_workers", **main) == 4
    assert value_of(flowing, "nemesis_keys_halted", **main) == 0  # unordered: never halts
    assert value_of(flowing, "nemesis_workers_configured", integration="it") == 4
    assert 0 <= value_of(flowing, "nemesis_workers_busy", **main) <= 4
    since_read = value_of(flowing, "nemesis_seconds_since_last_read", **main)
    assert 0 <= since_read <= scrapes.running_s  # it has read since it started
    assert 0 <= value_of(flowing, "nemesis_in_flight_messages", **main) <= 4
    for name in ("nemesis_buffered_messages", "nemesis_unfinished_messages"):
        assert 0 <= value_of(flowing, name, **main) <= BUFFER
    assert value_of(flowing, "nemesis_buffer_capacity", integration="it") == BUFFER
    assert value_of(flowing, "nemesis_assigned_partitions", **main) == 4
    assert value_of(flowing, "nemesis_runner_state", **main, state="running") == 1
    assert value_of(flowing, "nemesis_runner_state", **main, state="paused") == 0
    # While flowing, some partition is behind; lag in messages and seconds agree.
    lag = [v for labels, v in flowing["nemesis_commit_lag_messages"] if labels["flow"] == "main"]
    ages = [v for labels, v in flowing["nemesis_commit_lag_seconds"] if labels["flow"] == "main"]
    assert len(lag) == len(ages) == 4
    assert 0 < sum(lag) <= COUNT
    assert all(0 <= age < 60 for age in ages)
    assert max(ages) > 0
    # After: everything committed, nothing behind.
    lag_after = [
        v for labels, v in after["nemesis_commit_lag_messages"] if labels["flow"] == "main"
    ]
    assert sum(lag_after) == 0
    assert value_of(after, "nemesis_commit_lag_seconds", **main, partition="0", topic="orders") == 0
    assert sum(v for _, v in after["nemesis_committed_messages_total"]) >= COUNT
    # Deliveries, by outcome: delivered, retried once (a tenth), dead (a fiftieth).
    outcomes: dict[str, float] = {}
    for labels, value in after["nemesis_deliveries_total"]:
        outcomes[labels["outcome"]] = outcomes.get(labels["outcome"], 0) + value
    assert outcomes["dead"] == 1800 // 50
    assert outcomes["retry"] >= 1800 // 10 - 1800 // 50
    assert value_of(after, "nemesis_dlq_writes_total", integration="it", reason="http_4xx") == 36
    assert value_of(after, "nemesis_retry_publishes_total", integration="it", tier="1") > 0
    # Request durations by the same outcomes, one request per message (no batches here).
    requests = {
        labels["outcome"]: value
        for labels, value in after["nemesis_delivery_duration_seconds_count"]
        if labels["integration"] == "it"
    }
    assert requests == outcomes
    for outcome in outcomes:
        p_sum = value_of(after, "nemesis_delivery_duration_seconds_sum", outcome=outcome)
        assert 0.01 <= p_sum / requests[outcome] < 1  # the handler answers after 10 ms
    # Ages, once per accepted message, by the flow that delivered it: on the main flow
    # all below 1800 but the 36 dead and the 180 that failed once; those on retry tier 1.
    accepted = {"main": 1800 - 36 - 180, "retry-1": 180}
    for flow, count in accepted.items():
        labels = {"integration": "it", "flow": flow}
        assert value_of(after, "nemesis_delivery_age_seconds_count", **labels) == count
        age_sum = value_of(after, "nemesis_delivery_age_seconds_sum", **labels)
        assert 0.01 <= age_sum / count < 60  # at least the handler's 10 ms
    # The pipeline filtered the 200 messages at 1800 and above.
    filtered = value_of(
        after,
        "nemesis_stage_messages_total",
        integration="it",
        stage="below-1800",
        outcome="filtered",
    )
    assert filtered == 200
    assert value_of(after, "nemesis_breaker_state", integration="it") == 0
    limit = value_of(after, "nemesis_rate_limit_messages_per_second", integration="it", flow="main")
    assert limit == RATE_MAIN
    assert value_of(after, "nemesis_retry_tier_delay_seconds", integration="it", tier="1") == 0.2
    assert value_of(after, "process_resident_memory_bytes") > 10_000_000
    assert value_of(after, "nemesis_build_info")
    # The owning team, from the YAML's owners, on one info series per integration.
    for scrape in (flowing, after):
        assert scrape["nemesis_integration_info"] == [({"integration": "it", "team": "team-it"}, 1)]


def test_promtool_accepts_the_scrape(scrapes: Scrapes) -> None:
    for text in scrapes.texts():
        checked = run_promtool("check", "metrics", stdin=text)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.strip() == ""
        assert checked.stderr.strip() == ""


def test_no_label_value_is_unbounded(scrapes: Scrapes) -> None:
    allowed = {
        "integration",
        "flow",
        "topic",
        "partition",
        "stage",
        "tier",
        "outcome",
        "status",
        "reason",
        "state",
        "from_state",
        "to_state",
        "type",
        "field",
        "result",
        "le",
        "version",
        "generation",
        "implementation",
        "major",
        "minor",
        "patchlevel",
        "operation",  # the fleet's state store calls: a fixed set
        "team",  # the first of an integration's owners: one per integration
    }
    for text in scrapes.texts():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                assert set(sample.labels) <= allowed, (sample.name, sample.labels)
                if "operation" in sample.labels:
                    assert sample.labels["operation"] in FLEET_STATE_OPERATIONS
                # No message ids (topic:partition:offset) and no URLs in values.
                for value in sample.labels.values():
                    assert "://" not in value
                    assert not re.fullmatch(r".+:\d+:\d+", value)


# --- the dashboard ------------------------------------------------------------------

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "nemesis.json"
CONCERNS = [
    "Throughput",
    "Lag",
    "Stuck detection",
    "Pipeline stages",
    "Retries and DLQ",
    "Circuit breaker",
    "Rate limits",
]
_GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$integration": ".*",
}
_METRIC = re.compile(r"\b((?:nemesis|process|python)_[a-z0-9_]+)\b")


def dashboard_panels() -> Iterator[dict[str, Any]]:
    document = json.loads(DASHBOARD.read_text())
    for panel in document["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_expressions() -> list[str]:
    expressions = []
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            expression = target["expr"]
            for variable, value in _GRAFANA_VARIABLES.items():
                expression = expression.replace(variable, value)
            expressions.append(expression)
    return expressions


def test_the_dashboard_has_a_row_per_concern_and_valid_panels() -> None:
    document = json.loads(DASHBOARD.read_text())
    rows = [panel["title"] for panel in document["panels"] if panel["type"] == "row"]
    assert all(concern in rows for concern in CONCERNS), rows
    variables = {v["name"] for v in document["templating"]["list"]}
    assert variables == {"datasource", "team", "integration"}
    # A team picks its integrations: the team's owners, from nemesis_integration_info.
    [integration] = [v for v in document["templating"]["list"] if v["name"] == "integration"]
    assert integration["query"]["query"] == (
        'label_values(nemesis_integration_info{team=~"$team"}, integration)'
    )
    ids = [panel["id"] for panel in dashboard_panels()]
    assert len(ids) == len(set(ids))
    for panel in dashboard_panels():
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_every_dashboard_expression_names_an_exported_metric(exported: set[str]) -> None:
    expressions = dashboard_expressions()
    assert len(expressions) > 30
    for expression in expressions:
        names = set(_METRIC.findall(expression))
        assert names, expression
        assert names <= exported, (expression, names - exported)


def test_every_dashboard_expression_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses expressions in rule files: one recording rule per expression.
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expression_{i}", "expr": expression}
                    for i, expression in enumerate(dashboard_expressions())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    checked = run_promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --- the alert rules ----------------------------------------------------------------

ALERTS = DEPLOY / "prometheus" / "alerts.yaml"


@pytest.mark.slow
def test_the_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    checked = run_promtool("check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run_promtool("test", "rules", str(ALERTS.with_name("alerts.test.yaml")))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {
        rule["alert"]
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for rule in group["rules"]
    }
    required = {
        "NemesisConsumerStuck",
        "NemesisLagGrowing",
        "NemesisDlqGrowing",
        "NemesisBreakerOpen",
        "NemesisRetryTierBacklog",
        "NemesisKeyHalted",
    }
    assert required <= alerts
    # Every alert has a unit test.
    tests = yaml.safe_load(ALERTS.with_name("alerts.test.yaml").read_text())["tests"]
    tested_alerts = {case["alertname"] for test in tests for case in test["alert_rule_test"]}
    assert tested_alerts == alerts


def test_every_alert_names_exported_metrics(exported: set[str]) -> None:
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            names = set(_METRIC.findall(rule["expr"]))
            assert names <= exported, (rule["alert"], names - exported)


def test_every_per_integration_alert_carries_the_team() -> None:
    """Each rule with an integration label joins the team, and falls back to the same condition."""
    form = re.compile(
        r"\(\s*(?P<condition>.+?)\s*\)\s*"
        r"\* on \(integration\) group_left \(team\)"
        r" max by \(integration, team\) \(nemesis_integration_info\)\s*"
        r"or on \(integration\)\s*"
        r"label_replace\(\s*(?P<fallback>.+?)\s*, \"team\", \"unknown\", \"\", \"\"\s*\)\s*",
        re.DOTALL,
    )
    joined = set()
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            if "$labels.integration" not in rule["annotations"]["summary"]:
                continue
            matched = form.fullmatch(rule["expr"])
            assert matched, rule["alert"]
            assert matched["condition"] == matched["fallback"], rule["alert"]
            joined.add(rule["alert"])
    assert len(joined) == 12  # every per-integration rule of alerts.yaml
