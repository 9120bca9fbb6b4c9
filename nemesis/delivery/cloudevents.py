"""CloudEvents 1.0 encodings of an ``Event``: binary-mode HTTP headers and the JSON batch.

Binary mode (one event per request) carries the attributes as ``ce-*`` headers
and the payload as the body. String attributes are percent-encoded as the
CloudEvents HTTP binding prescribes (section 3.1.3.2): space, ``"``, ``%`` and
everything outside printable ASCII become ``%XX`` of their UTF-8 bytes. That
also neutralises CR/LF, so a message key or type can never inject a header.

The batch mode body is ``application/cloudevents-batch+json``: a JSON array of
structured events. A JSON payload goes into ``data`` as JSON (its bytes are
embedded unchanged), any other payload as base64 in ``data_base64``.

Extensions (``partitionkey``, ``topic``, ``partition``, ``offset``,
``attempt``) are strings in both modes: binary-mode headers are strings
anyway, and a CloudEvents Integer is 32-bit while offsets are 64-bit, so a
handler reads them the same way whichever mode its integration uses.
"""

from __future__ import annotations

import base64
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, unquote

import msgspec
import orjson

from nemesis.broker.port import is_text_key, key_bytes
from nemesis.delivery.port import Event

SPECVERSION = "1.0"
BATCH_CONTENT_TYPE = "application/cloudevents-batch+json"
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"
FALLBACK_CONTENT_TYPE = "application/octet-stream"

# Printable ASCII except '"' and '%': the characters a header value may carry unencoded.
_UNENCODED = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')
_NEEDS_NO_ENCODING = re.compile(r"[!#$&-~]*")
_is_header_safe = _NEEDS_NO_ENCODING.fullmatch
# A media type with parameters: visible ASCII, spaces and tabs, nothing that ends a header line.
_SAFE_CONTENT_TYPE = re.compile(r"[\t\x20-\x7e]+")


def encode_header_value(value: str) -> str:
    """Percent-encodes a string attribute for a ``ce-*`` header (CloudEvents HTTP binding)."""
    if _NEEDS_NO_ENCODING.fullmatch(value):
        return value
    # errors="replace": a lone surrogate must not fail a delivery; it becomes "?".
    return quote(value, safe=_UNENCODED, encoding="utf-8", errors="replace")


def decode_header_value(value: str) -> str:
    """Reverses ``encode_header_value`` (for handlers and tests)."""
    return unquote(value, encoding="utf-8", errors="replace") if "%" in value else value


def safe_content_type(content_type: str) -> str:
    """The content type if it can travel in a header as is, else application/octet-stream."""
    if _SAFE_CONTENT_TYPE.fullmatch(content_type):
        return content_type
    return FALLBACK_CONTENT_TYPE


def is_json(content_type: str) -> bool:
    """Whether a media type is JSON (``application/json``, ``text/json`` or a ``+json`` type)."""
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type in ("application/json", "text/json") or media_type.endswith("+json")


def rfc3339(unix_s: float) -> str:
    """Unix seconds as an RFC 3339 UTC timestamp with microseconds."""
    # Formatting a datetime per event was the largest single cost of a batch (16% of
    # the proxy's CPU): the seconds part is formatted once per second and kept.
    seconds, micros = divmod(int(unix_s * 1_000_000 + 0.5), 1_000_000)
    text = _SECONDS.get(seconds)
    if text is None:
        text = _utc_second(seconds)
    return "%s.%06dZ" % (text, micros)  # noqa: UP031  (measured faster than an f-string)


_SECONDS: dict[int, str] = {}
_SECONDS_KEPT = 256


def _utc_second(seconds: int) -> str:
    if len(_SECONDS) >= _SECONDS_KEPT:
        _SECONDS.clear()
    text = datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    _SECONDS[seconds] = text
    return text


def event_time(event: Event) -> str | None:
    """The producer's time, else the broker's; None when the message carries neither."""
    message = event.message
    unix_s = message.created_at or message.written_at
    return rfc3339(unix_s) if unix_s > 0 else None


