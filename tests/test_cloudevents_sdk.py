"""A handler written with the CloudEvents SDK for Python parses every delivery Nemesis makes.

The handler is a real aiohttp server on loopback that does what a team would
write: ``cloudevents.core.bindings.http.from_http`` for one event (binary
mode), and for a batch (``application/cloudevents-batch+json``, which the
SDK has no reader for) the SDK's ``JSONFormat`` on each element of the
array. Deliveries come from ``nemesis.delivery.http.HttpTransport``.

The SDK's legacy API (``cloudevents.v1.http.from_http``) parses them too,
but does not percent-decode header values as the HTTP binding requires: a
key with a space or non-ASCII characters reaches it still encoded. The
onboarding docs point teams at the current API for that reason.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

import cloudevents.v1.http as ce_legacy
import pytest
from aiohttp import web
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from hypothesis import given, settings
from hypothesis import strategies as st

from nemesis.broker.port import Message
from nemesis.config.models import TargetConfig
from nemesis.delivery.cloudevents import BATCH_CONTENT_TYPE, batch_body, binary_headers
from nemesis.delivery.http import HttpTransport, http_transport
from nemesis.delivery.port import Event, Outcome

INTEGRATION = "orders-to-loyalty"
SOURCE = f"nemesis/{INTEGRATION}"


@dataclass
class SdkHandler:
    """An HTTP handler that parses every request with the CloudEvents SDK."""

    events: list[BaseCloudEvent] = field(default_factory=list)
    batches: list[list[BaseCloudEvent]] = field(default_factory=list)
    legacy: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {name.lower(): value for name, value in request.headers.items()}
        try:
            if headers.get("content-type") == BATCH_CONTENT_TYPE:
                elements = json.loads(body)
                self.batches.append(
                    [JSONFormat().read(CloudEvent, json.dumps(e)) for e in elements]
                )
                self.legacy.extend(_legacy_attributes(ce_legacy.from_dict(e)) for e in elements)
            else:
                message = ce_http.HTTPMessage(headers=headers, body=body)
                self.events.append(ce_http.from_http(message, JSONFormat(), CloudEvent))
                self.legacy.append(_legacy_attributes(ce_legacy.from_http(headers, body)))
        except (ValueError, TypeError, KeyError) as exc:
            # What a team's handler answers to a request it cannot parse: 400, dead at once.
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return web.Response(status=400, text=str(exc))
        return web.Response(status=200)


def _legacy_attributes(event: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = dict(event.get_attributes())
    attributes["data"] = event.get_data()
    return attributes


@pytest.fixture
async def handler() -> AsyncIterator[SdkHandler]:
    sdk_handler = SdkHandler()
    app = web.Application()
    app.router.add_post("/events", sdk_handler.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    sdk_handler.url = f"http://{host}:{port}/events"
    yield sdk_handler
    await runner.cleanup()


@pytest.fixture
async def transport(handler: SdkHandler) -> AsyncIterator[HttpTransport]:
    opened = http_transport(
        TargetConfig(url=handler.url, timeout_s=5), integration=INTEGRATION, max_connections=4
    )
    yield opened
    await opened.close()


def event(
    id_: str = "orders:3:41",
    *,
    value: bytes = b'{"order": {"id": 17, "amount": 250.5}}',
    key: str | None = "customer-9",
    type_: str = "order.created",
    content_type: str = "application/json",
    created_at: float = 1764480000.25,
    written_at: float = 0.0,
    attempt: int = 1,
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
    return Event(message, id=id_, type=type_, attempt=attempt, content_type=content_type)


# Every shape of delivery: payload kinds, optional attributes, awkward text.
DELIVERIES = {
    "json": event(),
    "json array": event(value=b"[1, 2, 3]"),
    "no key, no time": event(key=None, created_at=0.0, written_at=0.0),
    "broker time": event(created_at=0.0, written_at=1764480001.5),
    "retry attempt": event(attempt=4),
    "unicode key and type": event(key="клиент 9", type_="заказ.создан"),
    "header-hostile key": event(key='a b"c%d\r\nX-Injected: 1'),
    "protobuf bytes": event(value=b"\x08\x96\x01\xff\x00", content_type="application/x-protobuf"),
    "text": event(value="déjà vu".encode(), content_type="text/plain; charset=utf-8"),
    "labelled JSON, not JSON": event(value=b"{not json"),
    "empty payload": event(value=b""),
    "64-bit offset": event(offset=2**40 + 7),
    "cloudevents+json payload": event(content_type="application/vnd.orders+json"),
}


def expected_data(sent: Event) -> Any:
    """What the SDK's JSON format makes of the payload, per its documented rules."""
    body = sent.body
    if not body:
        return None
    if "json" in sent.content_type:
        try:
            return json.loads(body)
        except ValueError:
            pass
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return body


