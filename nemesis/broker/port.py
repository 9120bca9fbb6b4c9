"""The broker port: what Nemesis needs from a topic system.

Two backends implement it: ``embedded`` (one SQLite file) and ``ydb`` (YDB
topics). The semantics are chosen so that YDB fits without contortions:

* A reader belongs to one consumer name and receives messages only from the
  partitions currently assigned to it. Each message carries its *partition
  session* (YDB: the partition session; embedded: the lease generation). When
  a session ends (the partition was given to another reader), its messages are
  stale: they are neither processed further nor committed. ``session.alive``
  says which.
* The runner decides what may be committed (the contiguous done prefix of a
  partition session) and hands the reader those messages, in offset order.
  The reader turns them into its own commit (embedded: one offset update
  fenced by the lease generation; YDB: the SDK's commit of those messages).
* A write returns only after the broker acknowledged it durably, and says per
  message whether it was written or skipped as a duplicate (producer id +
  seqno, as YDB de-duplicates).
* Every call that can block takes a timeout: the YDB SDK retries forever.
* Where a consumer starts (``StartFrom``) matters only on a partition it has
  never committed: once it committed, a reader resumes from the commit.
  ``TopicAdmin.seek`` moves a committed offset either way; the reader that
  holds the partition loses it and its next owner reads from there.
* A reader may read several topics as one consumer (an integration's retry
  tiers and replay topic are read by one): each message and session names its
  topic, and commits, pauses and sessions stay per partition session.
* An idle reader costs nothing: a ``receive`` with nothing to read waits for
  data (or ``interrupt``) rather than polling, so callers may pass long
  timeouts.
"""

from __future__ import annotations

import enum
import itertools
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

# A record's headers: (name, value) in order; a value may be None (Kafka allows it).
Headers = tuple[tuple[str, bytes | None], ...]


def partition_for_key(key: str, partitions: int) -> int:
    """The partition of a key: CRC-32 of its UTF-8 bytes, stable across processes and versions.

    Every backend that picks a key's partition itself (embedded, YDB) uses it.
    """
    return zlib.crc32(key.encode("utf-8")) % partitions


def key_text(raw: bytes) -> str:
    """A broker's key as the port's text: UTF-8, each byte that does not decode a lone surrogate."""
    return raw.decode("utf-8", "surrogateescape")


def key_bytes(key: str) -> bytes:
    """The bytes of a key made by ``key_text`` (UTF-8 for any other text)."""
    return key.encode("utf-8", "surrogateescape")


