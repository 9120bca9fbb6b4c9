"""The DLQ viewer in headless Chromium: sign in, filter, read, requeue via a real proxy, discard.

Screenshots of the main pages go to test-artifacts/screenshots/ for a person to look at.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from playwright.async_api import expect

from dlq_viewer.testing import (
    STANDARD_ACCESS,
    ViewerEnv,
    eventually,
    integration,
    letter,
    viewer_env,
)
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.dlq import DeadLetterFilter, Reason, Status
from nemesis.runtime.app import Proxy
from nemesis.runtime.runner import RunnerOptions
from nemesis.testing import HandlerServer, LedgerEntry
from tests.browser.conftest import Tab, serving

ALICE, BOB, ROOT = STANDARD_ACCESS.people
FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[ViewerEnv]:
    integrations = {
        "orders-a": integration("orders-a", ["team-a"], rate_limits={"replay": 40}),
        "orders-b": integration("orders-b", ["team-b"]),
    }
    async with viewer_env(tmp_path, integrations=integrations, lifespan=False) as opened:
        yield opened


async def fill(env: ViewerEnv) -> None:
    """A day of failures: 422s and 409s in orders-a, timeouts in orders-b."""
    now = time.time()
    letters = [
        letter(
            "orders-a",
            n,
            at=now - n * 1500,
            http_status=409 if n % 4 == 0 else 422,
            error=f"409 conflict: order ord-{n} already settled" if n % 4 == 0 else None,
            metadata={"type": "order.created", "source": "shop", "trace-id": f"t-{n:04x}"},
        )
        for n in range(48)
    ]
    letters += [
        letter(
            "orders-b",
            n,
            at=now - n * 700,
            reason=Reason.RETRIES_EXHAUSTED,
            http_status=503,
            error=f"503 Service Unavailable after {3 + n % 3} attempts",
        )
        for n in range(30)
    ]
    await env.store.put(letters)


async def test_sign_in_filter_and_read_a_message(env: ViewerEnv, tab: Tab) -> None:
    await fill(env)
    async with serving(env) as base:
        tab.base_url = base
        await tab.open("/")
        assert tab.page.url.startswith(base + "/login")
        await tab.shot("login", full_page=False)
        await tab.sign_in(ALICE)
        assert tab.page.url == base + "/"
        assert await tab.page.text_content("#kpi-total") == "48"
        assert await tab.page.locator("#integrations-table tbody tr").count() == 1
        await tab.shot("overview")

        await tab.page.click("nav >> text=Messages")
        assert await tab.page.text_content("#match-count") == "48"
        await tab.shot("messages", full_page=False)
        await tab.page.fill("#f-http", "409")
        async with tab.page.expect_navigation():
            await tab.page.click("#apply-filters")
        assert "http_status=409" in tab.page.url
        assert await tab.page.text_content("#match-count") == "12"
        assert await tab.page.locator("#messages-table tbody tr").count() == 12
        await tab.page.fill("#f-q", "ord-8 ")
        async with tab.page.expect_navigation():
            await tab.page.click("#apply-filters")
        # A text search is counted after the page arrives. (Waited for through the
        # locator: a string predicate is evaluated as script, which the CSP refuses.)
        await expect(tab.page.locator("#match-count")).to_have_text("1")
        await tab.shot("messages-filtered", full_page=False)

        async with tab.page.expect_navigation():
            await tab.page.click("#messages-table a.when-link")
        payload = await tab.page.text_content("#payload-text")
        assert payload is not None
        assert json.loads(payload) == {"order_id": "ord-8", "n": 8}
        assert '"order_id": "ord-8"' in payload  # indented, not one long line
        assert "409 conflict: order ord-8 already settled" in (
            await tab.page.text_content("#error-text") or ""
        )
        assert "t-0008" in (await tab.page.text_content("#metadata-table") or "")
        await tab.shot("message")

        await tab.page.context.grant_permissions(["clipboard-read", "clipboard-write"])
        await tab.page.click("[data-copy=payload-text]")
        await tab.page.wait_for_selector("[data-copy=payload-text] >> text=Copied")
        copied = await tab.page.evaluate("navigator.clipboard.readText()")
        assert json.loads(copied) == {"order_id": "ord-8", "n": 8}
        async with tab.page.expect_download() as download_info:
            await tab.page.click("#download-payload")
        download = await download_info.value
        saved = await download.path()
        assert await asyncio.to_thread(Path(saved).read_bytes) == b'{"order_id": "ord-8", "n": 8}'
        assert download.suggested_filename.endswith(".json")

        await tab.open("/groups")
        assert await tab.page.locator("#groups-table tbody tr").count() == 2
        await tab.shot("groups")
    tab.assert_clean()


def n_of(entry: LedgerEntry) -> int:
    return int(json.loads(entry.body)["n"])


async def publish(env: ViewerEnv, count: int) -> None:
    await env.broker.admin.create_topic(
        "orders",
        partitions=2,
        consumers=[ConsumerSpec("orders-a"), ConsumerSpec("orders-b")],
        exist_ok=True,
    )
    writer = await env.broker.writer("orders")
    try:
        await writer.write(
            [
                OutgoingMessage(value=orjson.dumps({"n": n}), metadata={"type": "order.created"})
                for n in range(count)
            ]
        )
    finally:
        await writer.close()


async def test_requeue_a_filtered_set_reaches_the_handler_exactly_once(
    tmp_path: Path, tab: Tab
) -> None:
    count = 70
    rejected = {n for n in range(count) if n % 5 == 0}  # 422: fixed by the deploy below
    conflicts = {n for n in range(count) if n % 7 == 0 and n % 5 != 0}  # 409: stay dead
    async with HandlerServer() as handler, HandlerServer() as bystander:
        handler.when(lambda e: n_of(e) % 5 == 0, status=422, body='{"error": "missing city"}')
        handler.when(lambda e: n_of(e) % 7 == 0, status=409, body='{"error": "settled"}')
        integrations = {
            "orders-a": integration(
                "orders-a",
                ["team-a"],
                url=handler.url,
                rate_limits={"replay": 40},
                retry={"tiers": ["100ms"]},
            ),
            "orders-b": integration("orders-b", ["team-b"], url=bystander.url),
        }
        async with viewer_env(tmp_path, integrations=integrations, lifespan=False) as env:
            await publish(env, count)
            proxy = Proxy(env.broker, integrations, dlq=env.store, runner_options=FAST)
            running = asyncio.create_task(proxy.run(), name="proxy")
            try:
                dead = len(rejected | conflicts)

                async def all_dead() -> bool:
                    return await env.store.count(DeadLetterFilter()) >= dead

                await eventually(all_dead, timeout_s=60, what=f"{dead} dead letters")
                await bystander.ledger.wait_for(count, timeout_s=30)
                handler.reset()  # the fix is deployed: everything is accepted now
                handler.ledger.clear()
                bystander_before = len(bystander.ledger)

                async with serving(env) as base:
                    tab.base_url = base
                    await tab.sign_in(ALICE)
                    await tab.open("/messages?integration=orders-a")
                    assert await tab.page.text_content("#match-count") == str(
                        len(rejected | conflicts)
                    )
                    await tab.page.fill("#f-http", "422")
                    async with tab.page.expect_navigation():
                        await tab.page.click("#apply-filters")
                    async with tab.page.expect_navigation():
                        await tab.page.click("#requeue-all")
                    heading = await tab.page.text_content("h1")
                    assert heading == f"Requeue {len(rejected)} messages?"
                    assert "40.0 messages per second" in (
                        await tab.page.text_content("#confirm-card") or ""
                    )
                    await tab.shot("confirm")
                    async with tab.page.expect_navigation():
                        await tab.page.click("#confirm-bulk")
                    assert "/jobs/" in tab.page.url
                    await tab.page.wait_for_selector("#job-state >> text=done")
                    assert await tab.page.text_content("#job-done") == str(len(rejected))
                    await tab.shot("job")

                    await handler.ledger.wait_for(len(rejected), timeout_s=30)
                    await asyncio.sleep(0.3)  # nothing else may follow
                    received = [n_of(entry) for entry in handler.ledger]
                    assert sorted(received) == sorted(rejected)  # exactly those, once each
                    arrivals = sorted(entry.received_monotonic for entry in handler.ledger)
                    # ...at the integration's replay rate limit, not all at once: the
                    # limiter allows its small burst (50 ms worth) plus 40/s after it.
                    span = arrivals[-1] - arrivals[0]
                    assert len(arrivals) <= 40 * 0.05 + 40 * span * 1.05 + 1
                    assert len(bystander.ledger) == bystander_before

                    await tab.open("/audit")
                    row = tab.page.locator("#audit-table tbody tr").first
                    text = await row.text_content() or ""
                    assert "alice" in text
                    assert "requeue" in text
                    assert str(len(rejected)) in text
                    assert "HTTP 422" in text
                    await tab.shot("audit")
            finally:
                proxy.stop()
                await running
            requeued = await env.store.count(DeadLetterFilter(status=Status.REQUEUED))
            still_dead = await env.store.count(DeadLetterFilter(status=Status.DEAD))
            assert (requeued, still_dead) == (len(rejected), len(conflicts))
    tab.assert_clean()


async def test_discard_selected_rows_and_see_the_audit_entry(env: ViewerEnv, tab: Tab) -> None:
    await fill(env)
    async with serving(env) as base:
        tab.base_url = base
        await tab.sign_in(ALICE)
        await tab.open("/messages")
        boxes = tab.page.locator("#messages-table tbody input[name=ids]")
        chosen = [await boxes.nth(i).get_attribute("value") or "" for i in (1, 2)]
        assert await tab.page.is_disabled("#discard-selected")
        await boxes.nth(1).check()
        await boxes.nth(2).check()
        assert await tab.page.text_content("[data-selected]") == "2"
        await tab.page.click("#discard-selected")
        dialog = tab.page.locator("#confirm-dialog")
        await dialog.wait_for(state="visible")
        assert "Discard 2 selected message(s)?" in (
            await tab.page.text_content("#confirm-text") or ""
        )
        await tab.shot("discard-dialog", full_page=False)
        async with tab.page.expect_navigation():
            await tab.page.click("#confirm-ok")
        assert await tab.page.text_content("#flash") == "Discarded 2 messages."
        assert await tab.page.text_content("#match-count") == "46"

        await tab.page.select_option("#f-status", "discarded")
        async with tab.page.expect_navigation():
            await tab.page.click("#apply-filters")
        shown = await tab.page.locator("#messages-table tbody tr").evaluate_all(
            "rows => rows.map(row => row.dataset.id)"
        )
        assert sorted(shown) == sorted(chosen)

        await tab.open("/audit")
        entry = await tab.page.locator("#audit-table tbody tr").first.text_content() or ""
        assert "alice" in entry
        assert "discard" in entry
        assert "2 selected" in entry
        rows = await env.store.get_many(chosen)
        assert {row.status for row in rows} == {Status.DISCARDED}
        assert re.search(r"\b2\b", entry)
    tab.assert_clean()
