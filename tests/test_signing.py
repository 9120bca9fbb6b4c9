"""Signed deliveries: the shared vectors, a third-party verifier, and what must be refused.

``standardwebhooks`` (PyPI, the Standard Webhooks project's own library) is the
third party: it signs each vector's content to the same signature, and
verifies the requests Nemesis' real transports send to a real handler server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from nemesis.broker.port import Message
from nemesis.config.models import TargetConfig
from nemesis.delivery import signing
from nemesis.delivery.h1 import H1Transport
from nemesis.delivery.http import HttpTransport
from nemesis.delivery.port import Event
from nemesis.delivery.signing import SignatureError, Signer
from nemesis.proto.nemesis.v1 import handler_pb2 as pb

VECTORS: dict[str, Any] = json.loads(
    Path(signing.__file__).with_name("signing-vectors.json").read_text(encoding="utf-8")
)
HTTP = [v for v in VECTORS["signed"] if v["transport"] == "http"]
GRPC = [v for v in VECTORS["signed"] if v["transport"] == "grpc"]


def pairs(request: dict[str, Any]) -> list[tuple[str, str]]:
    return [(name, value) for name, value in request["request_headers"]]


def event_of(fields: dict[str, Any]) -> pb.Event:
    """A ``nemesis.v1.Event`` from a vector's JSON form."""
    event = pb.Event(
        id=fields["id"],
        source=fields["source"],
        spec_version=fields["spec_version"],
        type=fields["type"],
        data_content_type=fields["data_content_type"],
        data=bytes.fromhex(fields["data_hex"]),
        topic=fields["topic"],
        partition=fields["partition"],
        offset=int(fields["offset"]),
        attempt=fields["attempt"],
        extensions=fields["extensions"],
    )
    if "time" in fields:
        event.time.seconds = int(fields["time"]["seconds"])
        event.time.nanos = fields["time"]["nanos"]
    if "partition_key" in fields:
        event.partition_key = fields["partition_key"]
    return event


def library(secret: str) -> Webhook:
    """The third-party verifier for one secret (a raw secret is its UTF-8 bytes)."""
    return Webhook(secret if secret.startswith("whsec_") else secret.encode())


def library_signature(secret: str, msg_id: str, timestamp: int, content: str) -> str:
    return library(secret).sign(msg_id, datetime.fromtimestamp(timestamp, UTC), content)


@pytest.mark.parametrize("vector", HTTP, ids=[v["name"] for v in HTTP])
def test_the_http_vectors(vector: dict[str, Any]) -> None:
    body = bytes.fromhex(vector["body_hex"])
    content = signing.http_content(pairs(vector), body)
    assert content.decode() == vector["content"]
    signed = Signer(vector["secrets"]).http(
        pairs(vector), body, batch=vector["batch"], timestamp=vector["timestamp"]
    )
    assert dict(signed) == vector["signed_headers"]
    assert vector["signed_headers"]["content-digest"] == signing.content_digest(body)
    # The third-party library computes the same signature, one per secret in order.
    headers = vector["signed_headers"]
    expected = [
        library_signature(s, headers["webhook-id"], vector["timestamp"], vector["content"])
        for s in vector["secrets"]
    ]
    assert headers["webhook-signature"].split(" ") == expected
    for secret in vector["secrets"]:  # each secret alone verifies (old or new handler)
        signing.verify_http(
            [*pairs(vector), *headers.items()],
            body,
            [signing.key_of(secret)],
            now=vector["timestamp"] + 10,
        )


@pytest.mark.parametrize("vector", GRPC, ids=[v["name"] for v in GRPC])
def test_the_grpc_vectors(vector: dict[str, Any]) -> None:
    events = [event_of(fields) for fields in vector["events"]]
    content = signing.grpc_content(events, batch=vector["batch"])
    assert content.decode() == vector["content"]
    signed = dict(
        Signer(vector["secrets"]).grpc(events, batch=vector["batch"], timestamp=vector["timestamp"])
    )
    assert signed == vector["signed_headers"]
    expected = [
        library_signature(s, signed["webhook-id"], vector["timestamp"], vector["content"])
        for s in vector["secrets"]
    ]
    assert signed["webhook-signature"].split(" ") == expected
    keys = [signing.key_of(s) for s in vector["secrets"]]
    signing.verify_grpc(signed, events, keys, batch=vector["batch"], now=vector["timestamp"])


FORGERIES = VECTORS["forgeries"]


