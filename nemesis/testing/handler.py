"""A real HTTP handler server on loopback that records deliveries and misbehaves on demand.

Use it in a test::

    async with HandlerServer() as server:
        server.fail_first(2)                # every id: 503 twice, then 200
        ...                                 # deliver to server.url
        await server.ledger.wait_for(100)   # 100 distinct ids answered done

or as a process, for tests that run the proxy in a subprocess::

    python -m nemesis.testing.handler --port 8900 --ledger ledger.jsonl

Built on a raw asyncio protocol with httptools (the parser uvicorn uses)
rather than aiohttp.web: loaded by wrk over loopback (300-byte JSON POSTs,
one core for the server), a raw asyncio server answered 10-16k requests/s
and aiohttp.web 7-10k, so it does not become the bottleneck of the proxy it
measures; and it owns its sockets, which is what
counting TCP connections, hanging answers and refusing connections on the
same port need.

The answer to a request is chosen on arrival: the first rule (in the order
added) that matches any of the request's ledger entries, else the default
answer (``behave``). Delays and holds then postpone the answer; answers on
one connection keep their order, as HTTP/1.1 requires.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import random
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Any, Final, cast

import httptools
import orjson

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.delivery.cloudevents import (
    BATCH_CONTENT_TYPE,
    STRUCTURED_CONTENT_TYPE,
    decode_header_value,
)
from nemesis.delivery.contract import VERDICT_HEADER
from nemesis.testing.ledger import Ledger, LedgerEntry

logger = logging.getLogger(__name__)

_REASONS: Final = {status.value: status.phrase for status in HTTPStatus}
_RENDERED_CACHE_SIZE: Final = 1024


@dataclass(frozen=True, slots=True)
class Response:
    """An answer the server gives: status, headers, body, and when."""

    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    delay_s: float = 0.0  # added to the server-wide delay
    hang: bool = False  # held until the next ``release()``
    disconnect: bool = False  # close the connection instead of answering (a crashed handler)

    @property
    def verdict(self) -> str | None:
        """The nemesis-verdict header this answer carries, if any."""
        for name, value in self.headers:
            if name.lower() == VERDICT_HEADER:
                return value
        return None


def response(
    status: int = 200,
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes | str = b"",
    delay_s: float = 0.0,
    hang: bool = False,
    disconnect: bool = False,
) -> Response:
    """A checked ``Response``: a header that could break the answer is refused."""
    if not 100 <= status <= 999:
        raise ValueError(f"status {status} is not a three-digit HTTP status")
    pairs = tuple((headers or {}).items())
    for name, value in pairs:
        if any(c in name + value for c in "\r\n\0") or not name or ":" in name:
            raise ValueError(f"response header {name!r} would break the HTTP answer")
    if delay_s < 0:
        raise ValueError("delay_s cannot be negative")
    encoded = body.encode("utf-8") if isinstance(body, str) else body
    return Response(status, pairs, encoded, delay_s, hang, disconnect)


@dataclass(slots=True, eq=False)
class Rule:
    """Answers ``response`` to the requests ``matches`` accepts, at most ``times`` times."""

    matches: Callable[[LedgerEntry], bool]
    response: Response
    times: int | None = None  # None: no limit
    used: int = 0

    @property
    def exhausted(self) -> bool:
        """Whether the rule has answered as often as it was allowed to."""
        return self.times is not None and self.used >= self.times


class HandlerServer:
    """An HTTP handler on loopback: records every delivery, answers as scripted."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        ledger_path: str | Path | None = None,
        seed: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.host = host
        self.clock = clock  # stamps arrivals: a fake one lets tests measure jumped time
        self.ledger = Ledger(ledger_path)
        self._port = port
        self._random = random.Random(seed)
        self._default = Response()
        self._rules: list[Rule] = []
        self._delay_s = (0.0, 0.0)
        self._holding = False
        self._release = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._connections_total = 0
        self._requests = 0
        self._pending = 0
        self._rendered: dict[tuple[Response, bool], bytes] = {}

    # --- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Starts listening (on a free port when ``port`` was 0)."""
        await self.accept_connections()

    async def close(self) -> None:
        """Stops listening, drops connections, cancels held answers, closes the ledger file."""
        await self.refuse_connections()
        self.ledger.close()

    async def __aenter__(self) -> HandlerServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def port(self) -> int:
        """The port; the real one once started with port 0."""
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port/``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._port}/"

    @property
    def connections(self) -> int:
        """TCP connections accepted so far."""
        return self._connections_total

    @property
    def open_connections(self) -> int:
        """TCP connections open now."""
        return len(self._connections)

    @property
    def requests(self) -> int:
        """HTTP requests received so far."""
        return self._requests

    @property
    def pending(self) -> int:
        """Answers decided but not sent yet (delayed or held)."""
        return self._pending

    # --- scripting ------------------------------------------------------------------

    def behave(
        self,
        status: int = 200,
        *,
        headers: Mapping[str, str] | None = None,
        body: bytes | str = b"",
        delay_s: float = 0.0,
        disconnect: bool = False,
    ) -> None:
        """Sets the answer to every request no rule matches."""
        self._default = response(
            status, headers=headers, body=body, delay_s=delay_s, disconnect=disconnect
        )

    def when(
        self,
        matches: Callable[[LedgerEntry], bool],
        *,
        status: int = 503,
        headers: Mapping[str, str] | None = None,
        body: bytes | str = b"",
        delay_s: float = 0.0,
        hang: bool = False,
        disconnect: bool = False,
        times: int | None = None,
    ) -> Rule:
        """Adds a rule for requests with an entry ``matches`` accepts; earlier rules win."""
        answer = response(
            status, headers=headers, body=body, delay_s=delay_s, hang=hang, disconnect=disconnect
        )
        rule = Rule(matches, answer, times)
        self._rules.append(rule)
        return rule

    def fail_ids(
        self,
        ids: Iterable[str],
        *,
        status: int = 503,
        headers: Mapping[str, str] | None = None,
        body: bytes | str = b"",
        times: int | None = None,
    ) -> Rule:
        """Answers ``status`` to every arrival of these ids."""
        failing = frozenset(ids)
        return self.when(
            lambda entry: entry.id in failing,
            status=status,
            headers=headers,
            body=body,
            times=times,
        )

    def fail_first(
        self,
        attempts: int,
        *,
        status: int = 503,
        headers: Mapping[str, str] | None = None,
        body: bytes | str = b"",
    ) -> Rule:
        """Answers ``status`` to the first ``attempts`` arrivals of every id; later ones pass."""
        return self.when(
            lambda entry: entry.id is not None and entry.receipt <= attempts,
            status=status,
            headers=headers,
            body=body,
        )

    def delay(self, min_s: float, max_s: float | None = None) -> None:
        """Delays every answer by ``min_s``, or by a random time in [min_s, max_s]."""
        max_s = min_s if max_s is None else max_s
        if not 0 <= min_s <= max_s:
            raise ValueError("need 0 <= min_s <= max_s")
        self._delay_s = (min_s, max_s)

    def hang(self) -> None:
        """Holds every answer from now on until ``release()``."""
        self._holding = True

    def release(self) -> None:
        """Sends every held answer and stops holding new ones."""
        self._holding = False
        self._release.set()
        self._release = asyncio.Event()

    def remove(self, rule: Rule) -> None:
        """Removes a rule added before."""
        self._rules.remove(rule)

    def reset(self) -> None:
        """Back to answering 200 at once: no rules, no delay, held answers released."""
        self._default = Response()
        self._rules.clear()
        self._delay_s = (0.0, 0.0)
        self.release()

    async def refuse_connections(self) -> None:
        """Stops listening and drops open connections: clients get "connection refused"."""
        if self._server is not None:
            self._server.close()
            self._server = None
        connections = list(self._connections)
        held = [task for connection in connections for task in connection.tasks]
        for connection in connections:
            connection.abort()
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        # connection_lost runs on a later loop turn; until then the sockets stay open.
        for _ in range(100):
            if not self._connections:
                break
            await asyncio.sleep(0)

    async def accept_connections(self) -> None:
        """Listens (again) on the same port."""
        if self._server is not None:
            return
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.host, self._port, reuse_address=True, backlog=1024
        )
        self._port = self._server.sockets[0].getsockname()[1]

    # --- the request path -------------------------------------------------------------

    def _connection_made(self, connection: _Connection) -> int:
        self._connections.add(connection)
        self._connections_total += 1
        return self._connections_total

    def _connection_lost(self, connection: _Connection) -> None:
        self._connections.discard(connection)

    def _handle(self, connection: _Connection, request: _Request) -> None:
        self._requests += 1
        entries = _entries(request, self._requests, connection.number)
        if entries is None:
            entries = [_bare_entry(request, self._requests, connection.number)]
            chosen = response(400, body="not a valid CloudEvents batch")
        else:
            self.ledger.admit(entries)
            chosen = self._choose(entries)
        verdict = chosen.verdict
        status = 0 if chosen.disconnect else chosen.status
        for entry in entries:
            entry.status = status
            entry.verdict = verdict
        self.ledger.record(entries)
        low, high = self._delay_s
        delay_s = chosen.delay_s + (low if high <= low else self._random.uniform(low, high))
        held = chosen.hang or self._holding
        data = None if chosen.disconnect else self._render(chosen, request.keep_alive)
        connection.send(data, request.keep_alive, delay_s, held)

    def _choose(self, entries: Sequence[LedgerEntry]) -> Response:
        for rule in self._rules:
            if rule.exhausted:
                continue
            try:
                matched = any(rule.matches(entry) for entry in entries)
            except Exception:
                # A test's predicate is arbitrary code: its bug must show as a logged
                # traceback and a 500, not as a connection the parser gave up on.
                logger.exception("a handler rule predicate failed")
                return response(500, body="rule predicate failed")
            if matched:
                rule.used += 1
                return rule.response
        return self._default

    def _render(self, answer: Response, keep_alive: bool) -> bytes:
        key = (answer, keep_alive)
        rendered = self._rendered.get(key)
        if rendered is None:
            rendered = _render(answer, keep_alive)
            if len(self._rendered) < _RENDERED_CACHE_SIZE:
                self._rendered[key] = rendered
        return rendered

    def _held_until(self) -> asyncio.Event:
        return self._release


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    received_monotonic: float
    received_wall: float