def source_for(integration: str) -> str:
    """The ``ce-source`` of every event an integration delivers."""
    return f"nemesis/{integration}"


def binary_headers(event: Event, source: str) -> dict[str, str]:
    """The ``ce-*`` and content-type headers of one event in binary mode."""
    message = event.message
    return binary_headers_from(
        constant_headers(source, event.type, message.topic, event.content_type), event
    )


def constant_headers(source: str, type_: str, topic: str, content_type: str) -> dict[str, str]:
    """The headers that many events share: a transport keeps them by (type, topic, content type)."""
    return {
        "ce-specversion": SPECVERSION,
        "ce-source": encode_header_value(source),
        "ce-type": encode_header_value(type_),
        "ce-topic": encode_header_value(topic),
        "content-type": safe_content_type(content_type),
    }


def binary_headers_from(constant: dict[str, str], event: Event) -> dict[str, str]:
    """``constant`` (from ``constant_headers`` for this event) plus the event's own headers."""
    message = event.message
    headers = constant.copy()
    event_id = event.id
    headers["ce-id"] = event_id if _is_header_safe(event_id) else encode_header_value(event_id)
    headers["ce-partition"] = str(message.partition)
    headers["ce-offset"] = str(message.offset)
    headers["ce-attempt"] = str(event.attempt)
    unix_s = message.created_at or message.written_at
    if unix_s > 0:
        headers["ce-time"] = rfc3339(unix_s)
    if message.key is not None:
        headers["ce-partitionkey"] = encode_header_value(message.key)
    trace = event.trace
    if trace is not None:
        headers["traceparent"] = trace.traceparent
        if trace.state:
            headers["tracestate"] = trace.state
    return headers


def trace_headers(event: Event) -> list[tuple[str, str]]:
    """The ``traceparent`` and ``tracestate`` a handler receives with one event.

    Both are plain ASCII by construction (``nemesis.tracecontext``
    validates a record's own): they cannot break a header line.
    """
    trace = event.trace
    if trace is None:
        return []
    if trace.state:
        return [("traceparent", trace.traceparent), ("tracestate", trace.state)]
    return [("traceparent", trace.traceparent)]


def binary_header_lines(event: Event) -> tuple[str, str]:
    """The event's own headers of ``binary_headers_from`` as HTTP/1.1 lines, and its ce-id.

    For a transport that writes the request head itself (``nemesis.delivery.h1``):
    the same names and values in the same order, without a dict in between.
    Every value is percent-encoded or a number, so no line can hold a CR, LF or
    NUL of its own.
    """
    message = event.message
    event_id = event.id
    if not _is_header_safe(event_id):
        event_id = encode_header_value(event_id)
    lines = "ce-id: %s\r\nce-partition: %d\r\nce-offset: %d\r\nce-attempt: %d\r\n" % (  # noqa: UP031
        event_id,
        message.partition,
        message.offset,
        event.attempt,
    )
    unix_s = message.created_at or message.written_at
    if unix_s > 0:
        lines += "ce-time: " + rfc3339(unix_s) + "\r\n"
    if message.key is not None:
        lines += "ce-partitionkey: " + encode_header_value(message.key) + "\r\n"
    trace = event.trace
    if trace is not None:
        lines += "traceparent: " + trace.traceparent + "\r\n"
        if trace.state:
            lines += "tracestate: " + trace.state + "\r\n"
    return event_id, lines


def _utf8(text: str) -> str:
    # orjson refuses lone surrogates; one odd key must not fail a whole batch.
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="replace").decode("utf-8")
    return text