def is_text_key(key: str) -> bool:
    """Whether a key is UTF-8 text (not a binary key held by ``key_text``)."""
    if key.isascii():
        return True
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@runtime_checkable
class PartitionSession(Protocol):
    """One reader's hold on one partition, from assignment until revocation."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def id(self) -> int:
        """Unique per (topic, partition) holder: YDB's session id, or the lease generation."""
        ...

    @property
    def alive(self) -> bool:
        """False once the partition was revoked: its messages must not be committed."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class Message:
    """A message read from a topic partition.

    ``created_at`` is the producer's time and ``written_at`` the broker's,
    both as Unix seconds. ``metadata`` holds the per-message string pairs
    (YDB metadata items; retry tiers keep their bookkeeping there).

    Kept as the producer wrote them (Kafka): ``key`` is text, and a key that
    is not UTF-8 holds each byte that does not decode as a lone surrogate
    (``key_text``; ``key_bytes`` gives the bytes back). ``headers`` are the
    record's own headers, in order, duplicates and null values included
    (Nemesis' ``nemesis-*`` bookkeeping is never among them); ``metadata``
    is their string view then: the last value of each header that is UTF-8
    text. ``tombstone`` marks a record without a value (``value`` is empty
    then), unlike an empty one. A backend without headers or null values
    leaves them empty and False.
    """

    topic: str
    partition: int
    offset: int
    value: bytes
    key: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    producer_id: str | None = None
    seqno: int | None = None
    created_at: float = 0.0
    written_at: float = 0.0
    session: PartitionSession | None = None
    headers: Headers = ()
    tombstone: bool = False

    @property
    def alive(self) -> bool:
        """Whether the message still belongs to a live partition session."""
        return self.session is None or self.session.alive


_MESSAGE_FIELDS = (
    "topic",
    "partition",
    "offset",
    "value",
    "key",
    "metadata",
    "producer_id",
    "seqno",
    "created_at",
    "written_at",
    "session",
    "headers",
    "tombstone",
)


def _message_builder() -> Callable[..., Message]:
    """A Message constructor without the frozen dataclass's per-field ``object.__setattr__``.

    The generated ``__init__`` of a frozen slotted dataclass costs about
    twice as much as setting the slots directly, and a read of a few hundred
    thousand messages a second spends most of its time there. Should
    ``Message`` gain or lose a field, this falls back to the keyword
    constructor (which then fails loudly if a field went away) rather than
    leave a slot unset.
    """
    if {f.name for f in fields(Message)} != set(_MESSAGE_FIELDS):

        def build_by_keyword(*values: Any) -> Message:
            return Message(**dict(zip(_MESSAGE_FIELDS[: len(values)], values, strict=True)))

        return build_by_keyword

    (
        topic_,
        partition_,
        offset_,
        value_,
        key_,
        metadata_,
        producer_,
        seqno_,
        created_,
        written_,
        session_,
        headers_,
        tombstone_,
    ) = (getattr(Message, name).__set__ for name in _MESSAGE_FIELDS)
    new = object.__new__

    def build(
        topic: str,
        partition: int,
        offset: int,
        value: bytes,
        key: str | None,
        metadata: Mapping[str, str],
        producer_id: str | None,
        seqno: int | None,
        created_at: float,
        written_at: float,
        session: PartitionSession,
        headers: Headers = (),
        tombstone: bool = False,
    ) -> Message:
        message: Message = new(Message)
        topic_(message, topic)
        partition_(message, partition)
        offset_(message, offset)
        value_(message, value)
        key_(message, key)
        metadata_(message, metadata)
        producer_(message, producer_id)
        seqno_(message, seqno)
        created_(message, created_at)
        written_(message, written_at)
        session_(message, session)
        headers_(message, headers)
        tombstone_(message, tombstone)
        return message

    return build


# Every backend's reader makes its messages with it: a read is one per message.
build_message = _message_builder()


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """A message to write.

    Partition choice: ``partition`` if given, else a stable hash of ``key``,
    else round-robin. ``seqno`` with the writer's producer id enables
    de-duplication: a message whose seqno is not above the last one written
    by that producer is skipped.

    ``key``, ``headers`` and ``tombstone`` as in ``Message``: a backend with
    headers writes ``headers`` as they are, then the ``metadata`` pairs whose
    names they lack (a retry tier's copy of a record: its headers, then
    Nemesis' bookkeeping).
    """

    value: bytes
    key: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    partition: int | None = None
    seqno: int | None = None
    created_at: float | None = None
    headers: Headers = ()
    tombstone: bool = False


class WriteStatus(enum.Enum):
    WRITTEN = "written"
    DUPLICATE = "duplicate"


@dataclass(frozen=True, slots=True)
class WriteResult:
    status: WriteStatus
    partition: int
    offset: int | None  # None for a skipped duplicate


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    name: str
    # Start position for a consumer that has never committed: the oldest retained message.
    important: bool = False


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    partition: int
    start_offset: int  # oldest retained offset
    end_offset: int  # offset the next message will get
    last_written_at: float | None
    committed: Mapping[str, int]  # consumer -> committed offset (next to read)


@dataclass(frozen=True, slots=True)
class TopicDescription:
    name: str
    partitions: Sequence[PartitionInfo]
    consumers: Sequence[str]
    retention_s: float | None


@dataclass(frozen=True, slots=True)
class StartFrom:
    """Where a consumer starts on a partition it has never committed.

    ``earliest``: the oldest retained message. ``latest``: the partition's
    end when the reader first takes the partition (only messages written
    after that). ``time``: the first message the broker wrote at or after
    ``at`` (Unix seconds), or the end if there is none. Until the
    consumer's first commit a backend may choose again at a restart (Kafka
    and YDB do; the embedded backend commits its choice at once).

    Kafka maps ``earliest``/``latest`` onto ``auto.offset.reset`` and
    ``time`` onto ``offsets_for_times`` for the partitions without a commit.
    """

    kind: Literal["earliest", "latest", "time"] = "earliest"
    at: float | None = None

    def __post_init__(self) -> None:
        if (self.kind == "time") != (self.at is not None):
            raise ValueError("a start from a time needs `at`, and only it")


EARLIEST = StartFrom("earliest")


@dataclass(frozen=True, slots=True)
class Seek:
    """A committed offset moved by ``TopicAdmin.seek``: where it was and where it is."""

    partition: int
    before: int
    after: int


class TopicAdmin(Protocol):
    async def create_topic(
        self,
        name: str,
        *,
        partitions: int,
        consumers: Sequence[ConsumerSpec] = (),
        retention_s: float | None = None,
        exist_ok: bool = False,
    ) -> None: ...

    async def add_consumer(self, topic: str, consumer: ConsumerSpec) -> None:
        """Registers a consumer; a consumer that exists already is left alone."""
        ...

    async def list_topics(self) -> Sequence[str]: ...

    async def describe_topic(self, name: str) -> TopicDescription: ...

    async def drop_topic(self, name: str) -> None: ...

    async def offsets_for_time(self, topic: str, at: float) -> Mapping[int, int]:
        """Per partition, the offset of the first message written at or after ``at``
        (Unix seconds, the broker's write time); the end offset where there is none."""
        ...

    async def seek(self, topic: str, consumer: str, partition: int, offset: int) -> Seek:
        """Sets ``consumer``'s committed offset (the next to read) on one partition.

        Moves either way; an offset outside the retained range is clamped to
        it; a partition that does not exist is a ValueError. A reader holding
        the partition loses it (its later commits of the partition are
        ignored) and its next owner reads from ``offset``: seek while the
        consumer's readers are paused or gone, or they may deliver what they
        had read already. A backend that cannot move the offset of a consumer
        with live readers (Kafka: a group that has members) raises BrokerError
        saying so, and the caller stops the readers first.
        """
        ...

    async def live_readers(self, topic: str, consumer: str) -> Sequence[str]:
        """Names of the readers of ``consumer`` the broker knows to be alive now."""
        ...

    async def write_times(self, topic: str, offsets: Mapping[int, int]) -> Mapping[int, float]:
        """The broker's write time of the message at ``offsets[partition]``, where it is
        cheap to know; partitions it cannot tell (or without that message) are left out."""
        ...


@runtime_checkable
class DescribesMany(Protocol):
    """An admin that describes many topics in one trip (optional, for cheap lag rounds).

    The lag monitor describes every topic a process reads every few seconds;
    with hundreds of integrations, one trip per topic is most of what an idle
    process does. An admin with this method is asked once per round instead.
    """

    async def describe_topics(self, names: Sequence[str]) -> Mapping[str, TopicDescription]:
        """The topics of ``names`` that exist, described as ``describe_topic`` does."""
        ...


class TopicReader(Protocol):
    """Reads one or more topics as one consumer; partitions are assigned by the broker."""

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        """Up to ``max_messages``; an empty sequence when nothing arrived in ``timeout_s``."""
        ...

    async def commit(self, messages: Sequence[Message]) -> None:
        """Commits a contiguous run of processed messages of one partition session.

        Messages of a dead session are ignored: their partition belongs to
        another reader now, which will read them again.
        """
        ...

    def pause(self, session: PartitionSession) -> None:
        """Stop delivering messages of this session until ``resume`` (flow control)."""
        ...

    def resume(self, session: PartitionSession) -> None: ...

    def interrupt(self) -> None:
        """Makes a ``receive`` waiting now return at once (with what it has, maybe nothing).

        For a caller that stops or pauses: it may wait in ``receive`` as long
        as it likes and still react at once. Nothing read is lost by it. A
        call while no ``receive`` waits has no effect on the next one.
        """
        ...

    def sessions(self) -> Sequence[PartitionSession]:
        """The partition sessions this reader holds now."""
        ...

    def stalled(self) -> Mapping[tuple[str, int], str]:
        """Partitions held and delivering nothing, by (topic, partition), with the reason.

        A partition the reader cannot go past on its own (a batch in a codec
        Nemesis cannot decode) stays assigned and sends nothing more until an
        operator acts; its lag grows. Empty when every partition flows.
        """
        ...

    async def close(self, timeout_s: float = 5.0) -> None: ...


class TopicWriter(Protocol):
    """Writes to one topic as one producer."""

    @property
    def producer_id(self) -> str: ...

    async def write(
        self, messages: Sequence[OutgoingMessage], timeout_s: float = 10.0
    ) -> Sequence[WriteResult]: ...

    async def close(self, timeout_s: float = 5.0) -> None: ...


class Broker(Protocol):
    """A backend: opens admins, readers and writers over one connection."""

    @property
    def admin(self) -> TopicAdmin: ...

    async def reader(
        self,
        topic: str | Sequence[str],
        consumer: str,
        *,
        start_from: StartFrom = EARLIEST,
    ) -> TopicReader:
        """A reader of ``topic`` as ``consumer``; several topics: one reader over all of them.

        Every topic must exist and have the consumer registered. ``start_from``
        applies to partitions the consumer never committed.
        """
        ...

    async def writer(self, topic: str, producer_id: str | None = None) -> TopicWriter: ...

    async def close(self) -> None: ...


SessionT = TypeVar("SessionT", bound=PartitionSession)


def run_session(
    messages: Sequence[Message], kind: type[SessionT], mine: Callable[[SessionT], bool]
) -> SessionT:
    """The one session of a non-empty run handed to ``TopicReader.commit``, checked.

    A run is one partition session's messages, in offset order, received by
    the reader committing them (``mine``); anything else is a caller's bug
    (``ValueError``), never a commit of the wrong offsets. Every backend's
    reader checks its runs here.
    """
    session = messages[0].session
    if not isinstance(session, kind) or not mine(session):
        raise ValueError("messages were not received by this reader")
    for previous, message in itertools.pairwise(messages):
        if message.session is not session or message.offset <= previous.offset:
            raise ValueError("commit takes one partition session's messages in offset order")
    return session
