"""The gRPC transport against a real grpcio server on loopback: what only gRPC has.

The cases every transport shares (outcome table, verdicts, Retry-After, no
answer, error text) are in ``tests/transport``.

``GrpcHandler`` is the handler side: a real ``grpc.aio`` server implementing
``nemesis.v1.HandlerService`` that records every call and answers as a test
scripts it. Other test modules import it from here.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

import grpc
import pytest
from grpc import aio
from pydantic import ValidationError

from nemesis import __version__
from nemesis.broker.port import Message
from nemesis.config.models import TargetConfig
from nemesis.delivery.grpc import GrpcTransport
from nemesis.delivery.port import Event, Outcome
from nemesis.errors import ConfigError
from nemesis.proto import SERVICE
from nemesis.proto.nemesis.v1 import handler_pb2 as pb

INTEGRATION = "orders-to-loyalty"
CREATED_AT = 1764480000.25  # 2025-11-30T05:20:00.25Z
PAYLOAD = b'{"order": {"id": 17, "city": "msk", "amount": 250.5}}'


def grpc_transport(target: TargetConfig, integration: str, max_connections: int) -> GrpcTransport:
    """The gRPC transport of ``target``, as the registry's ``grpc`` kind makes it."""
    return GrpcTransport(target, integration=integration, max_connections=max_connections)