class _Connection(asyncio.Protocol):
    """One TCP connection: parses requests with httptools, writes answers in order."""

    def __init__(self, server: HandlerServer) -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self.number = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self._tail: asyncio.Task[None] | None = None
        self._url = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self.number = self._server._connection_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connection_lost(self)
        for task in self.tasks:
            task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._write(_render(response(400, body="bad request"), keep_alive=False), False)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._raw_headers = []
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # Decoded once per request in _decoded_headers: this callback is the hottest spot.
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._headers = _decoded_headers(self._raw_headers)
        if self._headers.get("expect", "").lower() == "100-continue" and self._transport:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = _Request(
            method=self._parser.get_method().decode("ascii", errors="replace"),
            path=self._url.decode("latin-1"),
            headers=self._headers,
            body=body,
            keep_alive=self._parser.should_keep_alive(),
            received_monotonic=self._server.clock.monotonic(),
            received_wall=self._server.clock.time(),
        )
        self._server._handle(self, request)

    # answers

    def send(self, data: bytes | None, keep_alive: bool, delay_s: float, held: bool) -> None:
        """Writes an answer (None: drops the connection), after earlier ones on this connection."""
        if delay_s <= 0 and not held and self._tail is None:
            self._write(data, keep_alive)
            return
        release = self._server._held_until() if held else None
        task = asyncio.get_running_loop().create_task(
            self._send_later(self._tail, data, keep_alive, delay_s, release)
        )
        self._server._pending += 1
        self._tail = task
        self.tasks.add(task)
        task.add_done_callback(self._answered)

    async def _send_later(
        self,
        previous: asyncio.Task[None] | None,
        data: bytes | None,
        keep_alive: bool,
        delay_s: float,
        release: asyncio.Event | None,
    ) -> None:
        if previous is not None:
            # HTTP/1.1 answers go out in request order; waiting does not raise.
            await asyncio.wait([previous])
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if release is not None:
            await release.wait()
        self._write(data, keep_alive)

    def _answered(self, task: asyncio.Task[None]) -> None:
        self._server._pending -= 1
        self.tasks.discard(task)
        if self._tail is task:
            self._tail = None

    def _write(self, data: bytes | None, keep_alive: bool) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if data is None:
            transport.abort()
            return
        transport.write(data)
        if not keep_alive:
            transport.close()


