"""The handler contract: what a handler's answer means, whatever carried it.

A transport (``nemesis.delivery.http``, ``nemesis.delivery.grpc``) only moves
bytes: it sends a request and hands back what came over the wire, either an
answer (an HTTP status with headers and the first KiB of the body, or a gRPC
status with details and trailers) or a ``WireError`` (a small typed value:
timeout, refused, reset, TLS, too large, ...). ``Contract`` turns either into
the ``DeliveryResult`` the runner consumes. Everything a second transport
would otherwise have to copy lives here:

- the verdict a handler may give (``nemesis-verdict`` header or trailer:
  ``drop``, ``dead`` or ``retry``), which overrides the status;
- one table per protocol, ``answer_for_response`` (HTTP statuses) and
  ``answer_for_grpc_status`` (gRPC codes), with a comment on each decision:
  each row names the ``Outcome`` and, for an answer that did not finish the
  message, its ``FailureKind``; the circuit breaker and the failure policy
  read the kind and never the status;
- ``Retry-After`` (seconds or an HTTP date, bounded by
  ``MAX_RETRY_AFTER_S``) and gRPC's ``grpc-retry-pushback-ms``;
- the error text of a failed delivery: one line, at most ``ERROR_TEXT_CHARS``
  characters of the handler's words, with the request payload, the
  integration's header values and the credentials in any URL or
  ``Authorization``-like value replaced (``Redactor``); it goes to logs and
  the DLQ, which must never carry a secret or the payload;
- signing (``nemesis.delivery.signing``): the headers that sign a request,
  so that every transport signs the same way.
"""

from __future__ import annotations

import email.utils
import enum
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import TYPE_CHECKING, Final, Literal, NamedTuple

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import TargetConfig
from nemesis.delivery import signing
from nemesis.delivery.port import DeliveryResult, FailureKind, Outcome

if TYPE_CHECKING:  # the generated code is a build product: only the gRPC transport needs it
    from nemesis.proto.nemesis.v1 import handler_pb2 as pb

VERDICT_HEADER: Final = "nemesis-verdict"  # an HTTP header or a gRPC trailer
RETRY_AFTER_HEADER: Final = "retry-after"  # an HTTP header or a gRPC trailer
PUSHBACK_TRAILER: Final = "grpc-retry-pushback-ms"
SIGNING_HEADERS: Final = signing.SIGNING_HEADERS  # HTTP headers or gRPC metadata

# A handler's Retry-After is obeyed up to this: a wrong date or a huge number must not
# park a message for days; the retry tiers take over from there.
MAX_RETRY_AFTER_S: Final = 3600.0
# What a transport keeps of a response body for the error text (a bounded body), and how
# much of the handler's words the error shows.
ERROR_BODY_BYTES: Final = 1024
ERROR_TEXT_CHARS: Final = 200
# Shorter payloads or secrets than this would be found in the error text by coincidence.
_MIN_REDACTED_BYTES: Final = 8
_PAYLOAD_MARK: Final = b"<request payload>"
_SECRET_MARK: Final = b"<redacted>"


class Answer(NamedTuple):
    """What a handler's answer amounts to: its outcome, and why it did not finish, if not."""

    outcome: Outcome
    failure: FailureKind | None = None


def _failed(kind: FailureKind) -> Answer:
    return Answer(kind.outcome, kind)


_DELIVERED: Final = Answer(Outcome.DELIVERED)
_DROPPED: Final = Answer(Outcome.DROPPED)
_REJECTED: Final = _failed(FailureKind.REJECTED)
_SERVER_ERROR: Final = _failed(FailureKind.SERVER_ERROR)
_RATE_LIMITED: Final = _failed(FailureKind.RATE_LIMITED)
# Timeout, refused or reset connection, an answer too large to read: no answer.
NO_ANSWER: Final = _failed(FailureKind.NO_ANSWER)

_VERDICTS: Final = {
    "drop": _DROPPED,
    "dead": _failed(FailureKind.VERDICT_DEAD),
    "retry": _failed(FailureKind.VERDICT_RETRY),
}


def verdict_of(value: str | None) -> Answer | None:
    """The answer a ``nemesis-verdict`` value gives; None when absent or unknown."""
    if value is None:
        return None
    # An unknown verdict is ignored rather than guessed at: the status decides.
    return _VERDICTS.get(value.strip().lower())


# --- HTTP -------------------------------------------------------------------------------

