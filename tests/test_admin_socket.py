"""The admin API's and the viewer's server sockets: what uvicorn serves on, as ``run`` binds it.

uvicorn writes an answer's headers and its body in two sends. With Nagle's
algorithm on, the body waits for the client's ACK of the headers, which a
Linux client delays by about 40 ms: every small answer would take that long.
asyncio turns Nagle off on the connections it accepts, but only on sockets
that say they are TCP, so a listening socket must be made as one.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import uvicorn
from fastapi import FastAPI

from dlq_viewer.server import bound_port, viewer_server
from nemesis.admin import UvicornService
from tests.operability import wait_until_true


def app() -> FastAPI:
    made = FastAPI()

    @made.get("/")
    async def ok() -> str:
        return "ok"

    return made


async def nagle_off_on_a_connection(server: uvicorn.Server, url: str) -> bool:
    """Whether the connection ``server`` accepted for a request to ``url`` has TCP_NODELAY."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        answer = await client.get("/")
        assert answer.json() == "ok"
        # The connection is kept alive: uvicorn still holds it.
        (connection,) = server.server_state.connections
        accepted: socket.socket = connection.transport.get_extra_info("socket")
        return accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_the_admin_api_s_connections_have_nagle_off() -> None:
    service = UvicornService(app(), host="127.0.0.1", port=0, name="test", proxy_headers=False)
    service.bind()
    task = asyncio.create_task(service.serve())
    try:
        await wait_until_true(lambda: service.started)
        assert await nagle_off_on_a_connection(service._server, service.url)
    finally:
        service.stop()
        await task


async def test_the_standalone_viewer_s_connections_have_nagle_off() -> None:
    server = viewer_server(app(), "127.0.0.1", 0)
    task = asyncio.create_task(server.serve())
    try:
        await wait_until_true(lambda: server.started)
        url = f"http://127.0.0.1:{bound_port(server)}"
        assert await nagle_off_on_a_connection(server, url)
    finally:
        server.stop()
        await task
