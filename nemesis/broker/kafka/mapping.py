"""Kafka records <-> the port's messages, and the partition session of a group member.

A record's key is the message key (UTF-8); its headers are the message
metadata, except three that Nemesis' writers add and readers take off again:
``__producer`` (the writer's producer id), ``__seqno`` (its sequence number,
for de-duplication) and ``__created`` (a ``created_at`` older than the write,
as a retry tier keeps its source message's).

Kafka keeps one time per record: the time of the write (the producer's
clock, or the broker's where the topic has
``message.timestamp.type=LogAppendTime``). That is ``written_at``, and
``created_at`` unless ``__created`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemesis.broker.port import Message, OutgoingMessage, build_message

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
    producer_id: str | None = None
    seqno: int | None = None
    created_at: float | None = None
    for name, raw in record.headers or ():
        value = raw.decode("utf-8", "replace") if raw is not None else ""
        if name == PRODUCER_HEADER:
            producer_id = value
        elif name == SEQNO_HEADER:
            seqno = int(value) if value.isdigit() else None
        elif name == CREATED_HEADER:
            created_at = _float(value)
        else:
            metadata[name] = value
    timestamp_s = record.timestamp / 1000 if record.timestamp is not None else 0.0
    key = record.key
    # Positional, in build_message's order: a read makes one per record.
    return build_message(
        record.topic,
        record.partition,
        record.offset,
        record.value if record.value is not None else b"",
        key.decode("utf-8", "replace") if key is not None else None,
        metadata,
        producer_id,
        seqno,
        timestamp_s if created_at is None else created_at,
        timestamp_s,
        session,
    )


def headers_of(
    message: OutgoingMessage, producer_id: str, seqno: int | None
) -> list[tuple[str, bytes]]:
    """The record headers for a message: its metadata, then Nemesis' own."""
    headers = [(name, value.encode()) for name, value in _items(message.metadata)]
    headers.append((PRODUCER_HEADER, producer_id.encode()))
    if seqno is not None:
        headers.append((SEQNO_HEADER, str(seqno).encode()))
    if message.created_at is not None:
        headers.append((CREATED_HEADER, repr(message.created_at).encode()))
    return headers


def _items(metadata: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in metadata.items() if k not in _OWN_HEADERS]


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
