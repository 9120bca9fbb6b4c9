"""Headless Chromium (Debian's, driven by Playwright) against a viewer served on 127.0.0.1.

The browser is the system Chromium at /usr/bin/chromium (``NEMESIS_CHROMIUM``
overrides the path); Playwright's own browser downloads do not work on the
build machines. Without Chromium these tests fail, saying how to install it:
a browser suite that skips itself would hide a broken UI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.async_api import Browser, ConsoleMessage, Dialog, Page, async_playwright

from dlq_viewer.server import bound_port, viewer_server
from dlq_viewer.testing import Person, ViewerEnv

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "test-artifacts" / "screenshots"
CHROMIUM = Path(os.environ.get("NEMESIS_CHROMIUM", "/usr/bin/chromium"))
# Without the networking flags Chromium keeps calling Google's hosts, which this network refuses.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not await asyncio.to_thread(CHROMIUM.exists):
        pytest.fail(
            f"Chromium is not installed at {CHROMIUM}: the browser tests need Debian's chromium"
            " (apt-get install -y chromium) or NEMESIS_CHROMIUM pointing at one"
        )
    async with async_playwright() as playwright:
        # Playwright gives every launch a new, empty profile directory of its own.
        launched = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True
        )
        try:
            yield launched
        finally:
            await launched.close()


@dataclass
class Tab:
    """A page, and everything it said that a test must see: script errors, CSP reports, dialogs."""

    page: Page
    base_url: str = ""
    problems: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    async def open(self, path: str) -> None:
        """Navigates to ``path`` on the viewer."""
        await self.page.goto(self.base_url + path)

    async def sign_in(self, person: Person) -> None:
        """Signs in through the form and lands on the overview."""
        await self.open("/login")
        await self.page.fill("#username", person.name)
        await self.page.fill("#password", person.password)
        async with self.page.expect_navigation():
            await self.page.click("button[type=submit]")

    async def shot(self, name: str, *, full_page: bool = True) -> Path:
        """Saves a screenshot as test-artifacts/screenshots/<name>.png."""
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        await self.page.screenshot(path=str(path), full_page=full_page)
        return path

    def assert_clean(self) -> None:
        """No script error, no CSP violation and no dialog happened on any page."""
        assert self.problems == []
        assert self.dialogs == []


@pytest.fixture
async def tab(browser: Browser) -> AsyncIterator[Tab]:
    context = await browser.new_context(
        viewport={"width": 1440, "height": 900}, locale="en-US", timezone_id="UTC"
    )
    page = await context.new_page()
    page.set_default_timeout(15_000)
    opened = Tab(page)

    def on_console(message: ConsoleMessage) -> None:
        # Error pages (404, 403) are expected in some tests; anything else is a problem.
        if message.type == "error" and "Failed to load resource" not in message.text:
            opened.problems.append(message.text)

    async def on_dialog(dialog: Dialog) -> None:
        opened.dialogs.append(f"{dialog.type}: {dialog.message}")
        await dialog.dismiss()

    page.on("console", on_console)
    page.on("pageerror", lambda error: opened.problems.append(f"page error: {error}"))
    page.on("dialog", on_dialog)
    try:
        yield opened
    finally:
        await context.close()


@contextlib.asynccontextmanager
async def serving(env: ViewerEnv) -> AsyncIterator[str]:
    """Serves the viewer on a free port of 127.0.0.1; yields its base URL."""
    server = viewer_server(env.app, "127.0.0.1", 0)
    task = asyncio.create_task(server.serve(), name="viewer-under-test")
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    await task  # raises why it could not start
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{bound_port(server)}"
    finally:
        server.stop()
        await task
