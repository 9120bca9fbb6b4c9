"""Signed deliveries: how Nemesis signs a request and how a handler checks it.

The scheme is Standard Webhooks (``docs/signing.md`` says why), over a signed
content that names every attribute a handler acts on::

    webhook-id:        the event's ce-id (a batch: "batch-" + 32 hex of its content's SHA-256)
    webhook-timestamp: unix seconds when Nemesis sent the request
    webhook-signature: v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>." + content)>[ v1,...]
    content-digest:    sha-256=:<base64 SHA-256 of the body>:   (RFC 9530)

``content`` is not the body: it is a canonical JSON object (RFC 8785: keys
sorted, no whitespace, strings escaped as ECMAScript's ``JSON.stringify``
does), built by the handler from what it received:

- HTTP: every ``ce-*`` header and ``content-type``, by lowercase name, values
  as received (percent-encoded, visible ASCII), and ``content-digest``
  computed from the body, never read from the request. A header named twice,
  or a value outside visible ASCII, is refused before any HMAC.
- gRPC ``Deliver``: the fields of ``nemesis.v1.Event`` by their proto names,
  as strings (``grpc_event_content``), with the data's ``content-digest``.
- gRPC ``DeliverBatch``: a JSON array of those objects, in the request's order.

JSON gives every value a boundary, so no byte can move from one attribute to
the next (``ce-id: a:1`` with body ``1.2`` and ``ce-id: a:1.1`` with ``2``
sign different contents), and an attribute added, removed or changed changes
the content. Standard Webhooks' own libraries check the result: a handler
passes ``content`` as the payload and the three ``webhook-*`` headers.

- Keys: a secret ``whsec_<base64>`` is the standard's form, its key the
  decoded bytes; any other secret's key is its UTF-8 bytes (a secret of the
  legacy scheme keeps working while a handler moves).
- During a rotation Nemesis holds two secrets and sends one ``v1`` for each;
  a handler accepts the request when any signature matches any of its keys.
- A handler refuses a timestamp further than 300 s from its clock (the
  standard's window), so a captured request cannot be replayed later.

The legacy scheme (``signing.scheme: legacy`` or ``both``, until the end date
``LEGACY_END`` that ``docs/signing.md`` gives) is one header,
``nemesis-signature: t=<t>,v1=<hex HMAC-SHA256(secret, "<t>.<ce-id>." + body)>``;
a batch signs the empty id and a gRPC batch the netstrings of its events' ids
and data (``grpc_batch_body``). It signs neither the other attributes nor the
boundary between the id and the body.

A handler answers an unsigned, mis-signed or stale request with 401 (gRPC
UNAUTHENTICATED), which Nemesis retries and never dead-letters.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, Literal
from urllib.parse import quote

from nemesis.config.models import SigningConfig
from nemesis.errors import ConfigError, ConfigProblem

if TYPE_CHECKING:  # the generated code is a build product: only the gRPC transport needs it
    from nemesis.proto.nemesis.v1 import handler_pb2 as pb

ID_HEADER: Final = "webhook-id"
TIMESTAMP_HEADER: Final = "webhook-timestamp"
WEBHOOK_SIGNATURE_HEADER: Final = "webhook-signature"
DIGEST_HEADER: Final = "content-digest"
LEGACY_HEADER: Final = "nemesis-signature"
# Every header (or gRPC metadata key) a signing request may carry: none can be configured.
SIGNING_HEADERS: Final = frozenset(
    {ID_HEADER, TIMESTAMP_HEADER, WEBHOOK_SIGNATURE_HEADER, DIGEST_HEADER, LEGACY_HEADER}
)
# The last day a handler may rely on the legacy header (``signing.scheme: legacy|both``).
LEGACY_END: Final = "2027-06-30"
DEFAULT_TOLERANCE_S: Final = 300
SECRET_PREFIX: Final = "whsec_"
_VERSION: Final = "v1"
# A header value a verifier takes part in the content: visible ASCII and inner spaces.
_VISIBLE_ASCII: Final = re.compile(r"[\x20-\x7e]*")
_TIMESTAMP: Final = re.compile(r"[0-9]{1,12}")

Scheme = Literal["standard-webhooks", "legacy", "both"]


class SignatureError(ValueError):
    """A request whose signature is missing, malformed, wrong or stale."""


# --- the signed content -------------------------------------------------------------------


def content_digest(body: bytes) -> str:
    """The RFC 9530 ``Content-Digest`` of ``body``: ``sha-256=:<base64>:``."""
    return f"sha-256=:{base64.b64encode(hashlib.sha256(body).digest()).decode()}:"


def canonical_json(value: Mapping[str, str] | Sequence[Mapping[str, str]]) -> bytes:
    """RFC 8785 for objects of strings (and arrays of them): sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def http_content(
    headers: Iterable[tuple[str, str]], body: bytes, *, digest: str | None = None
) -> bytes:
    """What an HTTP request signs: its ``ce-*`` and ``content-type`` headers and body digest.

    ``headers`` are every header of the request (name, value), in any case;
    raises ``SignatureError`` for one of those headers named twice, or with a
    value that is not visible ASCII (a verifier's frameworks would disagree on
    it). ``digest``: the body's ``content_digest``, when the caller has it.
    """
    attributes: dict[str, str] = {}
    for name, value in headers:
        lowered = name.lower()
        if not (lowered.startswith("ce-") or lowered == "content-type"):
            continue
        if lowered in attributes:
            raise SignatureError(f"{lowered} is given twice")
        if not (value.isascii() and value.isprintable()):
            raise SignatureError(f"{lowered} is not visible ASCII")
        attributes[lowered] = value
    attributes[DIGEST_HEADER] = content_digest(body) if digest is None else digest
    return canonical_json(attributes)


