"""The HTTP transport: CloudEvents over HTTP/1.1 on a pooled aiohttp session.

The handler contract (DESIGN.md section 6) is implemented here: one POST per
event in CloudEvents binary mode, or one POST per batch in the CloudEvents
JSON batch format (``nemesis.delivery.cloudevents``), and one function,
``outcome_for_response``, that turns the handler's answer into an ``Outcome``.
Whatever happens on the wire comes back as a ``DeliveryResult``; aiohttp's
exceptions are translated here and never reach the caller.

aiohttp rather than httpx: on this machine it delivers 10-15x more requests
per CPU second (research/perf-baseline.md).
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import re
from collections.abc import Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any, Final

import aiohttp

from nemesis import __version__
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import TargetConfig
from nemesis.delivery.cloudevents import (
    BATCH_CONTENT_TYPE,
    batch_body,
    binary_headers_from,
    constant_headers,
    source_for,
)
from nemesis.delivery.deadlines import Deadlines
from nemesis.delivery.port import DeliveryResult, Event, Outcome
from nemesis.errors import ConfigError, ConfigProblem

VERDICT_HEADER: Final = "nemesis-verdict"
USER_AGENT: Final = f"nemesis/{__version__}"

# What is kept of a response body for the error text, and how much of it the error shows.
ERROR_BODY_BYTES: Final = 1024
ERROR_TEXT_CHARS: Final = 200
# A longer response body is not read to the end: closing the connection is cheaper.
DRAIN_LIMIT_BYTES: Final = 256 * 1024
# Below the idle timeout of common servers (uvicorn and Node 5 s), so a pooled
# connection is rarely reused just as the handler closes it.
KEEPALIVE_S: Final = 4.0
# Sets of shared headers a transport keeps (one per event type and topic it delivers).
_CONSTANT_HEADER_SETS: Final = 256
_NO_TIMEOUT: Final = aiohttp.ClientTimeout(
    total=None, connect=None, sock_read=None, sock_connect=None
)

_DEAD_STATUSES: Final = frozenset({400, 409, 410, 413, 415, 422})
_COME_BACK_LATER_STATUSES: Final = frozenset({408, 425, 429})
_MISCONFIGURED_STATUSES: Final = frozenset({401, 403, 404, 405})
_VERDICTS: Final = {"drop": Outcome.DROPPED, "dead": Outcome.DEAD, "retry": Outcome.RETRY}


def outcome_for_response(status: int | None, headers: Mapping[str, str] | None = None) -> Outcome:
    """The HTTP handler contract: the handler's answer (None: no answer) -> Outcome.

    ``headers`` must look names up case-insensitively (aiohttp's response
    headers do). Integration-wide failures retry, so that the circuit breaker
    stops the flow and the messages wait in the topic; only the listed
    message-level violations go to the DLQ at once. An unlisted status never
    dead-letters at once: a truly bad message still reaches the DLQ when the
    retry tiers run out, while a misbehaving handler cannot drain a topic into
    the DLQ.
    """
    verdict = headers.get(VERDICT_HEADER) if headers is not None else None
    if verdict is not None:
        # The handler's explicit verdict overrides the status; an unknown one is
        # ignored rather than guessed at, and the status decides.
        by_verdict = _VERDICTS.get(verdict.strip().lower())
        if by_verdict is not None:
            return by_verdict
    if status is None:
        # Timeout, refused or reset connection: the handler may be down or overloaded.
        return Outcome.RETRY
    if 200 <= status <= 299:
        # The handler took the message: its offset may be committed.
        return Outcome.DELIVERED
    if status in _DEAD_STATUSES:
        # 400, 409, 410, 413, 415, 422: this message breaks the contract; retrying cannot help.
        return Outcome.DEAD
    if status in _COME_BACK_LATER_STATUSES:
        # 408, 425, 429: the handler asks to be called again later (Retry-After).
        return Outcome.RETRY
    if status in _MISCONFIGURED_STATUSES:
        # 401, 403, 404, 405: credentials, route or method are wrong for every message alike.
        return Outcome.RETRY
    if 500 <= status <= 599:
        # The handler failed or is unavailable.
        return Outcome.RETRY
    # 1xx as a final answer, 3xx (redirects are not followed: a moved handler is a
    # reviewed config change, and a POST must not turn into a GET), the other 4xx
    # and nonsense statuses: retry, as argued above.
    return Outcome.RETRY


def parse_retry_after(value: str | None, now: float) -> float | None:
    """``Retry-After`` (delta seconds or HTTP date) as seconds from ``now`` (Unix seconds)."""
    if value is None:
        return None
    value = value.strip()
    try:
        # RFC 9110 says whole seconds; a fraction is accepted rather than ignored.
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if 0 <= seconds < float("inf") else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except ValueError:
        return None
    # A date without a zone (or "-0000") is naive; HTTP dates are always GMT.
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now)


@dataclass(frozen=True, slots=True)
class HttpTransportStatistics:
    """A snapshot of one transport's counters."""

    requests: int  # HTTP requests sent, resends included
    in_flight: int  # deliveries waiting for an answer now
    resends: int  # requests sent again at once after a pooled connection died under them
    max_connections: int