def _decoded_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in raw:
        key = name.decode("latin-1").lower()
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            text = value.decode("latin-1")
        # A repeated header is one comma-separated list (RFC 9110, section 5.3).
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


def _render(answer: Response, keep_alive: bool) -> bytes:
    reason = _REASONS.get(answer.status, "Status")
    lines = [f"HTTP/1.1 {answer.status} {reason}", f"content-length: {len(answer.body)}"]
    if not keep_alive:
        lines.append("connection: close")
    lines.extend(f"{name}: {value}" for name, value in answer.headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + answer.body


# --- turning a request into ledger entries --------------------------------------------


def _entries(request: _Request, number: int, connection: int) -> list[LedgerEntry] | None:
    """The request's entries; None when a batch or structured body does not parse."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type not in (BATCH_CONTENT_TYPE, STRUCTURED_CONTENT_TYPE):
        return [_binary_entry(request, number, connection)]
    try:
        parsed = orjson.loads(request.body)
        if media_type == STRUCTURED_CONTENT_TYPE:
            return [_structured_entry(parsed, request, number, connection, "structured", 0)]
        if not isinstance(parsed, list):
            return None
        return [
            _structured_entry(event, request, number, connection, "batch", len(parsed))
            for event in parsed
        ]
    except (ValueError, TypeError):  # invalid JSON or base64, an event that is not an object
        return None


def _binary_entry(request: _Request, number: int, connection: int) -> LedgerEntry:
    get = request.headers.get
    return LedgerEntry(
        request=number,
        connection=connection,
        id=_decoded(get("ce-id")),
        topic=_decoded(get("ce-topic")),
        partition=_int(get("ce-partition")),
        offset=_int(get("ce-offset")),
        attempt=_int(get("ce-attempt")),
        type=_decoded(get("ce-type")),
        source=_decoded(get("ce-source")),
        time=get("ce-time"),
        key=_decoded(get("ce-partitionkey")),
        content_type=get("content-type"),
        body=request.body,
        headers=request.headers,
        received_monotonic=request.received_monotonic,
        received_wall=request.received_wall,
        method=request.method,
        path=request.path,
    )


def _structured_entry(
    event: Any, request: _Request, number: int, connection: int, mode: str, batch_size: int
) -> LedgerEntry:
    if not isinstance(event, dict):
        raise TypeError("a CloudEvent must be a JSON object")
    if "data_base64" in event:
        body = base64.b64decode(str(event["data_base64"]), validate=True)
    elif "data" in event:
        body = orjson.dumps(event["data"])
    else:
        body = b""
    get = event.get
    return LedgerEntry(
        request=number,
        connection=connection,
        id=_str(get("id")),
        topic=_str(get("topic")),
        partition=_int(get("partition")),
        offset=_int(get("offset")),
        attempt=_int(get("attempt")),
        type=_str(get("type")),
        source=_str(get("source")),
        time=_str(get("time")),
        key=_str(get("partitionkey")),
        content_type=_str(get("datacontenttype")),
        body=body,
        headers=request.headers,
        received_monotonic=request.received_monotonic,
        received_wall=request.received_wall,
        mode=mode,
        batch_size=batch_size,
        method=request.method,
        path=request.path,
    )


def _bare_entry(request: _Request, number: int, connection: int) -> LedgerEntry:
    entry = _binary_entry(request, number, connection)
    entry.mode = "batch"
    entry.id = None
    return entry


def _decoded(value: str | None) -> str | None:
    return None if value is None else decode_header_value(value)


def _str(value: object) -> str | None:
    return None if value is None else str(value)


def _int(value: object) -> int | None:
    if value is None:
        return None
    try:
        return int(str(value))
    except ValueError:
        return None


# --- the standalone process ------------------------------------------------------------


def _delay_arg(text: str) -> tuple[float, float]:
    low, _, high = text.partition(":")
    return float(low) / 1000, float(high or low) / 1000


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m nemesis.testing.handler",
        description="A Nemesis test handler: records deliveries (JSON lines), answers as told.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    parser.add_argument("--ledger", type=Path, help="append every delivery to this JSON-lines file")
    parser.add_argument("--status", type=int, default=200, help="the default answer")
    parser.add_argument("--verdict", choices=("drop", "dead", "retry"), help="nemesis-verdict")
    parser.add_argument("--retry-after", help="a Retry-After header on every answer")
    parser.add_argument("--fail-first", type=int, default=0, metavar="N", help="503 N times per id")
    parser.add_argument(
        "--delay-ms", type=_delay_arg, metavar="MS[:MAX_MS]", help="fixed or random delay"
    )
    parser.add_argument("--seed", type=int, help="seed for random delays")
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    retry_after = {"retry-after": args.retry_after} if args.retry_after else {}
    verdict = {VERDICT_HEADER: args.verdict} if args.verdict else {}
    server = HandlerServer(args.host, args.port, ledger_path=args.ledger, seed=args.seed)
    server.behave(args.status, headers={**verdict, **retry_after})
    if args.fail_first:
        server.fail_first(args.fail_first, headers=retry_after)
    if args.delay_ms:
        server.delay(*args.delay_ms)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        # The line a parent process waits for: it names the port when --port was 0.
        print(f"listening on {server.url}", flush=True)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the handler until SIGTERM or SIGINT."""
    args = _parse_args(argv)
    try:
        import uvloop
    except ImportError:
        loop_factory = None
    else:
        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
