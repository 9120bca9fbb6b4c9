"""The admin API's and the viewer's server sockets: what uvicorn serves on, as ``run`` binds it.

uvicorn writes an answer's headers and its body in two sends. With Nagle's
algorithm on, the body waits for the client's ACK of the headers, which a
Linux client delays by about 40 ms: every small answer would take that long.
asyncio turns Nagle off on the connections it accepts, but only on sockets
that say they are TCP, so the listening socket must be made as one.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
from starlette.types import Receive, Scope, Send

from nemesis.admin import UvicornService
from tests.operability import wait_until_true


async def ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_an_accepted_connection_has_nagle_off() -> None:
    service = UvicornService(ok, host="127.0.0.1", port=0, name="test", proxy_headers=False)
    service.bind()
    task = asyncio.create_task(service.serve())
    try:
        await wait_until_true(lambda: service.started)
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:
            answer = await client.get("/")
            assert answer.text == "ok"
            # The connection is kept alive: uvicorn still holds it.
            connections = service._server.server_state.connections
            assert len(connections) == 1
            (connection,) = connections
            accepted = connection.transport.get_extra_info("socket")
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        service.stop()
        await task
