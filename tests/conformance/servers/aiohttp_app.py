"""The conformance routes on aiohttp.web: ``python aiohttp_app.py PORT KEEPALIVE_S``."""

from __future__ import annotations

import sys

from aiohttp import web


async def handle(request: web.Request) -> web.StreamResponse:
    await request.read()
    path = request.path
    if path == "/chunked":
        response = web.StreamResponse(status=503)
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"answered ")
        await response.write(b"in chunks")
        await response.write_eof()
        return response
    if path.startswith("/status/"):
        status = int(path.rsplit("/", 1)[1])
        return web.Response(status=status, text=f"answered {status}")
    if path == "/close":
        return web.Response(status=204, headers={"Connection": "close"})
    return web.Response(status=204)


def main() -> None:
    port, keepalive_s = int(sys.argv[1]), float(sys.argv[2])
    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    web.run_app(
        app,
        host="127.0.0.1",
        port=port,
        keepalive_timeout=keepalive_s,
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