def structured_event(event: Event, source: str) -> dict[str, object]:
    """One event in the CloudEvents JSON format (a batch element)."""
    message = event.message
    body = event.body
    structured: dict[str, object] = {
        "specversion": SPECVERSION,
        "id": _utf8(event.id),
        "source": _utf8(source),
        "type": _utf8(event.type),
        "datacontenttype": _utf8(event.content_type),
        "topic": message.topic,
        "partition": str(message.partition),
        "offset": str(message.offset),
        "attempt": str(event.attempt),
    }
    time = event_time(event)
    if time is not None:
        structured["time"] = time
    if message.key is not None:
        structured["partitionkey"] = _utf8(message.key)
    structured.update(trace_headers(event))
    if is_json(event.content_type) and is_json_text(body):
        # Embedded byte for byte: no re-serialisation, numbers keep their exact text.
        structured["data"] = orjson.Fragment(body)
    else:
        structured["data_base64"] = base64.b64encode(body).decode("ascii")
    return structured


# Validates without building the values: msgspec skips what it decodes into Raw (the
# grammar is checked, strings' UTF-8 is not). About 5x cheaper than orjson.loads,
# which builds every object (3 us per event in a batch of 100: a fifth of the proxy).
_ANY_JSON = msgspec.json.Decoder(msgspec.Raw)
_JSON_ARRAY = msgspec.json.Decoder(list[msgspec.Raw])


def is_json_text(body: bytes) -> bool:
    """Whether ``body`` is one JSON text in UTF-8 (RFC 8259)."""
    # A payload labelled JSON that is not JSON would corrupt the whole batch array,
    # so it travels as base64 instead (its datacontenttype still says what it claims).
    try:
        _ANY_JSON.decode(body)
    except msgspec.DecodeError:
        return False
    return _is_utf8(body)


def _is_utf8(data: bytes) -> bool:
    if data.isascii():
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def batch_body(events: Sequence[Event], source: str) -> bytes:
    """The body of a CloudEvents JSON batch request.

    Written as bytes directly rather than through ``structured_event`` and
    ``orjson.dumps``, with JSON payloads embedded unchanged; the whole body is
    then checked once to prove it is valid JSON (one call instead of one per
    payload). Only when that fails is each payload checked, and the ones that
    are not JSON travel as base64.
    """
    if not all(event.plain for event in events):
        return b"[%b]" % b",".join(
            [
                orjson.dumps(
                    structured_event(e, source) if e.plain else general_structured_event(e, source)
                )
                for e in events
            ]
        )
    source_json = _json_string(source)
    body = _batch_in_one_format(events, source_json)
    if body is None:
        body = b"[%b]" % b",".join([_structured_bytes(e, source_json, True) for e in events])
    try:
        _JSON_ARRAY.decode(body)
    except msgspec.DecodeError:
        valid = False
    else:
        valid = _is_utf8(body)
    if not valid:
        body = b"[%b]" % b",".join([_structured_bytes(e, source_json, False) for e in events])
    return body


# An event of a batch as one %-format: the shared head (see _event_head), then the
# id, partition, offset, attempt, time (second, microseconds), key part, trace part (the
# CloudEvents distributed-tracing extension: a batch has one request's headers), data key
# and data.
_BATCH_EVENT = b'%b,"id":%b,"partition":"%d","offset":"%d","attempt":"%d","time":"%b%06dZ"%b%b%b%b}'
_DATA = b',"data":'
_DATA_BASE64 = b',"data_base64":"'
# (type, content type, topic, source) -> (the event's head, whether its data is JSON)
_EVENT_HEADS: dict[tuple[str, str, str, bytes], tuple[bytes, bool]] = {}
_SECOND_HEADS: dict[int, bytes] = {}
_KEPT = 1024