@dataclass(frozen=True, slots=True)
class Answer:
    """What the handler answers to one call."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    trailers: tuple[tuple[str, str], ...] = ()
    delay_s: float = 0.0
    padding_bytes: int = 0  # an unknown field of this size in the response: an oversized answer


@dataclass(frozen=True, slots=True)
class Received:
    """One call as the handler saw it."""

    method: str
    events: tuple[pb.Event, ...]
    metadata: dict[str, str]
    peer: str
    answer: Answer


Script = Callable[[Sequence[pb.Event]], Answer]


def always_ok(events: Sequence[pb.Event]) -> Answer:
    return Answer()


@dataclass
class GrpcHandler:
    """A ``nemesis.v1.HandlerService`` on 127.0.0.1: records calls, answers as ``script`` says."""

    script: Script = always_ok
    # Consulted before script, with the call's method and metadata (a signature check);
    # None from it: the script answers.
    check: Callable[[str, Sequence[pb.Event], Mapping[str, str]], Answer | None] | None = None
    calls: list[Received] = field(default_factory=list)  # as they arrived
    answered: list[Received] = field(default_factory=list)  # answered before the caller gave up
    _server: aio.Server | None = None
    _port: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    def delivered_ids(self) -> set[str]:
        """Ids of events in calls answered OK without a verdict (not those that timed out)."""
        return {
            event.id
            for call in self.answered
            if call.answer.code is grpc.StatusCode.OK and not call.answer.trailers
            for event in call.events
        }

    async def wait_for(self, count: int, timeout_s: float = 20) -> None:
        """Until ``count`` distinct ids were answered OK."""
        await self._wait(lambda: len(self.delivered_ids()) >= count, timeout_s)

    async def wait_for_calls(self, count: int, timeout_s: float = 20) -> None:
        """Until ``count`` calls arrived (answered or not)."""
        await self._wait(lambda: len(self.calls) >= count, timeout_s)

    async def _wait(self, done: Callable[[], bool], timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not done():
                self._changed.clear()
                await self._changed.wait()

    async def __aenter__(self) -> GrpcHandler:
        server = aio.server()
        handlers = {
            "Deliver": grpc.unary_unary_rpc_method_handler(
                self._deliver,
                request_deserializer=pb.DeliverRequest.FromString,
                response_serializer=pb.DeliverResponse.SerializeToString,
            ),
            "DeliverBatch": grpc.unary_unary_rpc_method_handler(
                self._deliver_batch,
                request_deserializer=pb.DeliverBatchRequest.FromString,
                response_serializer=pb.DeliverBatchResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self._port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            await self._server.stop(None)

    async def _deliver(
        self, request: pb.DeliverRequest, context: aio.ServicerContext[object, object]
    ) -> pb.DeliverResponse:
        answer = await self._answer("Deliver", (request.event,), context)
        return _padded(pb.DeliverResponse(), answer.padding_bytes)

    async def _deliver_batch(
        self, request: pb.DeliverBatchRequest, context: aio.ServicerContext[object, object]
    ) -> pb.DeliverBatchResponse:
        answer = await self._answer("DeliverBatch", tuple(request.events), context)
        return _padded(pb.DeliverBatchResponse(), answer.padding_bytes)

    async def _answer(
        self,
        method: str,
        events: tuple[pb.Event, ...],
        context: aio.ServicerContext[object, object],
    ) -> Answer:
        metadata = {
            key: value
            for key, value in (context.invocation_metadata() or ())
            if isinstance(value, str)
        }
        checked = None if self.check is None else self.check(method, events, metadata)
        answer = self.script(events) if checked is None else checked
        received = Received(method, events, metadata, context.peer(), answer)
        self.calls.append(received)
        self._changed.set()
        if answer.delay_s:
            # grpc.aio cancels this coroutine when the caller's deadline passes.
            await asyncio.sleep(answer.delay_s)
        self.answered.append(received)
        self._changed.set()
        if answer.trailers:
            context.set_trailing_metadata(answer.trailers)
        if answer.code is not grpc.StatusCode.OK:
            await context.abort(answer.code, answer.details)
        return answer


_Response = TypeVar("_Response", pb.DeliverResponse, pb.DeliverBatchResponse)


def _padded(response: _Response, size: int) -> _Response:
    if size:
        # Field 15, length-delimited: unknown to every reader, kept and sent by protobuf.
        response.MergeFromString(b"\x7a" + _varint(size) + b"x" * size)
    return response


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def make_event(
    id_: str = "orders/3/41",
    *,
    key: str | None = "customer-9",
    value: bytes = PAYLOAD,
    attempt: int = 1,
    created_at: float = CREATED_AT,
    written_at: float = 0.0,
    offset: int = 41,
) -> Event:
    message = Message(
        topic="orders",
        partition=3,
        offset=offset,
        value=value,
        key=key,
        created_at=created_at,
        written_at=written_at,
    )
    return Event(message=message, id=id_, type="order.created", attempt=attempt)


def target(url: str, timeout_s: float = 2.0, headers: dict[str, str] | None = None) -> TargetConfig:
    return TargetConfig(url=url, timeout_s=timeout_s, headers=headers or {})


@pytest.fixture
async def handler() -> AsyncIterator[GrpcHandler]:
    async with GrpcHandler() as server:
        yield server


@pytest.fixture
async def transport(handler: GrpcHandler) -> AsyncIterator[GrpcTransport]:
    opened = grpc_transport(target(handler.url), INTEGRATION, 8)
    yield opened
    await opened.close()


# --- delivery -------------------------------------------------------------------------


async def test_one_event_carries_the_http_contract_attributes(handler: GrpcHandler) -> None:
    transport = grpc_transport(
        target(handler.url, headers={"Authorization": "Bearer t0k"}), INTEGRATION, 4
    )
    try:
        result = await transport.deliver(make_event(attempt=2))
    finally:
        await transport.close()
    assert result.outcome is Outcome.DELIVERED
    assert result.status == 0
    assert result.error is None
    [call] = handler.calls
    assert call.method == "Deliver"
    [event] = call.events
    assert event.id == "orders/3/41"
    assert event.source == f"nemesis/{INTEGRATION}"
    assert event.spec_version == "1.0"
    assert event.type == "order.created"
    assert event.time.ToMicroseconds() == round(CREATED_AT * 1_000_000)
    assert event.data_content_type == "application/json"
    assert event.data == PAYLOAD
    assert event.HasField("partition_key")
    assert event.partition_key == "customer-9"
    assert (event.topic, event.partition, event.offset, event.attempt) == ("orders", 3, 41, 2)
    # target.headers travel as call metadata (credentials via ${VAR}).
    assert call.metadata["authorization"] == "Bearer t0k"
    assert f"nemesis/{__version__}" in call.metadata["user-agent"]


async def test_missing_key_and_time_stay_unset(
    handler: GrpcHandler, transport: GrpcTransport
) -> None:
    await transport.deliver(make_event(key=None, created_at=0.0, written_at=0.0))
    [event] = handler.calls[0].events
    assert not event.HasField("partition_key")
    assert not event.HasField("time")


async def test_time_falls_back_to_the_broker_time(
    handler: GrpcHandler, transport: GrpcTransport
) -> None:
    await transport.deliver(make_event(created_at=0.0, written_at=1764480001.5))
    [event] = handler.calls[0].events
    assert event.time.ToMicroseconds() == 1764480001_500_000


async def test_unicode_survives_and_a_binary_key_arrives_as_its_bytes(
    handler: GrpcHandler, transport: GrpcTransport
) -> None:
    assert (await transport.deliver(make_event(key="клиент-9"))).outcome is Outcome.DELIVERED
    # The port's text for the key bytes b"bad\x80key" (not UTF-8): key_text.
    assert (await transport.deliver(make_event(key="bad\udc80key"))).outcome is Outcome.DELIVERED
    assert handler.calls[0].events[0].partition_key == "клиент-9"
    binary = handler.calls[1].events[0]
    assert not binary.HasField("partition_key")
    assert base64.b64decode(binary.extensions["partitionkeybase64"]) == b"bad\x80key"


async def test_batch_is_one_call_in_order(handler: GrpcHandler, transport: GrpcTransport) -> None:
    events = [make_event(f"orders/3/{n}", offset=n, value=b'{"n": %d}' % n) for n in range(25)]
    result = await transport.deliver_batch(events)
    assert result.outcome is Outcome.DELIVERED
    [call] = handler.calls
    assert call.method == "DeliverBatch"
    assert [e.id for e in call.events] == [f"orders/3/{n}" for n in range(25)]
    assert [e.data for e in call.events] == [b'{"n": %d}' % n for n in range(25)]
    assert {e.source for e in call.events} == {f"nemesis/{INTEGRATION}"}


async def test_one_channel_carries_every_call(
    handler: GrpcHandler, transport: GrpcTransport
) -> None:
    results = await asyncio.gather(*(transport.deliver(make_event(f"e{n}")) for n in range(40)))
    assert {r.outcome for r in results} == {Outcome.DELIVERED}
    # One client address and port: one connection, calls multiplexed over it.
    assert len({call.peer for call in handler.calls}) == 1
    assert transport.statistics().calls == 40
    assert transport.statistics().in_flight == 0
    assert transport.statistics().channel == "ready"


# --- the status table ------------------------------------------------------------------

# The handler contract's table (nemesis.delivery.contract.answer_for_grpc_status).
EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT: Outcome.DEAD,
    grpc.StatusCode.FAILED_PRECONDITION: Outcome.DEAD,
    grpc.StatusCode.OUT_OF_RANGE: Outcome.DEAD,
    grpc.StatusCode.ALREADY_EXISTS: Outcome.DEAD,
    grpc.StatusCode.UNAVAILABLE: Outcome.RETRY,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Outcome.RETRY,
    grpc.StatusCode.DEADLINE_EXCEEDED: Outcome.RETRY,
    grpc.StatusCode.ABORTED: Outcome.RETRY,
    grpc.StatusCode.INTERNAL: Outcome.RETRY,
    grpc.StatusCode.UNKNOWN: Outcome.RETRY,
    grpc.StatusCode.CANCELLED: Outcome.RETRY,
    grpc.StatusCode.NOT_FOUND: Outcome.RETRY,
    grpc.StatusCode.PERMISSION_DENIED: Outcome.RETRY,
    grpc.StatusCode.UNAUTHENTICATED: Outcome.RETRY,
    grpc.StatusCode.UNIMPLEMENTED: Outcome.RETRY,
    grpc.StatusCode.DATA_LOSS: Outcome.RETRY,
}


@pytest.mark.parametrize("code", list(EXPECTED), ids=lambda code: code.name)
async def test_each_status_from_a_real_handler_maps_as_the_table_says(
    handler: GrpcHandler, transport: GrpcTransport, code: grpc.StatusCode
) -> None:
    handler.script = lambda events: Answer(code, f"answered {code.name}")
    result = await transport.deliver(make_event())
    assert result.outcome is EXPECTED[code]
    assert result.status == code.value[0]
    assert result.error == f"gRPC {code.name}: answered {code.name}"
    batch = await transport.deliver_batch([make_event("a"), make_event("b")])
    assert batch.outcome is EXPECTED[code]


async def test_a_handler_that_raises_is_retried(transport: GrpcTransport) -> None:
    async def broken(request: pb.DeliverRequest, context: object) -> pb.DeliverResponse:
        raise RuntimeError("bug in the handler")

    server = aio.server()
    method = grpc.unary_unary_rpc_method_handler(
        broken,
        request_deserializer=pb.DeliverRequest.FromString,
        response_serializer=pb.DeliverResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Deliver": method}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    other = grpc_transport(target(f"grpc://127.0.0.1:{port}"), INTEGRATION, 1)
    try:
        result = await other.deliver(make_event())
    finally:
        await other.close()
        await server.stop(None)
    assert result.outcome is Outcome.RETRY
    assert result.status == grpc.StatusCode.UNKNOWN.value[0]


async def test_a_handler_without_deliver_batch_is_retried(transport: GrpcTransport) -> None:
    server = aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    other = grpc_transport(target(f"grpc://127.0.0.1:{port}"), INTEGRATION, 1)
    try:
        result = await other.deliver_batch([make_event("a"), make_event("b")])
    finally:
        await other.close()
        await server.stop(None)
    # A configuration problem for every message alike: retry, so the breaker opens.
    assert result.outcome is Outcome.RETRY
    assert result.status == grpc.StatusCode.UNIMPLEMENTED.value[0]


# --- the verdict trailer ---------------------------------------------------------------


# --- deadlines and failures ---------------------------------------------------------------


async def test_deadline_is_target_timeout_and_produces_a_retry(handler: GrpcHandler) -> None:
    handler.script = lambda events: Answer(delay_s=2.0)
    transport = grpc_transport(target(handler.url, timeout_s=0.2), INTEGRATION, 2)
    started = time.monotonic()
    try:
        result = await transport.deliver(make_event())
        single = time.monotonic() - started
        batch = await transport.deliver_batch([make_event("a"), make_event("b")])
    finally:
        await transport.close()
    assert result.outcome is Outcome.RETRY
    assert result.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert result.error == "timeout after 0.2s"
    # The deadline ended it (the status says so, not the handler's 2 s answer); the
    # figure is the call's own time (its lower bound allows for gRPC's own clock).
    assert 0.15 <= result.duration_s <= single
    assert batch.outcome is Outcome.RETRY
    assert batch.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


async def test_closed_transport_answers_retry(handler: GrpcHandler) -> None:
    transport = grpc_transport(target(handler.url), INTEGRATION, 1)
    assert (await transport.deliver(make_event())).outcome is Outcome.DELIVERED
    await transport.close()
    result = await transport.deliver(make_event())
    assert (result.outcome, result.error) == (Outcome.RETRY, "transport closed")
    assert (await transport.deliver_batch([make_event()])).outcome is Outcome.RETRY
    assert transport.statistics().channel == "closed"


async def test_close_cancels_calls_in_flight_as_retries(handler: GrpcHandler) -> None:
    handler.script = lambda events: Answer(delay_s=5.0)
    transport = grpc_transport(target(handler.url, timeout_s=10), INTEGRATION, 1)
    pending = asyncio.create_task(transport.deliver(make_event()))
    await handler.wait_for_calls(1, timeout_s=5)
    await transport.close()
    result = await pending
    assert result.outcome is Outcome.RETRY
    assert result.status == grpc.StatusCode.CANCELLED.value[0]


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("grpc://loyalty.svc:50051", "loyalty.svc:50051"),
        ("grpc://loyalty.svc", "loyalty.svc:80"),
        ("grpcs://loyalty.example.com", "loyalty.example.com:443"),
        ("grpc://[::1]:50051/", "[::1]:50051"),
    ],
)
def test_target_address(url: str, address: str) -> None:
    assert grpc_transport(target(url), INTEGRATION, 1).address == address


@pytest.mark.parametrize(
    ("url", "headers", "message"),
    [
        ("http://loyalty.svc/events", {}, "needs grpc"),
        ("grpc://loyalty.svc:50051/nemesis.v1.HandlerService", {}, "service and methods"),
        ("grpc://loyalty.svc:50051?x=1", {}, "service and methods"),
        ("grpc://user:secret@loyalty.svc:50051", {}, "credentials go in target.headers"),
        ("grpc://loyalty.svc:50051", {"X Token": "a"}, "metadata key"),
        ("grpc://loyalty.svc:50051", {"grpc-timeout": "1S"}, "set by gRPC"),
        ("grpc://loyalty.svc:50051", {"x-token-bin": "a"}, "metadata key"),
        ("grpc://loyalty.svc:50051", {"x-token": "caf\u00e9"}, "printable ASCII"),
    ],
)
def test_bad_targets_are_config_errors(url: str, headers: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        grpc_transport(target(url, headers=headers), INTEGRATION, 1)
    assert raised.value.problems[0].field is not None
    assert raised.value.problems[0].field.startswith("target.")


def test_a_port_out_of_range_is_refused_by_the_configuration_and_the_transport() -> None:
    with pytest.raises(ValidationError, match="the port must be a number from 1 to 65535"):
        target("grpc://loyalty.svc:99999")
    unchecked = TargetConfig.model_construct(url="grpc://loyalty.svc:99999")
    with pytest.raises(ConfigError, match="port"):
        grpc_transport(unchecked, INTEGRATION, 1)


def test_max_connections_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        grpc_transport(target("grpc://loyalty.svc:50051"), INTEGRATION, 0)