def expected_batch_data(sent: Event) -> Any:
    """In a batch, JSON payloads travel as ``data``, anything else as ``data_base64``."""
    body = sent.body
    if "json" in sent.content_type:
        try:
            return json.loads(body)
        except ValueError:
            pass
    return body


def assert_attributes(parsed: BaseCloudEvent, sent: Event) -> None:
    message = sent.message
    attributes = parsed.get_attributes()
    assert parsed.get_id() == sent.id
    assert parsed.get_source() == SOURCE
    assert parsed.get_type() == sent.type
    assert parsed.get_specversion() == "1.0"
    assert parsed.get_datacontenttype() == sent.content_type
    unix_s = message.created_at or message.written_at
    if unix_s:
        assert parsed.get_time() == datetime.fromtimestamp(unix_s, tz=UTC)
    # Without ce-time the SDK fills in its own "now": nothing to compare.
    if message.key is None:
        assert "partitionkey" not in attributes
    else:
        assert parsed.get_extension("partitionkey") == message.key
    assert parsed.get_extension("topic") == message.topic
    assert parsed.get_extension("partition") == str(message.partition)
    assert parsed.get_extension("offset") == str(message.offset)
    assert parsed.get_extension("attempt") == str(sent.attempt)


@pytest.mark.parametrize("name", list(DELIVERIES))
async def test_sdk_parses_every_single_delivery(
    handler: SdkHandler, transport: HttpTransport, name: str
) -> None:
    sent = DELIVERIES[name]
    result = await transport.deliver(sent)
    assert handler.errors == []
    assert result.outcome is Outcome.DELIVERED
    [parsed] = handler.events
    assert_attributes(parsed, sent)
    assert parsed.get_data() == expected_data(sent)


async def test_sdk_parses_a_batch_of_every_kind(
    handler: SdkHandler, transport: HttpTransport
) -> None:
    sent = list(DELIVERIES.values())
    result = await transport.deliver_batch(sent)
    assert handler.errors == []
    assert result.outcome is Outcome.DELIVERED
    [parsed] = handler.batches
    assert len(parsed) == len(sent)
    for one, original in zip(parsed, sent, strict=True):
        assert_attributes(one, original)
        assert one.get_data() == expected_batch_data(original)


async def test_the_legacy_sdk_api_parses_too_but_leaves_headers_encoded(
    handler: SdkHandler, transport: HttpTransport
) -> None:
    unicode_key = DELIVERIES["unicode key and type"]
    await transport.deliver(unicode_key)
    await transport.deliver_batch([unicode_key])
    assert handler.errors == []
    single, in_batch = handler.legacy
    # cloudevents.v1.http.from_http does not percent-decode (HTTP binding 3.1.3.2).
    assert single["partitionkey"] != "клиент 9"
    assert unquote(single["partitionkey"]) == "клиент 9"
    assert unquote(single["type"]) == "заказ.создан"
    assert in_batch["partitionkey"] == "клиент 9"
    assert single["data"] == in_batch["data"] == json.loads(unicode_key.body)


async def test_a_batch_of_many_parses_in_order(
    handler: SdkHandler, transport: HttpTransport
) -> None:
    sent = [event(f"orders:3:{n}", offset=n, value=b'{"n": %d}' % n) for n in range(200)]
    assert (await transport.deliver_batch(sent)).outcome is Outcome.DELIVERED
    [parsed] = handler.batches
    assert [p.get_id() for p in parsed] == [s.id for s in sent]
    assert [p.get_data() for p in parsed] == [{"n": n} for n in range(200)]


_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    id_=_text.filter(bool),
    key=st.none() | _text,
    type_=_text.filter(bool),
    payload=st.binary(max_size=64),
    json_payload=st.booleans(),
)
def test_any_event_survives_both_encodings(
    id_: str, key: str | None, type_: str, payload: bytes, json_payload: bool
) -> None:
    """The wire forms Nemesis writes, read back by the SDK, without the network."""
    content_type = "application/json" if json_payload else "application/octet-stream"
    sent = event(id_, key=key, type_=type_, value=payload, content_type=content_type)
    headers = binary_headers(sent, SOURCE)
    single = ce_http.from_http(
        ce_http.HTTPMessage(headers=headers, body=sent.body), JSONFormat(), CloudEvent
    )
    assert_attributes(single, sent)
    [element] = json.loads(batch_body([sent], SOURCE))
    batched = JSONFormat().read(CloudEvent, json.dumps(element))
    assert_attributes(batched, sent)
    data = batched.get_data()
    if "data_base64" in element:
        assert data == payload == base64.b64decode(element["data_base64"])
    else:
        assert data == json.loads(payload)