def _batch_in_one_format(events: Sequence[Event], source_json: bytes) -> bytes | None:
    """The batch body in a single %-format over every event's parts (payloads trusted).

    About twice as fast as formatting event by event (``_structured_bytes``),
    which remains the general path: None when an event carries no time.
    """
    parts: list[object] = []
    add = parts.extend
    dumps, heads, seconds = orjson.dumps, _EVENT_HEADS, _SECOND_HEADS
    for event in events:
        message = event.message
        unix_s = message.created_at or message.written_at
        if unix_s <= 0:
            return None
        content_type = event.content_type
        shared = (event.type, content_type, message.topic, source_json)
        known = heads.get(shared)
        head, json_data = _event_head(shared) if known is None else known
        micros = int(unix_s * 1_000_000 + 0.5)
        second = micros // 1_000_000
        second_head = seconds.get(second)
        if second_head is None:
            second_head = _second_head(second)
        key = message.key
        if json_data:
            data_key, data = _DATA, event.body
        else:
            data_key, data = _DATA_BASE64, base64.b64encode(event.body) + b'"'
        add(
            (
                head,
                dumps(_utf8(event.id)),
                message.partition,
                message.offset,
                event.attempt,
                second_head,
                micros - second * 1_000_000,
                b"" if key is None else b',"partitionkey":' + dumps(_utf8(key)),
                _trace_part(event),
                data_key,
                data,
            )
        )
    return b"[" + b",".join([_BATCH_EVENT] * len(events)) % tuple(parts) + b"]"


def _event_head(shared: tuple[str, str, str, bytes]) -> tuple[bytes, bool]:
    type_, content_type, topic, source_json = shared
    if len(_EVENT_HEADS) >= _KEPT:
        _EVENT_HEADS.clear()
    head = b'{"specversion":"1.0","source":%b,"type":%b,"datacontenttype":%b,"topic":%b' % (
        source_json,
        _json_string(type_),
        _json_string(content_type),
        _json_string(topic),
    )
    known = _EVENT_HEADS[shared] = (head, is_json(content_type))
    return known


def _second_head(second: int) -> bytes:
    if len(_SECOND_HEADS) >= _KEPT:
        _SECOND_HEADS.clear()
    head = _SECOND_HEADS[second] = _utc_second(second).encode("ascii") + b"."
    return head


# One %-format per event: measured cheaper than joining a list of parts.
_STRUCTURED = (
    b'{"specversion":"1.0","id":%b,"source":%b,"type":%b,"datacontenttype":%b,"topic":%b,'
    b'"partition":"%d","offset":"%d","attempt":"%d"%b%b%b%b'
)


def _structured_bytes(event: Event, source_json: bytes, trust_json: bool) -> bytes:
    message = event.message
    payload = event.body
    content_type = event.content_type
    unix_s = message.created_at or message.written_at
    key = message.key
    if _is_json_cached(content_type) and (trust_json or is_json_text(payload)):
        data = b',"data":%b}' % payload
    else:
        data = b',"data_base64":"%b"}' % base64.b64encode(payload)
    return _STRUCTURED % (
        orjson.dumps(_utf8(event.id)),
        source_json,
        _json_string(event.type),
        _json_string(content_type),
        _json_string(message.topic),
        message.partition,
        message.offset,
        event.attempt,
        b',"time":"%b"' % _rfc3339_bytes(unix_s) if unix_s > 0 else b"",
        b"" if key is None else b',"partitionkey":%b' % orjson.dumps(_utf8(key)),
        _trace_part(event),
        data,
    )


def _trace_part(event: Event) -> bytes:
    """The event's trace context as batch members (plain ASCII: no JSON escaping needed)."""
    trace = event.trace
    if trace is None:
        return b""
    part = b',"traceparent":"' + trace.traceparent.encode("ascii") + b'"'
    if trace.state:
        part += b',"tracestate":"' + trace.state.encode("ascii") + b'"'
    return part


def _rfc3339_bytes(unix_s: float) -> bytes:
    seconds, micros = divmod(int(unix_s * 1_000_000 + 0.5), 1_000_000)
    head = _SECOND_HEADS.get(seconds)
    if head is None:
        head = _second_head(seconds)
    return b"%b%06dZ" % (head, micros)


@functools.lru_cache(maxsize=1024)
def _json_string(text: str) -> bytes:
    # Types, topics, content types and sources repeat: encode each once.
    return orjson.dumps(_utf8(text))


@functools.lru_cache(maxsize=256)
def _is_json_cached(content_type: str) -> bool:
    return is_json(content_type)


# --- records that are CloudEvents already, and events off the fast path ------------------
#
# A record written in the CloudEvents Kafka binding (binary mode: ``ce_*`` headers,
# structured mode: a ``content-type: application/cloudevents+json`` record whose value
# is the JSON event) keeps its own attributes; Nemesis' coordinates travel as extensions
# beside them (docs/handler-contract.md, "Records that are CloudEvents").

