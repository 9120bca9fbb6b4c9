"""The log itself: topics, appends, reads and retention, as SQL run on a connection's thread.

Every function here is synchronous and takes the ``sqlite3.Connection`` of
the thread it runs on (see ``db.SqliteThread``); the async classes in
``broker`` and ``reader`` schedule them. Offsets within a partition are
dense: the log never has gaps except the prefix retention removed.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import orjson

from nemesis.broker.embedded.tail import ReadRow
from nemesis.broker.port import (
    ConsumerSpec,
    Message,
    OutgoingMessage,
    PartitionInfo,
    PartitionSession,
    TopicDescription,
    WriteResult,
    WriteStatus,
    build_message,
    partition_for_key,
)
from nemesis.errors import TopicExists, TopicNotFound
from nemesis.sqlite_thread import read_transaction, write_transaction

_NO_METADATA: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Topic:
    """A topic's row: its id never changes and is never reused, unlike its name."""

    id: int
    name: str
    partitions: int
    retention_s: float | None


def find_topic(conn: sqlite3.Connection, name: str) -> Topic:
    """The topic called ``name``, or TopicNotFound."""
    row = conn.execute(
        "SELECT id, partitions, retention_s FROM topics WHERE name = ?", (name,)
    ).fetchone()
    if row is None:
        raise TopicNotFound(f"topic {name!r} does not exist")
    return Topic(row[0], name, row[1], row[2])


def find_consumer(conn: sqlite3.Connection, topic: str, consumer: str) -> Topic:
    """The topic, after checking ``consumer`` is registered on it (YDB requires it too)."""
    found = find_topic(conn, topic)
    row = conn.execute(
        "SELECT 1 FROM consumers WHERE topic_id = ? AND name = ?", (found.id, consumer)
    ).fetchone()
    if row is None:
        raise TopicNotFound(f"topic {topic!r} has no consumer {consumer!r}")
    return found


# --- admin ----------------------------------------------------------------------


def create_topic(
    conn: sqlite3.Connection,
    name: str,
    *,
    partitions: int,
    consumers: Sequence[ConsumerSpec],
    retention_s: float | None,
    exist_ok: bool,
    now: float,
) -> None:
    """Creates a topic with its partitions and consumers; TopicExists unless ``exist_ok``.

    With ``exist_ok`` an existing topic keeps its partitions and retention;
    only missing consumers are added.
    """
    with write_transaction(conn):
        row = conn.execute("SELECT id FROM topics WHERE name = ?", (name,)).fetchone()
        if row is not None:
            if not exist_ok:
                raise TopicExists(f"topic {name!r} already exists")
            topic_id = int(row[0])
        else:
            cursor = conn.execute(
                "INSERT INTO topics (name, partitions, retention_s, created_at)"
                " VALUES (?, ?, ?, ?)",
                (name, partitions, retention_s, now),
            )
            topic_id = int(cursor.lastrowid or 0)
            conn.executemany(
                "INSERT INTO partitions (topic_id, partition_id, start_offset, end_offset)"
                " VALUES (?, ?, 0, 0)",
                [(topic_id, p) for p in range(partitions)],
            )
        _insert_consumers(conn, topic_id, consumers, now)


def add_consumer(conn: sqlite3.Connection, topic: str, consumer: ConsumerSpec, now: float) -> None:
    """Registers a consumer; an existing one is left as it is."""
    with write_transaction(conn):
        _insert_consumers(conn, find_topic(conn, topic).id, [consumer], now)


def _insert_consumers(
    conn: sqlite3.Connection, topic_id: int, consumers: Sequence[ConsumerSpec], now: float
) -> None:
    conn.executemany(
        "INSERT OR IGNORE INTO consumers (topic_id, name, important, created_at)"
        " VALUES (?, ?, ?, ?)",
        [(topic_id, c.name, int(c.important), now) for c in consumers],
    )


def list_topics(conn: sqlite3.Connection) -> list[str]:
    """Topic names in alphabetical order."""
    return [row[0] for row in conn.execute("SELECT name FROM topics ORDER BY name")]