_DEAD_STATUSES: Final = frozenset({400, 409, 410, 413, 415, 422})
_COME_BACK_LATER_STATUSES: Final = frozenset({408, 425})
_MISCONFIGURED_STATUSES: Final = frozenset({401, 403, 404, 405})


def answer_for_response(status: int | None, headers: Mapping[str, str] | None = None) -> Answer:
    """The HTTP handler contract: the handler's answer (None: no answer) -> Outcome and kind.

    ``headers`` must look names up case-insensitively (aiohttp's response
    headers do). Integration-wide failures retry, so that the circuit breaker
    stops the flow and the messages wait in the topic; only the listed
    message-level violations go to the DLQ at once. An unlisted status never
    dead-letters at once: a truly bad message still reaches the DLQ when the
    retry tiers run out, while a misbehaving handler cannot drain a topic into
    the DLQ.
    """
    if headers is not None:
        # The handler's explicit verdict overrides the status.
        by_verdict = verdict_of(headers.get(VERDICT_HEADER))
        if by_verdict is not None:
            return by_verdict
    if status is None:
        # Timeout, refused or reset connection: the handler may be down or overloaded.
        return NO_ANSWER
    if 200 <= status <= 299:
        # The handler took the message: its offset may be committed.
        return _DELIVERED
    if status in _DEAD_STATUSES:
        # 400, 409, 410, 413, 415, 422: this message breaks the contract; retrying cannot help.
        return _REJECTED
    if status == 429:
        # The handler is overloaded and asks to be called again later (Retry-After).
        return _RATE_LIMITED
    if status in _COME_BACK_LATER_STATUSES:
        # 408, 425: the handler asks to be called again later (Retry-After).
        return _SERVER_ERROR
    if status in _MISCONFIGURED_STATUSES:
        # 401, 403, 404, 405: credentials, route or method are wrong for every message
        # alike. 401 is also a handler refusing a missing, wrong or stale signature
        # (signing secrets that differ between the two sides): retry, never dead-letter.
        return _SERVER_ERROR
    if 500 <= status <= 599:
        # The handler failed or is unavailable.
        return _SERVER_ERROR
    # 1xx as a final answer, 3xx (redirects are not followed: a moved handler is a
    # reviewed config change, and a POST must not turn into a GET), the other 4xx
    # and nonsense statuses: retry, as argued above.
    return _SERVER_ERROR


# --- gRPC -------------------------------------------------------------------------------