STRUCTURED_PREFIX = "application/cloudevents+json"
# Nemesis' own extensions, added to every event whose attributes do not name them already.
NEMESIS_EXTENSIONS = ("topic", "partition", "offset", "attempt")
KEY_BASE64 = "partitionkeybase64"  # a key that is not UTF-8, base64 (RFC 4648, padded)
TOMBSTONE = "tombstone"  # "true" on a record without a value
_REQUIRED = ("id", "source", "type")
_ATTRIBUTE_NAME = re.compile(r"[a-z0-9]{1,64}")
_ANY_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])


@dataclass(frozen=True, slots=True)
class CloudRecord:
    """A record that is a CloudEvent: its attributes (not ``specversion``) and its data.

    ``data`` None: the event has none (a binary-mode tombstone, or a structured
    event without ``data``). ``attributes`` holds ``datacontenttype`` when the
    event has one.
    """

    attributes: dict[str, str]
    data: bytes | None


@functools.lru_cache(maxsize=256)  # content types repeat; this runs for every event
def is_structured(content_type: str) -> bool:
    """Whether a record's content type says it is a JSON-format event (structured mode)."""
    return content_type[: len(STRUCTURED_PREFIX)].lower() == STRUCTURED_PREFIX


def cloud_record(metadata: Mapping[str, str], value: bytes, tombstone: bool) -> CloudRecord | None:
    """The CloudEvent a record is, by the Kafka binding; None when it is not one."""
    content_type = metadata.get("content-type")
    if content_type is not None and is_structured(content_type):
        return None if tombstone else _structured_record(value)
    if metadata.get("ce_specversion") != SPECVERSION:
        return None
    attributes = {
        name[3:]: text
        for name, text in metadata.items()
        if name.startswith("ce_")
        and name != "ce_specversion"
        and _ATTRIBUTE_NAME.fullmatch(name[3:])
    }
    if not all(attributes.get(name) for name in _REQUIRED):
        return None
    if content_type is not None:
        attributes["datacontenttype"] = content_type
    return CloudRecord(attributes, None if tombstone else value)


def _structured_record(value: bytes) -> CloudRecord | None:
    """A JSON-format event (CloudEvents JSON format): attributes as strings, data as bytes."""
    try:
        members = _ANY_OBJECT.decode(value)
    except msgspec.DecodeError:
        return None
    attributes: dict[str, str] = {}
    for name, raw in members.items():
        if name in ("data", "data_base64") or not _ATTRIBUTE_NAME.fullmatch(name):
            continue
        text = _attribute_text(orjson.loads(bytes(raw)))
        if text is not None:
            attributes[name] = text
    if attributes.pop("specversion", None) != SPECVERSION:
        return None
    if not all(attributes.get(name) for name in _REQUIRED):
        return None
    data: bytes | None = None
    if "data_base64" in members:
        encoded = orjson.loads(bytes(members["data_base64"]))
        try:
            data = base64.b64decode(encoded, validate=True) if isinstance(encoded, str) else None
        except ValueError:
            return None
    elif "data" in members:
        raw_data = bytes(members["data"])
        content_type = attributes.get("datacontenttype")
        if content_type is None or is_json(content_type):
            # JSON data is delivered as the JSON text the producer wrote, byte for byte.
            data = raw_data
            attributes.setdefault("datacontenttype", "application/json")
        else:
            # A string that is not JSON content: the string's own UTF-8 (JSON format, 3.1).
            text = orjson.loads(raw_data)
            data = text.encode() if isinstance(text, str) else raw_data
    return CloudRecord(attributes, data)