@pytest.mark.parametrize("forgery", FORGERIES, ids=[f["name"] for f in FORGERIES])
def test_a_forgery_is_refused_by_nemesis_and_by_the_library(forgery: dict[str, Any]) -> None:
    keys = [signing.key_of(s) for s in forgery["secrets"]]
    signed = list(forgery["signed_headers"].items())
    original, forged = forgery["original"], forgery["forged"]
    now = forgery["timestamp"]
    signing.verify_http(
        [*pairs(original), *signed], bytes.fromhex(original["body_hex"]), keys, now=now
    )
    with pytest.raises(SignatureError):
        signing.verify_http(
            [*pairs(forged), *signed], bytes.fromhex(forged["body_hex"]), keys, now=now
        )
    # The library, given the content a handler builds from the forged request, refuses it.
    try:
        content = signing.http_content(pairs(forged), bytes.fromhex(forged["body_hex"]))
    except SignatureError:
        return  # refused before any HMAC (an attribute given twice)
    headers = forgery["signed_headers"]
    for secret in forgery["secrets"]:
        signature = library_signature(
            secret, headers["webhook-id"], forgery["timestamp"], content.decode()
        )
        assert signature not in headers["webhook-signature"].split(" ")


def test_the_re_split_of_the_issue_fails_the_legacy_scheme() -> None:
    """Why the legacy header had to go: the same signature covers both requests."""
    secret, t = b"k1-test-secret", 1_733_060_000
    header = signing.legacy_sign([secret], t, "topic-s:1:3", b"1.25")
    signing.legacy_verify(header, [secret], "topic-s:1:3.1", b"25", now=t)


HOSTILE = VECTORS["hostile_headers"]


@pytest.mark.parametrize("hostile", HOSTILE, ids=[h["name"] for h in HOSTILE])
def test_a_hostile_header_is_a_signature_error(hostile: dict[str, Any]) -> None:
    vector = HTTP[0]
    now = int(time.time())
    body = bytes.fromhex(vector["body_hex"])
    signer = Signer(vector["secrets"])
    headers = dict(pairs(vector))
    headers.update(signer.http(pairs(vector), body, batch=False, timestamp=now))
    for name, value in hostile.items():
        if name == "name":
            continue
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
    with pytest.raises(SignatureError):
        signing.verify_http(headers.items(), body, signer.keys, now=now)


def test_a_verifier_refuses_what_it_must() -> None:
    vector = HTTP[0]
    body = bytes.fromhex(vector["body_hex"])
    signer = Signer(vector["secrets"])
    t = vector["timestamp"]
    signed = dict(signer.http(pairs(vector), body, batch=False, timestamp=t))
    request = [*pairs(vector), *signed.items()]
    cases: dict[str, tuple[Sequence[tuple[str, str]], Sequence[bytes], float]] = {
        "wrong secret": (request, [b"other"], t),
        "stale": (request, signer.keys, t + 301),
        "from the future": (request, signer.keys, t - 301),
        "no signature": ([*pairs(vector)], signer.keys, t),
        "webhook-id twice": ([*request, ("webhook-id", "x")], signer.keys, t),
        "another webhook-id": (
            [*pairs(vector), *{**signed, "webhook-id": "orders/0/43"}.items()],
            signer.keys,
            t,
        ),
    }
    for name, (given, keys, now) in cases.items():
        with pytest.raises(SignatureError):  # noqa: PT012 - the fail() names the case
            signing.verify_http(given, body, keys, now=now)
            pytest.fail(f"accepted: {name}")
    signing.verify_http(request, body, signer.keys, now=t + 300)  # the window's edge passes


def test_unknown_versions_are_skipped() -> None:
    vector = HTTP[0]
    body = bytes.fromhex(vector["body_hex"])
    signed = dict(vector["signed_headers"])
    signed["webhook-signature"] = "v2,AAAA " + signed["webhook-signature"]
    keys = [signing.key_of(s) for s in vector["secrets"]]
    signing.verify_http([*pairs(vector), *signed.items()], body, keys, now=vector["timestamp"])


@pytest.mark.parametrize("vector", VECTORS["legacy"]["vectors"], ids=lambda v: v["name"])
def test_the_legacy_vectors(vector: dict[str, Any]) -> None:
    secrets = [s.encode() for s in vector["secrets"]]
    body = bytes.fromhex(vector["body_hex"])
    header = signing.legacy_sign(secrets, vector["timestamp"], vector["event_id"], body)
    assert header == vector["header"]
    for secret in secrets:
        signing.legacy_verify(
            header, [secret], vector["event_id"], body, now=vector["timestamp"] + 10
        )


def test_a_whsec_secret_that_is_not_base64_is_refused() -> None:
    with pytest.raises(ValueError, match="base64"):
        Signer(["whsec_not base64!"])


# --- real transports, a real handler, the third-party library --------------------------------


def make_event(payload: bytes, offset: int) -> Event:
    message = Message("orders", 3, offset, payload, key="customer-7", created_at=1764480000.25)
    return Event(message=message, id=f"orders/3/{offset}", type="order.created")


SECRETS = ("whsec_" + "bmVtZXNpcy1saXZlLWtleS0zMi1ieXRlcy1sb25nIQ==", "a-previous-raw-secret")


