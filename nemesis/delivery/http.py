"""The HTTP transport: CloudEvents over HTTP/1.1 on a pooled aiohttp session.

It moves bytes and nothing more: one POST per event in CloudEvents binary
mode, or one POST per batch in the CloudEvents JSON batch format
(``nemesis.delivery.cloudevents``). What comes back (a status, headers and
the first KiB of the body) or what went wrong on the wire (aiohttp's
exceptions, translated here into a ``WireError``, never reaching the caller)
is turned into a ``DeliveryResult`` by ``nemesis.delivery.contract``, which
owns the outcome table, verdicts, Retry-After and error text.

aiohttp rather than httpx: it delivers 10-15x more requests per CPU second.
"""

from __future__ import annotations

import asyncio
import errno
import ssl
from collections.abc import Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
from multidict import CIMultiDict

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import TargetConfig
from nemesis.delivery.cloudevents import (
    BATCH_CONTENT_TYPE,
    batch_body,
    binary_headers_from,
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
    checked_headers,
)
from nemesis.delivery.port import DeliveryResult, Event, config_problem
from nemesis.delivery.tls import ssl_context
from nemesis.errors import ConfigError

_NO_CONTENT_TYPE: Final = ("content-type",)
# Sets of shared headers a transport keeps (one per event type and topic it delivers).
_CONSTANT_HEADER_SETS: Final = 256
_NO_TIMEOUT: Final = aiohttp.ClientTimeout(
    total=None, connect=None, sock_read=None, sock_connect=None
)


@dataclass(frozen=True, slots=True)
class HttpTransportStatistics:
    """A snapshot of one transport's counters."""

    requests: int  # HTTP requests sent, resends included
    in_flight: int  # deliveries waiting for an answer now
    resends: int  # requests sent again at once after a pooled connection died under them
    max_connections: int


