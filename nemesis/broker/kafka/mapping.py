"""Kafka records <-> the port's messages, and the partition session of a group member.

A record is kept as its producer wrote it: the key's bytes (``key_text``:
a key that is not UTF-8 too), a null value as a tombstone, and every header,
in order, duplicates and null values included, as the message's
``headers``; ``metadata`` is their string view (the last value of each
header that is UTF-8 text), which the type lookup and the pipelines read.

Nemesis' own headers stay out of ``headers``: the ``nemesis-*`` bookkeeping
of a retry tier or a replay (in ``metadata`` only, never written by a
producer), and three that Nemesis' writers add and readers take off again:
``__producer`` (the writer's producer id), ``__seqno`` (its sequence number,
for de-duplication) and ``__created`` (a ``created_at`` older than the write,
as a retry tier keeps its source message's). A write puts a message's
``headers`` first, as they are, then its ``metadata`` pairs that they lack
(its bookkeeping), then Nemesis' own: a record copied to a retry tier and
read back has the headers it had.

Kafka keeps one time per record: the time of the write (the producer's
clock, or the broker's where the topic has
``message.timestamp.type=LogAppendTime``). That is ``written_at``, and
``created_at`` unless ``__created`` says otherwise.
"""

from __future__ import annotations

from typing import Any

from nemesis.broker.port import Message, OutgoingMessage, build_message, key_bytes, key_text
from nemesis.topology import META_PREFIX

PRODUCER_HEADER = "__producer"
SEQNO_HEADER = "__seqno"
CREATED_HEADER = "__created"
_OWN_HEADERS = (PRODUCER_HEADER, SEQNO_HEADER, CREATED_HEADER)


class KafkaSession:
    """One reader's hold on one partition: from assignment by the group until revocation.

    ``id`` is a serial of the reader: a partition given back to the same
    member after a rebalance is a new session, whose first messages are the
    ones after the group's committed offset.
    """

    __slots__ = ("_alive", "_id", "_partition", "_topic", "owner", "paused")

    def __init__(self, topic: str, partition: int, session_id: int, owner: object) -> None:
        self._topic = topic
        self._partition = partition
        self._id = session_id
        self._alive = True
        self.owner = owner
        self.paused = False

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def partition(self) -> int:
        return self._partition

    @property
    def id(self) -> int:
        return self._id

    @property
    def alive(self) -> bool:
        return self._alive

    def end(self) -> None:
        """The partition was revoked (or the member fell out of the group): stale from now."""
        self._alive = False

    def __repr__(self) -> str:
        state = "alive" if self._alive else "ended"
        return f"KafkaSession({self._topic}[{self._partition}] #{self._id}, {state})"


def to_message(record: Any, session: KafkaSession) -> Message:
    """The port's message for an aiokafka ``ConsumerRecord``."""
    metadata: dict[str, str] = {}
    headers: list[tuple[str, bytes | None]] = []
    producer_id: str | None = None
    seqno: int | None = None
    created_at: float | None = None
    for name, raw in record.headers or ():
        if name in _OWN_HEADERS:
            value = _text(raw) or ""
            if name == PRODUCER_HEADER:
                producer_id = value
            elif name == SEQNO_HEADER:
                seqno = int(value) if value.isdigit() else None
            else:
                created_at = _float(value)
            continue
        if name.startswith(META_PREFIX):
            metadata[name] = _text(raw) or ""
            continue
        headers.append((name, None if raw is None else bytes(raw)))
        text = _text(raw)
        if text is not None:
            metadata[name] = text
        else:
            metadata.pop(name, None)  # the view holds a header's last value, or nothing
    timestamp_s = record.timestamp / 1000 if record.timestamp is not None else 0.0
    key = record.key
    value = record.value
    # Positional, in build_message's order: a read makes one per record.
    return build_message(
        record.topic,
        record.partition,
        record.offset,
        value if value is not None else b"",
        key_text(key) if key is not None else None,
        metadata,
        producer_id,
        seqno,
        timestamp_s if created_at is None else created_at,
        timestamp_s,
        session,
        tuple(headers),
        value is None,
    )


def _text(raw: bytes | None) -> str | None:
    """A header value as UTF-8 text; None for a null value or bytes that are not UTF-8."""
    if raw is None:
        return None
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return None


def record_key(message: OutgoingMessage) -> bytes | None:
    """The record key of a message: the bytes its key stands for."""
    return None if message.key is None else key_bytes(message.key)


def record_value(message: OutgoingMessage) -> bytes | None:
    """The record value: None for a tombstone."""
    return None if message.tombstone else message.value


def headers_of(
    message: OutgoingMessage, producer_id: str, seqno: int | None
) -> list[tuple[str, bytes | None]]:
    """The record headers for a message: its headers, the metadata they lack, Nemesis' own."""
    headers: list[tuple[str, bytes | None]] = [
        (name, value) for name, value in message.headers if name not in _OWN_HEADERS
    ]
    present = {name for name, _ in headers}
    headers += [
        (name, value.encode())
        for name, value in message.metadata.items()
        if name not in present and name not in _OWN_HEADERS
    ]
    headers.append((PRODUCER_HEADER, producer_id.encode()))
    if seqno is not None:
        headers.append((SEQNO_HEADER, str(seqno).encode()))
    if message.created_at is not None:
        headers.append((CREATED_HEADER, repr(message.created_at).encode()))
    return headers


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def header_value(record: Any, name: str) -> str | None:
    """One header of a record, decoded; None when absent."""
    for header, raw in record.headers or ():
        if header == name and raw is not None:
            return str(raw.decode("utf-8", "replace"))
    return None