# Header names that belong to the contract or to HTTP framing, not to target.headers.
_RESERVED_HEADERS: Final = frozenset({"content-type", "content-length", "transfer-encoding"})
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_UNSAFE_VALUE_CHARS: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_BLANK_OR_CONTROL_RUNS: Final = re.compile(r"[\s\x00-\x1f\x7f]+")


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
                [_problem(integration, "target.url", "the HTTP transport needs http(s)://")]
            )
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._url = target.url
        self._timeout_s = target.timeout_s
        self._deadlines = Deadlines(target.timeout_s)
        self._max_connections = max_connections
        self._clock = clock
        self._source = source_for(integration)
        # Sent with every request, so that aiohttp adds none of its own: asking it to skip
        # its defaults (skip_auto_headers) costs more per request than sending these.
        self._extra_headers = {
            "user-agent": USER_AGENT,
            "accept": "*/*",
            # The body is drained unread: asking for compression would be waste.
            "accept-encoding": "identity",
            **_checked_headers(target.headers, integration),
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
        shared = (event.type, event.message.topic, event.content_type)
        constant = self._constant_headers.get(shared)
        if constant is None:
            constant = self._constant_for(shared)
        body = event.message.value if event.payload is None else event.payload  # event.body
        return self._post(body, binary_headers_from(constant, event), (body,))

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
        return self._post(body, self._batch_headers, [event.body for event in events])

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
        connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S)
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
        self, body: bytes, headers: Mapping[str, str], sent: Collection[bytes]
    ) -> DeliveryResult:
        if self._closed:
            return DeliveryResult(Outcome.RETRY, error="transport closed")
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
                        self._url, data=body, headers=headers, allow_redirects=False
                    ) as response:
                        kept = await _drain(response)
                        return self._answered(response, kept, sent, started)
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
                    return self._failed(_describe(exc), started)
        except asyncio.CancelledError:
            if deadline.timed_out():
                return self._failed(f"timeout after {self._timeout_s}s", started)
            raise
        finally:
            deadlines.finish(deadline)
            self._in_flight -= 1

    def _answered(
        self,
        response: aiohttp.ClientResponse,
        kept: bytes,
        sent: Collection[bytes],
        started: float,
    ) -> DeliveryResult:
        status = response.status
        headers = response.headers
        if 200 <= status <= 299 and VERDICT_HEADER not in headers and "retry-after" not in headers:
            # The common answer, without the table's general path.
            return DeliveryResult(
                Outcome.DELIVERED, status, None, None, self._clock.monotonic() - started
            )
        outcome = outcome_for_response(status, headers)
        error = None if outcome is Outcome.DELIVERED else _error_text(status, response, kept, sent)
        retry_after = response.headers.get("retry-after")
        if retry_after is not None:
            retry_after_s = parse_retry_after(retry_after, self._clock.time())
        else:
            retry_after_s = None
        return DeliveryResult(
            outcome,
            status=status,
            error=error,
            retry_after_s=retry_after_s,
            duration_s=self._clock.monotonic() - started,
        )

    def _failed(self, error: str, started: float) -> DeliveryResult:
        outcome = outcome_for_response(None)
        return DeliveryResult(outcome, error=error, duration_s=self._clock.monotonic() - started)


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


def _describe(exc: aiohttp.ClientError | OSError) -> str:
    """Short text for an exception; built from parts that cannot hold the payload or a secret."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"cannot resolve {exc.host}"
    if isinstance(exc, aiohttp.ClientSSLError):
        return _one_line(f"TLS error: {exc.os_error}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        if exc.os_error.errno == errno.ECONNREFUSED:
            return "connection refused"
        return _one_line(f"cannot connect: {exc.os_error.strerror or type(exc.os_error).__name__}")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    if isinstance(exc, aiohttp.ClientResponseError):
        return _one_line(f"invalid HTTP response: {exc.message}")
    if isinstance(exc, OSError):
        return _one_line(f"connection error: {exc.strerror or type(exc).__name__}")
    return f"HTTP client error: {type(exc).__name__}"


def _error_text(
    status: int, response: aiohttp.ClientResponse, kept: bytes, sent: Collection[bytes]
) -> str:
    """``HTTP 503: <start of the body>``, without anything of what we sent."""
    text = f"HTTP {status}"
    verdict = response.headers.get(VERDICT_HEADER, "").strip().lower()
    if verdict in _VERDICTS:
        text += f" ({VERDICT_HEADER}: {verdict})"
    snippet = _one_line(_redacted(kept, sent).decode("utf-8", errors="replace"))
    return f"{text}: {snippet}" if snippet else text


def _redacted(kept: bytes, sent: Collection[bytes]) -> bytes:
    # Handlers like to echo the request in their error; logs and the DLQ reason must not
    # carry the payload. Shorter payloads than this would match by coincidence.
    for body in sent:
        probe = body[:64]
        if len(probe) >= 8 and (at := kept.find(probe)) >= 0:
            kept = kept[:at] + b"<request payload>"
    return kept


def _one_line(text: str) -> str:
    return _BLANK_OR_CONTROL_RUNS.sub(" ", text).strip()[:ERROR_TEXT_CHARS].rstrip()


def _checked_headers(headers: Mapping[str, str], integration: str) -> dict[str, str]:
    checked: dict[str, str] = {}
    for name, value in headers.items():
        field = f"target.headers.{name}"
        lowered = name.lower()
        if not _TOKEN.fullmatch(name):
            raise ConfigError([_problem(integration, field, "not a valid HTTP header name")])
        if lowered.startswith("ce-") or lowered in _RESERVED_HEADERS:
            raise ConfigError([_problem(integration, field, "set by Nemesis (handler contract)")])
        if _UNSAFE_VALUE_CHARS.search(value):
            raise ConfigError([_problem(integration, field, "control characters in the value")])
        checked[lowered] = value
    return checked


def _problem(integration: str, field: str, message: str) -> ConfigProblem:
    return ConfigProblem(file=f"integration {integration}", line=None, field=field, message=message)
