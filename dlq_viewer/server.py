"""Serving the viewer with uvicorn inside a process that owns its signals (``nemesis run``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


class ViewerStartError(Exception):
    """The viewer could not listen (the address is taken, or not ours to bind)."""


class ViewerServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to its host process; ``stop()`` ends it.

    Plain uvicorn replaces the process's signal handlers while it serves and
    exits the process when it cannot bind; inside ``nemesis run`` the proxy
    owns the signals, and a taken port must be an error, not an exit.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Installs nothing: the host process handles signals and calls ``stop()``."""
        yield

    def stop(self) -> None:
        """Stops accepting, finishes open requests, runs the app's shutdown; ``serve`` returns."""
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serves until ``stop()``; raises ``ViewerStartError`` (naming the cause) if it cannot."""
        own: socket.socket | None = None
        if sockets is None:
            # Bound here, not by uvicorn: its bind error is a log line and an exit,
            # while the caller needs the address and the cause in the exception.
            own = listen(self.config.host, self.config.port, self.config.backlog)
            sockets = [own]
        try:
            await super().serve(sockets)
        except SystemExit:
            # uvicorn logs why (e.g. the port is in use) and then exits.
            raise ViewerStartError(
                f"the DLQ viewer could not start on {self.config.host}:{self.config.port}"
            ) from None
        finally:
            if own is not None:
                own.close()


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket bound and listening on ``host:port``: from then on a connection waits."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that say they are TCP
    # (uvicorn sends an answer's headers and body apart; see nemesis.admin.server).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ViewerStartError(
            f"the DLQ viewer cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    return sock


def viewer_server(
    app: FastAPI, host: str, port: int, *, log_level: str = "warning"
) -> ViewerServer:
    """A server for ``app`` on ``host:port`` (port 0: any free port, see ``bound_port``)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        # request.client must be the TCP peer: the trusted-header check depends on it.
        proxy_headers=False,
        server_header=False,
        access_log=False,
        log_config=None,  # keep the host process's logging setup
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )
    return ViewerServer(config)


def bound_port(server: ViewerServer) -> int:
    """The port a started server listens on (useful with port 0)."""
    for listener in server.servers:
        for sock in listener.sockets:
            port: int = sock.getsockname()[1]
            return port
    raise RuntimeError("the viewer server is not listening yet")


async def serve_viewer(
    app: FastAPI, host: str, port: int, *, stop: asyncio.Event | None = None
) -> None:
    """Serves ``app`` on ``host:port`` until ``stop`` is set, then shuts down gracefully."""
    server = viewer_server(app, host, port)
    if stop is None:
        await server.serve()
        return
    # Owned here: cancelled and awaited whichever way serve() ends.
    watcher = asyncio.ensure_future(_stop_when_set(stop, server))
    try:
        await server.serve()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _stop_when_set(stop: asyncio.Event, server: ViewerServer) -> None:
    await stop.wait()
    server.stop()