def _attribute_text(value: object) -> str | None:
    """An attribute's JSON value as the string a binary-mode header carries; None: absent."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return None


def encode_forwarded(value: bytes) -> str:
    """A forwarded header's bytes as an HTTP field value, losslessly.

    Visible ASCII and inner spaces pass as they are; ``%``, control bytes,
    bytes above 0x7E and a leading or trailing space become ``%XX``.
    ``urllib.parse.unquote_to_bytes`` gives the bytes back. A trace context
    (``traceparent``, ``tracestate``) is always plain ASCII, so it passes unchanged.
    """
    if _PLAIN_FORWARDED.fullmatch(value):
        return value.decode("ascii")
    return "".join(
        chr(byte)
        if (0x21 <= byte <= 0x7E and byte != 0x25) or (byte == 0x20 and 0 < i < len(value) - 1)
        else "%%%02X" % byte  # noqa: UP031
        for i, byte in enumerate(value)
    )


# Visible ASCII but "%", with inner spaces: a value that passes as it is.
_PLAIN_FORWARDED = re.compile(rb"(?:[!-$&-~](?:[ !-$&-~]*[!-$&-~])?)?")


def attributes_of(event: Event, source: str) -> dict[str, str]:
    """Every CloudEvents attribute of an event but ``datacontenttype``, as strings.

    A record that is a CloudEvent keeps its own (``Event.attributes``); Nemesis
    adds its coordinates (``NEMESIS_EXTENSIONS``), the key as ``partitionkey``
    (UTF-8) or ``partitionkeybase64`` (any other bytes) and ``tombstone`` where
    the event does not carry an attribute of that name.
    """
    message = event.message
    own = event.attributes
    if own is None:
        attributes = {"id": event.id, "source": source, "type": event.type}
        time = event_time(event)
        if time is not None:
            attributes["time"] = time
    else:
        attributes = {name: text for name, text in own.items() if name != "datacontenttype"}
    coordinates = (message.topic, str(message.partition), str(message.offset), str(event.attempt))
    for name, text in zip(NEMESIS_EXTENSIONS, coordinates, strict=True):
        attributes.setdefault(name, text)
    key = message.key
    if key is not None and "partitionkey" not in attributes:
        if is_text_key(key):
            attributes["partitionkey"] = key
        else:
            attributes.setdefault(KEY_BASE64, base64.b64encode(key_bytes(key)).decode("ascii"))
    if message.tombstone:
        attributes.setdefault(TOMBSTONE, "true")
    return attributes


def has_data(event: Event) -> bool:
    """Whether the event carries data (a tombstone, or a CloudEvent without data, does not)."""
    return bool(event.content_type)


def full_binary_headers(event: Event, source: str) -> list[tuple[str, str]]:
    """Every header of one event in binary mode, for an event off the fast path.

    The same names as ``binary_headers_from``; besides, the record's own
    CloudEvents attributes, a binary key, the tombstone mark and the forwarded
    producer headers (duplicates as repeated fields, in order).
    """
    headers = [("ce-specversion", SPECVERSION)]
    headers += [
        (f"ce-{name}", encode_header_value(text))
        for name, text in attributes_of(event, source).items()
    ]
    if has_data(event) and event.content_type:
        headers.append(("content-type", safe_content_type(event.content_type)))
    headers += [(name, encode_forwarded(value)) for name, value in event.forwarded]
    headers += trace_headers(event)
    return headers


def general_structured_event(event: Event, source: str) -> dict[str, object]:
    """One event off the fast path in the CloudEvents JSON format (a batch element)."""
    structured: dict[str, object] = {"specversion": SPECVERSION}
    structured.update((name, _utf8(text)) for name, text in attributes_of(event, source).items())
    if "traceparent" not in structured:
        # The CloudEvents distributed-tracing extension: a batch has one request's
        # headers, so each event's trace context travels inside it. A record that is a
        # CloudEvent with an extension of its own keeps it as it came.
        structured.update(trace_headers(event))
    if not has_data(event):
        return structured
    body = event.body
    structured["datacontenttype"] = _utf8(event.content_type)
    if is_json(event.content_type) and is_json_text(body):
        structured["data"] = orjson.Fragment(body)
    else:
        structured["data_base64"] = base64.b64encode(body).decode("ascii")
    return structured
