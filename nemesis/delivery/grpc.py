"""The gRPC transport: the handler contract over ``nemesis.v1.HandlerService`` (grpcio asyncio).

``Deliver`` carries one event, ``DeliverBatch`` a batch whose answer applies
to every event in it; an ``Event`` holds the same CloudEvents attributes as
the HTTP transport's ``ce-*`` headers (``nemesis/proto/nemesis/v1/handler.proto``).
The transport moves the call and nothing more: the status, details and
trailers that come back (or the failure on the wire) are turned into a
``DeliveryResult`` by ``nemesis.delivery.contract``, which owns the status
table, the ``nemesis-verdict`` trailer, ``retry-after`` /
``grpc-retry-pushback-ms`` and the error text.

One channel per transport (one integration's target), opened on first use
and shared by every call: gRPC multiplexes the calls over HTTP/2, so the
worker count bounds the calls in flight, not connections. Every call has a
deadline of ``target.timeout_s``. grpcio's errors are translated here and
never reach the caller.

A ``grpcs://`` channel verifies the handler against grpcio's default roots,
or against ``target.tls.ca_file``; ``target.tls`` also gives the client
certificate (mutual TLS) and the name to check instead of the URL's host
(``nemesis.delivery.tls``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import SplitResult, urlsplit

import grpc
from grpc import aio

from nemesis import __version__
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import TargetConfig
from nemesis.delivery.cloudevents import (
    SPECVERSION,
    attributes_of,
    encode_forwarded,
    source_for,
    trace_headers,
)
from nemesis.delivery.contract import (
    RETRY_AFTER_HEADER,
    SIGNING_HEADERS,
    VERDICT_HEADER,
    Answer,
    WireError,
    WireFailure,
    answer_for_grpc_status,
    contract_for,
    grpc_retry_after_s,
    timeout_after,
)
from nemesis.delivery.port import DeliveryResult, Event, config_problem
from nemesis.delivery.tls import pem_files
from nemesis.errors import ConfigError
from nemesis.proto import SERVICE

try:
    from nemesis.proto.nemesis.v1 import handler_pb2 as pb
except ModuleNotFoundError as exc:
    # The generated code is a build product (nemesis.proto); say how to build it.
    raise ModuleNotFoundError(
        "the gRPC handler contract is not compiled: run `make proto` "
        "(python -m nemesis.proto, needs grpcio-tools)"
    ) from exc

DELIVER_METHOD: Final = f"/{SERVICE}/Deliver"
DELIVER_BATCH_METHOD: Final = f"/{SERVICE}/DeliverBatch"
VERDICT_TRAILER: Final = VERDICT_HEADER
RETRY_AFTER_TRAILER: Final = RETRY_AFTER_HEADER
DEFAULT_PORTS: Final = {"grpc": 80, "grpcs": 443}
# The largest answer read: a DeliverResponse is empty, so anything near this is not one.
MAX_RESPONSE_BYTES: Final = 256 * 1024
# grpcio's own words for an answer above the limit and for a target that refused to connect.
_TOO_LARGE_DETAILS: Final = "larger than max"
_REFUSED_DETAILS: Final = re.compile(
    r"(connections to all backends failing|failed to connect to all addresses).*Connection refused"
)


def answer_for_status(
    code: grpc.StatusCode | None, trailers: Mapping[str, str] | None = None
) -> Answer:
    """``nemesis.delivery.contract.answer_for_grpc_status`` for grpcio's status codes."""
    return answer_for_grpc_status(None if code is None else code.value[0], trailers)


def retry_after_s(trailers: Mapping[str, str], now: float) -> float | None:
    """The delay a handler asked for (``nemesis.delivery.contract.grpc_retry_after_s``)."""
    return grpc_retry_after_s(trailers, now)


def event_message(event: Event, source: str) -> pb.Event:
    """One event as ``nemesis.v1.Event``: the attributes of the HTTP contract, typed."""
    message = event.message
    if not event.plain:
        return _full_event_message(event, source)
    proto = pb.Event(
        id=_utf8(event.id),
        source=_utf8(source),
        spec_version=SPECVERSION,
        type=_utf8(event.type),
        data_content_type=_utf8(event.content_type),
        data=event.body,
        topic=_utf8(message.topic),
        partition=message.partition,
        offset=message.offset,
        attempt=event.attempt,
    )
    unix_s = message.created_at or message.written_at
    if unix_s > 0:
        # Microseconds, as ce-time over HTTP: both modes name the same instant.
        proto.time.FromMicroseconds(round(unix_s * 1_000_000))
    if message.key is not None:
        proto.partition_key = _utf8(message.key)
    return proto