def describe_topic(conn: sqlite3.Connection, name: str) -> TopicDescription:
    """Partitions with their offsets, and each consumer's committed offset.

    A consumer's committed offset is reported as the next offset it will
    read: never below the partition's start (retention may have deleted
    what it had not committed), and the start for one that never committed.
    """
    with read_transaction(conn):
        topic = find_topic(conn, name)
        consumers = [
            row[0]
            for row in conn.execute(
                "SELECT name FROM consumers WHERE topic_id = ? ORDER BY name", (topic.id,)
            )
        ]
        committed: dict[tuple[str, int], int] = {
            (row[0], row[1]): row[2]
            for row in conn.execute(
                "SELECT consumer, partition_id, committed FROM offsets WHERE topic_id = ?",
                (topic.id,),
            )
        }
        infos = [
            PartitionInfo(
                partition=p,
                start_offset=start,
                end_offset=end,
                last_written_at=last,
                committed={c: max(committed.get((c, p), start), start) for c in consumers},
            )
            for p, start, end, last in conn.execute(
                "SELECT partition_id, start_offset, end_offset, last_written_at FROM partitions"
                " WHERE topic_id = ? ORDER BY partition_id",
                (topic.id,),
            )
        ]
    return TopicDescription(
        name=name, partitions=infos, consumers=consumers, retention_s=topic.retention_s
    )


def describe_topics(conn: sqlite3.Connection, names: Sequence[str]) -> dict[str, TopicDescription]:
    """``describe_topic`` for each of ``names`` that exists, in one snapshot and four queries."""
    wanted = set(names)
    with read_transaction(conn):
        topics = {
            int(row[0]): (str(row[1]), row[2])
            for row in conn.execute("SELECT id, name, retention_s FROM topics")
            if row[1] in wanted
        }
        consumers: dict[int, list[str]] = {topic_id: [] for topic_id in topics}
        for topic_id, consumer in conn.execute(
            "SELECT topic_id, name FROM consumers ORDER BY topic_id, name"
        ):
            if topic_id in consumers:
                consumers[topic_id].append(consumer)
        committed: dict[tuple[int, str, int], int] = {
            (row[0], row[1], row[2]): row[3]
            for row in conn.execute(
                "SELECT topic_id, consumer, partition_id, committed FROM offsets"
            )
            if row[0] in topics
        }
        infos: dict[int, list[PartitionInfo]] = {topic_id: [] for topic_id in topics}
        for topic_id, p, start, end, last in conn.execute(
            "SELECT topic_id, partition_id, start_offset, end_offset, last_written_at"
            " FROM partitions ORDER BY topic_id, partition_id"
        ):
            if topic_id in infos:
                infos[topic_id].append(
                    PartitionInfo(
                        partition=p,
                        start_offset=start,
                        end_offset=end,
                        last_written_at=last,
                        committed={
                            c: max(committed.get((topic_id, c, p), start), start)
                            for c in consumers[topic_id]
                        },
                    )
                )
    return {
        name: TopicDescription(
            name=name,
            partitions=infos[topic_id],
            consumers=consumers[topic_id],
            retention_s=retention_s,
        )
        for topic_id, (name, retention_s) in topics.items()
    }


def drop_topic(conn: sqlite3.Connection, name: str) -> int:
    """Deletes a topic's metadata at once, returning its id; the messages go in batches later."""
    with write_transaction(conn):
        topic_id = find_topic(conn, name).id
        for table in (
            "partitions",
            "producers",
            "consumers",
            "offsets",
            "leases",
            "members",
            "bells",
        ):
            conn.execute(f"DELETE FROM {table} WHERE topic_id = ?", (topic_id,))
        conn.execute("DELETE FROM topics WHERE id = ?", (topic_id,))
        conn.execute("INSERT OR IGNORE INTO dropped_topics (topic_id) VALUES (?)", (topic_id,))
    return topic_id


def purge_dropped(conn: sqlite3.Connection, batch: int) -> int:
    """Deletes up to ``batch`` messages of dropped topics; 0 when none are left."""
    with write_transaction(conn):
        row = conn.execute("SELECT topic_id FROM dropped_topics LIMIT 1").fetchone()
        if row is None:
            return 0
        topic_id = row[0]
        last = conn.execute(
            "SELECT partition_id, msg_offset FROM messages WHERE topic_id = ?"
            " ORDER BY partition_id, msg_offset LIMIT 1 OFFSET ?",
            (topic_id, batch - 1),
        ).fetchone()
        if last is None:
            deleted = conn.execute("DELETE FROM messages WHERE topic_id = ?", (topic_id,)).rowcount
            conn.execute("DELETE FROM dropped_topics WHERE topic_id = ?", (topic_id,))
            # Report progress even for an empty topic so the caller asks again.
            return max(deleted, 1)
        return int(
            conn.execute(
                "DELETE FROM messages WHERE topic_id = ? AND (partition_id, msg_offset) <= (?, ?)",
                (topic_id, last[0], last[1]),
            ).rowcount
        )


