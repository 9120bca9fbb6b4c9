"""The handler contract for what a string map cannot hold of a record (docs/handler-contract.md).

The Kafka mapping keeps a record as written (binary keys, tombstones, duplicate
and null headers) and writes it back the same; events of CloudEvents records
keep their attributes in batches (parsed by the ``cloudevents`` SDK) and over
gRPC (a real ``nemesis.v1.HandlerService`` on 127.0.0.1); forwarded headers
come from Kafka headers and from the metadata of the other backends. The
end-to-end case with third-party producers is ``tests/test_kafka_records.py``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiokafka.structs import ConsumerRecord
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

from nemesis.broker.kafka.mapping import KafkaSession, headers_of, record_key, record_value
from nemesis.broker.kafka.mapping import to_message as kafka_message
from nemesis.broker.port import Message, OutgoingMessage, key_text
from nemesis.config.models import IntegrationConfig, TargetConfig
from nemesis.delivery.cloudevents import batch_body
from nemesis.delivery.grpc import GrpcTransport
from nemesis.delivery.port import Event, Outcome
from nemesis.runtime.events import EventFactory
from nemesis.transports import default_transports
from tests.kafka_broker import free_port
from tests.test_grpc_delivery import GrpcHandler, grpc_transport, target

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def config(**source: Any) -> IntegrationConfig:
    return IntegrationConfig.model_validate(
        {
            "name": "it",
            "owners": ["team"],
            "source": {"topic": "orders", "consumer": "it", **source},
            "target": {"url": "http://127.0.0.1:9/", "timeout_s": 5, "format": "bytes"},
        }
    )


def record(
    headers: list[tuple[str, bytes | None]], key: bytes | None = None, value: bytes | None = b"v"
) -> Message:
    raw = ConsumerRecord(
        topic="orders",
        partition=1,
        offset=7,
        timestamp=1764670000000,
        timestamp_type=0,
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=0,
        headers=headers,
    )
    return kafka_message(raw, KafkaSession("orders", 1, 1, owner=None))


def test_the_kafka_mapping_keeps_a_record_and_writes_it_back_the_same() -> None:
    headers: list[tuple[str, bytes | None]] = [
        ("x-dup", b"one"),
        ("x-null", None),
        ("x-dup", b"\xff two"),
        ("type", b"order.created"),
        ("nemesis-attempts", b"2"),  # a retry tier's bookkeeping: metadata only
        ("__producer", b"nemesis-1"),
    ]
    message = record(headers, key=b"\xff\xfe\x00k", value=None)
    assert message.headers == tuple(headers[:4])
    assert message.tombstone
    assert message.value == b""
    # The string view: each header's last UTF-8 value, the bookkeeping beside it.
    assert dict(message.metadata) == {"type": "order.created", "nemesis-attempts": "2"}
    assert message.producer_id == "nemesis-1"
    copy = OutgoingMessage(
        value=message.value,
        key=message.key,
        metadata={**message.metadata, "nemesis-attempts": "3"},
        headers=message.headers,
        tombstone=message.tombstone,
    )
    assert record_key(copy) == b"\xff\xfe\x00k"
    assert record_value(copy) is None
    assert headers_of(copy, "nemesis-2", None) == [
        *headers[:4],
        ("nemesis-attempts", b"3"),
        ("__producer", b"nemesis-2"),
    ]
    empty = record([], value=b"")
    assert (empty.value, empty.tombstone, empty.headers) == (b"", False, ())


def test_forwarded_headers_come_from_kafka_headers_and_from_other_backends_metadata() -> None:
    events = EventFactory(config(forward_headers=["traceparent", "x-dup"]))
    kafka = record(
        [
            ("TraceParent", TRACEPARENT),
            ("x-dup", b"a"),
            ("x-other", b"b"),
            ("x-dup", None),
            ("x-dup", b"\xff"),
        ]
    )
    # The trace context is continued (Event.trace), never copied as a forwarded header.
    assert events(kafka, 1).forwarded == (("x-dup", b"a"), ("x-dup", b"\xff"))
    assert events(kafka, 1).trace.traceparent == TRACEPARENT.decode()  # type: ignore[union-attr]
    embedded = Message("orders", 0, 1, b"{}", metadata={"traceparent": TRACEPARENT.decode()})
    assert events(embedded, 1).forwarded == ()
    assert events(embedded, 1).trace.traceparent == TRACEPARENT.decode()  # type: ignore[union-attr]
    assert EventFactory(config(forward_headers=[]))(kafka, 1).forwarded == ()


@pytest.mark.parametrize(
    "names",
    [["Traceparent"], ["ce-id"], ["nemesis-attempts"], ["content-type"], ["x-bin"], ["a", "a"]],
)
def test_forward_headers_refuses_names_the_contract_owns(names: list[str]) -> None:
    with pytest.raises(ValueError, match="forward_headers"):
        config(forward_headers=names)


def test_a_forwarded_header_that_target_headers_sets_too_is_refused() -> None:
    document = config(forward_headers=["x-tenant"]).model_dump()
    document["target"]["headers"] = {"X-Tenant": "fixed"}
    with pytest.raises(ValueError, match=r"x-tenant: set by target\.headers too"):
        IntegrationConfig.model_validate(document)


def test_target_headers_cannot_set_the_trace_context() -> None:
    document = config().model_dump()
    document["target"]["headers"] = {"TraceParent": "00-fixed"}
    with pytest.raises(ValueError, match=r"'TraceParent': set by Nemesis for every event"):
        IntegrationConfig.model_validate(document)


def cloud_binary() -> Message:
    return record(
        [
            ("ce_specversion", b"1.0"),
            ("ce_id", b"evt-1"),
            ("ce_source", b"/shop"),
            ("ce_type", b"order.created"),
            ("ce_subject", b"order/1"),
            ("ce_region", "éu".encode()),
            ("content-type", b"application/json"),
            ("traceparent", TRACEPARENT),
        ],
        key=b"\x80",
        value=b'{"n": 1.50}',
    )


def cloud_structured() -> Message:
    value = (
        b'{"specversion":"1.0","id":"evt-2","source":"/shop","type":"order.paid",'
        b'"count":3,"flag":true,"datacontenttype":"text/plain","data":"hello"}'
    )
    return record([("content-type", b"application/cloudevents+json")], key=b"k", value=value)


def test_a_batch_keeps_each_events_own_attributes_and_marks_a_tombstone() -> None:
    events = EventFactory(config())
    batch = [
        events(cloud_binary(), 2),
        events(cloud_structured(), 1),
        events(record([("traceparent", TRACEPARENT)], key=b"gone", value=None), 1),
    ]
    elements = json.loads(batch_body(batch, "nemesis/it"))
    parsed = [JSONFormat().read(CloudEvent, json.dumps(e)) for e in elements]
    binary, structured, tombstone = parsed
    assert (binary.get_id(), binary.get_source(), binary.get_subject()) == (
        "evt-1",
        "/shop",
        "order/1",
    )
    assert binary.get_extension("region") == "éu"
    assert binary.get_extension("traceparent") == TRACEPARENT.decode()
    assert binary.get_extension("attempt") == "2"
    assert base64.b64decode(binary.get_extension("partitionkeybase64")) == b"\x80"
    assert binary.get_data() == {"n": 1.5}
    assert (structured.get_id(), structured.get_type()) == ("evt-2", "order.paid")
    assert (structured.get_extension("count"), structured.get_extension("flag")) == ("3", "true")
    assert structured.get_datacontenttype() == "text/plain"
    assert elements[1]["data_base64"] == base64.b64encode(b"hello").decode()
    assert tombstone.get_extension("tombstone") == "true"
    assert "data" not in elements[2]
    assert "data_base64" not in elements[2]
    assert tombstone.get_extension("partitionkey") == "gone"


@pytest.fixture
async def grpc_handler() -> AsyncIterator[GrpcHandler]:
    async with GrpcHandler() as server:
        yield server


async def test_grpc_carries_a_cloudevent_records_attributes_and_forwarded_metadata(
    grpc_handler: GrpcHandler,
) -> None:
    transport: GrpcTransport = grpc_transport(target(grpc_handler.url), "it", 2)
    try:
        await transport.deliver(EventFactory(config())(cloud_binary(), 1))
    finally:
        await transport.close()
    [call] = grpc_handler.calls
    [event] = call.events
    assert (event.id, event.source, event.type) == ("evt-1", "/shop", "order.created")
    assert event.data == b'{"n": 1.50}'
    assert event.data_content_type == "application/json"
    assert dict(event.extensions) == {
        "subject": "order/1",
        "region": "éu",
        "partitionkeybase64": base64.b64encode(b"\x80").decode(),
    }
    assert not event.HasField("partition_key")
    assert (event.topic, event.partition, event.offset) == ("orders", 1, 7)
    assert call.metadata["traceparent"] == TRACEPARENT.decode()


def test_a_key_made_by_key_text_is_the_bytes_kafka_hashes() -> None:
    from nemesis.broker.kafka.writer import partition_of_key

    # murmur2 over the record key's bytes, as the Java client: not over replacement characters.
    assert partition_of_key(key_text(b"\xff\xfe"), 97) != partition_of_key("\ufffd\ufffd", 97)


@pytest.fixture
async def http_handler() -> AsyncIterator[tuple[str, list[tuple[list[tuple[str, str]], bytes]]]]:
    """An HTTP handler on 127.0.0.1 keeping each request's header lines as sent, and its body."""
    received: list[tuple[list[tuple[str, str]], bytes]] = []

    async def handle(request: web.Request) -> web.Response:
        lines = [(n.decode().lower(), v.decode("latin-1")) for n, v in request.raw_headers]
        received.append((lines, await request.read()))
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/", received
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("client", ["h1", "aiohttp"])
async def test_both_http_clients_send_a_records_headers_as_the_contract_says(
    client: str, http_handler: tuple[str, list[tuple[list[tuple[str, str]], bytes]]]
) -> None:
    url, received = http_handler
    events = EventFactory(config(forward_headers=["traceparent", "x-dup"]))
    plain = record(
        [("x-dup", b"a b"), ("x-dup", b"%\xff"), ("x-dup", None), ("traceparent", TRACEPARENT)],
        key=b"\xfe\x00",
        value=None,
    )
    transport = default_transports().open(
        TargetConfig(url=url, transport=client, timeout_s=5),
        integration="it",
        max_connections=2,
    )
    try:
        for message in (plain, cloud_binary()):
            result = await transport.deliver(events(message, 1))
            assert result.outcome is Outcome.DELIVERED, result
    finally:
        await transport.close()
    (tombstone, tombstone_body), (cloud, cloud_body) = received
    own = [(n, v) for n, v in tombstone if n.startswith("ce-") or n in ("x-dup", "traceparent")]
    assert own == [
        ("ce-specversion", "1.0"),
        ("ce-id", "orders:1:7"),
        ("ce-source", "nemesis/it"),
        ("ce-type", "nemesis.message"),
        ("ce-time", "2025-12-02T10:06:40.000000Z"),
        ("ce-topic", "orders"),
        ("ce-partition", "1"),
        ("ce-offset", "7"),
        ("ce-attempt", "1"),
        ("ce-partitionkeybase64", base64.b64encode(b"\xfe\x00").decode()),
        ("ce-tombstone", "true"),
        ("x-dup", "a b"),
        ("x-dup", "%25%FF"),
        ("traceparent", TRACEPARENT.decode()),
    ]
    assert "content-type" not in dict(tombstone)
    assert tombstone_body == b""
    headers = dict(cloud)
    assert (headers["ce-id"], headers["ce-source"], headers["ce-subject"]) == (
        "evt-1",
        "/shop",
        "order/1",
    )
    assert headers["ce-region"] == "%C3%A9u"
    assert headers["content-type"] == "application/json"
    assert cloud_body == b'{"n": 1.50}'


