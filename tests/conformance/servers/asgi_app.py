"""The conformance routes as an ASGI app, served by uvicorn."""

from __future__ import annotations

from typing import Any


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/ok`` 204, ``/status/N`` N, ``/chunked`` a chunked 503, ``/close`` 204 and close."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path: str = scope["path"]
    if path == "/chunked":
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"answered ", "more_body": True})
        await send({"type": "http.response.body", "body": b"in chunks"})
        return
    status, body, headers = 204, b"", []
    if path.startswith("/status/"):
        status = int(path.rsplit("/", 1)[1])
        body = f"answered {status}".encode()
    elif path == "/close":
        headers = [(b"connection", b"close")]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
