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

import functools
import hashlib
import os
import secrets
import socket
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nemesis.broker.embedded import bells
from nemesis.errors import TopicNotFound
from nemesis.sqlite_thread import when_unlocked, write_transaction


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


@functools.cache
def _node() -> str:
    """This boot of this machine and this pid namespace, as 8 hex digits.

    Two processes with one node digest see each other's pids; a container has
    its own pid namespace (so its own digest) even where it has the host's name.
    """
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    if not boot or not namespace:
        # Nothing to tell this boot and pid namespace from another: a random digest,
        # so no other process can take this one for its neighbour (leases then expire).
        return secrets.token_hex(4)
    return hashlib.sha256(f"{boot}/{namespace}".encode()).hexdigest()[:8]


def local_member_id() -> str:
    """``host:pid:random:node``: unique per broker, readable, and says where it runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}:{_node()}"


def is_dead_neighbour(member_id: str) -> bool:
    """True when ``member_id`` is a process of this host, boot and pid namespace that is gone.

    A reader's id is its broker's plus ``/<n>``. Ids that say nothing of where
    they run (other formats, other hosts) are never taken for dead.
    """
    parts = member_id.split("/", 1)[0].split(":")
    if len(parts) != 4 or parts[0] != socket.gethostname() or parts[3] != _node():
        return False
    try:
        pid = int(parts[1])
    except ValueError:
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    # Killed but not yet reaped by its parent: a zombie holds its pid and nothing else.
    stat = _read(f"/proc/{pid}/stat")
    state = stat.rpartition(")")[2].split()[:1]
    return state != ["Z"]


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
    position: int  # the committed offset, or the oldest retained one


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
) -> HeartbeatResult:
    """Runs one round of the lease protocol for ``member_id`` (see the module docstring).

    ``held`` maps the partitions the member believes it holds to their
    generations. ``bell`` is the address writers ring for this member.
    ``leaving`` releases everything the member holds and removes the member
    (and its bell), so the others rebalance at their next heartbeat.
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
                    partition, generation + 1, _start_position(conn, topic_id, consumer, partition)
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


def _start_position(conn: sqlite3.Connection, topic_id: int, consumer: str, partition: int) -> int:
    row = conn.execute(
        "SELECT MAX(p.start_offset, COALESCE(o.committed, 0)) FROM partitions p"
        " LEFT JOIN offsets o ON o.topic_id = p.topic_id AND o.partition_id = p.partition_id"
        " AND o.consumer = ? WHERE p.topic_id = ? AND p.partition_id = ?",
        (consumer, topic_id, partition),
    ).fetchone()
    return 0 if row is None else int(row[0])


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
