"""The admin API over a running proxy: health, readiness, auth, 422s, drift and reload status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from annotated_types import Ge, Le

from nemesis.admin import schemas
from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.models import BatchConfig, DeliveryConfig, EmbeddedBackendConfig
from nemesis.config.overrides import LIVE_FIELDS
from nemesis.runtime.app import Proxy, SupervisorOptions
from nemesis.runtime.reload import ConfigReloader
from nemesis.runtime.sizing import size_for
from nemesis.testing import HandlerServer
from tests.operability import (
    AUTH,
    FAST,
    admin_client,
    integration,
    integration_yaml,
    publish,
    running,
    wait_until_true,
)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


@pytest.fixture
async def handler() -> AsyncIterator[HandlerServer]:
    async with HandlerServer() as server:
        yield server


def setting(status: dict[str, Any], field: str) -> dict[str, Any]:
    found: dict[str, Any] = next(s for s in status["settings"] if s["field"] == field)
    return found


async def test_health_and_readiness_follow_the_proxy(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    proxy = Proxy(broker, {"it": integration("it", handler.url)}, runner_options=FAST)
    async with admin_client(proxy) as admin:
        assert (await admin.get("/healthz")).json() == {"status": "ok"}
        before = await admin.get("/readyz")
        assert before.status_code == 503
        assert before.json()["reasons"] == ["starting"]
        async with running(proxy):
            ready = await admin.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert ready.json() == {"status": "ready", "reasons": [], "integrations": 1}
            proxy.stop()
            stopping = await admin.get("/readyz")
            assert stopping.status_code == 503
            assert "stopping" in stopping.json()["reasons"][0]


async def test_changes_need_the_token(broker: EmbeddedBroker, handler: HandlerServer) -> None:
    proxy = Proxy(broker, {"it": integration("it", handler.url)}, runner_options=FAST)
    body = {"delivery": {"workers": 3}}
    async with admin_client(proxy) as admin:
        missing = await admin.patch("/integrations/it", json=body)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = await admin.patch(
            "/integrations/it", json=body, headers={"authorization": "Bearer nope"}
        )
        assert wrong.status_code == 403
        for path in ("/integrations/it/pause", "/config/reload"):
            assert (await admin.post(path)).status_code == 401
        assert (await admin.delete("/integrations/it/overrides")).status_code == 401
        assert proxy.integrations["it"].delivery.workers == 8  # nothing changed
        allowed = await admin.patch("/integrations/it", json=body, headers=AUTH)
        assert allowed.status_code == 200, allowed.text
    async with admin_client(proxy, token=None) as read_only:
        refused = await read_only.patch("/integrations/it", json=body, headers=AUTH)
        assert refused.status_code == 403
        assert "not configured" in refused.json()["detail"]
        assert (await read_only.get("/integrations/it")).status_code == 200


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"delivery": {"workers": 0}}, ["body", "delivery", "workers"]),
        ({"delivery": {"workers": 5000}}, ["body", "delivery", "workers"]),
        ({"delivery": {"workers": "many"}}, ["body", "delivery", "workers"]),
        ({"delivery": {"wokers": 4}}, ["body", "delivery", "wokers"]),
        (
            {"delivery": {"batch": {"max_wait_ms": -1}}},
            ["body", "delivery", "batch", "max_wait_ms"],
        ),
        ({"rate_limits": {"main": 0}}, ["body", "rate_limits", "main"]),
        ({"rate_limits": {"dlq": 5}}, ["body", "rate_limits", "dlq"]),
        ({"flags": {"disabled_types": "order.test"}}, ["body", "flags", "disabled_types"]),
        ({"paused": "sometimes"}, ["body", "paused"]),
        # The schema says boolean and integer: no 0 for false, no "4" or 4.0 for 4.
        ({"paused": 0}, ["body", "paused"]),
        ({"paused": 1}, ["body", "paused"]),
        ({"paused": "true"}, ["body", "paused"]),
        ({"delivery": {"workers": "4"}}, ["body", "delivery", "workers"]),
        ({"delivery": {"workers": 4.0}}, ["body", "delivery", "workers"]),
        ({"delivery": {"batch": {"size": True}}}, ["body", "delivery", "batch", "size"]),
        ({"rate_limits": {"main": "5"}}, ["body", "rate_limits", "main"]),
        # Fits the field, not the configuration: the buffer (500) cannot hold a batch of 600.
        (
            {"delivery": {"workers": 4, "batch": {"size": 600}}},
            ["body", "delivery", "batch", "size"],
        ),
        ({"delivery": {"buffer": 5, "batch": {"size": 10}}}, ["body", "delivery", "buffer"]),
    ],
)
async def test_invalid_values_get_a_422_naming_the_field(
    broker: EmbeddedBroker, handler: HandlerServer, body: dict[str, Any], loc: list[str]
) -> None:
    proxy = Proxy(broker, {"it": integration("it", handler.url)}, runner_options=FAST)
    async with admin_client(proxy) as admin:
        answer = await admin.patch("/integrations/it", json=body, headers=AUTH)
        assert answer.status_code == 422, answer.text
        locs = [error["loc"] for error in answer.json()["detail"]]
        assert loc in locs, locs
        if body == {"delivery": {"workers": 4, "batch": {"size": 600}}}:
            assert ["body", "delivery", "workers"] not in locs  # not part of the rule broken
    assert proxy.integrations["it"] == integration("it", handler.url)  # nothing applied


async def test_unknown_integrations_and_fields(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    proxy = Proxy(broker, {"it": integration("it", handler.url)}, runner_options=FAST)
    async with admin_client(proxy) as admin:
        assert (await admin.get("/integrations/nope")).status_code == 404
        patched = await admin.patch("/integrations/nope", json={"paused": True}, headers=AUTH)
        assert patched.status_code == 404
        assert (await admin.get("/integrations/Not_A_Name")).status_code == 422
        bad_field = await admin.delete("/integrations/it/overrides/target.url", headers=AUTH)
        assert bad_field.status_code == 422
        assert bad_field.json()["detail"][0]["loc"] == ["path", "field"]


async def test_status_reports_sources_drift_and_clearing(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    await publish(broker, 100, consumers=["it"])
    config = integration(
        "it", handler.url, delivery={"workers": 8, "buffer": 500}, rate_limits={"main": 100}
    )
    proxy = Proxy(broker, {"it": config}, runner_options=FAST)
    async with running(proxy), admin_client(proxy) as admin:
        await handler.ledger.wait_for(100)
        status = (await admin.get("/integrations/it")).json()
        assert status["state"] == "running"
        assert setting(status, "delivery.workers") == {
            "field": "delivery.workers",
            "value": 8,
            "source": "yaml",
            "yaml": 8,
            "drift": False,
        }
        assert setting(status, "delivery.batch.size")["source"] == "default"
        assert setting(status, "rate_limits.main")["value"] == 100
        assert status["drift"] == []
        assert {s["field"] for s in status["settings"]} == set(LIVE_FIELDS)
        assert [f["flow"] for f in status["flows"]] == ["main"]
        assert status["flows"][0]["topic"] == "orders"
        assert status["breaker"]["state"] == "closed"
        assert status["sizing"]["configured_workers"] == 8

        patched = await admin.patch(
            "/integrations/it",
            json={"delivery": {"workers": 16}, "rate_limits": {"main": None}, "paused": False},
            headers=AUTH,
        )
        status = patched.json()
        assert setting(status, "delivery.workers") == {
            "field": "delivery.workers",
            "value": 16,
            "source": "override",
            "yaml": 8,
            "drift": True,
        }
        # null lifts the limit; "not paused" is what the YAML says already: no drift.
        assert setting(status, "rate_limits.main")["value"] is None
        assert {s["field"] for s in status["drift"]} == {"delivery.workers", "rate_limits.main"}
        assert status["flows"][0]["workers"] == 16
        assert proxy.groups["it"].limits.statistics()

        cleared = await admin.delete("/integrations/it/overrides/delivery.workers", headers=AUTH)
        assert [s["field"] for s in cleared.json()["drift"]] == ["rate_limits.main"]
        assert cleared.json()["flows"][0]["workers"] == 8
        everything = await admin.delete("/integrations/it/overrides", headers=AUTH)
        assert everything.json()["drift"] == []
        assert setting(everything.json(), "rate_limits.main")["value"] == 100

        listed = (await admin.get("/integrations")).json()["integrations"]
        assert [i["name"] for i in listed] == ["it"]


async def test_an_override_ends_when_the_yaml_catches_up(
    broker: EmbeddedBroker, handler: HandlerServer, tmp_path: Path
) -> None:
    await publish(broker, 10, consumers=["it"])
    directory = tmp_path / "integrations"
    directory.mkdir()
    file = directory / "it.yaml"
    file.write_text(integration_yaml("it", handler.url, workers=8))
    config = integration("it", handler.url)
    proxy = Proxy(broker, {"it": config}, integration_files={"it": file}, runner_options=FAST)
    reloader = ConfigReloader(proxy, directory, watch=False)
    async with running(proxy), admin_client(proxy, reloader=reloader) as admin:
        await admin.patch(
            "/integrations/it", json={"delivery": {"workers": 12, "buffer": 600}}, headers=AUTH
        )
        # The pull request lands with workers 12; the buffer override is still drift.
        file.write_text(integration_yaml("it", handler.url, workers=12))
        reloaded = await admin.post("/config/reload", headers=AUTH)
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json()["applied"] == {"it": ["delivery.workers"]}
        status = (await admin.get("/integrations/it")).json()
        assert setting(status, "delivery.workers")["source"] == "yaml"
        assert [s["field"] for s in status["drift"]] == ["delivery.buffer"]
        await wait_until_true(lambda: proxy.runners["it"].statistics().workers == 12)
        config_status = (await admin.get("/config")).json()
        assert config_status["watching"] is False
        assert config_status["last_reload"]["trigger"] == "api"
        assert config_status["last_reload"]["ok"] is True


async def test_metrics_endpoint_and_sizing(broker: EmbeddedBroker, handler: HandlerServer) -> None:
    await publish(broker, 10, consumers=["it"])
    proxy = Proxy(broker, {"it": integration("it", handler.url)}, runner_options=FAST)
    async with running(proxy), admin_client(proxy) as admin:
        await wait_until_true(lambda: "it" in proxy.runners)
        scrape = await admin.get("/metrics")
        assert scrape.status_code == 200
        assert scrape.headers["content-type"].startswith("text/plain")
        assert 'nemesis_workers{flow="main",integration="it"} 8.0' in scrape.text
        figure = await admin.get("/sizing", params={"rps": 2000, "latency_ms": 80})
        expected = size_for(2000, 0.08)
        assert figure.json()["workers"] == expected.workers == 240
        assert figure.json()["buffer"] == expected.buffer
        assert (await admin.get("/sizing", params={"rps": -1, "latency_ms": 5})).status_code == 422


def test_patch_bounds_agree_with_the_configuration_models() -> None:
    def bounds(model: type[Any], name: str) -> tuple[object, object]:
        metadata = model.model_fields[name].metadata
        low = next(m.ge for m in metadata if isinstance(m, Ge))
        high = next(m.le for m in metadata if isinstance(m, Le))
        return low, high

    def patch_bounds(model: type[Any], name: str) -> tuple[object, object]:
        schema = model.model_json_schema()["properties"][name]["anyOf"][0]
        return schema["minimum"], schema["maximum"]

    for config_model, patch_model, name in [
        (DeliveryConfig, schemas.DeliveryPatch, "workers"),
        (DeliveryConfig, schemas.DeliveryPatch, "buffer"),
        (BatchConfig, schemas.BatchPatch, "size"),
        (BatchConfig, schemas.BatchPatch, "max_wait_ms"),
    ]:
        assert bounds(config_model, name) == patch_bounds(patch_model, name), name


async def test_the_live_sizing_figure_stands_beside_the_configured_workers(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    await publish(broker, 5000, consumers=["it"])
    handler.delay(0.02)
    config = integration("it", handler.url, delivery={"workers": 4, "buffer": 200})
    proxy = Proxy(
        broker,
        {"it": config},
        runner_options=FAST,
        supervisor_options=SupervisorOptions(lag_refresh_s=0.5),
    )
    async with admin_client(proxy) as admin:
        async with running(proxy):
            await wait_until_true(lambda: proxy.groups["it"].sizing.estimate() is not None, 20)
        # Stopped: the figure no longer moves between the two reads.
        status = (await admin.get("/integrations/it")).json()
        scrape = (await admin.get("/metrics")).text
    rates, sizing = status["rates"], status["sizing"]
    # Four workers at 20 ms or more each: at most 200 delivered a second (fewer on a
    # busy host), while 5000 wait.
    assert 0 < rates["delivered_per_s"] <= 200
    assert rates["latency_ms"] >= 20
    demand = max(rates["delivered_per_s"], rates["produced_per_s"] or 0)
    expected = size_for(demand, rates["latency_ms"] / 1000)
    assert sizing["configured_workers"] == 4
    assert sizing["recommended_workers"] == expected.workers
    assert sizing["recommended_buffer"] == expected.buffer
    assert f'nemesis_workers_recommended{{integration="it"}} {expected.workers}.0' in scrape
