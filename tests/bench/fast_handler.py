"""A minimal HTTP/1.1 keep-alive handler for benchmarks: answers 200 as fast as Python can.

Runs in its own process so it never shares a core with what is measured.
``GET /stats`` returns ``{"requests", "events", "latencies_ms", "from_log_ms"}``,
``GET /count`` only ``{"events"}`` (cheap to poll: the samples stay here, and
dumping them would hold up a delivery); ``POST /reset`` clears them. With
``--latency``, each request body's JSON field ``ts`` (Unix seconds, set by
whoever produced the message) is turned into a latency sample, and a
``ce-time`` header (the time the message was appended to the log, when the
producer set no time of its own) into a ``from_log_ms`` one.
A batch (``application/cloudevents-batch+json``) counts one event per element.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from datetime import datetime

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.events = 0
        self.latencies_ms: list[float] = []
        self.from_log_ms: list[float] = []


class HandlerProtocol(asyncio.Protocol):
    def __init__(self, stats: Stats, latency: bool) -> None:
        self._stats = stats
        self._latency = latency
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self._buffer[:end]).lower()
            length = 0
            marker = head.find(b"content-length:")
            if marker >= 0:
                line_end = head.find(b"\r\n", marker)
                length = int(head[marker + 15 : line_end if line_end >= 0 else None])
            total = end + 4 + length
            if len(self._buffer) < total:
                return
            body = bytes(self._buffer[end + 4 : total])
            del self._buffer[:total]
            self._handle(head, body)

    def _handle(self, head: bytes, body: bytes) -> None:
        assert self._transport is not None
        if head.startswith(b"get /stats"):
            payload = json.dumps(
                {
                    "requests": self._stats.requests,
                    "events": self._stats.events,
                    "latencies_ms": self._stats.latencies_ms,
                    "from_log_ms": self._stats.from_log_ms,
                }
            ).encode()
            self._write_json(payload)
            return
        if head.startswith(b"get /count"):
            self._write_json(b'{"events": %d}' % self._stats.events)
            return
        if head.startswith(b"post /reset"):
            self._stats.__init__()  # type: ignore[misc]
            self._transport.write(OK)
            return
        now = time.time()
        self._stats.requests += 1
        if b"cloudevents-batch" in head:
            self._stats.events += body.count(b'"specversion"')
        else:
            self._stats.events += 1
            if self._latency:
                self._stats.latencies_ms.append((now - json.loads(body)["ts"]) * 1000)
                marker = head.find(b"ce-time:")
                if marker >= 0:
                    value = head[marker + 8 : head.find(b"\r\n", marker)].strip().decode()
                    appended = datetime.fromisoformat(value.upper()).timestamp()
                    self._stats.from_log_ms.append((now - appended) * 1000)
        self._transport.write(OK)

    def _write_json(self, payload: bytes) -> None:
        assert self._transport is not None
        self._transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )


async def serve(port: int, latency: bool) -> None:
    stats = Stats()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HandlerProtocol(stats, latency), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency", action="store_true")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args.port, args.latency))
    except ImportError:
        asyncio.run(serve(args.port, args.latency))


if __name__ == "__main__":
    main()