def _with_trace(proto: pb.Event, event: Event) -> pb.Event:
    """A batch's event with its trace context as extensions (one call has one metadata)."""
    if "traceparent" not in proto.extensions:
        proto.extensions.update(trace_headers(event))
    return proto


# Attributes with a typed field of their own in nemesis.v1.Event.
_TYPED = frozenset({"id", "source", "type", "time", "topic", "partition", "offset", "attempt"})


def _full_event_message(event: Event, source: str) -> pb.Event:
    """An event off the fast path: a CloudEvents record's own attributes, a binary key."""
    message = event.message
    attributes = attributes_of(event, source)
    proto = pb.Event(
        id=_utf8(attributes["id"]),
        source=_utf8(attributes["source"]),
        spec_version=SPECVERSION,
        type=_utf8(attributes["type"]),
        data_content_type=_utf8(event.content_type),
        data=event.body,
        topic=_utf8(message.topic),
        partition=message.partition,
        offset=message.offset,
        attempt=event.attempt,
    )
    time = attributes.get("time")
    if time is not None:
        try:
            proto.time.FromJsonString(time)
        except ValueError:
            proto.extensions["time"] = _utf8(time)  # not RFC 3339 as protobuf reads it
    if "partitionkey" in attributes:
        proto.partition_key = _utf8(attributes.pop("partitionkey"))
    for name, text in attributes.items():
        if name not in _TYPED:
            proto.extensions[name] = _utf8(text)
    return proto


def forwarded_metadata(event: Event) -> tuple[tuple[str, str], ...]:
    """The forwarded producer headers as call metadata, encoded as over HTTP."""
    return tuple((name, encode_forwarded(value)) for name, value in event.forwarded)


@dataclass(frozen=True, slots=True)
class GrpcTransportStatistics:
    """A snapshot of one transport's counters."""

    calls: int  # calls started
    in_flight: int  # calls waiting for an answer now
    max_connections: int  # the integration's worker count (calls share one channel)
    channel: str  # the channel's connectivity: idle, connecting, ready, ... or "closed"


# gRPC metadata keys: lowercase token characters; "grpc-" belongs to the library.
_METADATA_KEY: Final = re.compile(r"[0-9a-z_.\-]+")
_RESERVED_METADATA: Final = frozenset({"content-type", "te", "user-agent", "host"})
_UNSAFE_VALUE_CHARS: Final = re.compile(r"[^\x20-\x7e]")


