"""Nemesis' own HTTP/1.1 transport: keep-alive connections on asyncio.Protocol and httptools.

The default transport of ``http://`` and ``https://`` targets (``target.transport:
h1``). A general client library spends most of a delivery's CPU on what a
delivery does not need (cookie jars, redirects, streaming readers, a timer per
request): this one writes one POST per event (CloudEvents binary mode) or per
batch on a pooled keep-alive connection and parses the answer with httptools
(llhttp, the parser uvicorn uses), on whatever event loop runs it (uvloop when
the ``speed`` extra is installed, asyncio's own otherwise).

Like every transport it only moves bytes: it hands ``nemesis.delivery.contract``
either an answer (status, headers, the first KiB of the body) or a
``WireError``, and the contract makes the ``DeliveryResult``.

What it owns, which a client library would otherwise:

- a pool of keep-alive connections per transport (one target), at most
  ``max_connections`` open; a request waits for a free one within its
  deadline. ``Connection: close`` (and HTTP/1.0) answers are honoured, and
  connections idle for ``KEEPALIVE_S`` are closed by a reaper.
- the resend rule: a request is never sent twice. A pooled connection the
  handler is known to have closed (its EOF already read) is discarded before
  anything is written, and a fresh one is used. Once the request is written,
  a connection that closes before the status line arrives is a retryable
  outcome ("connection closed before the response"): the handler may have
  taken the message, so the retry path (which the handler de-duplicates by
  ``ce-id``) decides, not a silent resend.
- once the status line and headers are in, the status decides the outcome,
  as with any client: a body cut short, over ``DRAIN_LIMIT_BYTES`` or badly
  framed only costs the connection.
- bounded answers: a head over ``MAX_HEAD_BYTES`` is a ``TOO_LARGE`` wire
  error; informational answers (100, 103) are skipped; 204 and 304 carry no
  body; chunked, content-length and read-until-close bodies are read.
- one deadline per request (``target.timeout_s``, from the wait for a
  connection to the end of the answer), kept by ``Deadlines``' single timer.
- TLS through the loop's SSL support: certificates verified against the
  system's CAs (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` name others) or
  ``target.tls.ca_file``'s, the host name (or ``target.tls.server_name``)
  checked and sent as SNI, a client certificate presented when
  ``target.tls.cert_file`` is set (``nemesis.delivery.tls``).
- DNS: the host is resolved for each new connection, never cached, and the
  connections rotate over the addresses it resolves to, so a handler behind
  a service name spreads its load over all of them and follows their changes.
- no header injection: ``target.headers`` are checked when the transport is
  made (``ConfigError``), the CloudEvents attributes are percent-encoded, and
  a request whose head would still hold CR, LF or NUL is not sent (DEAD).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import errno
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import httptools

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import TargetConfig, TlsConfig
from nemesis.delivery.cloudevents import (
    BATCH_CONTENT_TYPE,
    batch_body,
    binary_header_lines,
    binary_headers,
    constant_headers,
    full_binary_headers,
    source_for,
)
from nemesis.delivery.contract import (
    ERROR_BODY_BYTES,
    WireError,
    WireFailure,
    contract_for,
    timeout_after,
)
from nemesis.delivery.deadlines import Deadlines
from nemesis.delivery.http_common import (
    DRAIN_LIMIT_BYTES,
    KEEPALIVE_S,
    USER_AGENT,
    check_http_target,
    checked_headers,
    parse_http_url,
)
from nemesis.delivery.port import DeliveryResult, Event
from nemesis.delivery.tls import ssl_context

# A status line and headers longer than this are not read: no handler needs them.
MAX_HEAD_BYTES: Final = 64 * 1024
# Sets of shared headers a transport keeps (one per event type and topic it delivers).
_CONSTANT_HEADER_SETS: Final = 256
# A body larger than this is written apart from the head rather than joined to it.
_JOIN_BELOW_BYTES: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class H1TransportStatistics:
    """A snapshot of one transport's counters."""

    requests: int  # requests written
    in_flight: int  # deliveries waiting for an answer now
    open_connections: int
    idle_connections: int
    connects: int  # connections opened
    discarded: int  # pooled connections the handler closed (dropped before any reuse)
    max_connections: int


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer parsed by httptools."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False  # the peer closed (EOF) or the connection was lost
        self.reusable = False  # the last answer left it ready for another request
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._stray = False  # bytes after the answer: the connection is out of step
        self._head_bytes = 0
        self._headers_done = False
        self._message_done = False
        self._keep_alive = False  # the answer lets the connection serve another request
        # Called when the connection is lost while no request uses it (set by the pool).
        self.on_idle_lost: Callable[[_Connection], None] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self._body_bytes = 0
        self.error: WireError | None = None

    # --- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses).
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._message_done:
            # Bytes nobody asked for: the connection is out of step; never reuse it.
            self.reusable = False
            self._abort()
            return
        if not self._headers_done:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(WireError(WireFailure.PROTOCOL, "unrequested protocol switch"))
            return
        except httptools.HttpParserError as exc:
            self._broken_answer(str(exc) or type(exc).__name__)
            return
        if self._head_bytes > MAX_HEAD_BYTES:
            self._fail(WireError(WireFailure.TOO_LARGE, f"headers over {MAX_HEAD_BYTES} bytes"))
        elif self.answered():
            self._finish()
        elif self._body_bytes > DRAIN_LIMIT_BYTES:
            # A longer body is not read to the end: closing the connection is cheaper.
            self._finish()

    def eof_received(self) -> bool:
        self.closed = True
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if self._waiter is None:
            if self.on_idle_lost is not None:
                self.on_idle_lost(self)  # closed by the handler while pooled
            return
        if self._waiter.done():
            return
        if self._headers_done:
            # The status arrived and decides; a body read until close ends here too.
            self._finish()
        elif isinstance(exc, OSError) and exc.errno == errno.ECONNRESET:
            self._fail(WireError(WireFailure.RESET, "connection reset before the response"))
        else:
            self._fail(WireError(WireFailure.RESET, "connection closed before the response"))

    # --- httptools callbacks ----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._message_done:
            # A second answer in the same read: ignored, and the connection is not reused.
            self._stray = True
            return
        self._headers_done = False
        self.headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted here too: a head that arrives in one read is parsed whole before the check.
        self._head_bytes += len(name) + len(value)
        if not self._stray:
            self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._stray:
            return
        self.status = self._parser.get_status_code()
        if self.status >= 200:
            self._headers_done = True
            # Read now: llhttp forgets it once the message is complete.
            self._keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self._stray:
            return
        if self._body_bytes < ERROR_BODY_BYTES:
            self.body += body[: ERROR_BODY_BYTES - self._body_bytes]
        self._body_bytes += len(body)

    def on_message_complete(self) -> None:
        if self._stray or self.status < 200:
            return  # 100 Continue, 103 Early Hints: the final answer follows
        self._message_done = True

    # --- the request ------------------------------------------------------------------

    def send(self, data: bytes, body: bytes | None) -> asyncio.Future[None]:
        """Writes one request; the future is done when its answer (or failure) is in."""
        assert self.transport is not None
        self.reusable = False
        self._stray = False
        self._head_bytes = 0
        self._headers_done = False
        self._message_done = False
        self._keep_alive = False
        self.status = 0
        self.body = b""
        self._body_bytes = 0
        self.error = None
        waiter = self._waiter = self.loop.create_future()
        if body is None:
            self.transport.write(data)
        else:
            self.transport.writelines((data, body))
        return waiter

    def _finish(self) -> None:
        complete = self._message_done
        transport = self.transport
        self.reusable = (
            complete
            and not self._stray
            and not self.closed
            and self._keep_alive
            and transport is not None
            and not transport.is_closing()
            # An answer that came before the whole request was written (a handler
            # refusing early): what is left of the request must not reach the next one.
            and transport.get_write_buffer_size() == 0
        )
        if not self.reusable:
            self._abort()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _broken_answer(self, detail: str) -> None:
        if self._headers_done:
            # A framing error in the body: the status already decides.
            self._finish()
        else:
            self._fail(WireError(WireFailure.PROTOCOL, detail))

    def _fail(self, error: WireError) -> None:
        self.error = error
        self.reusable = False
        self._abort()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def answered(self) -> bool:
        """Whether the final answer to the request is in, whole."""
        return self._message_done

    def is_open(self) -> bool:
        """Whether the connection can still be written to."""
        return self.transport is not None and not self.transport.is_closing()

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def done_with_request(self) -> None:
        """Called once the caller stopped waiting (answered, failed, or cancelled)."""
        if not (self._waiter is not None and self._waiter.done()):
            self.reusable = False  # cancelled mid-request: its state is unknown
            self._abort()
        self._waiter = None

    def close(self) -> None:
        self.reusable = False
        self._abort()


