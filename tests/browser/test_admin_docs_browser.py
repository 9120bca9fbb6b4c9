"""The admin API's /docs in headless Chromium: served by the process, nothing from elsewhere.

The page must render with its own CSP in force (no violation reported, its
one style element allowed by hash), load nothing but itself, run no script,
and refuse to be framed; the API's JSON answers refuse framing too.
"""

from __future__ import annotations

from pathlib import Path

from playwright.async_api import Request

from nemesis.broker.embedded import open_embedded
from nemesis.config.models import EmbeddedBackendConfig
from tests.browser.conftest import Tab
from tests.operability import wait_until_true
from tests.test_admin_access import PLATFORM_TOKEN, auth_config, team_proxy

BLOCKED = "chrome-error://chromewebdata/"


async def test_docs_render_under_their_csp_and_load_nothing_else(tab: Tab, tmp_path: Path) -> None:
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    try:
        options = {"token": PLATFORM_TOKEN, "auth": auth_config()}
        async with team_proxy(broker, tmp_path, None, **options) as (_, url):
            requested: list[str] = []

            def on_request(request: Request) -> None:
                requested.append(request.url)

            tab.page.on("request", on_request)
            answer = await tab.page.goto(f"{url}/docs")
            assert answer is not None
            assert answer.status == 200
            assert "default-src 'none'" in answer.headers["content-security-policy"]
            assert answer.headers["x-frame-options"] == "DENY"
            headings = await tab.page.locator("h3").all_inner_texts()
            assert "PATCH /integrations/{name}" in headings
            assert "POST /integrations/{name}/pause" in headings
            # The style element is allowed by its hash: the page is laid out by it.
            width = await tab.page.evaluate("getComputedStyle(document.body).maxWidth")
            assert width == "960px"
            assert await tab.page.locator("script").count() == 0
            await tab.shot("admin-docs")
            assert requested == [f"{url}/docs"], requested  # no CDN, no asset from elsewhere
            tab.assert_clean()

            # Framed by another page: refused, for the page and for the API's answers
            # (Chromium shows its error page in the frame instead).
            for path in ("/docs", "/openapi.json"):
                await tab.page.goto("about:blank")
                await tab.page.set_content(f"<iframe src='{url}{path}'></iframe>")
                await wait_until_true(lambda: tab.page.frames[-1].url == BLOCKED, timeout_s=15)
    finally:
        await broker.close()
