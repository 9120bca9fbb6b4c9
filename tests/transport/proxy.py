"""A TCP proxy on 127.0.0.1 that can reset its client connections: a handler dying mid-answer."""

from __future__ import annotations

import asyncio
import socket
import struct
from types import TracebackType


class ResettingProxy:
    """Forwards bytes to ``upstream_port``; ``reset_all`` resets every client connection (RST)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.resets = 0
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> ResettingProxy:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.close()
        self.reset_all()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    def reset_all(self) -> None:
        """Resets every open client connection: the client reads ECONNRESET, not a clean close."""
        for client in list(self._clients):
            if client.transport.is_closing():
                continue
            raw = client.get_extra_info("socket")
            if raw is not None:
                # Linger 0: close() sends RST instead of FIN.
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.transport.abort()
            self.resets += 1
        self._clients.clear()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.create_task(_pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        sink.transport.abort()
