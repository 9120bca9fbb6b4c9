"""Configuration reload while the proxy runs: files added, changed, broken and removed.

In process with the real file watch (watchfiles) on a folder under tmp_path,
and through the real CLI with SIGHUP.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.loader import load_integrations
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.metrics import Metrics
from nemesis.runtime.app import Proxy
from nemesis.runtime.reload import ConfigReloader
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, stop_gracefully
from tests.operability import (
    AUTH,
    FAST,
    admin_client,
    committed,
    integration_yaml,
    publish,
    reloading,
    running,
    wait_until_true,
)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


def proxy_from(
    broker: EmbeddedBroker,
    directory: Path,
    metrics: Metrics | None = None,
    pipelines_dir: Path | None = None,
) -> tuple[Proxy, ConfigReloader]:
    """A proxy started from a directory the way ``nemesis run`` starts it, and its reloader."""
    integrations, problems = load_integrations(directory)
    proxy = Proxy(
        broker,
        integrations,
        pipelines_dir=pipelines_dir or directory.parent / "pipelines",
        integration_files={name: directory / f"{name}.yaml" for name in integrations},
        metrics=metrics,
        runner_options=FAST,
    )
    reloader = ConfigReloader(
        proxy, directory, watch=True, debounce_ms=50, initial_problems=problems
    )
    return proxy, reloader


async def test_files_added_broken_changed_and_removed_while_running(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    await publish(broker, 300, consumers=["alpha", "beta"])
    directory = tmp_path / "integrations"
    directory.mkdir()
    metrics = Metrics()
    async with HandlerServer() as alpha_handler, HandlerServer() as beta_handler:
        (directory / "alpha.yaml").write_text(integration_yaml("alpha", alpha_handler.url))
        proxy, reloader = proxy_from(broker, directory, metrics)
        async with (
            running(proxy),
            reloading(reloader, watched=directory),
            admin_client(proxy, reloader=reloader) as admin,
        ):
            await alpha_handler.ledger.wait_for(300, timeout_s=30)
            assert "beta" not in proxy.groups

            # A new file starts its integration.
            beta_file = directory / "beta.yaml"
            beta_file.write_text(integration_yaml("beta", beta_handler.url, workers=4))
            await beta_handler.ledger.wait_for(300, timeout_s=30)
            beta = proxy.groups["beta"]
            runner = beta.runners["main"]
            assert reloader.last is not None
            assert reloader.last.added == ["beta"]
            scrape = (await admin.get("/metrics")).text
            assert 'nemesis_integration_info{integration="beta",team="team-beta"} 1.0' in scrape

            # A broken file is reported with its line and field, and ignored.
            beta_file.write_text(
                integration_yaml("beta", beta_handler.url, workers=4).replace(
                    "workers: 4", "workers: 0"
                )
            )
            await wait_until_true(lambda: bool(proxy.groups["beta"].problems), timeout_s=10)
            assert proxy.groups["beta"] is beta
            assert beta.runners["main"] is runner
            assert runner.statistics().state.value == "running"
            config_status = (await admin.get("/config")).json()["last_reload"]
            assert config_status["ok"] is False
            assert config_status["kept"] == ["beta"]
            [problem] = config_status["problems"]
            assert (problem["file"], problem["line"], problem["field"]) == (
                str(beta_file),
                5,
                "delivery.workers",
            )
            status = (await admin.get("/integrations/beta")).json()
            assert status["problems"][0]["field"] == "delivery.workers"
            assert status["state"] == "running"
            scrape = (await admin.get("/metrics")).text
            assert "nemesis_config_invalid_files 1.0" in scrape
            # The last good configuration still delivers.
            await publish(broker, 40, start=300)
            await beta_handler.ledger.wait_for(340, timeout_s=30)

            # A live field changes without a restart.
            beta_file.write_text(integration_yaml("beta", beta_handler.url, workers=3))
            await wait_until_true(lambda: beta.runners["main"].statistics().workers == 3)
            assert proxy.groups["beta"] is beta
            assert beta.runners["main"] is runner
            assert beta.problems == []
            assert reloader.last is not None
            assert reloader.last.applied == {"beta": ["delivery.workers"]}

            # The target changes: beta alone restarts (alpha's runner stays).
            alpha_runner = proxy.groups["alpha"].runners["main"]
            beta_file.write_text(
                integration_yaml("beta", beta_handler.url, workers=3).replace(
                    "timeout_s: 5", "timeout_s: 7"
                )
            )
            await wait_until_true(lambda: proxy.groups["beta"] is not beta, timeout_s=10)
            assert proxy.groups["beta"].config.target.timeout_s == 7
            assert proxy.groups["alpha"].runners["main"] is alpha_runner

            # A removed file drains and stops its integration: what was in flight finishes.
            beta_handler.delay(0.3)
            await publish(broker, 60, start=340)
            await wait_until_true(lambda: beta_handler.pending > 0, timeout_s=10)
            beta_file.unlink()
            await wait_until_true(lambda: "beta" not in proxy.groups, timeout_s=15)
            assert beta_handler.pending == 0
            delivered_to_beta = len(beta_handler.ledger.done_ids())
            assert await committed(broker, "beta") == delivered_to_beta
            await asyncio.sleep(0.5)
            assert len(beta_handler.ledger.done_ids()) == delivered_to_beta
            assert reloader.last is not None
            assert reloader.last.removed == ["beta"]
            scrape = (await admin.get("/metrics")).text
            assert 'integration="beta"' not in scrape
            assert 'integration="alpha"' in scrape
            # The owning team goes with the integration; alpha's stays.
            assert 'nemesis_integration_info{integration="alpha",team="team-alpha"} 1.0' in scrape
            assert (await admin.get("/integrations/beta")).status_code == 404
    assert beta_handler.ledger.duplicates() == {}
    assert alpha_handler.ledger.duplicates() == {}


async def test_a_file_whose_pipeline_does_not_build_is_reported_and_not_started(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    directory = tmp_path / "integrations"
    directory.mkdir()
    async with HandlerServer() as handler:
        (directory / "alpha.yaml").write_text(integration_yaml("alpha", handler.url))
        proxy, reloader = proxy_from(broker, directory)
        (directory / "beta.yaml").write_text(
            integration_yaml("beta", handler.url, extra="pipeline: no-such-pipeline\n")
        )
        report = await reloader.reload("api")
        assert "beta" not in proxy.groups
        assert report.added == []
        assert [p.field for p in report.problems] == ["pipeline"]
        assert "no-such-pipeline" in report.problems[0].message
        # Fixed: the next reload starts it.
        (directory / "beta.yaml").write_text(integration_yaml("beta", handler.url))
        assert (await reloader.reload("api")).added == ["beta"]
        # A change that needs a restart but does not build leaves the running one alone.
        alpha = proxy.groups["alpha"]
        (directory / "alpha.yaml").write_text(
            integration_yaml("alpha", handler.url, extra="pipeline: no-such-pipeline\n")
        )
        report = await reloader.reload("api")
        assert proxy.groups["alpha"] is alpha
        assert report.restarted == {}
        assert report.kept == ["alpha"]
        assert [p.field for p in alpha.problems] == ["pipeline"]


def numbers_filter(bounds: str) -> str:
    """A pipeline file passing the messages ``{"n": n}`` whose n is within ``bounds``."""
    return f"description: some numbers\nstages:\n  - filter:\n      match:\n        n: {bounds}\n"


def delivered_numbers(handler: HandlerServer) -> set[int]:
    return {json.loads(entry.body)["n"] for entry in handler.ledger if entry.done}


async def test_a_changed_pipeline_file_restarts_the_integrations_that_use_it(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    await publish(broker, 200, consumers=["alpha", "beta"])
    directory = tmp_path / "integrations"
    directory.mkdir()
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    numbers = pipelines / "numbers.yaml"
    numbers.write_text(numbers_filter("{lt: 50}"))
    async with HandlerServer() as alpha_handler, HandlerServer() as beta_handler:
        (directory / "alpha.yaml").write_text(
            integration_yaml("alpha", alpha_handler.url, extra="pipeline: numbers\n")
        )
        (directory / "beta.yaml").write_text(integration_yaml("beta", beta_handler.url))
        proxy, reloader = proxy_from(broker, directory, pipelines_dir=pipelines)
        async with running(proxy), reloading(reloader, watched=directory):
            await alpha_handler.ledger.wait_for(50, timeout_s=30)
            await beta_handler.ledger.wait_for(200, timeout_s=30)
            alpha, beta = proxy.groups["alpha"], proxy.groups["beta"]
            await wait_until_true(lambda: alpha.runners["main"].statistics().unfinished == 0)

            # The pipelines directory is watched: an edit restarts alpha alone, on the new file.
            numbers.write_text(numbers_filter("{gte: 150}"))
            # The group is replaced during the reload, and the report recorded after it.
            await wait_until_true(
                lambda: reloader.last is not None and bool(reloader.last.restarted), timeout_s=10
            )
            assert reloader.last is not None
            assert proxy.groups["alpha"] is not alpha
            assert reloader.last.trigger == "watch"
            assert reloader.last.restarted == {"alpha": [str(numbers)]}
            assert proxy.groups["beta"] is beta
            await publish(broker, 100, start=200)
            await alpha_handler.ledger.wait_for(150, timeout_s=30)
            assert delivered_numbers(alpha_handler) == set(range(50)) | set(range(200, 300))
            for _ in range(200):  # the filtered ones are committed too
                if await committed(broker, "alpha") == 300:
                    break
                await asyncio.sleep(0.05)
            assert await committed(broker, "alpha") == 300

            # A pipeline file that no longer builds is reported with its line and field;
            # alpha runs on with the pipeline it has.
            restarted = proxy.groups["alpha"]
            numbers.write_text(numbers_filter("{gte: 150, near: 3}"))
            await wait_until_true(lambda: bool(restarted.problems), timeout_s=10)
            assert proxy.groups["alpha"] is restarted
            [problem] = restarted.problems
            assert (problem.file, problem.line) == (str(numbers), 5)
            assert "near" in problem.message
            assert reloader.last is not None
            assert reloader.last.kept == ["alpha"]
            assert reloader.last.restarted == {}
            await publish(broker, 10, start=300)
            await alpha_handler.ledger.wait_for(160, timeout_s=30)

            # Fixed, it is picked up; a reload with nothing changed restarts nothing.
            numbers.write_text(numbers_filter("{gte: 1000}"))
            await wait_until_true(lambda: proxy.groups["alpha"] is not restarted, timeout_s=10)
            assert proxy.groups["alpha"].problems == []
            report = await reloader.reload("api")
            assert (report.restarted, report.applied, report.added) == ({}, {}, [])
            await publish(broker, 10, start=310)
            await publish(broker, 1, start=1000)  # within the new bounds
            await alpha_handler.ledger.wait_for(161, timeout_s=30)
            await asyncio.sleep(0.3)
            assert delivered_numbers(alpha_handler) == (
                set(range(50)) | set(range(200, 310)) | {1000}
            )
    assert beta_handler.ledger.duplicates() == {}


async def test_an_integration_waiting_for_its_topic_says_so(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    directory = tmp_path / "integrations"
    directory.mkdir()
    async with HandlerServer() as handler:
        (directory / "alpha.yaml").write_text(integration_yaml("alpha", handler.url))
        proxy, _ = proxy_from(broker, directory)
        async with running(proxy), admin_client(proxy) as admin:
            await wait_until_true(lambda: bool(proxy.groups["alpha"].issues))
            status = (await admin.get("/integrations/alpha")).json()
            assert status["state"] == "waiting"
            assert status["issues"] == {"main": "topic orders does not exist"}


@pytest.mark.slow
async def test_sighup_reloads_and_the_admin_api_serves_beside_the_cli(
    workspace: Workspace,
) -> None:
    created = workspace.cli("topics", "create", "orders", "--partitions", "2")
    assert created.returncode == 0, created.stderr
    async with HandlerServer() as handler:
        workspace.write_config(
            "admin: {port: 0, token: '" + AUTH["authorization"].removeprefix("Bearer ") + "'}\n"
            "reload: {watch: false}\n"
            "log_format: json\n"
        )
        workspace.write_integration("alpha", integration_yaml("alpha", handler.url))
        proxy = await workspace.start("run")
        url = await admin_url_from_log(workspace)
        async with httpx.AsyncClient(base_url=url, timeout=10) as admin:
            assert (await admin.get("/healthz")).status_code == 200
            names = [i["name"] for i in (await admin.get("/integrations")).json()["integrations"]]
            assert names == ["alpha"]
            workspace.write_integration("beta", integration_yaml("beta", handler.url))
            await asyncio.sleep(0.5)  # not watching: nothing happens before the signal
            assert len((await admin.get("/integrations")).json()["integrations"]) == 1
            proxy.send_signal(signal.SIGHUP)
            for _ in range(100):
                listed = (await admin.get("/integrations")).json()["integrations"]
                if len(listed) == 2:
                    break
                await asyncio.sleep(0.1)
            assert [i["name"] for i in listed] == ["alpha", "beta"]
            reload_status = (await admin.get("/config")).json()["last_reload"]
            assert (reload_status["trigger"], reload_status["added"]) == ("signal", ["beta"])
            scrape = (await admin.get("/metrics")).text
            assert "process_resident_memory_bytes" in scrape
            assert 'nemesis_config_reloads_total{result="ok"}' in scrape
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    records = [json.loads(line) for line in workspace.logs().splitlines() if line.startswith("{")]
    assert records, workspace.logs()
    added = [r for r in records if r["msg"] == "integration beta: added"]
    assert added
    assert added[0]["integration"] == "beta"
    assert {"ts", "level", "logger", "msg"} <= set(records[0])


async def admin_url_from_log(workspace: Workspace, timeout_s: float = 30) -> str:
    """The admin API's address, from the line ``nemesis run`` logs once it listens."""
    async with asyncio.timeout(timeout_s):
        while True:
            found = re.search(r"admin API listening on (http://[0-9.:]+)", workspace.logs())
            if found:
                return found.group(1)
            await asyncio.sleep(0.05)
