"""YDB topic messages to and from the port's ``Message`` and ``OutgoingMessage``.

YDB messages have no key: a key travels as the metadata item ``__key``
(``KEY_ITEM``), so that keyed writes through Nemesis read back with their
key. Metadata values are bytes in YDB and strings in the port; bytes that
are not UTF-8 are decoded with replacement characters rather than dropped.
Times in YDB messages are naive UTC datetimes (protobuf's ``ToDatetime``);
the port's are Unix seconds.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from ydb import TopicReaderAsyncIO, TopicReaderMessage, TopicWriterMessage
from ydb._topic_reader.datatypes import PartitionSession as SdkPartitionSession

from nemesis.broker.port import Message, OutgoingMessage

KEY_ITEM = "__key"

_UTC = datetime.UTC


class YdbSession:
    """One YDB partition session of one reader, as the port's ``PartitionSession``.

    ``id`` is a serial of the reader, not YDB's partition session id: YDB's
    id is unique only within one read stream, and the SDK opens a new stream
    on every reconnect, so its ids repeat; the runner's commit tracking needs
    ids that never repeat for a partition. ``alive`` is the SDK's own state
    (false once the server stopped the session or the stream reconnected).
    """

    __slots__ = (
        "_id",
        "_sdk",
        "_topic",
        "inflight",
        "owner",
        "parked",
        "paused",
        "spilled",
        "stash",
        "stash_bytes",
    )

    def __init__(self, topic: str, sdk: SdkPartitionSession, serial: int, *, owner: object) -> None:
        self._topic = topic
        self.owner = owner  # the reader that received it: only that one may commit
        self._sdk = sdk
        self._id = serial
        self.paused = False
        # Messages received from the SDK and not yet handed out (paused, or
        # left over from a batch larger than asked for), in offset order.
        self.stash: list[tuple[Message, TopicReaderMessage]] = []
        self.stash_bytes = 0
        # Paused with a full stash: what it held and whatever arrives for it
        # is dropped, and read again from a new read session at the resume.
        self.spilled = False
        # Why nothing of this session is handed out any more (a message it
        # cannot decode), or None.
        self.parked: str | None = None
        # Handed out and not yet committed, by offset: a commit needs the SDK's
        # own messages, whose commit ranges chain (see YdbReader.commit).
        self.inflight: dict[int, TopicReaderMessage] = {}

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def partition(self) -> int:
        return self._sdk.partition_id

    @property
    def id(self) -> int:
        return self._id

    @property
    def alive(self) -> bool:
        return not self._sdk.closed

    @property
    def sdk(self) -> SdkPartitionSession:
        return self._sdk

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"<YdbSession {self._topic}[{self.partition}] #{self._id} {state}>"


def sdk_session(message: TopicReaderMessage) -> SdkPartitionSession:
    """The SDK's partition session of a message.

    The SDK exposes only ``alive`` and ``partition_id`` publicly; which
    session a message belongs to is its ``_partition_session``. This is the
    one private attribute the adapter reads (tests pin it against the
    installed SDK).
    """
    return message._partition_session


def sdk_partition_sessions(reader: TopicReaderAsyncIO) -> Sequence[SdkPartitionSession]:
    """The partition sessions the SDK reader's current read stream holds, from their start.

    The SDK (3.33) reports no session starts or stops to its caller: its
    event handler's ``on_init_partition`` and ``on_shutdown_partition`` are
    declared but never called, and ``on_partition_get_start_offset`` names a
    partition but not its session. The sessions live in the read stream's
    own table, read here (the one other private path the adapter follows;
    tests pin it against the installed SDK). Empty while no stream is open.
    """
    stream = getattr(getattr(reader, "_reconnector", None), "_stream_reader", None)
    table: dict[int, SdkPartitionSession] = getattr(stream, "_partition_sessions", {})
    return [session for session in list(table.values()) if not session.closed]


class Undecodable(bytes):
    """The data of a message compressed with a codec this reader cannot decode.

    The SDK fails its whole read stream on a codec it has no decoder for, and
    then every partition of the reader would restart on the same batch
    forever; a decoder that returns this instead lets the reader park the
    one partition and report why.
    """

    codec: int

    def __new__(cls, data: bytes, codec: int) -> Undecodable:
        made = super().__new__(cls, data)
        made.codec = codec
        return made


def session_key(session: SdkPartitionSession) -> tuple[int, int]:
    """Unique within one SDK reader: (read stream, YDB partition session id)."""
    return (session.reader_stream_id, session.id)


def to_message(topic: str, message: TopicReaderMessage, session: YdbSession) -> Message:
    """The port's view of a received YDB message."""
    items = message.metadata_items or {}
    metadata = {name: _text(value) for name, value in items.items() if name != KEY_ITEM}
    key = items.get(KEY_ITEM)
    data = message.data
    if not isinstance(data, bytes):
        # Only a custom decoder could make it something else, and the adapter installs none.
        raise TypeError(f"message data is {type(data).__name__}, expected bytes")
    return Message(
        topic=topic,
        partition=message.partition_id,
        offset=message.offset,
        value=data,
        key=None if key is None else _text(key),
        metadata=metadata,
        producer_id=message.producer_id or None,
        seqno=message.seqno,
        created_at=unix_seconds(message.created_at),
        written_at=unix_seconds(message.written_at),
        session=session,
    )


def to_sdk_message(message: OutgoingMessage, seqno: int | None, now: float) -> TopicWriterMessage:
    """A message for the SDK writer, with the seqno the writer chose (None: the SDK's)."""
    items: dict[str, str | bytes] = dict(message.metadata)
    if message.key is not None:
        items[KEY_ITEM] = message.key
    created = message.created_at if message.created_at is not None else now
    return TopicWriterMessage(
        data=message.value,
        metadata_items=items,
        seqno=seqno,
        created_at=datetime.datetime.fromtimestamp(created, _UTC),
    )


def unix_seconds(moment: datetime.datetime | None) -> float:
    """Unix seconds of an SDK time; naive datetimes are UTC (as protobuf makes them)."""
    if moment is None:
        return 0.0
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_UTC)
    return moment.timestamp()


def _text(value: str | bytes) -> str:
    if isinstance(value, str):
        return value
    return value.decode("utf-8", errors="replace")
