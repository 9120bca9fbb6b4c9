"""Hostile messages, other teams and other sites, in a real browser: nothing runs, nothing leaks.

A payload, an error text, a key or metadata may hold HTML, script,
``javascript:`` links and unicode that reorders or hides text. Each is
rendered on every page that shows it; a script that ran would set
``window.__pwned`` or open a dialog, and the test looks for both (and for
any CSP report or script error in the console).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from playwright.async_api import Browser, Locator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from dlq_viewer.auth import LOGIN_COOKIE, SESSION_COOKIE
from dlq_viewer.testing import (
    STANDARD_ACCESS,
    ViewerEnv,
    eventually,
    integration,
    letter,
    viewer_env,
)
from nemesis.dlq import DeadLetterFilter, Reason, Status
from tests.browser.conftest import Tab, serving

ALICE, BOB, ROOT = STANDARD_ACCESS.people

SCRIPT = "<script>window.__pwned = 'script'; alert('script')</script>"
IMAGE = "<img src=x onerror=\"window.__pwned = 'img'; alert('img')\">"
SVG = "<svg onload=\"window.__pwned = 'svg'\"></svg>"
LINK = "<a id=evil href=\"javascript:window.__pwned = 'link'\">click me</a>"
BARE_LINK = "javascript:window.__pwned='bare'"
STYLE = "<style>body { display: none }</style>"
BREAKOUT = "</pre></td></tr></table><script>window.__pwned = 'breakout'</script>"
RTL = "invoice\u202egpj.exe"  # shows as "invoiceexe.jpg"
HIDDEN = "pay\u200bpal\u2066\u2069\ufeff"
HOSTILE_PAYLOAD = (
    "{"
    f'"script": "{SCRIPT}", "img": "{IMAGE.replace(chr(34), chr(39))}", '
    f'"svg": "{SVG.replace(chr(34), chr(39))}", "link": "{LINK.replace(chr(34), chr(39))}", '
    f'"bare": "{BARE_LINK}", "style": "{STYLE}", "breakout": "{BREAKOUT}", '
    f'"file": "{RTL}", "name": "{HIDDEN}"'
    "}"
).encode()


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[ViewerEnv]:
    integrations = {
        "orders-a": integration("orders-a", ["team-a"]),
        "orders-b": integration("orders-b", ["team-b"]),
    }
    async with viewer_env(tmp_path, integrations=integrations, lifespan=False) as opened:
        await opened.store.put(
            [
                letter(
                    "orders-a",
                    1,
                    payload=HOSTILE_PAYLOAD,
                    error=f"422 {IMAGE} {SCRIPT} {RTL}",
                    key=SVG,
                    metadata={"type": LINK, STYLE: BREAKOUT, "name": HIDDEN},
                ),
                # Not JSON: shown as text, with the same tricks.
                letter("orders-a", 2, payload=f"{SCRIPT}\n{LINK}\n{RTL}".encode(), error=BREAKOUT),
                letter("orders-b", 1, error="422 team b secret"),
            ]
        )
        yield opened


async def assert_nothing_ran(tab: Tab) -> None:
    assert await tab.page.evaluate("window.__pwned === undefined")
    # Nothing from the messages became an element.
    main = tab.page.locator("main")
    for selector in ("script", "img", "svg:not(.chart):not(.meter)", "style", "a#evil"):
        assert await main.locator(selector).count() == 0, selector
    assert await tab.page.locator("a[href^='javascript:']").count() == 0
    tab.assert_clean()


def row_of(tab: Tab, source: str) -> Locator:
    """The link to the message listed with these source coordinates."""
    return tab.page.locator("#messages-table tr", has_text=source).locator("a.when-link")


async def test_hostile_payloads_render_as_inert_text(env: ViewerEnv, tab: Tab) -> None:
    async with serving(env) as base:
        tab.base_url = base
        await tab.sign_in(ROOT)
        for path in (
            "/",
            "/messages",
            "/messages?q=%3Cscript%3E",
            "/groups",
            "/messages?status=any",
        ):
            await tab.open(path)
            await assert_nothing_ran(tab)
            assert await tab.page.is_visible("main")  # <style> did not hide the page

        await tab.open("/messages?integration=orders-a")
        async with tab.page.expect_navigation():
            await row_of(tab, "orders:0:1").click()
        await assert_nothing_ran(tab)
        payload = await tab.page.text_content("#payload-text") or ""
        for text in (SCRIPT, "onerror=", "javascript:window.__pwned", "<svg onload=", "</pre>"):
            assert text in payload, text  # shown as the text it is
        error = await tab.page.text_content("#error-text") or ""
        assert SCRIPT in error
        assert "<img src=x onerror=" in error
        assert SVG in (await tab.page.text_content(".facts") or "")
        metadata = await tab.page.text_content("#metadata-table") or ""
        assert LINK in metadata
        assert STYLE in metadata
        assert BREAKOUT in metadata
        # The bidi override and the invisible characters are marked where they are.
        marked = await tab.page.locator("#payload-text .cc").evaluate_all(
            "spans => spans.map(span => span.dataset.cp)"
        )
        assert {"U+202E", "U+200B", "U+2066", "U+2069", "U+FEFF"} <= set(marked)
        notice = await tab.page.text_content("#payload-title + p") or ""
        assert "invisible or direction-changing" in notice
        # The override is isolated in its span: the text after it keeps its order.
        after = await tab.page.evaluate(
            """() => {
                const mark = document.querySelector('#payload-text .cc[data-cp="U+202E"]');
                return getComputedStyle(mark).unicodeBidi;
            }"""
        )
        assert after == "isolate"
        await tab.shot("hostile-payload")

        await tab.open("/messages?status=any&integration=orders-a")
        async with tab.page.expect_navigation():
            await row_of(tab, "orders:0:2").click()
        await assert_nothing_ran(tab)
        assert "UTF-8 text" in (await tab.page.text_content("#payload-title + p") or "")

        # Filter text goes into an audit entry's description: it stays text there too.
        await tab.open(
            "/actions/confirm?action=discard&status=any&q=" + "%3Cimg%20src%3Dx%20onerror"
        )
        async with tab.page.expect_navigation():
            await tab.page.click("#confirm-bulk")
        await tab.page.wait_for_selector("#job-state >> text=done")
        await tab.open("/audit")
        await assert_nothing_ran(tab)
        assert "<img src=x onerror" in (await tab.page.text_content("#audit-table") or "")


async def test_another_teams_messages_stay_out_of_sight(env: ViewerEnv, tab: Tab) -> None:
    (foreign,) = await env.store.select_ids(
        DeadLetterFilter(integrations=frozenset({"orders-b"})), 10
    )
    async with serving(env) as base:
        tab.base_url = base
        await tab.sign_in(ALICE)
        for path in ("/", "/messages?status=any", "/groups", "/audit"):
            await tab.open(path)
            body = await tab.page.text_content("body") or ""
            assert "orders-b" not in body, path
            assert "team b secret" not in body, path
        options = await tab.page.locator("#f-integration option").all_text_contents()
        await tab.open("/messages")
        options = await tab.page.locator("#f-integration option").all_text_contents()
        assert [o for o in options if o.startswith("orders")] == ["orders-a"]
        await tab.open(f"/messages/{foreign}")
        assert "No such message." in (await tab.page.text_content("main") or "")
        await tab.shot("not-found", full_page=False)
        row = await env.store.get(foreign)
        assert row is not None
        assert row.status is Status.DEAD
    tab.assert_clean()


async def test_signing_out_ends_the_session_for_a_copy_of_its_cookie_too(
    env: ViewerEnv, tab: Tab, browser: Browser
) -> None:
    async with serving(env) as base:
        tab.base_url = base
        await tab.sign_in(ALICE)
        cookies = await tab.page.context.cookies()
        session = [cookie for cookie in cookies if cookie["name"] == SESSION_COOKIE]
        assert len(session) == 1
        other = await browser.new_context()  # another machine, holding a copy of the cookie
        try:
            await other.add_cookies(
                [{"name": SESSION_COOKIE, "value": session[0]["value"], "url": base}]
            )
            copy = await other.new_page()
            await copy.goto(base + "/messages")
            assert copy.url.startswith(base + "/messages")  # the copy works while signed in
            async with tab.page.expect_navigation():
                await tab.page.click("text=Sign out")
            assert tab.page.url.startswith(base + "/login")
            await copy.goto(base + "/messages")
            assert copy.url.startswith(base + "/login")  # and not after signing out
        finally:
            await other.close()
    tab.assert_clean()


def attacker_site(target: str, ids: list[str]) -> Starlette:
    """A page on another origin that posts a form to the viewer as soon as it loads."""
    fields = "".join(f'<input name="ids" value="{i}">' for i in ids)

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(
            f'<form id="f" method="post" action="{target}/actions/selected">'
            f'<input name="action" value="discard">{fields}</form>'
            "<script>document.getElementById('f').submit()</script>"
        )

    return Starlette(routes=[Route("/", page)])


@contextlib.asynccontextmanager
async def serve_attacker(app: Starlette) -> AsyncIterator[str]:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off")
    )
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started, what="the attacker's server")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_a_form_on_another_site_cannot_act_for_a_signed_in_user(
    env: ViewerEnv, tab: Tab
) -> None:
    ids = list(await env.store.select_ids(DeadLetterFilter(), 10))
    async with serving(env) as base:
        tab.base_url = base
        await tab.sign_in(ROOT)
        # Another port on the same host is the same site: the session cookie goes along,
        # so only the CSRF token stands in the way.
        async with serve_attacker(attacker_site(base, ids)) as evil:
            async with tab.page.expect_navigation(url=re.compile(r"/actions/selected$")):
                await tab.page.goto(evil)
            assert "This form has expired" in (await tab.page.text_content("main") or "")
    assert await env.store.count(DeadLetterFilter(status=Status.DISCARDED)) == 0
    assert (await env.store.actions()).rows == []
    assert any(Reason.HTTP_4XX for _ in ids)


def sign_in_site(target: str, nonce: str, token: str) -> Starlette:
    """A page on another port that signs its visitor in to the viewer as the attacker."""

    async def page(request: Request) -> HTMLResponse:
        # Cookies do not tell ports apart: this page can plant the viewer's form cookie.
        return HTMLResponse(
            f'<form id="f" method="post" action="{target}/login">'
            f'<input name="username" value="{BOB.name}">'
            f'<input name="password" value="{BOB.password}">'
            f'<input name="csrf_token" value="{token}"></form>'
            f"<script>document.cookie = 'nemesis_login={nonce}; path=/login';"
            "document.getElementById('f').submit()</script>"
        )

    return Starlette(routes=[Route("/", page)])


async def test_a_page_on_another_port_cannot_sign_a_visitor_in_as_someone_else(
    env: ViewerEnv, tab: Tab
) -> None:
    async with serving(env) as base:
        tab.base_url = base
        # The attacker fetches a sign-in form of their own: its nonce and token.
        async with httpx.AsyncClient(base_url=base) as attacker:
            form = await attacker.get("/login")
            found = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
            assert found is not None
            nonce = attacker.cookies[LOGIN_COOKIE]
        async with serve_attacker(sign_in_site(base, nonce, found.group(1))) as evil:
            async with tab.page.expect_navigation(url=re.compile(r"/login$")):
                await tab.page.goto(evil)
            assert "The sign-in form expired" in await tab.page.content()
        cookies = await tab.page.context.cookies()
        assert SESSION_COOKIE not in {cookie["name"] for cookie in cookies}