def grpc_event_content(event: pb.Event) -> dict[str, str]:
    """The attributes of a ``nemesis.v1.Event`` a gRPC delivery signs, by field name."""
    attributes = {
        "id": event.id,
        "source": event.source,
        "spec_version": event.spec_version,
        "type": event.type,
        "data_content_type": event.data_content_type,
        DIGEST_HEADER: content_digest(event.data),
        "topic": event.topic,
        "partition": str(event.partition),
        "offset": str(event.offset),
        "attempt": str(event.attempt),
    }
    if event.HasField("time"):
        attributes["time"] = f"{event.time.seconds}.{event.time.nanos:09d}"
    if event.HasField("partition_key"):
        attributes["partition_key"] = event.partition_key
    for name, value in event.extensions.items():
        attributes[f"extensions.{name}"] = value
    return attributes


def grpc_content(events: Sequence[pb.Event], *, batch: bool) -> bytes:
    """What a gRPC call signs: one event's object (``Deliver``), or an array (``DeliverBatch``)."""
    if batch:
        return canonical_json([grpc_event_content(event) for event in events])
    [event] = events
    return canonical_json(grpc_event_content(event))


def batch_id(content: bytes) -> str:
    """The ``webhook-id`` of a batch: its content names it (a retry has the same id)."""
    return "batch-" + hashlib.sha256(content).hexdigest()[:32]


# --- keys and signatures ------------------------------------------------------------------


def key_of(secret: str) -> bytes:
    """The HMAC key of a secret: a ``whsec_`` secret's decoded bytes, else its UTF-8."""
    if secret.startswith(SECRET_PREFIX):
        try:
            return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
        except binascii.Error:
            raise ValueError("a whsec_ secret is whsec_ and base64") from None
    return secret.encode()


def webhook_signature(key: bytes, msg_id: str, timestamp: int, content: bytes) -> str:
    """One Standard Webhooks signature: ``v1,<base64 HMAC-SHA256>``."""
    mac = hmac.digest(key, f"{msg_id}.{timestamp}.".encode() + content, "sha256")
    return f"{_VERSION},{base64.b64encode(mac).decode()}"


def standard_headers(
    keys: Sequence[bytes], msg_id: str, timestamp: int, content: bytes
) -> list[tuple[str, str]]:
    """The three ``webhook-*`` headers, one signature per key."""
    if not keys:
        raise ValueError("signing needs at least one secret")
    signatures = " ".join(webhook_signature(key, msg_id, timestamp, content) for key in keys)
    return [
        (ID_HEADER, msg_id),
        (TIMESTAMP_HEADER, str(timestamp)),
        (WEBHOOK_SIGNATURE_HEADER, signatures),
    ]