class GrpcTransport:
    """Delivers one integration's events to its gRPC handler over one shared channel."""

    def __init__(
        self,
        target: TargetConfig,
        *,
        integration: str,
        max_connections: int,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._address, secure = _address(target, integration)
        self._credentials: grpc.ChannelCredentials | None = None
        self._server_name: str | None = None
        if secure:
            # Read now, so that a TLS file that does not load is a ConfigError, not a failed call.
            pems = pem_files(target.tls, where=f"integration {integration}")
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=pems.root_certificates,
                private_key=pems.private_key,
                certificate_chain=pems.certificate_chain,
            )
            self._server_name = target.tls.server_name if target.tls is not None else None
        self._timeout_s = target.timeout_s
        self._max_connections = max_connections
        self._clock = clock
        self._source = source_for(integration)
        self._metadata = _checked_metadata(target.headers, integration)
        self._contract = contract_for(
            target,
            integration=integration,
            clock=clock,
            redact=[value for _, value in self._metadata],
        )
        # Opened on first use: a grpc.aio channel belongs to the loop it is created in.
        self._channel: _Channel | None = None
        self._closed = False
        self._calls = 0
        self._in_flight = 0

    @property
    def address(self) -> str:
        """The channel's target, ``host:port``."""
        return self._address

    async def deliver(self, event: Event) -> DeliveryResult:
        """Calls ``Deliver`` with one event."""
        if self._closed:
            return self._closed_result()
        proto = event_message(event, self._source)
        metadata = self._metadata
        if event.forwarded:
            metadata = (*metadata, *forwarded_metadata(event))
        if event.trace is not None:
            metadata = (*metadata, *trace_headers(event))
        if self._contract.signs:
            metadata = (*metadata, *self._contract.sign_grpc([proto], batch=False))
        request = pb.DeliverRequest(event=proto)
        # Before the call: grpc counts its deadline from the call's creation.
        started = self._clock.monotonic()
        call = self._open().deliver(request, timeout=self._timeout_s, metadata=metadata)
        return await self._call(call, (event.body,), started)

    async def deliver_batch(self, events: Sequence[Event]) -> DeliveryResult:
        """Calls ``DeliverBatch`` with the events; the result applies to each."""
        if not events:
            raise ValueError("deliver_batch needs at least one event")
        if self._closed:
            return self._closed_result()
        protos = [_with_trace(event_message(event, self._source), event) for event in events]
        metadata = self._metadata
        if self._contract.signs:
            metadata = (*metadata, *self._contract.sign_grpc(protos, batch=True))
        request = pb.DeliverBatchRequest(events=protos)
        started = self._clock.monotonic()
        call = self._open().deliver_batch(request, timeout=self._timeout_s, metadata=metadata)
        return await self._call(call, [event.body for event in events], started)

    async def close(self) -> None:
        """Closes the channel; calls in flight end CANCELLED (retry), later ones answer RETRY."""
        self._closed = True
        if self._channel is not None:
            await self._channel.channel.close(None)

    def statistics(self) -> GrpcTransportStatistics:
        """A snapshot of the counters."""
        if self._channel is None or self._closed:
            state = "closed" if self._closed else "idle"
        else:
            state = self._channel.channel.get_state().name.lower()
        return GrpcTransportStatistics(
            calls=self._calls,
            in_flight=self._in_flight,
            max_connections=self._max_connections,
            channel=state,
        )

    def _open(self) -> _Channel:
        if self._channel is None:
            self._channel = _Channel.open(
                self._address, credentials=self._credentials, server_name=self._server_name
            )
        return self._channel

    async def _call(
        self,
        call: aio.UnaryUnaryCall[pb.DeliverRequest, pb.DeliverResponse]
        | aio.UnaryUnaryCall[pb.DeliverBatchRequest, pb.DeliverBatchResponse],
        sent: Sequence[bytes],
        started: float,
    ) -> DeliveryResult:
        self._calls += 1
        self._in_flight += 1
        try:
            try:
                await call
            except aio.AioRpcError as failed:
                code, details = failed.code(), failed.details()
                trailers = _metadata_dict(failed.trailing_metadata())
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._closed or (task is not None and task.cancelling()):
                    raise  # our own task is being cancelled: not an answer
                # close() cancelled the call under us: the handler may or may not have it.
                code, details, trailers = grpc.StatusCode.CANCELLED, "transport closed", {}
            else:
                code, details = grpc.StatusCode.OK, None
                trailers = _metadata_dict(await call.trailing_metadata())
        finally:
            self._in_flight -= 1
        contract = self._contract
        number = code.value[0]
        if code is grpc.StatusCode.DEADLINE_EXCEEDED and (
            self._clock.monotonic() - started >= self._timeout_s
        ):
            # Our deadline, not the handler's.
            failure = timeout_after(self._timeout_s)
            return contract.wire_error(failure, started, protocol="grpc", status=number)
        if code is grpc.StatusCode.UNAVAILABLE and _REFUSED_DETAILS.search(details or ""):
            # Nothing listens at the target: the same words as HTTP's refused connection.
            failure = WireError(WireFailure.REFUSED)
            return contract.wire_error(failure, started, protocol="grpc", status=number)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE_DETAILS in (details or ""):
            # grpcio refused an answer above MAX_RESPONSE_BYTES: the handler's status is unknown.
            failure = WireError(WireFailure.TOO_LARGE, f"above {MAX_RESPONSE_BYTES} bytes")
            return contract.wire_error(failure, started, protocol="grpc", status=number)
        return contract.grpc_answer(number, details, trailers, sent, started)

    def _closed_result(self) -> DeliveryResult:
        return self._contract.wire_error(WireError(WireFailure.CLOSED), None, protocol="grpc")


