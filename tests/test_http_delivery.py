"""The HTTP transport against a real handler server on loopback: what only HTTP has.

The cases every transport shares (outcome table, verdicts, Retry-After, no
answer, error text) are in ``tests/transport``.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemesis import __version__
from nemesis.broker.port import Message
from nemesis.config.models import TargetConfig
from nemesis.delivery.cloudevents import (
    BATCH_CONTENT_TYPE,
    batch_body,
    decode_header_value,
    encode_header_value,
    is_json_text,
    structured_event,
)
from nemesis.delivery.http import (
    HttpTransport,
    http_transport,
)
from nemesis.delivery.port import DeliveryResult, Event, Outcome
from nemesis.errors import ConfigError
from nemesis.testing import HandlerServer

INTEGRATION = "orders-to-loyalty"
CREATED_AT = 1764480000.25  # 2025-11-30T05:20:00.25Z
PAYLOAD = b'{"order": {"id": 17, "city": "msk", "amount": 250.5}}'


def make_event(
    id_: str = "orders/3/41",
    *,
    key: str | None = "customer-9",
    value: bytes = PAYLOAD,
    type_: str = "order.created",
    attempt: int = 1,
    content_type: str = "application/json",
    payload: bytes | None = None,
    partition: int = 3,
    offset: int = 41,
    created_at: float = CREATED_AT,
    written_at: float = 0.0,
) -> Event:
    message = Message(
        topic="orders",
        partition=partition,
        offset=offset,
        value=value,
        key=key,
        created_at=created_at,
        written_at=written_at,
    )
    return Event(
        message=message,
        id=id_,
        type=type_,
        attempt=attempt,
        content_type=content_type,
        payload=payload,
    )


@pytest.fixture
async def server() -> AsyncIterator[HandlerServer]:
    async with HandlerServer() as handler:
        yield handler


def target(server: HandlerServer, **fields: object) -> TargetConfig:
    return TargetConfig.model_validate({"url": server.url, "timeout_s": 2.0, **fields})


@pytest.fixture
async def transport(server: HandlerServer) -> AsyncIterator[HttpTransport]:
    delivering = http_transport(target(server), integration=INTEGRATION, max_connections=4)
    yield delivering
    await delivering.close()


# --- the outcome table ---------------------------------------------------------------

DELIVERED_STATUSES = [200, 201, 202, 204, 299]
DEAD_STATUSES = [400, 409, 410, 413, 415, 422]
RETRY_STATUSES = [408, 425, 429, 500, 502, 503, 504, 599, 401, 403, 404, 405]
# Decided here (not in the contract table): redirects, other 4xx and nonsense retry.
UNLISTED_STATUSES = [301, 302, 303, 307, 308, 402, 406, 411, 418, 421, 451, 600, 999]

TABLE = (
    [(status, Outcome.DELIVERED) for status in DELIVERED_STATUSES]
    + [(status, Outcome.DEAD) for status in DEAD_STATUSES]
    + [(status, Outcome.RETRY) for status in RETRY_STATUSES + UNLISTED_STATUSES]
)


@pytest.mark.parametrize(("status", "outcome"), TABLE)
async def test_status_maps_to_outcome(
    server: HandlerServer, transport: HttpTransport, status: int, outcome: Outcome
) -> None:
    server.behave(status, headers={"location": "http://127.0.0.1:1/elsewhere"})

    result = await transport.deliver(make_event())

    assert result.outcome is outcome
    assert result.status == status
    if outcome is Outcome.DELIVERED:
        assert result.error is None
    else:
        assert result.error == f"HTTP {status}"
    assert server.requests == 1  # redirects are not followed


# --- no answer ----------------------------------------------------------------------


async def test_hung_handler_times_out(server: HandlerServer) -> None:
    server.hang()
    delivering = http_transport(
        target(server, timeout_s=0.1), integration=INTEGRATION, max_connections=1
    )
    try:
        result = await delivering.deliver(make_event())
    finally:
        await delivering.close()
        server.release()

    assert (result.outcome, result.error) == (Outcome.RETRY, "timeout after 0.1s")


async def test_each_delivery_times_out_at_its_own_deadline(server: HandlerServer) -> None:
    """One timer serves the transport (nemesis.delivery.deadlines): none is cut early.

    With one pooled connection the later ones wait for it, and that wait counts.
    """
    server.hang()
    delivering = http_transport(
        target(server, timeout_s=0.3), integration=INTEGRATION, max_connections=1
    )
    loop = asyncio.get_running_loop()

    async def timed(n: int) -> tuple[DeliveryResult, float]:
        started = loop.time()
        result = await delivering.deliver(make_event(f"e{n}"))
        return result, loop.time() - started

    try:
        deliveries = []
        for n in range(3):
            deliveries.append(asyncio.create_task(timed(n)))
            await asyncio.sleep(0.1)
        results = await asyncio.gather(*deliveries)
    finally:
        await delivering.close()
        server.release()
    for result, waited in results:
        assert (result.outcome, result.error) == (Outcome.RETRY, "timeout after 0.3s")
        # Never cut early; and the figure is this call's own time, the wait included.
        assert 0.3 <= result.duration_s <= waited
    assert delivering.statistics().in_flight == 0


async def test_a_delivery_answered_in_time_leaves_its_task_alone(
    server: HandlerServer,
) -> None:
    delivering = http_transport(
        target(server, timeout_s=0.1), integration=INTEGRATION, max_connections=1
    )
    try:
        result = await delivering.deliver(make_event())
        await asyncio.sleep(0.3)  # past the deadline the delivery had
    finally:
        await delivering.close()
    assert result.outcome is Outcome.DELIVERED
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_a_cancelled_delivery_is_cancelled_not_timed_out(server: HandlerServer) -> None:
    server.hang()
    delivering = http_transport(
        target(server, timeout_s=5.0), integration=INTEGRATION, max_connections=2
    )
    try:
        delivery = asyncio.create_task(delivering.deliver(make_event()))
        await server.ledger.wait_until(lambda ledger: ledger.requests == 1, timeout_s=2.0)
        delivery.cancel()
        with pytest.raises(asyncio.CancelledError):
            await delivery
        assert delivering.statistics().in_flight == 0
        server.release()
        assert (await delivering.deliver(make_event("next"))).outcome is Outcome.DELIVERED
    finally:
        await delivering.close()
        server.release()


async def test_connection_dropped_by_handler_is_resent_once(
    server: HandlerServer, transport: HttpTransport
) -> None:
    server.when(lambda entry: entry.receipt == 1, disconnect=True)

    result = await transport.deliver(make_event())

    assert result.outcome is Outcome.DELIVERED
    assert server.ledger.counts() == {"orders/3/41": 2}
    assert transport.statistics().resends == 1


async def test_connection_dropped_twice_is_retry(
    server: HandlerServer, transport: HttpTransport
) -> None:
    server.behave(disconnect=True)

    result = await transport.deliver(make_event())

    assert (result.outcome, result.status, result.error) == (
        Outcome.RETRY,
        None,
        "server disconnected",
    )
    assert server.requests == 2


async def test_handler_going_away_mid_request_is_retry(
    server: HandlerServer, transport: HttpTransport
) -> None:
    server.hang()
    delivery = asyncio.create_task(transport.deliver(make_event()))
    await server.ledger.wait_until(lambda ledger: ledger.requests == 1, timeout_s=2.0)

    await server.refuse_connections()
    result = await delivery

    assert (result.outcome, result.error) == (Outcome.RETRY, "connection refused")


# --- the request --------------------------------------------------------------------


async def test_binary_mode_headers(server: HandlerServer) -> None:
    delivering = http_transport(
        target(server, headers={"Authorization": "Bearer s3cret", "X-Team": "loyalty"}),
        integration=INTEGRATION,
        max_connections=1,
    )
    try:
        result = await delivering.deliver(make_event(attempt=3, offset=2**40, partition=7))
    finally:
        await delivering.close()

    assert result.outcome is Outcome.DELIVERED
    [entry] = server.ledger.entries
    assert entry.body == PAYLOAD
    assert entry.headers == {
        "host": f"127.0.0.1:{server.port}",
        "user-agent": f"nemesis/{__version__}",
        "accept": "*/*",
        "accept-encoding": "identity",
        "content-type": "application/json",
        "content-length": str(len(PAYLOAD)),
        "ce-specversion": "1.0",
        "ce-id": "orders/3/41",
        "ce-source": f"nemesis/{INTEGRATION}",
        "ce-type": "order.created",
        "ce-time": "2025-11-30T05:20:00.250000Z",
        "ce-partitionkey": "customer-9",
        "ce-topic": "orders",
        "ce-partition": "7",
        "ce-offset": str(2**40),
        "ce-attempt": "3",
        "authorization": "Bearer s3cret",
        "x-team": "loyalty",
    }


async def test_time_falls_back_to_written_at_and_key_is_optional(
    server: HandlerServer, transport: HttpTransport
) -> None:
    await transport.deliver(make_event("a", key=None, created_at=0.0, written_at=CREATED_AT))
    await transport.deliver(make_event("b", created_at=0.0, written_at=0.0))

    written, unknown = server.ledger.entries
    assert written.headers["ce-time"] == "2025-11-30T05:20:00.250000Z"
    assert "ce-partitionkey" not in written.headers
    assert "ce-time" not in unknown.headers


async def test_pipeline_payload_replaces_the_message_value(
    server: HandlerServer, transport: HttpTransport
) -> None:
    await transport.deliver(
        make_event(payload=b"\x00\x01binary", content_type="application/x-protobuf")
    )

    [entry] = server.ledger.entries
    assert (entry.body, entry.content_type) == (b"\x00\x01binary", "application/x-protobuf")


async def test_header_injection_is_neutralised(
    server: HandlerServer, transport: HttpTransport
) -> None:
    key = "k\r\nx-injected: yes"
    type_ = "order\r\n\r\nGET /admin HTTP/1.1"
    id_ = 'id "1"\n100%'

    result = await transport.deliver(
        make_event(id_, key=key, type_=type_, content_type="text/plain\r\nx-evil: 1")
    )

    assert result.outcome is Outcome.DELIVERED
    assert server.requests == 1
    [entry] = server.ledger.entries
    assert "x-injected" not in entry.headers
    assert "x-evil" not in entry.headers
    assert entry.headers["content-type"] == "application/octet-stream"
    assert entry.headers["ce-partitionkey"] == "k%0D%0Ax-injected:%20yes"
    for name in ("ce-id", "ce-type", "ce-partitionkey"):
        assert all(0x21 <= ord(c) <= 0x7E for c in entry.headers[name]), name
    assert (entry.key, entry.type, entry.id) == (key, type_, id_)


async def test_unicode_key_round_trips(server: HandlerServer, transport: HttpTransport) -> None:
    key = "ключ-🔑 «x»"

    await transport.deliver(make_event(key=key, type_="заказ.создан"))

    [entry] = server.ledger.entries
    assert entry.headers["ce-partitionkey"].isascii()
    assert (entry.key, entry.type) == (key, "заказ.создан")


def test_header_encoding_follows_the_cloudevents_http_binding() -> None:
    # The example of the CloudEvents HTTP protocol binding, section 3.1.3.2.
    assert encode_header_value("Euro € 😀") == "Euro%20%E2%82%AC%20%F0%9F%98%80"
    assert encode_header_value('a"b%c') == "a%22b%25c"
    assert encode_header_value("plain-ascii_1.2:3/4") == "plain-ascii_1.2:3/4"
    assert decode_header_value("Euro%20%E2%82%AC%20%F0%9F%98%80") == "Euro € 😀"
    assert encode_header_value("lone \ud800 surrogate") == "lone%20?%20surrogate"


# --- batches ------------------------------------------------------------------------


async def test_batch_is_a_cloudevents_json_array(
    server: HandlerServer, transport: HttpTransport
) -> None:
    events = [
        make_event("e-json", offset=1),
        make_event(
            "e-bin", offset=2, key=None, content_type="application/x-protobuf", payload=b"\xff\x00"
        ),
        make_event("e-bad", offset=3, payload=b"{not json", content_type="application/json"),
        make_event("e-text", offset=4, payload="привет".encode(), content_type="text/plain"),
    ]

    result = await transport.deliver_batch(events)

    assert result.outcome is Outcome.DELIVERED
    assert server.requests == 1
    entries = server.ledger.entries
    assert [entry.id for entry in entries] == ["e-json", "e-bin", "e-bad", "e-text"]
    assert {(entry.mode, entry.batch_size) for entry in entries} == {("batch", 4)}
    assert entries[0].headers["content-type"] == BATCH_CONTENT_TYPE
    assert not [name for name in entries[0].headers if name.startswith("ce-")]
    assert orjson.loads(entries[0].body) == orjson.loads(PAYLOAD)
    assert [entry.body for entry in entries[1:]] == [b"\xff\x00", b"{not json", "привет".encode()]
    assert [entry.offset for entry in entries] == [1, 2, 3, 4]


def test_batch_body_structure() -> None:
    events = [
        make_event("e-json", attempt=2),
        make_event("e-bin", key=None, payload=b"\x01", content_type="application/octet-stream"),
    ]

    json_event, binary_event = orjson.loads(batch_body(events, f"nemesis/{INTEGRATION}"))

    assert json_event == {
        "specversion": "1.0",
        "id": "e-json",
        "source": f"nemesis/{INTEGRATION}",
        "type": "order.created",
        "time": "2025-11-30T05:20:00.250000Z",
        "datacontenttype": "application/json",
        "partitionkey": "customer-9",
        "topic": "orders",
        "partition": "3",
        "offset": "41",
        "attempt": "2",
        "data": orjson.loads(PAYLOAD),
    }
    assert "data" not in binary_event
    assert "partitionkey" not in binary_event
    assert base64.b64decode(binary_event["data_base64"]) == b"\x01"
    # JSON data is embedded byte for byte, not re-serialised.
    assert PAYLOAD in batch_body(events[:1], "nemesis/x")


@pytest.mark.parametrize(
    "payload",
    [
        b'{"city": "\xff"}',  # invalid UTF-8 inside a string
        b'{"a": 1,}',
        b"[1, 2",
        b"NaN",
        b"",
        b'{"a": 1} {"b": 2}',
    ],
)
def test_a_payload_labelled_json_that_is_not_travels_as_base64(payload: bytes) -> None:
    good = make_event("good")
    bad = make_event("bad", payload=payload)
    body = batch_body([good, bad], "nemesis/x")
    # The batch stays one valid JSON text, and a strict parser takes it.
    parsed_good, parsed_bad = orjson.loads(body)
    body.decode("utf-8")
    assert parsed_good["data"] == orjson.loads(PAYLOAD)
    assert "data" not in parsed_bad
    assert base64.b64decode(parsed_bad["data_base64"]) == payload
    assert not is_json_text(payload)


@pytest.mark.parametrize(
    "payload", [b"3", b' {"a": [1, {"b": null}]} ', rb'"caf\u00e9"', '"é"'.encode()]
)
def test_json_payloads_are_embedded_as_they_are(payload: bytes) -> None:
    assert is_json_text(payload)
    assert payload in batch_body([make_event("e", payload=payload)], "nemesis/x")


# --- the answer ---------------------------------------------------------------------


async def test_large_error_bodies_keep_the_connection(
    server: HandlerServer, transport: HttpTransport
) -> None:
    server.behave(503, body=b"x" * 100_000)

    results = [await transport.deliver(make_event(str(n))) for n in range(5)]

    assert {result.outcome for result in results} == {Outcome.RETRY}
    assert server.connections == 1


async def test_connection_pool_is_reused(server: HandlerServer) -> None:
    delivering = http_transport(target(server), integration=INTEGRATION, max_connections=4)
    try:
        sequential = [await delivering.deliver(make_event(f"s{n}")) for n in range(20)]
        assert server.connections == 1
        concurrent = await asyncio.gather(
            *(delivering.deliver(make_event(f"c{n}")) for n in range(200))
        )
        assert delivering.statistics().in_flight == 0
    finally:
        await delivering.close()

    assert {result.outcome for result in sequential + concurrent} == {Outcome.DELIVERED}
    assert len(server.ledger.done_ids()) == 220
    assert server.connections <= 4
    assert delivering.statistics().requests == 220


# --- configuration ------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Token": "a\r\nX-Injected: 1"},
        {"X-Token": "a\nb"},
        {"bad header": "x"},
        {"ce-id": "fixed"},
        {"Content-Type": "text/plain"},
        {"Content-Length": "0"},
    ],
)
def test_target_headers_are_checked(headers: dict[str, str]) -> None:
    config = TargetConfig(url="http://127.0.0.1:9/", headers=headers)
    with pytest.raises(ConfigError, match=r"target\.headers"):
        http_transport(config, integration=INTEGRATION, max_connections=1)


def test_http_transport_needs_an_http_url() -> None:
    with pytest.raises(ConfigError, match="http"):
        http_transport(TargetConfig(url="grpc://127.0.0.1:9"), integration="x", max_connections=1)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=5),
    key=st.none() | st.text(max_size=10),
    type_=st.text(min_size=1, max_size=12),
    payload=st.sampled_from([b'{"a": 1}', b"[1, 2]", b"not json", b"\xff\x00", b" 3 ", b""]),
    content_type=st.sampled_from(["application/json", "text/plain", "application/x+json"]),
    created_at=st.sampled_from([1764482352.25, 1764482352.9999996, 0.0]),
)
def test_batch_body_bytes_match_the_structured_events(
    ids: list[str],
    key: str | None,
    type_: str,
    payload: bytes,
    content_type: str,
    created_at: float,
) -> None:
    # With a time the batch is written in one format, without one event by event.
    events = [
        Event(
            Message("orders", 3, 10 + n, payload, key=key, created_at=created_at),
            id=event_id,
            type=type_,
            attempt=n + 1,
            content_type=content_type,
        )
        for n, event_id in enumerate(ids)
    ]
    expected = [structured_event(event, "nemesis/x") for event in events]
    assert orjson.loads(batch_body(events, "nemesis/x")) == orjson.loads(orjson.dumps(expected))