class HttpTransport:
    """Delivers one integration's events to its HTTP handler over a pooled aiohttp session."""

    def __init__(
        self,
        target: TargetConfig,
        *,
        integration: str,
        max_connections: int,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if target.scheme not in ("http", "https"):
            raise ConfigError(
                [config_problem(integration, "target.url", "the HTTP transport needs http(s)://")]
            )
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._url = target.url
        # aiohttp's default (True): the system's CAs. Made now, so that a TLS file that
        # does not load is a ConfigError, not a failed delivery.
        self._ssl: ssl.SSLContext | bool = True
        self._server_hostname: str | None = None  # None: the URL's host
        if target.tls is not None and target.scheme == "https":
            self._ssl = ssl_context(target.tls, where=f"integration {integration}")
            self._ssl.set_alpn_protocols(["http/1.1"])  # as aiohttp's own default context
            self._server_hostname = target.tls.server_name
        self._timeout_s = target.timeout_s
        self._deadlines = Deadlines(target.timeout_s)
        self._max_connections = max_connections
        self._clock = clock
        self._source = source_for(integration)
        own_headers = checked_headers(target.headers, integration)
        self._contract = contract_for(
            target, integration=integration, clock=clock, redact=own_headers.values()
        )
        self._signs = self._contract.signs
        # Sent with every request, so that aiohttp adds none of its own: asking it to skip
        # its defaults (skip_auto_headers) costs more per request than sending these.
        self._extra_headers = {
            "user-agent": USER_AGENT,
            "accept": "*/*",
            # The body is drained unread: asking for compression would be waste.
            "accept-encoding": "identity",
            **own_headers,
        }
        self._batch_headers = {"content-type": BATCH_CONTENT_TYPE, **self._extra_headers}
        # Headers every event of a (type, topic, content type) shares, with the extra ones.
        self._constant_headers: dict[tuple[str, str, str], dict[str, str]] = {}
        # Opened on first use: an aiohttp session must be created inside the running loop.
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._requests = 0
        self._in_flight = 0
        self._resends = 0

    def deliver(self, event: Event) -> Coroutine[Any, Any, DeliveryResult]:
        """POSTs one event in CloudEvents binary mode.

        A plain function returning ``_post``'s coroutine, so that no frame of its
        own sits between the caller and aiohttp (it would be resumed at every
        suspension of the request).
        """
        if not event.plain:
            return self._deliver_in_full(event)
        shared = (event.type, event.message.topic, event.content_type)
        constant = self._constant_headers.get(shared)
        if constant is None:
            constant = self._constant_for(shared)
        body = event.message.value if event.payload is None else event.payload  # event.body
        headers = binary_headers_from(constant, event)
        if self._signs:
            headers.update(self._contract.sign_http(headers.items(), body))
        return self._post(body, headers, (body,))

    def _deliver_in_full(self, event: Event) -> Coroutine[Any, Any, DeliveryResult]:
        """An event off the fast path: a CloudEvents record, a binary key, forwarded headers."""
        body = event.body
        headers = CIMultiDict(full_binary_headers(event, self._source))
        headers.extend(self._extra_headers)
        if self._signs:
            headers.extend(self._contract.sign_http(headers.items(), body))
        # An event without data has no content type: aiohttp must not add its own.
        skip = () if "content-type" in headers else _NO_CONTENT_TYPE
        return self._post(body, headers, (body,), skip)

    def _constant_for(self, shared: tuple[str, str, str]) -> dict[str, str]:
        if len(self._constant_headers) >= _CONSTANT_HEADER_SETS:
            self._constant_headers.clear()  # a topic with ever new types: stay bounded
        type_, topic, content_type = shared
        constant = constant_headers(self._source, type_, topic, content_type)
        constant.update(self._extra_headers)
        self._constant_headers[shared] = constant
        return constant

    def deliver_batch(self, events: Sequence[Event]) -> Coroutine[Any, Any, DeliveryResult]:
        """POSTs the events as one CloudEvents JSON batch; the result applies to each."""
        if not events:
            raise ValueError("deliver_batch needs at least one event")
        body = batch_body(events, self._source)
        headers = self._batch_headers
        if self._signs:
            signed = self._contract.sign_http(headers.items(), body, batch=True)
            headers = {**headers, **dict(signed)}
        return self._post(body, headers, [event.body for event in events])

    async def close(self) -> None:
        """Closes the pooled connections; later deliveries answer RETRY."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
        self._deadlines.close()

    def statistics(self) -> HttpTransportStatistics:
        """A snapshot of the counters."""
        return HttpTransportStatistics(
            requests=self._requests,
            in_flight=self._in_flight,
            resends=self._resends,
            max_connections=self._max_connections,
        )

    def _open_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, keepalive_timeout=KEEPALIVE_S, ssl=self._ssl
        )
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            # No timeout of aiohttp's own: _post keeps target.timeout_s with Deadlines
            # (one timer per transport instead of one per request; see that module).
            timeout=_NO_TIMEOUT,
            raise_for_status=False,
            # The body is drained unread: decompressing it is waste.
            auto_decompress=False,
            trust_env=False,
        )

    async def _post(
        self,
        body: bytes,
        headers: Mapping[str, str],
        sent: Collection[bytes],
        skip: tuple[str, ...] = (),
    ) -> DeliveryResult:
        if self._closed:
            return self._contract.wire_error(WireError(WireFailure.CLOSED), None)
        if self._session is None:
            self._session = self._open_session()
        session = self._session
        started = self._clock.monotonic()
        self._in_flight += 1
        # target.timeout_s, from here to the end of the answer: the wait for a pooled
        # connection and a resend included.
        deadlines = self._deadlines
        deadline = deadlines.start()
        try:
            resent = False
            while True:
                self._requests += 1
                try:
                    async with session.post(
                        self._url,
                        data=body,
                        headers=headers,
                        skip_auto_headers=skip or None,
                        allow_redirects=False,
                        server_hostname=self._server_hostname,
                    ) as response:
                        kept = await _drain(response)
                        return self._contract.http_answer(
                            response.status, response.headers, kept, sent, started
                        )
                except (aiohttp.ClientError, OSError) as exc:
                    if (
                        not resent
                        and _died_under_us(exc)
                        and not self._closed
                        and deadlines.left(deadline) > 0
                    ):
                        # The pooled connection was closed by the handler as we reused it
                        # (an idle-timeout race). Sending again at once beats a trip through
                        # the retry tiers; the handler de-duplicates by ce-id anyway.
                        self._resends += 1
                        resent = True
                        continue
                    return self._contract.wire_error(wire_error(exc), started)
        except asyncio.CancelledError:
            if deadline.timed_out():
                return self._contract.wire_error(timeout_after(self._timeout_s), started)
            raise
        finally:
            deadlines.finish(deadline)
            self._in_flight -= 1


def http_transport(
    target: TargetConfig, *, integration: str, max_connections: int
) -> HttpTransport:
    """The HTTP transport for one integration; ``max_connections`` is its worker count.

    Waiting for a free pooled connection counts against ``target.timeout_s``, so
    ``max_connections`` should be at least the number of concurrent deliveries.
    """
    return HttpTransport(target, integration=integration, max_connections=max_connections)


async def _drain(response: aiohttp.ClientResponse) -> bytes:
    """Reads the body to its end so the connection can be reused; keeps its first KiB."""
    content = response.content
    if content.at_eof():
        return b""  # a body-less answer, the usual one: nothing to wait for
    kept = b""
    read = 0
    try:
        while chunk := await content.readany():
            if len(kept) < ERROR_BODY_BYTES:
                kept += chunk[: ERROR_BODY_BYTES - len(kept)]
            read += len(chunk)
            if read > DRAIN_LIMIT_BYTES:
                response.close()
                break
    except (TimeoutError, aiohttp.ClientError, OSError):
        # The status already arrived and decides the outcome; only the connection is lost.
        response.close()
    return kept


def _died_under_us(exc: BaseException) -> bool:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False  # a new connection could not be made: nothing was sent
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientConnectionResetError):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE)


def wire_error(exc: aiohttp.ClientError | OSError) -> WireError:
    """aiohttp's exception as a wire error; built from parts that cannot hold the payload."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return WireError(WireFailure.DNS, exc.host)
    if isinstance(exc, aiohttp.ClientSSLError):
        return WireError(WireFailure.TLS, str(exc.os_error))
    if isinstance(exc, aiohttp.ClientConnectorError):
        if exc.os_error.errno == errno.ECONNREFUSED:
            return WireError(WireFailure.REFUSED)
        detail = exc.os_error.strerror or type(exc.os_error).__name__
        return WireError(WireFailure.CONNECT, detail)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return WireError(WireFailure.RESET)
    if isinstance(exc, aiohttp.ClientConnectionResetError):
        return WireError(WireFailure.RESET, "connection reset")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return WireError(WireFailure.RESET, "answer cut short")
    if isinstance(exc, aiohttp.ClientResponseError):
        return WireError(WireFailure.PROTOCOL, f"HTTP: {exc.message}")
    if isinstance(exc, OSError):
        if exc.errno in (errno.ECONNRESET, errno.EPIPE):
            return WireError(WireFailure.RESET, exc.strerror or "connection reset")
        return WireError(WireFailure.CONNECT, exc.strerror or type(exc).__name__)
    return WireError(WireFailure.PROTOCOL, f"HTTP client error: {type(exc).__name__}")