TRACED = Message("orders", 0, 3, b'{"n": 1}', created_at=1764670000.0)


def traced_events() -> tuple[Event, Event]:
    """A plain event (the transports' fast path) and one off it, each with its trace context."""
    events = EventFactory(config())
    plain = events(TRACED, 1)
    producer = events(
        Message(
            "orders",
            0,
            4,
            b'{"n": 2}',
            metadata={"traceparent": TRACEPARENT.decode(), "tracestate": "shop=1"},
            created_at=1764670000.0,
        ),
        1,
    )
    assert plain.plain
    assert plain.trace is not None
    assert plain.trace.started
    return plain, producer


@pytest.mark.parametrize("client", ["h1", "aiohttp"])
async def test_every_http_request_carries_its_events_trace_context(
    client: str, http_handler: tuple[str, list[tuple[list[tuple[str, str]], bytes]]]
) -> None:
    url, received = http_handler
    plain, producer = traced_events()
    single = default_transports().open(
        TargetConfig(url=url, transport=client, timeout_s=5), integration="it", max_connections=2
    )
    try:
        for event in (plain, producer):
            assert (await single.deliver(event)).outcome is Outcome.DELIVERED
        assert (await single.deliver_batch([plain, producer])).outcome is Outcome.DELIVERED
    finally:
        await single.close()
    (first, _), (second, _), (_, batch) = received
    assert plain.trace is not None
    assert dict(first)["traceparent"] == plain.trace.traceparent
    assert "tracestate" not in dict(first)
    assert (dict(second)["traceparent"], dict(second)["tracestate"]) == (
        TRACEPARENT.decode(),
        "shop=1",
    )
    # A batch: each event's context as its CloudEvents distributed-tracing extension.
    parsed = [JSONFormat().read(CloudEvent, json.dumps(e)) for e in json.loads(batch)]
    assert parsed[0].get_extension("traceparent") == plain.trace.traceparent
    assert parsed[1].get_extension("traceparent") == TRACEPARENT.decode()
    assert parsed[1].get_extension("tracestate") == "shop=1"


async def test_grpc_carries_the_trace_context_as_metadata_and_in_a_batch_as_extensions(
    grpc_handler: GrpcHandler,
) -> None:
    plain, producer = traced_events()
    transport: GrpcTransport = grpc_transport(target(grpc_handler.url), "it", 2)
    try:
        await transport.deliver(plain)
        await transport.deliver(producer)
        await transport.deliver_batch([plain, producer])
    finally:
        await transport.close()
    first, second, batch = grpc_handler.calls
    assert plain.trace is not None
    assert first.metadata["traceparent"] == plain.trace.traceparent
    assert (second.metadata["traceparent"], second.metadata["tracestate"]) == (
        TRACEPARENT.decode(),
        "shop=1",
    )
    assert [dict(e.extensions).get("traceparent") for e in batch.events] == [
        plain.trace.traceparent,
        TRACEPARENT.decode(),
    ]
    assert dict(batch.events[1].extensions)["tracestate"] == "shop=1"
