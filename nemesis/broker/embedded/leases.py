"""Partition leases: how readers of one consumer share a topic, across processes.

The protocol, run by every reader in its heartbeat (one write transaction):

1. Renew its member row (``expires_at = now + lease_s``) and forget members
   whose row expired: they died without saying goodbye. Its bell row, if it
   has a bell (see ``bells``), is renewed and expired the same way.
2. Compute the fair share from the live members alone, the same way in every
   process: members sorted by id, partition ``p`` goes to ``members[p % n]``.
3. Release held partitions outside its share; renew those inside it. A
   partition whose lease row no longer names it with the same generation
   (or whose lease expired) is *lost*: its session ends.
4. Take every partition of its share that is free or whose lease expired,
   bumping the generation. A partition still leased to a live member is left
   for that member to release at its own next heartbeat.

The generation is the fencing token: a commit updates the offset only if the
lease row still names the committing reader with the session's generation,
in the same transaction, so a reader that lost its partition cannot move the
new owner's offset.

A dead predecessor on the same machine does not have to expire. A member id
(``local_member_id``) says where its process runs: host name, pid, and a
digest of the boot and the pid namespace. In step 1 a member whose id names
this host, this boot and this pid namespace, and a pid that is no longer
alive (``is_dead_neighbour``), is forgotten at once and its leases are freed:
a ``nemesis run`` restarted after ``kill -9`` takes its partitions back
without waiting ``lease_s``. Anything it cannot be sure of (another host,
another container, a pid that is alive, even if reused) waits for expiry as
before; the generation fences a mistaken takeover in any case.
"""

from __future__ import annotations

import os
import secrets
import socket
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from nemesis import processes
from nemesis.broker.embedded import bells, log
from nemesis.broker.port import EARLIEST, StartFrom
from nemesis.errors import TopicNotFound
from nemesis.sqlite_thread import when_unlocked, write_transaction