class Handler:
    """An aiohttp handler that verifies with ``standardwebhooks`` and records what it saw."""

    def __init__(self, secret: str) -> None:
        self.webhook = library(secret)
        self.seen: list[tuple[int, dict[str, str], bytes]] = []
        self.legacy: list[str | None] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        content = signing.http_content(request.headers.items(), body)
        status = 204
        try:
            self.webhook.verify(content, dict(request.headers))
        except WebhookVerificationError:
            status = 401
        self.seen.append((status, {k.lower(): v for k, v in request.headers.items()}, body))
        self.legacy.append(request.headers.get(signing.LEGACY_HEADER))
        return web.Response(status=status)


@pytest.fixture
async def handler_url() -> Any:
    handlers = {secret: Handler(secret) for secret in SECRETS}
    app = web.Application()
    for index, handler in enumerate(handlers.values()):
        app.router.add_post(f"/{index}", handler.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", list(handlers.values())
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("transport", [HttpTransport, H1Transport], ids=["aiohttp", "h1"])
@pytest.mark.parametrize("scheme", ["standard-webhooks", "both", "legacy"])
async def test_the_library_accepts_what_each_transport_sends(
    handler_url: Any, transport: Any, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, handlers = handler_url
    monkeypatch.setenv("HOOK_SECRET", SECRETS[0])
    monkeypatch.setenv("HOOK_SECRET_PREVIOUS", SECRETS[1])
    signing_config = {"scheme": scheme, "secrets_env": ["HOOK_SECRET", "HOOK_SECRET_PREVIOUS"]}
    event = make_event(b'{"order": 1}', offset=3)
    for index, handler in enumerate(handlers):
        target = TargetConfig.model_validate({"url": f"{url}/{index}", "signing": signing_config})
        sender = transport(target, integration="orders", max_connections=2)
        try:
            await sender.deliver(event)
            await sender.deliver_batch([event, make_event(b"2", offset=4)])
        finally:
            await sender.close()
        statuses = [status for status, _, _ in handler.seen]
        if scheme == "legacy":
            assert statuses == [401, 401]
            assert all(header is not None for header in handler.legacy)
            continue
        assert statuses == [204, 204], handler.seen
        assert (handler.legacy[0] is not None) is (scheme == "both")
        _, headers, body = handler.seen[0]
        assert headers["webhook-id"] == headers["ce-id"]
        assert headers["content-digest"] == signing.content_digest(body)
        assert headers["ce-partitionkey"] == "customer-7"


@pytest.mark.parametrize(
    "forge",
    [
        ("type", "order.test"),
        ("source", "nemesis/evil"),
        ("partition_key", "customer-8"),
        ("id", "orders/0/42.1"),
        ("data", b"25"),
        ("offset", 43),
    ],
    ids=lambda forge: forge[0],
)
def test_a_forged_grpc_event_is_refused(forge: tuple[str, Any]) -> None:
    vector = GRPC[0]
    [event] = [event_of(fields) for fields in vector["events"]]
    signed = dict(
        Signer(vector["secrets"]).grpc([event], batch=False, timestamp=vector["timestamp"])
    )
    keys = [signing.key_of(s) for s in vector["secrets"]]
    signing.verify_grpc(signed, [event], keys, batch=False, now=vector["timestamp"])
    name, value = forge
    setattr(event, name, value)
    with pytest.raises(SignatureError):
        signing.verify_grpc(signed, [event], keys, batch=False, now=vector["timestamp"])


def test_a_grpc_batch_cannot_be_reordered_or_cut() -> None:
    vector = GRPC[1]
    events = [event_of(fields) for fields in vector["events"]]
    keys = [signing.key_of(s) for s in vector["secrets"]]
    signed = vector["signed_headers"]
    for forged in (events[::-1], events[:1]):
        with pytest.raises(SignatureError):
            signing.verify_grpc(signed, forged, keys, batch=True, now=vector["timestamp"])


def test_the_both_scheme_signs_grpc_calls_for_old_and_new_handlers() -> None:
    vector = GRPC[1]
    events = [event_of(fields) for fields in vector["events"]]
    secrets = ["k1-test-secret"]
    at = vector["timestamp"]
    signed = dict(Signer(secrets, "both").grpc(events, batch=True, timestamp=at))
    signing.verify_grpc(signed, events, [b"k1-test-secret"], batch=True, now=at)
    body = signing.grpc_batch_body((event.id, event.data) for event in events)
    signing.legacy_verify(signed["nemesis-signature"], [b"k1-test-secret"], "", body, now=at)
    legacy = dict(Signer(secrets, "legacy").grpc(events[:1], batch=False, timestamp=at))
    assert set(legacy) == {"nemesis-signature"}
    signing.legacy_verify(
        legacy["nemesis-signature"], [b"k1-test-secret"], events[0].id, events[0].data, now=at
    )


def test_an_unknown_scheme_is_a_config_problem() -> None:
    with pytest.raises(ValueError, match="scheme"):
        TargetConfig.model_validate(
            {"url": "http://x/events", "signing": {"secrets_env": ["S"], "scheme": "rsa"}}
        )
