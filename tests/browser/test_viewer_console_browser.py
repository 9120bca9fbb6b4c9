"""The team console in headless Chromium over a real proxy, fleet member and state store.

A team pauses its integration and re-tunes it through the console's forms;
the proxy's fleet member applies both from the state store, and the
replica's reports show the change on the page. Hostile text in the store
(reports, flags, who set an override) renders inert on every console page.
Screenshots of the owner's and a read-only view go to test-artifacts/.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dlq_viewer.testing import STANDARD_ACCESS, ViewerEnv, eventually, integration, viewer_env
from nemesis.fleet.member import FleetMember, FleetOptions
from nemesis.fleet.port import MemberInfo
from nemesis.fleet.sqlite import SqliteStateStore, open_sqlite_state
from nemesis.runtime.app import Proxy
from nemesis.runtime.reports import StatusReporter
from nemesis.runtime.runner import RunnerOptions
from nemesis.testing import HandlerServer
from tests.browser.conftest import Tab, serving
from tests.browser.test_viewer_browser_security import IMAGE, RTL, SCRIPT, SVG, assert_nothing_ran

ALICE, BOB, ROOT = STANDARD_ACCESS.people
FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2)


@pytest.fixture
async def state(tmp_path: Path) -> AsyncIterator[SqliteStateStore]:
    store = await open_sqlite_state(tmp_path / "state.db")
    try:
        yield store
    finally:
        await store.close()


async def test_a_team_pauses_and_retunes_its_integration_through_the_console(
    tmp_path: Path, tab: Tab, state: SqliteStateStore
) -> None:
    async with HandlerServer() as handler:
        integrations = {
            "orders-a": integration("orders-a", ["team-a"], url=handler.url),
            "orders-b": integration("orders-b", ["team-b"], url=handler.url),
        }
        async with viewer_env(
            tmp_path, integrations=integrations, lifespan=False, state=state
        ) as env:
            await env.broker.admin.create_topic("orders", partitions=2)
            proxy = Proxy(env.broker, integrations, dlq=env.store, runner_options=FAST)
            fleet = FleetMember(
                state, proxy, options=FleetOptions(lease_s=30, poll_s=0.1), member_id="replica-1"
            )
            reporter = StatusReporter(proxy, state, "replica-1", every_s=0.1)
            await fleet.join()
            tasks = [
                asyncio.create_task(proxy.run(), name="proxy"),
                asyncio.create_task(fleet.run(), name="fleet"),
                asyncio.create_task(reporter.run(), name="reports"),
            ]
            try:
                await run_the_console(tab, env, proxy)
            finally:
                for task in tasks[1:]:
                    task.cancel()
                proxy.stop()
                await asyncio.gather(*tasks, return_exceptions=True)
    tab.assert_clean()


async def run_the_console(tab: Tab, env: ViewerEnv, proxy: Proxy) -> None:
    async with serving(env) as base:
        tab.base_url = base
        await tab.sign_in(ALICE)
        await tab.open("/console")
        assert await tab.page.locator("#console-table tbody tr").count() == 1
        await tab.page.click("text=orders-a")

        async def shows(selector: str, text: str) -> bool:
            await tab.page.reload()
            return text in (await tab.page.text_content(selector) or "")

        await eventually(
            lambda: shows("#kpi-state", "running"), timeout_s=30, what="a running report"
        )
        async with tab.page.expect_navigation():
            await tab.page.click("#pause")
        assert "Paused" in (await tab.page.text_content("#flash") or "")
        await eventually(
            lambda: proxy.integrations["orders-a"].paused, timeout_s=30, what="the proxy paused"
        )
        await eventually(lambda: shows("#kpi-state", "paused"), timeout_s=30, what="paused shown")

        await tab.page.fill("#tune-delivery-workers", "3")
        await tab.page.fill("#tune-rate_limits-main", "250")
        async with tab.page.expect_navigation():
            await tab.page.click("#tune-submit")
        assert "delivery.workers=3" in (await tab.page.text_content("#flash") or "")
        await eventually(
            lambda: proxy.integrations["orders-a"].delivery.workers == 3,
            timeout_s=30,
            what="the proxy re-tuned",
        )
        assert proxy.integrations["orders-a"].rate_limits.main == 250.0
        row = tab.page.locator('#settings-table tr[data-field="delivery.workers"]')
        assert "override" in (await row.text_content() or "")
        await tab.page.fill("#flags-types", "order.test")
        async with tab.page.expect_navigation():
            await tab.page.click("#flags-submit")
        await tab.shot("console-owner")
        await tab.page.screenshot(path=str(shots() / "console-owner.png"), full_page=True)

        async with tab.page.expect_navigation():
            await tab.page.click("#resume")
        await eventually(
            lambda: not proxy.integrations["orders-a"].paused, timeout_s=30, what="resumed"
        )
        await tab.open("/console")
        await tab.page.screenshot(path=str(shots() / "console-list-owner.png"), full_page=True)

        # Another team's integration is not there at all.
        answer = await tab.page.goto(base + "/console/orders-b")
        assert answer is not None
        assert answer.status == 404
        assert "orders-b" not in await tab.page.content()

        await tab.page.context.clear_cookies()
        await tab.sign_in(ROOT)
        await tab.open("/console/orders-a")
        assert await tab.page.locator("#read-only").count() == 1
        assert await tab.page.locator("form[action$='/pause'], #tune-form").count() == 0
        await tab.shot("console-read-only")
        await tab.page.screenshot(path=str(shots() / "console-read-only.png"), full_page=True)
    entries = (await env.store.actions()).rows
    assert [(e.who, e.action.value) for e in entries][:4] == [
        ("alice", "resume"),
        ("alice", "tune"),
        ("alice", "tune"),
        ("alice", "pause"),
    ]


def shots() -> Path:
    """Where screenshots for the report go (outside the repository)."""
    path = Path(__file__).resolve().parents[3] / "console-shots"
    path.mkdir(parents=True, exist_ok=True)
    return path


HOSTILE = [SCRIPT, IMAGE, SVG, RTL, "</td></tr></table><script>window.__pwned = 'x'</script>"]


async def test_hostile_text_from_the_store_stays_inert_on_console_pages(
    tmp_path: Path, tab: Tab, state: SqliteStateStore
) -> None:
    integrations = {"orders-a": integration("orders-a", ["team-a"])}
    now = time.time()
    text = " ".join(HOSTILE)
    await state.heartbeat(MemberInfo(text, text, 1, now), now=now, lease_s=600)
    await state.publish_reports(
        text,
        {"orders-a": {"state": text, "breaker": text, "issues": {text: text}, "every_s": 600}},
        now=now,
    )
    await state.set_overrides("orders-a", {"flags.disabled_types": HOSTILE}, set_by=text, now=now)
    async with (
        viewer_env(tmp_path, integrations=integrations, lifespan=False, state=state) as env,
        serving(env) as base,
    ):
        tab.base_url = base
        for person in (ALICE, ROOT):
            await tab.page.context.clear_cookies()
            await tab.sign_in(person)
            for path in ("/console", "/console/orders-a"):
                await tab.open(path)
                await assert_nothing_ran(tab)
        assert SCRIPT in (await tab.page.text_content("#issues") or "")