def verify_standard(
    headers: Mapping[str, str],
    keys: Iterable[bytes],
    content: bytes,
    *,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> None:
    """Raises ``SignatureError`` unless the ``webhook-*`` headers sign ``content`` in time.

    ``headers`` by lowercase name. Every malformed value is a ``SignatureError``,
    never another exception: a handler answers it 401.
    """
    msg_id = headers.get(ID_HEADER)
    stamp = headers.get(TIMESTAMP_HEADER)
    given = headers.get(WEBHOOK_SIGNATURE_HEADER)
    if not msg_id or not stamp or not given:
        raise SignatureError("no webhook-id, webhook-timestamp or webhook-signature")
    for name, value in (
        (ID_HEADER, msg_id),
        (TIMESTAMP_HEADER, stamp),
        (WEBHOOK_SIGNATURE_HEADER, given),
    ):
        if not _VISIBLE_ASCII.fullmatch(value):
            raise SignatureError(f"{name} is not visible ASCII")
    if not _TIMESTAMP.fullmatch(stamp):
        raise SignatureError(f"{TIMESTAMP_HEADER} is not whole seconds")
    timestamp = int(stamp)
    if abs(now - timestamp) > tolerance_s:
        raise SignatureError(f"{TIMESTAMP_HEADER} is {now - timestamp:.0f}s from now")
    candidates: list[bytes] = []
    for part in given.split(" "):
        version, sep, encoded = part.partition(",")
        if version != _VERSION or not sep:
            continue  # another version, or a stray space: the standard skips it
        try:
            candidates.append(base64.b64decode(encoded, validate=True))
        except binascii.Error:
            continue
    if not candidates:
        raise SignatureError(f"{WEBHOOK_SIGNATURE_HEADER} has no {_VERSION} signature")
    for key in keys:
        expected = webhook_signature(key, msg_id, timestamp, content).partition(",")[2]
        digest = base64.b64decode(expected)
        if any(hmac.compare_digest(digest, candidate) for candidate in candidates):
            return
    raise SignatureError(f"{WEBHOOK_SIGNATURE_HEADER} matches no secret")


# --- the legacy header --------------------------------------------------------------------


def legacy_signature(secret: bytes, timestamp: int, event_id: str, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``"<timestamp>.<event_id>." + body`` under ``secret``."""
    mac = hmac.new(secret, f"{timestamp}.{event_id}.".encode(), hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


def legacy_sign(secrets: Sequence[bytes], timestamp: int, event_id: str, body: bytes) -> str:
    """The ``nemesis-signature`` header value: the time, then one ``v1`` per secret."""
    if not secrets:
        raise ValueError("signing needs at least one secret")
    parts = [f"t={timestamp}"]
    parts += [f"{_VERSION}={legacy_signature(s, timestamp, event_id, body)}" for s in secrets]
    return ",".join(parts)


def legacy_parse(header: str) -> tuple[int, list[str]]:
    """The timestamp and the ``v1`` signatures of a ``nemesis-signature`` value."""
    timestamp: int | None = None
    signatures: list[str] = []
    for part in header.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            raise SignatureError(f"malformed {LEGACY_HEADER} part {part.strip()!r}")
        if name == "t":
            if not _TIMESTAMP.fullmatch(value):
                raise SignatureError(f"{LEGACY_HEADER}: t is not a whole number of seconds")
            timestamp = int(value)
        elif name == _VERSION:
            signatures.append(value)
        # Other schemes are skipped: a later scheme can be added beside v1.
    if timestamp is None:
        raise SignatureError(f"{LEGACY_HEADER} has no t=")
    if not signatures:
        raise SignatureError(f"{LEGACY_HEADER} has no {_VERSION}=")
    return timestamp, signatures


def legacy_verify(
    header: str | None,
    secrets: Iterable[bytes],
    event_id: str,
    body: bytes,
    *,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> None:
    """Raises ``SignatureError`` unless ``header`` signs this request with one of ``secrets``."""
    if not header:
        raise SignatureError(f"no {LEGACY_HEADER} header")
    timestamp, given = legacy_parse(header)
    if abs(now - timestamp) > tolerance_s:
        raise SignatureError(f"{LEGACY_HEADER} is {now - timestamp:.0f}s from now")
    for secret in secrets:
        expected = legacy_signature(secret, timestamp, event_id, body)
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return
    raise SignatureError(f"{LEGACY_HEADER} matches no secret")


def grpc_batch_body(events: Iterable[tuple[str, bytes]]) -> bytes:
    """What a legacy ``DeliverBatch`` signs: each event's (id, data) as netstrings, in order."""
    parts: list[bytes] = []
    for event_id, data in events:
        encoded = event_id.encode()
        parts += [b"%d:" % len(encoded), encoded, b",", b"%d:" % len(data), data, b","]
    return b"".join(parts)


# --- the signer of one integration --------------------------------------------------------


class Signer:
    """One integration's secrets and scheme: the headers each request carries."""

    __slots__ = ("keys", "scheme", "secrets")

    def __init__(self, secrets: Sequence[str], scheme: Scheme = "standard-webhooks") -> None:
        if not secrets:
            raise ValueError("signing needs at least one secret")
        self.secrets = tuple(secrets)
        self.scheme: Scheme = scheme
        # The Standard Webhooks HMAC keys, in the secrets' order.
        self.keys = tuple(key_of(secret) for secret in secrets)

    def http(
        self, headers: Iterable[tuple[str, str]], body: bytes, *, batch: bool, timestamp: int
    ) -> list[tuple[str, str]]:
        """The headers that sign an HTTP request whose other headers are ``headers``."""
        signed: list[tuple[str, str]] = []
        headers = list(headers)
        if self.scheme != "legacy":
            digest = content_digest(body)
            content = http_content(headers, body, digest=digest)
            if batch:
                msg_id = batch_id(content)
            else:
                msg_id = next(value for name, value in headers if name.lower() == "ce-id")
            signed.append((DIGEST_HEADER, digest))
            signed += standard_headers(self.keys, msg_id, timestamp, content)
        if self.scheme != "standard-webhooks":
            event_id = "" if batch else next(v for n, v in headers if n.lower() == "ce-id")
            raw = [s.encode() for s in self.secrets]
            signed.append((LEGACY_HEADER, legacy_sign(raw, timestamp, event_id, body)))
        return signed

    def grpc(
        self, events: Sequence[pb.Event], *, batch: bool, timestamp: int
    ) -> list[tuple[str, str]]:
        """The metadata that signs a ``Deliver`` (one event) or ``DeliverBatch`` call."""
        signed: list[tuple[str, str]] = []
        if self.scheme != "legacy":
            content = grpc_content(events, batch=batch)
            # Metadata values are ASCII: a batch's id is hex, an event's id percent-encoded.
            msg_id = batch_id(content) if batch else _ascii_id(events[0].id)
            signed += standard_headers(self.keys, msg_id, timestamp, content)
        if self.scheme != "standard-webhooks":
            raw = [s.encode() for s in self.secrets]
            if batch:
                body = grpc_batch_body((event.id, event.data) for event in events)
                header = legacy_sign(raw, timestamp, "", body)
            else:
                header = legacy_sign(raw, timestamp, events[0].id, events[0].data)
            signed.append((LEGACY_HEADER, header))
        return signed


def _ascii_id(event_id: str) -> str:
    if _VISIBLE_ASCII.fullmatch(event_id) and "%" not in event_id:
        return event_id
    return quote(event_id, safe="")


def secrets_from_environment(
    config: SigningConfig, env: Mapping[str, str], *, where: str
) -> tuple[str, ...]:
    """The signing secrets the variables of ``config`` hold, in its order.

    Raises ``ConfigError`` naming ``where`` (the integration file) and every
    variable that is unset, empty, or a ``whsec_`` value that is not base64;
    the message never holds a value.
    """
    problems: list[ConfigProblem] = []
    secrets: list[str] = []
    for index, name in enumerate(config.secrets_env):
        value = env.get(name, "")
        field = f"target.signing.secrets_env.{index}"
        if not value:
            message = (
                f"environment variable {name} is unset or empty: it must hold the signing"
                " secret (set it, or remove target.signing to send unsigned requests)"
            )
            problems.append(ConfigProblem(where, None, field, message))
        else:
            try:
                key_of(value)
            except ValueError:
                message = f"environment variable {name} starts with whsec_ but is not base64"
                problems.append(ConfigProblem(where, None, field, message))
        secrets.append(value)
    if problems:
        raise ConfigError(problems)
    return tuple(secrets)


def verify_http(
    headers: Iterable[tuple[str, str]],
    body: bytes,
    keys: Iterable[bytes],
    *,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> None:
    """Raises ``SignatureError`` unless an HTTP request (every header, its body) is signed."""
    headers = list(headers)
    content = http_content(headers, body)
    by_name: dict[str, str] = {}
    for name, value in headers:
        lowered = name.lower()
        if (
            lowered in (ID_HEADER, TIMESTAMP_HEADER, WEBHOOK_SIGNATURE_HEADER)
            and lowered in by_name
        ):
            raise SignatureError(f"{lowered} is given twice")
        by_name[lowered] = value
    verify_standard(by_name, keys, content, now=now, tolerance_s=tolerance_s)


def verify_grpc(
    metadata: Mapping[str, str],
    events: Sequence[pb.Event],
    keys: Iterable[bytes],
    *,
    batch: bool,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> None:
    """Raises ``SignatureError`` unless a gRPC call (its metadata, its events) is signed."""
    content = grpc_content(events, batch=batch)
    verify_standard(metadata, keys, content, now=now, tolerance_s=tolerance_s)