class GrpcCode(enum.IntEnum):
    """gRPC status codes by number (as grpc.StatusCode, without importing grpcio)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


_DEAD_CODES: Final = frozenset(
    {
        GrpcCode.INVALID_ARGUMENT,
        GrpcCode.FAILED_PRECONDITION,
        GrpcCode.OUT_OF_RANGE,
        GrpcCode.ALREADY_EXISTS,
    }
)
_TRY_LATER_CODES: Final = frozenset(
    {
        GrpcCode.UNAVAILABLE,
        GrpcCode.DEADLINE_EXCEEDED,
        GrpcCode.ABORTED,
        GrpcCode.INTERNAL,
    }
)
_MISCONFIGURED_CODES: Final = frozenset(
    {
        GrpcCode.UNAUTHENTICATED,
        GrpcCode.PERMISSION_DENIED,
        GrpcCode.UNIMPLEMENTED,
        GrpcCode.NOT_FOUND,
    }
)


def answer_for_grpc_status(code: int | None, trailers: Mapping[str, str] | None = None) -> Answer:
    """The gRPC handler contract: the call's status (None: no answer) and trailers -> Answer.

    It mirrors ``answer_for_response``: integration-wide failures retry, so
    that the circuit breaker stops the flow and messages wait in the topic;
    only message-level violations go to the DLQ at once, and a status this
    table does not know never does (a truly bad message still reaches the DLQ
    when the retry tiers run out).
    """
    if trailers is not None:
        # The handler's explicit verdict overrides the status.
        by_verdict = verdict_of(trailers.get(VERDICT_HEADER))
        if by_verdict is not None:
            return by_verdict
    if code is None:
        # No status at all (the transport was closed before the call): try again later.
        return NO_ANSWER
    if code == GrpcCode.OK:
        # The handler took the event: its offset may be committed.
        return _DELIVERED
    if code in _DEAD_CODES:
        # INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE: this message breaks the
        # contract (HTTP's 400/422); ALREADY_EXISTS is HTTP's 409. Retrying cannot help.
        return _REJECTED
    if code == GrpcCode.RESOURCE_EXHAUSTED:
        # The handler is overloaded (HTTP's 429).
        return _RATE_LIMITED
    if code in _TRY_LATER_CODES:
        # UNAVAILABLE, DEADLINE_EXCEEDED (the handler's deadline), ABORTED, INTERNAL: the
        # handler is down, overloaded or failed (5xx).
        return _SERVER_ERROR
    if code in _MISCONFIGURED_CODES:
        # UNAUTHENTICATED, PERMISSION_DENIED, UNIMPLEMENTED, NOT_FOUND: credentials,
        # service or method are wrong for every message alike (HTTP's 401/403/404/405).
        # UNAUTHENTICATED is also a refused signature, as HTTP's 401: retry.
        return _SERVER_ERROR
    # UNKNOWN (what a server answers when the handler raised), CANCELLED (the server
    # or our shutdown cancelled the call), DATA_LOSS and numbers gRPC does not define:
    # the handler failed, not the message; retry, as argued above.
    return _SERVER_ERROR


def grpc_code_name(code: int) -> str:
    """``UNAVAILABLE`` for 14; the number for a code gRPC does not define."""
    try:
        return GrpcCode(code).name
    except ValueError:
        return str(code)


# --- Retry-After ----------------------------------------------------------------------


def parse_retry_after(value: str | None, now: float) -> float | None:
    """``Retry-After`` (delta seconds or HTTP date) as seconds from ``now`` (Unix seconds).

    None when absent or unreadable; at most ``MAX_RETRY_AFTER_S``.
    """
    if value is None:
        return None
    value = value.strip()
    try:
        # RFC 9110 says whole seconds; a fraction is accepted rather than ignored.
        seconds = float(value)
    except ValueError:
        pass
    else:
        return min(seconds, MAX_RETRY_AFTER_S) if 0 <= seconds < float("inf") else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (ValueError, IndexError):
        return None
    # A date without a zone (or "-0000") is naive; HTTP dates are always GMT.
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return min(max(0.0, when.timestamp() - now), MAX_RETRY_AFTER_S)


def grpc_retry_after_s(trailers: Mapping[str, str], now: float) -> float | None:
    """The delay a handler asked for: ``retry-after`` (as HTTP's) or ``grpc-retry-pushback-ms``."""
    delay = parse_retry_after(trailers.get(RETRY_AFTER_HEADER), now)
    if delay is not None:
        return delay
    pushback = trailers.get(PUSHBACK_TRAILER)
    if pushback is None:
        return None
    try:
        milliseconds = int(pushback.strip())
    except ValueError:
        return None
    # gRFC A6: a negative pushback means "do not retry"; Nemesis still retries, with no hint.
    return min(milliseconds / 1000, MAX_RETRY_AFTER_S) if milliseconds >= 0 else None


# --- what went wrong on the wire ----------------------------------------------------------


class WireFailure(enum.Enum):
    """Why a request got no (complete) answer."""

    TIMEOUT = "timeout"  # no answer within target.timeout_s
    REFUSED = "refused"  # nothing listens at the target
    RESET = "reset"  # the handler closed or reset the connection before its answer was whole
    TLS = "tls"  # the TLS handshake or certificate check failed
    DNS = "dns"  # the target's host name does not resolve
    CONNECT = "connect"  # another failure to connect (unreachable network, ...)
    PROTOCOL = "protocol"  # the answer was not valid HTTP / gRPC
    TOO_LARGE = "too large"  # the answer was larger than a transport reads
    CLOSED = "closed"  # the transport was closed: nothing was sent


@dataclass(frozen=True, slots=True)
class WireError:
    """A request that got no answer, as a value; ``detail`` never holds payload or secrets."""

    failure: WireFailure
    detail: str = ""  # built by the transport from parts that cannot hold either

    def text(self) -> str:
        """The error text of a delivery that failed this way."""
        failure, detail = self.failure, self.detail
        if failure is WireFailure.TIMEOUT:
            return f"timeout after {detail}" if detail else "timeout"
        if failure is WireFailure.REFUSED:
            return "connection refused"
        if failure is WireFailure.RESET:
            return f"server disconnected ({detail})" if detail else "server disconnected"
        if failure is WireFailure.CLOSED:
            return "transport closed"
        prefix = {
            WireFailure.TLS: "TLS error",
            WireFailure.DNS: "cannot resolve",
            WireFailure.CONNECT: "cannot connect",
            WireFailure.PROTOCOL: "invalid response",
            WireFailure.TOO_LARGE: "answer too large",
        }[failure]
        separator = " " if failure is WireFailure.DNS else ": "
        return one_line(f"{prefix}{separator}{detail}" if detail else prefix)


def timeout_after(timeout_s: float) -> WireError:
    """The wire error of a request that got no answer within ``timeout_s``."""
    return WireError(WireFailure.TIMEOUT, f"{timeout_s}s")


# --- error text -------------------------------------------------------------------------

_BLANK_OR_CONTROL_RUNS: Final = re.compile(r"[\s\x00-\x1f\x7f]+")
# user:password@ in a URL, and the credentials of an Authorization-like value.
_URL_CREDENTIALS: Final = re.compile(rb"(?i)\b([a-z][a-z0-9+.\-]*://)[^/@\s\"'<>]+@")
_SCHEME_CREDENTIALS: Final = re.compile(rb"(?i)\b(bearer|basic|digest)(\s+)[^\s\"'<>,;]+")


def one_line(text: str) -> str:
    """``text`` on one line, blanks and control characters squeezed, cut to ERROR_TEXT_CHARS."""
    return _BLANK_OR_CONTROL_RUNS.sub(" ", text).strip()[:ERROR_TEXT_CHARS].rstrip()


class Redactor:
    """Takes the payload and secrets out of a handler's words before they become error text."""

    __slots__ = ("_secrets",)

    def __init__(self, secrets: Iterable[str | bytes] = ()) -> None:
        encoded: set[bytes] = set()
        for secret in secrets:
            value = secret.encode() if isinstance(secret, str) else secret
            # "Bearer <token>": a handler may quote the token alone.
            encoded.update((value, value.rsplit(None, 1)[-1] if value.strip() else value))
        # Longest first: a secret that contains another is replaced whole.
        self._secrets = sorted(
            (s for s in encoded if len(s) >= _MIN_REDACTED_BYTES), key=len, reverse=True
        )

    def __call__(self, words: bytes, sent: Collection[bytes] = ()) -> bytes:
        """``words`` without the request payloads ``sent``, the secrets, or URL credentials."""
        # Handlers like to echo the request in their error; logs and the DLQ reason must
        # not carry the payload: what follows its start is cut.
        for body in sent:
            probe = body[:64]
            if len(probe) >= _MIN_REDACTED_BYTES and (at := words.find(probe)) >= 0:
                words = words[:at] + _PAYLOAD_MARK
        for secret in self._secrets:
            words = words.replace(secret, _SECRET_MARK)
        words = _URL_CREDENTIALS.sub(rb"\1<redacted>@", words)
        return _SCHEME_CREDENTIALS.sub(rb"\1\2<redacted>", words)


def error_text(status: str, verdict: str | None, words: str) -> str:
    """``HTTP 503 (nemesis-verdict: dead): <the handler's words>`` (``words`` already redacted).

    ``status`` names the status: ``HTTP 503``, ``gRPC UNAVAILABLE``.
    """
    text = status
    if verdict_of(verdict) is not None:
        text += f" ({VERDICT_HEADER}: {(verdict or '').strip().lower()})"
    snippet = one_line(words)
    return f"{text}: {snippet}" if snippet else text


# --- the contract of one integration --------------------------------------------------------


class Contract:
    """One integration's side of the handler contract, shared by whichever transport it uses.

    ``redact``: values that must never appear in error text (the target's
    header values, the signing secrets). ``signer``: when given, every
    request is signed (``sign_http``, ``sign_grpc``) with a timestamp from ``clock``.
    """

    __slots__ = ("_clock", "_redactor", "_signer")

    def __init__(
        self,
        *,
        clock: Clock = SYSTEM_CLOCK,
        redact: Iterable[str | bytes] = (),
        signer: signing.Signer | None = None,
    ) -> None:
        self._clock = clock
        self._signer = signer
        secrets: list[str | bytes] = []
        if signer is not None:
            secrets += [*signer.secrets, *signer.keys]
        self._redactor = Redactor([*redact, *secrets])

    @property
    def clock(self) -> Clock:
        """The clock the results' durations and the signatures' timestamps are read from."""
        return self._clock

    @property
    def signs(self) -> bool:
        """Whether requests are signed."""
        return self._signer is not None

    def sign_http(
        self, headers: Iterable[tuple[str, str]], body: bytes, *, batch: bool = False
    ) -> list[tuple[str, str]]:
        """The headers that sign an HTTP request, timestamp read now (only when ``signs``).

        ``headers``: the request's other headers (its ``ce-*`` and
        ``content-type`` are signed); ``body``: the bytes sent.
        """
        assert self._signer is not None
        return self._signer.http(headers, body, batch=batch, timestamp=int(self._clock.time()))

    def sign_grpc(self, events: Sequence[pb.Event], *, batch: bool) -> list[tuple[str, str]]:
        """The metadata that signs a ``Deliver`` or ``DeliverBatch`` call (only when ``signs``)."""
        assert self._signer is not None
        return self._signer.grpc(events, batch=batch, timestamp=int(self._clock.time()))

    def http_answer(
        self,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
        sent: Collection[bytes],
        started: float,
    ) -> DeliveryResult:
        """An HTTP answer as a result (``headers`` case-insensitive, ``body`` its first KiB)."""
        clock = self._clock
        if 200 <= status <= 299 and VERDICT_HEADER not in headers and "retry-after" not in headers:
            # The common answer, without the table's general path.
            duration_s = clock.monotonic() - started
            return DeliveryResult(Outcome.DELIVERED, status, None, None, duration_s)
        outcome, failure = answer_for_response(status, headers)
        error = None
        if outcome is not Outcome.DELIVERED:
            words = self._redactor(body[:ERROR_BODY_BYTES], sent)
            error = error_text(
                f"HTTP {status}", headers.get(VERDICT_HEADER), words.decode("utf-8", "replace")
            )
        retry_after = headers.get(RETRY_AFTER_HEADER)
        return DeliveryResult(
            outcome,
            status=status,
            error=error,
            retry_after_s=parse_retry_after(retry_after, clock.time()) if retry_after else None,
            duration_s=clock.monotonic() - started,
            failure=failure,
        )

    def grpc_answer(
        self,
        code: int,
        details: str | None,
        trailers: Mapping[str, str],
        sent: Collection[bytes],
        started: float,
    ) -> DeliveryResult:
        """A gRPC status (the handler's, or the client library's) as a result."""
        outcome, failure = answer_for_grpc_status(code, trailers)
        error = None
        if outcome is not Outcome.DELIVERED:
            words = self._redactor((details or "").encode()[:ERROR_BODY_BYTES], sent)
            error = error_text(
                f"gRPC {grpc_code_name(code)}",
                trailers.get(VERDICT_HEADER),
                words.decode("utf-8", "replace"),
            )
        return DeliveryResult(
            outcome,
            status=code,
            error=error,
            retry_after_s=grpc_retry_after_s(trailers, self._clock.time()),
            duration_s=self._clock.monotonic() - started,
            protocol="grpc",
            failure=failure,
        )

    def wire_error(
        self,
        failure: WireError,
        started: float | None,
        *,
        protocol: Literal["http", "grpc"] = "http",
        status: int | None = None,
    ) -> DeliveryResult:
        """A request without an answer as a result (``started`` None: nothing was sent).

        ``status``: what the protocol's library reported, if anything (gRPC's
        DEADLINE_EXCEEDED for our own deadline, RESOURCE_EXHAUSTED for an answer
        too large); the answer is no answer, whatever it is.
        """
        # Nothing was answered: the handler may be down, slow or unreachable. Retry,
        # so that the circuit breaker sees it.
        outcome, kind = NO_ANSWER
        duration_s = 0.0 if started is None else self._clock.monotonic() - started
        text = self._redactor(failure.text().encode()).decode("utf-8", errors="replace")
        return DeliveryResult(
            outcome,
            status=status,
            error=text,
            duration_s=duration_s,
            protocol=protocol,
            failure=kind,
        )


def contract_for(
    target: TargetConfig,
    *,
    integration: str,
    clock: Clock = SYSTEM_CLOCK,
    redact: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
) -> Contract:
    """The contract of an integration's target: its signing secrets read from the environment.

    Raises ``ConfigError`` when a variable ``target.signing`` names is unset or empty.
    """
    signer = None
    if target.signing is not None:
        secrets = signing.secrets_from_environment(
            target.signing, os.environ if env is None else env, where=f"integration {integration}"
        )
        signer = signing.Signer(secrets, target.signing.scheme)
    return Contract(clock=clock, redact=redact, signer=signer)