class _Target:
    """Where the requests go: host, port, TLS, and the start of every request head."""

    def __init__(self, url: str, integration: str, tls: TlsConfig | None) -> None:
        parts = parse_http_url(url, integration)
        port = parts.port
        # user:password@ in the URL: sent as Basic credentials, as HTTP clients do.
        self.basic_credentials: str | None = None
        self.secrets: list[str] = []  # to be kept out of error text
        if parts.username is not None or parts.password is not None:
            self.secrets = [parts.password or ""]
            pair = f"{parts.username or ''}:{parts.password or ''}"
            self.basic_credentials = "Basic " + base64.b64encode(pair.encode()).decode()
        self.tls = parts.tls
        self.host = parts.host
        self.port = port or (443 if self.tls else 80)
        path = parts.path
        try:
            self.address: str | None = str(ipaddress.ip_address(self.host))
        except ValueError:
            self.address = None  # a name: resolved for each new connection
        host_header = f"[{self.host}]" if ":" in self.host else self.host
        if port is not None:
            host_header += f":{port}"
        self.request_line = f"POST {path} HTTP/1.1\r\nhost: {host_header}\r\n"
        # Made now, so that a TLS file that does not load is a ConfigError, not a failed delivery.
        self.ssl = ssl_context(tls, where=f"integration {integration}") if self.tls else None
        # The name the certificate must hold; sent as SNI unless it is an address.
        server_name = tls.server_name if tls is not None else None
        self.server_hostname = (server_name or self.host) if self.tls else None


Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def resolve_host(host: str, port: int) -> list[str]:
    """The addresses of ``host``, asked of the system resolver each time (never cached)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class PoolClosed(Exception):
    """The transport was closed while a request waited for a connection."""


class _Pool:
    """At most ``limit`` connections to one target; idle ones kept for ``keepalive_s``."""

    def __init__(
        self, target: _Target, limit: int, keepalive_s: float, resolve: Resolver | None
    ) -> None:
        self._target = target
        self._resolve = resolve or resolve_host
        self._limit = limit
        self._keepalive_s = keepalive_s
        self._idle: collections.deque[_Connection] = collections.deque()  # oldest left
        self._busy = 0  # connections handed out, or being opened
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._rotation = 0
        self._reaper: asyncio.TimerHandle | None = None
        self._closed = False
        self.connects = 0
        self.discarded = 0

    @property
    def open_connections(self) -> int:
        return self._busy + len(self._idle)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def acquire(self) -> _Connection:
        """A connection for one request: a pooled one still open, else a new one."""
        while self._busy + len(self._idle) >= self._limit and not self._idle:
            if self._closed:
                raise PoolClosed
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_next()  # pass the wake-up on: this caller leaves
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
        if self._closed:
            raise PoolClosed
        connection = self.take_idle()
        if connection is not None:
            return connection
        self._busy += 1
        try:
            return await self._connect()
        except BaseException:
            self._busy -= 1
            self._wake_next()
            raise

    def take_idle(self) -> _Connection | None:
        """A pooled connection still open, if there is one (``acquire`` without waiting)."""
        idle = self._idle
        while idle:
            connection = idle.pop()  # the most recently used: least likely to be closed
            if connection.closed or not connection.reusable or not connection.is_open():
                # Known closed before anything was written: discard it, nothing is lost.
                self.discarded += 1
                connection.close()
                continue
            self._busy += 1
            return connection
        return None

    def release(self, connection: _Connection) -> None:
        """Takes a connection back after its request: pooled if reusable, closed otherwise."""
        self._busy -= 1
        if connection.reusable and not connection.closed and not self._closed:
            loop = connection.loop
            connection.idle_since = loop.time()
            connection.on_idle_lost = self._lost_while_idle
            self._idle.append(connection)
            if self._reaper is None:
                self._reaper = loop.call_later(self._keepalive_s, self._reap, loop)
        else:
            connection.close()
        self._wake_next()

    def close(self) -> None:
        self._closed = True
        for connection in self._idle:
            connection.close()
        self._idle.clear()
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _lost_while_idle(self, connection: _Connection) -> None:
        # The handler closed a pooled connection: it leaves the pool at once, so that it
        # holds no place under the limit and is never picked for a request.
        if connection in self._idle:
            self._idle.remove(connection)
            self.discarded += 1
            self._wake_next()

    def _wake_next(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _reap(self, loop: asyncio.AbstractEventLoop) -> None:
        self._reaper = None
        idle = self._idle
        now = loop.time()
        while idle and (idle[0].closed or now - idle[0].idle_since >= self._keepalive_s):
            idle.popleft().close()
        if idle:
            self._reaper = loop.call_at(idle[0].idle_since + self._keepalive_s, self._reap, loop)
        self._wake_next()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        target = self._target
        if target.address is not None:
            addresses: Sequence[str] = [target.address]
        else:
            addresses = await self._resolve(target.host, target.port)
            if not addresses:
                raise socket.gaierror(socket.EAI_NONAME, "no address")
        # Each new connection starts at the next address: the load spreads over all of them.
        start = self._rotation % len(addresses)
        self._rotation += 1
        failure: OSError | None = None
        for address in [*addresses[start:], *addresses[:start]]:
            try:
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop),
                    address,
                    target.port,
                    ssl=target.ssl,
                    server_hostname=target.server_hostname,
                )
            except ssl.SSLError:
                raise  # the address answered: its certificate is what failed
            except OSError as exc:
                failure = exc
                continue
            self.connects += 1
            return connection
        assert failure is not None
        raise failure


class H1Transport:
    """Delivers one integration's events to its HTTP handler over pooled HTTP/1.1 connections."""

    def __init__(
        self,
        target: TargetConfig,
        *,
        integration: str,
        max_connections: int,
        clock: Clock = SYSTEM_CLOCK,
        keepalive_s: float = KEEPALIVE_S,
        resolve: Resolver | None = None,
    ) -> None:
        check_http_target(target, integration)  # what `nemesis validate` checks too
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._target = _Target(target.url, integration, target.tls)
        self._timeout_s = target.timeout_s
        self._deadlines = Deadlines(target.timeout_s)
        self._max_connections = max_connections
        self._clock = clock
        self._source = source_for(integration)
        own_headers = checked_headers(target.headers, integration)
        credentials = self._target.basic_credentials
        if credentials is not None and "authorization" not in own_headers:
            own_headers["authorization"] = credentials
        self._contract = contract_for(
            target,
            integration=integration,
            clock=clock,
            redact=[*own_headers.values(), *self._target.secrets],
        )
        self._signs = self._contract.signs
        extra = {
            "user-agent": USER_AGENT,
            "accept": "*/*",
            # The body is read only for error text: compression would be waste.
            "accept-encoding": "identity",
            **own_headers,
        }
        self._extra_head = "".join(f"{name}: {value}\r\n" for name, value in extra.items())
        self._batch_head = (
            f"{self._target.request_line}content-type: {BATCH_CONTENT_TYPE}\r\n{self._extra_head}"
        )
        # The head of every event of a (type, topic, content type), up to its own headers.
        self._constant_heads: dict[tuple[str, str, str], str] = {}
        self._pool = _Pool(self._target, max_connections, keepalive_s, resolve)
        self._closed = False
        self._requests = 0
        self._in_flight = 0

    def deliver(self, event: Event) -> Coroutine[Any, Any, DeliveryResult]:
        """POSTs one event in CloudEvents binary mode."""
        if not event.plain:
            return self._deliver_in_full(event)
        shared = (event.type, event.message.topic, event.content_type)
        head = self._constant_heads.get(shared)
        if head is None:
            head = self._constant_head(shared)
        body = event.message.value if event.payload is None else event.payload
        _, lines = binary_header_lines(event)
        if self._signs:
            signed = self._contract.sign_http(binary_headers(event, self._source).items(), body)
            lines += "".join(f"{name}: {value}\r\n" for name, value in signed)
        return self._post(head, lines, body, (body,))

    def _deliver_in_full(self, event: Event) -> Coroutine[Any, Any, DeliveryResult]:
        """An event off the fast path: a CloudEvents record, a binary key, forwarded headers."""
        body = event.body
        headers = full_binary_headers(event, self._source)
        # Every value is percent-encoded or a number: no line holds a CR, LF or NUL.
        head = self._target.request_line + "".join(f"{n}: {v}\r\n" for n, v in headers)
        head += self._extra_head
        lines = ""
        if self._signs:
            signed = self._contract.sign_http(headers, body)
            lines = "".join(f"{name}: {value}\r\n" for name, value in signed)
        return self._post(head, lines, body, (body,))

    def deliver_batch(self, events: Sequence[Event]) -> Coroutine[Any, Any, DeliveryResult]:
        """POSTs the events as one CloudEvents JSON batch; the result applies to each."""
        if not events:
            raise ValueError("deliver_batch needs at least one event")
        body = batch_body(events, self._source)
        lines = ""
        if self._signs:
            batch = [("content-type", BATCH_CONTENT_TYPE)]
            signed = self._contract.sign_http(batch, body, batch=True)
            lines = "".join(f"{name}: {value}\r\n" for name, value in signed)
        return self._post(self._batch_head, lines, body, [event.body for event in events])

    async def close(self) -> None:
        """Closes the pooled connections; later deliveries answer RETRY."""
        self._closed = True
        self._pool.close()
        self._deadlines.close()

    def statistics(self) -> H1TransportStatistics:
        """A snapshot of the counters."""
        pool = self._pool
        return H1TransportStatistics(
            requests=self._requests,
            in_flight=self._in_flight,
            open_connections=pool.open_connections,
            idle_connections=pool.idle_connections,
            connects=pool.connects,
            discarded=pool.discarded,
            max_connections=self._max_connections,
        )

    def _constant_head(self, shared: tuple[str, str, str]) -> str:
        if len(self._constant_heads) >= _CONSTANT_HEADER_SETS:
            self._constant_heads.clear()  # a topic with ever new types: stay bounded
        type_, topic, content_type = shared
        constant = constant_headers(self._source, type_, topic, content_type)
        head = self._target.request_line + "".join(
            f"{name}: {value}\r\n" for name, value in constant.items()
        )
        head += self._extra_head
        self._constant_heads[shared] = head
        return head

    async def _post(
        self, head: str, lines: str, body: bytes, sent: Collection[bytes]
    ) -> DeliveryResult:
        """POSTs ``body`` with ``head`` (the constant part) and ``lines`` (its own headers)."""
        contract = self._contract
        if self._closed:
            return contract.wire_error(WireError(WireFailure.CLOSED), None)
        data = f"{head}{lines}content-length: {len(body)}\r\n\r\n".encode()
        separate: bytes | None = None
        if len(body) < _JOIN_BELOW_BYTES:
            data += body
        else:
            separate = body
        started = self._clock.monotonic()
        self._in_flight += 1
        deadlines = self._deadlines
        # target.timeout_s, from here to the end of the answer: the wait for a connection
        # and its opening included.
        deadline = deadlines.start()
        pool = self._pool
        connection: _Connection | None = None
        try:
            try:
                connection = pool.take_idle() or await pool.acquire()
            except PoolClosed:
                return contract.wire_error(WireError(WireFailure.CLOSED), None)
            except ssl.SSLError as exc:
                return contract.wire_error(WireError(WireFailure.TLS, _ssl_detail(exc)), started)
            except OSError as exc:
                return contract.wire_error(_connect_error(exc, self._target.host), started)
            self._requests += 1
            await connection.send(data, separate)
            if connection.error is not None:
                return contract.wire_error(connection.error, started)
            return contract.http_answer(
                connection.status, connection.headers, connection.body, sent, started
            )
        except asyncio.CancelledError:
            if deadline.timed_out():
                return contract.wire_error(timeout_after(self._timeout_s), started)
            raise
        finally:
            deadlines.finish(deadline)
            self._in_flight -= 1
            if connection is not None:
                connection.done_with_request()
                pool.release(connection)


def _ssl_detail(exc: ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return exc.verify_message or "certificate verify failed"
    return exc.reason or type(exc).__name__


def _connect_error(exc: OSError, host: str) -> WireError:
    """Why a new connection could not be made (nothing was sent)."""
    if isinstance(exc, socket.gaierror):
        return WireError(WireFailure.DNS, host)
    if isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED:
        return WireError(WireFailure.REFUSED)
    return WireError(WireFailure.CONNECT, exc.strerror or type(exc).__name__)
