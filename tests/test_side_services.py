"""``nemesis run`` when the admin API or the DLQ viewer cannot listen: loud, and visible."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Workspace, integration_yaml, stop_gracefully

pytestmark = pytest.mark.slow


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program listens on for the test's length."""
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        yield int(blocker.getsockname()[1])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def prepare(workspace: Workspace, *, admin_port: int, viewer_port: int) -> None:
    workspace.write_config(f"admin: {{port: {admin_port}}}\nviewer: {{port: {viewer_port}}}\n")
    workspace.write_integration("loyalty", integration_yaml("loyalty", "http://127.0.0.1:9/"))
    created = workspace.cli("topics", "create", "orders", "--partitions", "1")
    assert created.returncode == 0, created.stderr


def test_run_exits_when_the_admin_api_cannot_listen(workspace: Workspace, taken_port: int) -> None:
    prepare(workspace, admin_port=taken_port, viewer_port=free_port())
    result = workspace.cli("run", timeout=60)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert (
        f"nemesis: the admin API cannot listen on http://127.0.0.1:{taken_port}:"
        " Address already in use" in result.stderr
    )
    assert "nothing could report health or readiness" in result.stderr


async def test_a_viewer_that_cannot_listen_is_an_error_and_a_readiness_reason(
    workspace: Workspace, taken_port: int
) -> None:
    admin_port = free_port()
    prepare(workspace, admin_port=admin_port, viewer_port=taken_port)
    proxy = await workspace.start("run")
    reason = (
        f"DLQ viewer not serving: cannot listen on http://127.0.0.1:{taken_port}:"
        " Address already in use"
    )
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}") as client:
        async with asyncio.timeout(60):
            while True:
                try:
                    ready = await client.get("/readyz")
                except httpx.TransportError:
                    await asyncio.sleep(0.1)  # not listening yet
                    continue
                if "starting" not in ready.json()["reasons"]:
                    break
                await asyncio.sleep(0.1)
        assert ready.status_code == 503
        assert ready.json()["reasons"] == [reason]
        # Deliveries run without the viewer: the proxy itself is up.
        assert (await client.get("/healthz")).status_code == 200
    assert await stop_gracefully(proxy) == 0, workspace.logs()
    errors = [line for line in workspace.logs().splitlines() if " ERROR " in line]
    assert any(
        f"DLQ viewer NOT STARTED: cannot listen on http://127.0.0.1:{taken_port}" in line
        for line in errors
    ), workspace.logs()


async def test_the_viewer_server_names_the_address_and_the_cause(taken_port: int) -> None:
    from fastapi import FastAPI

    from dlq_viewer.server import ViewerStartError, serve_viewer

    with pytest.raises(ViewerStartError) as info:
        await serve_viewer(FastAPI(), "127.0.0.1", taken_port, stop=asyncio.Event())
    assert str(info.value) == (
        f"the DLQ viewer cannot listen on 127.0.0.1:{taken_port}: Address already in use"
    )