# --- append ---------------------------------------------------------------------


@dataclass(slots=True)
class AppendTarget:
    """What an append needs to know about its writer; touched only on the write thread."""

    topic: Topic
    producer_id: str
    next_round_robin: int = 0


@dataclass(frozen=True, slots=True)
class Appended:
    """The outcome of one append: per-message results and the rows inserted."""

    results: list[WriteResult]
    rows: list[tuple[Any, ...]]  # as inserted: (topic_id, partition_id, msg_offset, ...)


def append(
    conn: sqlite3.Connection,
    target: AppendTarget,
    messages: Sequence[OutgoingMessage],
    clock: Callable[[], float],
) -> Appended:
    """Appends a batch in one transaction, skipping duplicates by producer seqno.

    De-duplication follows YDB: per topic and producer, a message whose
    seqno is not above the last written one is a duplicate (also within the
    batch); a message without seqno is always written.

    ``written_at`` is read from ``clock`` once the write lock is held, as a
    broker's log-append time is: appends to a partition are stamped in the
    order they are written, whichever writer waited longer for the lock.
    """
    topic = target.topic
    partitions = [_choose_partition(target, m) for m in messages]
    with write_transaction(conn):
        now = clock()
        ends: dict[int, int] = dict(
            conn.execute(
                "SELECT partition_id, end_offset FROM partitions WHERE topic_id = ?", (topic.id,)
            ).fetchall()
        )
        if not ends:  # a dropped topic's partitions go with it
            raise TopicNotFound(f"topic {topic.name!r} does not exist")
        last_seqno: int | None = None
        if any(m.seqno is not None for m in messages):
            row = conn.execute(
                "SELECT last_seqno FROM producers WHERE topic_id = ? AND producer_id = ?",
                (topic.id, target.producer_id),
            ).fetchone()
            last_seqno = None if row is None else row[0]
        seqno_before = last_seqno
        rows: list[tuple[Any, ...]] = []
        results: list[WriteResult] = []
        for message, partition in zip(messages, partitions, strict=True):
            seqno = message.seqno
            if seqno is not None:
                if last_seqno is not None and seqno <= last_seqno:
                    results.append(WriteResult(WriteStatus.DUPLICATE, partition, None))
                    continue
                last_seqno = seqno
            offset = ends[partition]
            ends[partition] = offset + 1
            rows.append(
                (
                    topic.id,
                    partition,
                    offset,
                    now,
                    now if message.created_at is None else message.created_at,
                    seqno,
                    target.producer_id,
                    message.key,
                    orjson.dumps(dict(message.metadata)).decode() if message.metadata else None,
                    message.value,
                )
            )
            results.append(WriteResult(WriteStatus.WRITTEN, partition, offset))
        if rows:
            conn.executemany(
                "INSERT INTO messages (topic_id, partition_id, msg_offset, written_at, created_at,"
                " seqno, producer_id, key, metadata, value) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            touched = {row[1] for row in rows}
            conn.executemany(
                "UPDATE partitions SET end_offset = ?, last_written_at = ?"
                " WHERE topic_id = ? AND partition_id = ?",
                [(ends[p], now, topic.id, p) for p in touched],
            )
        if last_seqno is not None and last_seqno != seqno_before:
            conn.execute(
                "INSERT INTO producers (topic_id, producer_id, last_seqno, updated_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (topic_id, producer_id)"
                " DO UPDATE SET last_seqno = excluded.last_seqno, updated_at = excluded.updated_at",
                (topic.id, target.producer_id, last_seqno, now),
            )
    return Appended(results, rows)


def _choose_partition(target: AppendTarget, message: OutgoingMessage) -> int:
    count = target.topic.partitions
    if message.partition is not None:
        if not 0 <= message.partition < count:
            raise ValueError(
                f"partition {message.partition} is out of range: "
                f"topic {target.topic.name!r} has {count}"
            )
        return message.partition
    if message.key is not None:
        return partition_for_key(message.key, count)
    partition = target.next_round_robin % count
    target.next_round_robin = partition + 1
    return partition


# --- read -----------------------------------------------------------------------


@dataclass(slots=True)
class ReadRequest:
    """One partition to read from ``position`` on, for ``session``."""

    session: PartitionSession
    position: int
    messages: list[Message] = field(default_factory=list)
    # The read reached the partition's end (returned less than it asked for).
    exhausted: bool = False


_ENDS_SQL = "SELECT partition_id, end_offset FROM partitions WHERE topic_id = ?"
_READ_SQL = (
    "SELECT msg_offset, value, key, metadata, producer_id, seqno, created_at, written_at"
    " FROM messages WHERE topic_id = ? AND partition_id = ? AND msg_offset >= ?"
    " ORDER BY msg_offset LIMIT ?"
)


# What one read takes from the file at most, in value bytes (a first message is
# taken whatever its size). Every reader of the process shares one read
# connection: a read of a topic of megabyte messages must not hold the others'
# reads up for the time of copying a whole batch of them.
READ_MAX_BYTES = 4 * 1024 * 1024


def read(
    conn: sqlite3.Connection,
    topic: Topic,
    requests: Sequence[ReadRequest],
    max_messages: int,
    max_bytes: int = READ_MAX_BYTES,
) -> None:
    """Fills each request's ``messages`` from the file, up to ``max_messages`` in all, fairly.

    The end offsets are read first, in one statement, and only partitions
    with something past their position are read: a reader woken for one
    partition, or polling an idle topic, spends one statement, not one per
    partition (each costs about as much as the end offsets of all of them).
    A row appended after that first look is found by the next read, which
    the append's ring or the reader's poll causes. Rows are taken one at a
    time and the read ends once ``max_bytes`` of values are in (see ``fill``).
    """
    ends: dict[int, int] = dict(conn.execute(_ENDS_SQL, (topic.id,)).fetchall())

    def fetch(partition: int, position: int, limit: int, max_bytes: int) -> Sequence[ReadRow]:
        if ends.get(partition, 0) <= position:
            return []
        rows: list[ReadRow] = []
        size = 0
        for row in conn.execute(_READ_SQL, (topic.id, partition, position, limit)):
            rows.append(row)
            size += len(row[1])
            if size >= max_bytes:
                break
        return rows

    fill(topic.name, requests, max_messages, fetch, max_bytes)


def fill(
    topic: str,
    requests: Sequence[ReadRequest],
    max_messages: int,
    fetch: Callable[[int, int, int, int], Sequence[ReadRow]],
    max_bytes: int | None = None,
) -> None:
    """Fills each request's ``messages`` with ``fetch(partition, position, limit, bytes)``, fairly.

    Each pass gives every partition that still has messages an equal share
    of what is left of the budget, so one busy partition cannot starve the
    others and a lone busy partition still fills the whole batch. With
    ``max_bytes``, the fill also ends once that many value bytes are in: a
    fetch returns rows until the bytes left are reached, the one that
    reaches them included, so a message larger than the whole budget is
    still read (alone). A partition cut short by bytes is not exhausted:
    the next read goes on from there at once.
    """
    budget = max_messages
    bytes_left = (1 << 62) if max_bytes is None else max_bytes
    pending = [(r, r.position) for r in requests]
    build = build_message
    while pending and budget > 0:
        share = -(-budget // len(pending))
        still_full = []
        for request, position in pending:
            limit = min(share, budget)
            if limit <= 0:
                break
            rows = fetch(request.session.partition, position, limit, bytes_left)
            if rows and max_bytes is not None:
                bytes_left -= sum(len(row[1]) for row in rows)
            if len(rows) < limit and bytes_left > 0:
                request.exhausted = True
            if not rows:
                continue
            session = request.session
            partition = session.partition
            request.messages.extend(
                [
                    build(
                        topic,
                        partition,
                        offset,
                        value,
                        key,
                        _NO_METADATA if meta is None else orjson.loads(meta),
                        producer,
                        seqno,
                        created,
                        written,
                        session,
                    )
                    for offset, value, key, meta, producer, seqno, created, written in rows
                ]
            )
            budget -= len(rows)
            if bytes_left <= 0:
                return
            if len(rows) == limit:
                still_full.append((request, rows[-1][0] + 1))
        pending = still_full


# --- retention --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExpiryCandidate:
    """A partition whose oldest message is older than its topic's retention."""

    topic_id: int
    partition: int
    cutoff: float  # messages written before this Unix time are expired


# (topic id, partition) -> (start offset, retention, written_at of the message there).
OldestKnown = dict[tuple[int, int], tuple[int, float, float | None]]


def expiry_candidates(
    conn: sqlite3.Connection, now: float, known: OldestKnown | None = None
) -> list[ExpiryCandidate]:
    """Partitions whose oldest retained message has expired (a cheap read-only check).

    ``known`` remembers each partition's oldest message between calls: it is
    looked up again only once the partition's start offset moved (retention
    or a purge deleted it), so a round over partitions that keep their
    messages is one query, not one per partition. Give the same dict to
    every call, from one thread.
    """
    candidates = []
    seen: set[tuple[int, int]] = set()
    with read_transaction(conn):
        partitions = conn.execute(
            "SELECT t.id, t.retention_s, p.partition_id, p.start_offset"
            " FROM topics t JOIN partitions p ON p.topic_id = t.id"
            " WHERE t.retention_s IS NOT NULL AND p.start_offset < p.end_offset"
        ).fetchall()
        for topic_id, retention_s, partition, start in partitions:
            cutoff = now - retention_s
            key = (topic_id, partition)
            seen.add(key)
            cached = None if known is None else known.get(key)
            if cached is not None and cached[0] == start and cached[1] == retention_s:
                written_at = cached[2]
            else:
                oldest = conn.execute(
                    "SELECT written_at FROM messages WHERE topic_id = ? AND partition_id = ?"
                    " AND msg_offset >= ? ORDER BY msg_offset LIMIT 1",
                    (topic_id, partition, start),
                ).fetchone()
                written_at = None if oldest is None else float(oldest[0])
                if known is not None:
                    known[key] = (start, retention_s, written_at)
            if written_at is not None and written_at < cutoff:
                candidates.append(ExpiryCandidate(topic_id, partition, cutoff))
    if known is not None:
        for key in [key for key in known if key not in seen]:
            del known[key]
    return candidates


def expire(conn: sqlite3.Connection, candidate: ExpiryCandidate, batch: int) -> int:
    """Deletes up to ``batch`` expired messages from the head of one partition.

    Only a prefix is deleted, so the partition stays dense: it stops at the
    first message still within retention (even if a later one is older,
    after a wall-clock step back) and at the committed offset of any
    *important* consumer, whose unread messages retention must keep (as YDB).
    """
    topic_id, partition = candidate.topic_id, candidate.partition
    with write_transaction(conn):
        row = conn.execute(
            "SELECT start_offset FROM partitions WHERE topic_id = ? AND partition_id = ?",
            (topic_id, partition),
        ).fetchone()
        if row is None:  # dropped meanwhile
            return 0
        start = row[0]
        floor = conn.execute(
            "SELECT MIN(COALESCE(o.committed, ?)) FROM consumers c LEFT JOIN offsets o"
            " ON o.topic_id = c.topic_id AND o.consumer = c.name AND o.partition_id = ?"
            " WHERE c.topic_id = ? AND c.important",
            (start, partition, topic_id),
        ).fetchone()[0]
        new_start = start
        for offset, written_at in conn.execute(
            "SELECT msg_offset, written_at FROM messages WHERE topic_id = ? AND partition_id = ?"
            " AND msg_offset >= ? ORDER BY msg_offset LIMIT ?",
            (topic_id, partition, start, batch),
        ).fetchall():
            if written_at >= candidate.cutoff or (floor is not None and offset >= floor):
                break
            new_start = offset + 1
        if new_start == start:
            return 0
        conn.execute(
            "DELETE FROM messages WHERE topic_id = ? AND partition_id = ?"
            " AND msg_offset >= ? AND msg_offset < ?",
            (topic_id, partition, start, new_start),
        )
        conn.execute(
            "UPDATE partitions SET start_offset = ? WHERE topic_id = ? AND partition_id = ?",
            (new_start, topic_id, partition),
        )
    return int(new_start - start)


# --- offsets for operators ----------------------------------------------------------


def first_offset_at(conn: sqlite3.Connection, topic_id: int, partition: int, at: float) -> int:
    """The offset of the first retained message written at or after ``at``; the end if none.

    A binary search over the partition's offsets, a point lookup per step:
    appends stamp ``written_at`` in offset order, so the times only grow
    (after a wall-clock step back the boundary found is one of the steps).
    """
    row = conn.execute(
        "SELECT start_offset, end_offset FROM partitions WHERE topic_id = ? AND partition_id = ?",
        (topic_id, partition),
    ).fetchone()
    if row is None:
        raise TopicNotFound(f"topic id {topic_id} has no partition {partition}")
    low, high = int(row[0]), int(row[1])
    while low < high:
        middle = (low + high) // 2
        found = conn.execute(
            "SELECT written_at FROM messages WHERE topic_id = ? AND partition_id = ?"
            " AND msg_offset = ?",
            (topic_id, partition, middle),
        ).fetchone()
        # Inside one transaction [start, end) is dense; a missing row would be below start.
        if found is not None and found[0] >= at:
            high = middle
        else:
            low = middle + 1
    return low


def offsets_for_time(conn: sqlite3.Connection, name: str, at: float) -> dict[int, int]:
    """Per partition, ``first_offset_at``."""
    with read_transaction(conn):
        topic = find_topic(conn, name)
        return {p: first_offset_at(conn, topic.id, p, at) for p in range(topic.partitions)}


@dataclass(frozen=True, slots=True)
class Moved:
    """What ``seek`` did to one partition's committed offset."""

    partition: int
    before: int
    after: int


def seek(
    conn: sqlite3.Connection, topic: str, consumer: str, partition: int, offset: int, now: float
) -> Moved:
    """Sets a committed offset (clamped to the retained range) and revokes the partition's lease.

    The lease row loses its owner in the same transaction: the reader that
    held the partition finds its lease lost at its next heartbeat, its
    session ends (its commits are fenced by the generation), and whoever
    takes the partition next starts at the new offset.
    """
    with write_transaction(conn):
        found = find_consumer(conn, topic, consumer)
        row = conn.execute(
            "SELECT p.start_offset, p.end_offset, o.committed FROM partitions p LEFT JOIN offsets o"
            " ON o.topic_id = p.topic_id AND o.partition_id = p.partition_id AND o.consumer = ?"
            " WHERE p.topic_id = ? AND p.partition_id = ?",
            (consumer, found.id, partition),
        ).fetchone()
        if row is None:
            raise ValueError(
                f"partition {partition} is out of range: topic {topic!r} has {found.partitions}"
            )
        start, end, committed = int(row[0]), int(row[1]), row[2]
        before = max(start, 0 if committed is None else int(committed))
        after = min(max(offset, start), end)
        conn.execute(
            "INSERT INTO offsets (topic_id, consumer, partition_id, committed, committed_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (topic_id, consumer, partition_id)"
            " DO UPDATE SET committed = excluded.committed, committed_at = excluded.committed_at",
            (found.id, consumer, partition, after, now),
        )
        conn.execute(
            "UPDATE leases SET owner = NULL, expires_at = 0"
            " WHERE topic_id = ? AND consumer = ? AND partition_id = ?",
            (found.id, consumer, partition),
        )
    return Moved(partition, before, after)


def lease_settled(
    conn: sqlite3.Connection, topic: str, consumer: str, partition: int, now: float
) -> bool:
    """After a seek: a reader holds the partition again, or no reader of the consumer is alive."""
    with read_transaction(conn):
        found = find_topic(conn, topic)
        owner = conn.execute(
            "SELECT owner FROM leases WHERE topic_id = ? AND consumer = ? AND partition_id = ?",
            (found.id, consumer, partition),
        ).fetchone()
        if owner is not None and owner[0] is not None:
            return True
        alive = conn.execute(
            "SELECT 1 FROM members WHERE topic_id = ? AND consumer = ? AND expires_at >= ?",
            (found.id, consumer, now),
        ).fetchone()
        return alive is None


def live_members(conn: sqlite3.Connection, topic: str, consumer: str, now: float) -> list[str]:
    """The members of a consumer whose heartbeat has not expired."""
    with read_transaction(conn):
        found = find_topic(conn, topic)
        return [
            row[0]
            for row in conn.execute(
                "SELECT member_id FROM members WHERE topic_id = ? AND consumer = ?"
                " AND expires_at >= ? ORDER BY member_id",
                (found.id, consumer, now),
            )
        ]


def write_times(
    conn: sqlite3.Connection, topic: str, offsets: Mapping[int, int]
) -> dict[int, float]:
    """The ``written_at`` of the message at each partition's offset, where it exists."""
    with read_transaction(conn):
        found = find_topic(conn, topic)
        times: dict[int, float] = {}
        for partition, offset in offsets.items():
            row = conn.execute(
                "SELECT written_at FROM messages WHERE topic_id = ? AND partition_id = ?"
                " AND msg_offset = ?",
                (found.id, partition, offset),
            ).fetchone()
            if row is not None:
                times[partition] = float(row[0])
        return times