def local_member_id() -> str:
    """``host:pid:random:node``: unique per broker, readable, and says where it runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}:{processes.node()}"


def is_dead_neighbour(member_id: str) -> bool:
    """True when ``member_id`` is a process of this host, boot and pid namespace that is gone.

    A reader's id is its broker's plus ``/<n>``. Ids that say nothing of where
    they run (other formats, other hosts) are never taken for dead
    (``nemesis.processes.is_dead_neighbour``).
    """
    parts = member_id.split("/", 1)[0].split(":")
    if len(parts) != 4:
        return False
    host, pid, _random, node = parts
    try:
        return processes.is_dead_neighbour(host, int(pid), node)
    except ValueError:
        return False


def fair_share(members: Sequence[str], partitions: int, member: str) -> frozenset[int]:
    """The partitions ``member`` should hold when ``members`` share a topic."""
    ordered = sorted(members)
    if member not in ordered:
        return frozenset()
    return frozenset(p for p in range(partitions) if ordered[p % len(ordered)] == member)


@dataclass(frozen=True, slots=True)
class Acquired:
    """A partition just leased: its new generation and where reading starts."""

    partition: int
    generation: int
    position: int  # the committed offset, or where ``start_from`` says


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    """What changed for one member in one heartbeat."""

    expires_at: float  # the renewed leases run until then
    acquired: tuple[Acquired, ...]
    kept: tuple[int, ...]
    released: tuple[int, ...]
    lost: tuple[int, ...]
    settled: bool  # holds its whole fair share (nothing waits on another member)
    members: int
    member_ids: tuple[str, ...] = ()  # the consumer's live members, sorted


def heartbeat(
    conn: sqlite3.Connection,
    *,
    topic_id: int,
    consumer: str,
    member_id: str,
    held: Mapping[int, int],
    now: float,
    lease_s: float,
    bell: bytes | None = None,
    leaving: bool = False,
    start_from: StartFrom = EARLIEST,
) -> HeartbeatResult:
    """Runs one round of the lease protocol for ``member_id`` (see the module docstring).

    ``held`` maps the partitions the member believes it holds to their
    generations. ``bell`` is the address writers ring for this member.
    ``leaving`` releases everything the member holds and removes the member
    (and its bell), so the others rebalance at their next heartbeat.
    ``start_from`` places a partition the consumer never committed.
    """
    expires_at = now + lease_s
    with write_transaction(conn):
        row = conn.execute("SELECT partitions FROM topics WHERE id = ?", (topic_id,)).fetchone()
        if row is None:
            raise TopicNotFound(f"topic id {topic_id} was dropped")
        partitions = int(row[0])
        if leaving:
            conn.execute(
                "DELETE FROM members WHERE topic_id = ? AND consumer = ? AND member_id = ?",
                (topic_id, consumer, member_id),
            )
            conn.execute(
                "UPDATE leases SET owner = NULL, expires_at = 0"
                " WHERE topic_id = ? AND consumer = ? AND owner = ?",
                (topic_id, consumer, member_id),
            )
            bells.remove(conn, topic_id=topic_id, member_id=member_id)
            return HeartbeatResult(now, (), (), tuple(held), (), True, 0)
        conn.execute(
            "INSERT INTO members (topic_id, consumer, member_id, expires_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (topic_id, consumer, member_id)"
            " DO UPDATE SET expires_at = excluded.expires_at",
            (topic_id, consumer, member_id, expires_at),
        )
        conn.execute(
            "DELETE FROM members WHERE topic_id = ? AND consumer = ? AND expires_at < ?",
            (topic_id, consumer, now),
        )
        _forget_dead_neighbours(conn, topic_id, consumer, member_id)
        if bell is not None:
            bells.renew(
                conn,
                topic_id=topic_id,
                member_id=member_id,
                address=bell,
                expires_at=expires_at,
                now=now,
            )
        members = [
            r[0]
            for r in conn.execute(
                "SELECT member_id FROM members WHERE topic_id = ? AND consumer = ?",
                (topic_id, consumer),
            )
        ]
        share = fair_share(members, partitions, member_id)
        leases: dict[int, tuple[str | None, int, float]] = {
            r[0]: (r[1], r[2], r[3])
            for r in conn.execute(
                "SELECT partition_id, owner, generation, expires_at FROM leases"
                " WHERE topic_id = ? AND consumer = ?",
                (topic_id, consumer),
            )
        }
        kept: list[int] = []
        released: list[int] = []
        lost: list[int] = []
        for partition, generation in held.items():
            owner, current, lease_expires = leases.get(partition, (None, 0, 0.0))
            if owner != member_id or current != generation or lease_expires < now:
                lost.append(partition)
            elif partition in share:
                kept.append(partition)
            else:
                released.append(partition)
        conn.executemany(
            "UPDATE leases SET expires_at = ?"
            " WHERE topic_id = ? AND consumer = ? AND partition_id = ?",
            [(expires_at, topic_id, consumer, p) for p in kept],
        )
        conn.executemany(
            "UPDATE leases SET owner = NULL, expires_at = 0"
            " WHERE topic_id = ? AND consumer = ? AND partition_id = ?",
            [(topic_id, consumer, p) for p in released],
        )
        acquired: list[Acquired] = []
        waiting = False
        for partition in sorted(share.difference(kept)):
            owner, generation, lease_expires = leases.get(partition, (None, 0, 0.0))
            # Our own name on a lease we do not know of: a heartbeat whose
            # answer we never got (timeout), or a restart under the same
            # member id. Either way it is ours to take over with a new generation.
            if owner is not None and owner != member_id and lease_expires >= now:
                waiting = True
                continue
            acquired.append(
                Acquired(
                    partition,
                    generation + 1,
                    _start_position(conn, topic_id, consumer, partition, start_from, now),
                )
            )
        conn.executemany(
            "INSERT INTO leases (topic_id, consumer, partition_id, owner, generation, expires_at)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (topic_id, consumer, partition_id) DO UPDATE"
            " SET owner = excluded.owner, generation = excluded.generation,"
            " expires_at = excluded.expires_at",
            [
                (topic_id, consumer, a.partition, member_id, a.generation, expires_at)
                for a in acquired
            ],
        )
    return HeartbeatResult(
        expires_at=expires_at,
        acquired=tuple(acquired),
        kept=tuple(kept),
        released=tuple(released),
        lost=tuple(lost),
        settled=not waiting,
        members=len(members),
        member_ids=tuple(sorted(members)),
    )


def _forget_dead_neighbours(
    conn: sqlite3.Connection, topic_id: int, consumer: str, member_id: str
) -> None:
    """Removes the other members of this host whose process is gone, and frees their leases."""
    dead = [
        r[0]
        for r in conn.execute(
            "SELECT member_id FROM members WHERE topic_id = ? AND consumer = ?",
            (topic_id, consumer),
        )
        if r[0] != member_id and is_dead_neighbour(r[0])
    ]
    for member in dead:
        conn.execute(
            "DELETE FROM members WHERE topic_id = ? AND consumer = ? AND member_id = ?",
            (topic_id, consumer, member),
        )
        conn.execute(
            "UPDATE leases SET owner = NULL, expires_at = 0"
            " WHERE topic_id = ? AND consumer = ? AND owner = ?",
            (topic_id, consumer, member),
        )
        bells.remove(conn, topic_id=topic_id, member_id=member)


class Holding(NamedTuple):
    """What one reader of this process holds, as its last heartbeat left it."""

    topic_id: int
    consumer: str
    member_id: str
    held: Mapping[int, int]  # partition -> generation
    members: tuple[str, ...]  # the consumer's members then, sorted


def renew_all(
    conn: sqlite3.Connection,
    *,
    owner_prefix: str,
    holdings: Sequence[Holding],
    now: float,
    lease_s: float,
    gone: Callable[[str], bool] | None = None,
) -> tuple[float, list[bool]]:
    """Renews every member, lease and bell of one process in one transaction.

    The members, leases and bells whose member id starts with ``owner_prefix``
    (one process's readers) get ``now + lease_s``, in three statements. Then
    each holding is checked against the tables: when its consumer's members
    are no longer the ones it saw (one joined, left or expired), a lease it
    holds names someone else or another generation, or its topic is gone, it
    needs the full protocol (``heartbeat``) to rebalance: that one is True in
    the returned list. The others keep exactly what they hold, renewed. Returns
    the new expiry and that list.

    ``gone`` tells of a member that can be forgotten before it expires (its
    process is known to be dead): its consumer's readers run the full
    protocol too. It is asked once per process (member id up to the ``/``).
    """
    expires_at = now + lease_s
    # Member ids are "<process>/<n>": the prefix "<process>/" is the range up to "<process>0".
    low, high = owner_prefix, owner_prefix[:-1] + chr(ord(owner_prefix[-1]) + 1)
    with write_transaction(conn):
        conn.execute(
            "UPDATE members SET expires_at = ? WHERE member_id >= ? AND member_id < ?",
            (expires_at, low, high),
        )
        conn.execute(
            "UPDATE leases SET expires_at = ? WHERE owner >= ? AND owner < ?",
            (expires_at, low, high),
        )
        conn.execute(
            "UPDATE bells SET expires_at = ? WHERE member_id >= ? AND member_id < ?",
            (expires_at, low, high),
        )
        topics = {int(row[0]) for row in conn.execute("SELECT id FROM topics")}
        members: dict[tuple[int, str], list[str]] = {}
        expired: set[tuple[int, str]] = set()
        processes: dict[str, bool] = {}  # member id up to "/" -> gone
        for topic_id, consumer, member_id, member_expires in conn.execute(
            "SELECT topic_id, consumer, member_id, expires_at FROM members"
        ):
            members.setdefault((topic_id, consumer), []).append(member_id)
            if member_expires < now:
                expired.add((topic_id, consumer))
            elif gone is not None and not member_id.startswith(owner_prefix):
                process = member_id.split("/", 1)[0]
                dead = processes.get(process)
                if dead is None:
                    dead = processes[process] = gone(member_id)
                if dead:
                    expired.add((topic_id, consumer))
        leased: dict[tuple[int, str, str], dict[int, int]] = {}
        for topic_id, consumer, partition, owner, generation in conn.execute(
            "SELECT topic_id, consumer, partition_id, owner, generation FROM leases"
            " WHERE owner >= ? AND owner < ?",
            (low, high),
        ):
            leased.setdefault((topic_id, consumer, owner), {})[partition] = generation
    stale = []
    for holding in holdings:
        group = (holding.topic_id, holding.consumer)
        stale.append(
            holding.topic_id not in topics
            or group in expired
            or tuple(sorted(members.get(group, ()))) != holding.members
            or leased.get((*group, holding.member_id), {}) != dict(holding.held)
        )
    return expires_at, stale


def _start_position(
    conn: sqlite3.Connection,
    topic_id: int,
    consumer: str,
    partition: int,
    start_from: StartFrom,
    now: float,
) -> int:
    """The committed offset; for a partition never committed, where ``start_from`` says.

    A position other than the oldest message is committed at once, in the
    heartbeat's transaction: the next owner of the partition (a restart
    before the first commit, a rebalance) starts there too, not at a later
    ``latest``.
    """
    row = conn.execute(
        "SELECT p.start_offset, p.end_offset, o.committed FROM partitions p"
        " LEFT JOIN offsets o ON o.topic_id = p.topic_id AND o.partition_id = p.partition_id"
        " AND o.consumer = ? WHERE p.topic_id = ? AND p.partition_id = ?",
        (consumer, topic_id, partition),
    ).fetchone()
    if row is None:
        return 0
    start, end, committed = int(row[0]), int(row[1]), row[2]
    if committed is not None or start_from.kind == "earliest":
        return max(start, 0 if committed is None else int(committed))
    if start_from.at is None:
        position = end
    else:
        position = log.first_offset_at(conn, topic_id, partition, start_from.at)
    conn.execute(
        "INSERT INTO offsets (topic_id, consumer, partition_id, committed, committed_at)"
        " VALUES (?, ?, ?, ?, ?)",
        (topic_id, consumer, partition, position, now),
    )
    return position


def commit_offset(
    conn: sqlite3.Connection,
    *,
    topic_id: int,
    consumer: str,
    partition: int,
    owner: str,
    generation: int,
    offset: int,
    now: float,
) -> bool:
    """Moves the committed offset forward, fenced by the lease; False if the lease is gone.

    Fencing on owner and generation (not on expiry) is enough: a lease row
    that still names this session was not taken over, and a reader that
    takes it over later reads the committed offset in its own transaction,
    after this one.
    """
    # One statement, committed on its own: the write lock is held only while SQLite
    # runs it. As a transaction of several statements it was also held while this
    # thread waited for the GIL between them, and an append in another process
    # that found it taken slept a whole millisecond in SQLite's busy handler.
    # The update always writes a fenced row, so a row count of 1 means the lease held.
    cursor = when_unlocked(
        conn,
        "INSERT INTO offsets (topic_id, consumer, partition_id, committed, committed_at)"
        " SELECT ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM leases WHERE topic_id = ?"
        " AND consumer = ? AND partition_id = ? AND owner = ? AND generation = ?)"
        " ON CONFLICT (topic_id, consumer, partition_id) DO UPDATE"
        " SET committed = max(offsets.committed, excluded.committed),"
        " committed_at = CASE WHEN excluded.committed > offsets.committed"
        " THEN excluded.committed_at ELSE offsets.committed_at END",
        (
            topic_id,
            consumer,
            partition,
            offset,
            now,
            topic_id,
            consumer,
            partition,
            owner,
            generation,
        ),
    )
    return cursor.rowcount == 1