@dataclass(frozen=True, slots=True)
class _Channel:
    """The shared channel and the two methods of the service, bound to it."""

    channel: aio.Channel
    deliver: aio.UnaryUnaryMultiCallable[pb.DeliverRequest, pb.DeliverResponse]
    deliver_batch: aio.UnaryUnaryMultiCallable[pb.DeliverBatchRequest, pb.DeliverBatchResponse]

    @classmethod
    def open(
        cls,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None,
        server_name: str | None = None,
    ) -> _Channel:
        """A channel to ``address``: TLS with ``credentials``, plain text without."""
        options: list[tuple[str, str | int]] = [
            ("grpc.primary_user_agent", f"nemesis/{__version__}"),
            # A DNS name with several addresses (a headless Kubernetes service) spreads
            # the calls over every handler pod instead of pinning one connection.
            ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}'),
            ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
        ]
        if server_name is not None:
            # The name checked against the handler's certificate and sent as SNI.
            options.append(("grpc.ssl_target_name_override", server_name))
        if credentials is not None:
            channel = aio.secure_channel(address, credentials, options=options)
        else:
            channel = aio.insecure_channel(address, options=options)
        return cls(
            channel,
            channel.unary_unary(
                DELIVER_METHOD,
                request_serializer=pb.DeliverRequest.SerializeToString,
                response_deserializer=pb.DeliverResponse.FromString,
            ),
            channel.unary_unary(
                DELIVER_BATCH_METHOD,
                request_serializer=pb.DeliverBatchRequest.SerializeToString,
                response_deserializer=pb.DeliverBatchResponse.FromString,
            ),
        )


def _metadata_dict(metadata: Iterable[object] | None) -> dict[str, str]:
    """Metadata pairs as a dict; binary (``-bin``) values are not part of the contract."""
    # Typed loosely on purpose: grpc-stubs types AioRpcError.trailing_metadata() as
    # grpc._Metadatum objects, while grpcio returns (key, value) pairs.
    pairs: dict[str, str] = {}
    for item in metadata or ():
        if isinstance(item, tuple) and len(item) == 2:
            key, value = item
            if isinstance(key, str) and isinstance(value, str):
                # The first of a repeated key wins.
                pairs.setdefault(key.lower(), value)
    return pairs


def _utf8(text: str) -> str:
    # Protobuf strings must be valid UTF-8: one odd key must not fail a delivery.
    if text.isascii():
        return text
    return text.encode("utf-8", errors="replace").decode("utf-8")


def _address(target: TargetConfig, integration: str) -> tuple[str, bool]:
    """``grpc[s]://host[:port]`` as the channel target ``host:port``, and whether it is TLS."""
    if target.scheme not in DEFAULT_PORTS:
        raise ConfigError(
            [config_problem(integration, "target.url", "the gRPC transport needs grpc(s)://")]
        )
    parts = urlsplit(target.url)
    problem = None
    port = _port(parts)
    if port is None:
        problem = "the port is not a number between 1 and 65535"
    elif parts.path not in ("", "/") or parts.query or parts.fragment:
        problem = "a gRPC target is grpc://host:port: the service and methods are fixed"
    elif parts.username is not None or parts.password is not None:
        problem = "credentials go in target.headers (metadata) with ${VAR}, not in the URL"
    elif not parts.hostname:
        problem = "the URL names no host"
    if problem is not None or port is None:
        raise ConfigError([config_problem(integration, "target.url", problem or "")])
    host = parts.hostname or ""
    port = port or DEFAULT_PORTS[target.scheme]
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}"), target.scheme == "grpcs"


def _port(parts: SplitResult) -> int | None:
    """The port in the URL; 0 when none is written, None when it is not a port."""
    try:
        port = parts.port
    except ValueError:
        return None
    if port is None:
        return 0
    return port if port > 0 else None


def _checked_metadata(headers: Mapping[str, str], integration: str) -> tuple[tuple[str, str], ...]:
    checked: list[tuple[str, str]] = []
    for name, value in headers.items():
        field = f"target.headers.{name}"
        key = name.lower()
        if not _METADATA_KEY.fullmatch(key) or key.endswith("-bin"):
            message = "not a valid gRPC metadata key (letters, digits, '-', '_', '.'; no -bin)"
            raise ConfigError([config_problem(integration, field, message)])
        if key.startswith("grpc-") or key in _RESERVED_METADATA:
            raise ConfigError([config_problem(integration, field, "set by gRPC itself")])
        if key in SIGNING_HEADERS:
            message = "set by Nemesis when target.signing is configured"
            raise ConfigError([config_problem(integration, field, message)])
        if _UNSAFE_VALUE_CHARS.search(value):
            message = "gRPC metadata values are printable ASCII"
            raise ConfigError([config_problem(integration, field, message)])
        checked.append((key, value))
    return tuple(checked)
