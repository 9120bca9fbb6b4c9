"""Bells: how a reader in another process learns of an append within a fraction of a millisecond.

A reader in the writer's own process is woken directly (see ``tail``); one
in another process is rung. Each broker that reads binds a UNIX datagram
socket, its *bell*, and each of its readers registers the bell's address
for its topic in the ``bells`` table, renewed and expired together with the
reader's member row (``leases``). A
writer, once its append transaction has committed, sends one small datagram
to every bell of the topic: the topic id and the partitions it appended to.
The bell's broker wakes its readers holding one of those partitions, and
they read the file at once.

A ring is sent after the commit, so a woken reader always finds the rows.
An append of up to ``MAX_ROWS_BYTES`` also carries its rows, exactly as the
file holds them: the receiving broker puts them in its tail cache
(``tail``) and its readers take them from there, without the round trip to
the read thread (most of the cross-process write-to-receive latency). Rows
are taken only from a sender of this user (``SO_PASSCRED``: the same trust as
write access to the file) and only when they continue what the cache holds;
otherwise the ring is a plain hint and the reader reads the file. A ring may
be lost: a full queue, a writer whose list of bells predates the reader, a
socket the writer may not reach. Readers keep polling for that case, so a
lost ring costs one poll interval, never a message. Sending never blocks and
never fails the write.

Addresses are ``<db>.bells/<pid>-<random>.sock``, unique per incarnation of a
broker: a writer that finds nobody bound there (ECONNREFUSED) knows the
process died, removes the file and stops ringing it; a new bell sweeps such
leftovers from the folder too. Where the path would be longer than AF_UNIX
allows, a Linux abstract-namespace name derived from a hash of the database
path is used instead (and on other systems the readers just poll).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import socket
import sqlite3
import struct
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from nemesis.broker.embedded.tail import ReadRow, read_row
from nemesis.clock import Clock
from nemesis.sqlite_thread import when_unlocked

logger = logging.getLogger(__name__)

# Writers re-read the bells of a topic this often: a reader that joins is
# rung at most this long after it registered (polling covers the gap).
REFRESH_S = 0.25
# Longer than any lease: after that a dead bell's row is gone from the table.
DEAD_MEMORY_S = 300.0
# A ring names the partitions appended to, so that a reader holding none of
# them stays asleep; a batch over more partitions than this rings them all.
MAX_PARTITIONS_PER_RING = 64
# One drain takes at most this many datagrams before yielding to the loop;
# the kernel queue is bounded anyway (net.unix.max_dgram_qlen).
MAX_DRAIN = 1024
# sun_path holds 108 bytes, the terminating NUL included.
MAX_PATH_BYTES = 107
# An append carries its rows in its ring up to this many bytes of values;
# a bigger one rings without them (a datagram is one buffer on both ends).
MAX_ROWS_BYTES = 32 * 1024
_TOPIC = struct.Struct("<q")
_PARTITION = struct.Struct("<I")
# A ring with rows: this mark where a topic id would be, then the topic id,
# then the rows by partition (msgpack).
_ROWS_MARK = -1
_ROWS_HEAD = struct.Struct("<qq")
# Room for the rows, their keys and metadata, and the encoding.
_RECV_BYTES = 4 * MAX_ROWS_BYTES
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ROWS_ENCODER = msgspec.msgpack.Encoder()
# tail.ReadRow, spelled out for the decoder (which checks every field's type).
_ROW = tuple[int, bytes, str | None, str | None, str | None, int | None, float, float]
_ROWS_DECODER = msgspec.msgpack.Decoder(list[tuple[int, list[_ROW]]])

# Topic id -> the partitions rung, or None for every partition.
Rings = Mapping[int, "frozenset[int] | None"]
# Topic id -> partition -> the rows a ring carried, in offset order.
RingRows = Mapping[int, Mapping[int, "list[ReadRow]"]]


# --- the table --------------------------------------------------------------------------
# These run inside the caller's write transaction (the lease heartbeat), so a
# bell row lives and dies with its reader's member row.


def renew(
    conn: sqlite3.Connection,
    *,
    topic_id: int,
    member_id: str,
    address: bytes,
    expires_at: float,
    now: float,
) -> None:
    """Registers (or renews) a reader's bell for its topic and forgets expired ones."""
    conn.execute(
        "INSERT INTO bells (topic_id, member_id, address, expires_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (topic_id, member_id)"
        " DO UPDATE SET address = excluded.address, expires_at = excluded.expires_at",
        (topic_id, member_id, address, expires_at),
    )
    conn.execute("DELETE FROM bells WHERE topic_id = ? AND expires_at < ?", (topic_id, now))


def remove(conn: sqlite3.Connection, *, topic_id: int, member_id: str) -> None:
    """Forgets a reader's bell (it is leaving)."""
    conn.execute("DELETE FROM bells WHERE topic_id = ? AND member_id = ?", (topic_id, member_id))


def lookup(conn: sqlite3.Connection, topic_id: int, now: float) -> list[bytes]:
    """The live bell addresses of a topic, each once."""
    # Read on the write connection, which polls for locks (see db.poll_for_locks).
    return [
        bytes(row[0])
        for row in when_unlocked(
            conn,
            "SELECT DISTINCT address FROM bells WHERE topic_id = ? AND expires_at >= ?",
            (topic_id, now),
        )
    ]


# --- the message ------------------------------------------------------------------------


def encode(topic_id: int, partitions: Collection[int]) -> bytes:
    """A ring: the topic id, then the partitions (none: all of them)."""
    if len(partitions) > MAX_PARTITIONS_PER_RING:
        return _TOPIC.pack(topic_id)
    return struct.pack(f"<q{len(partitions)}I", topic_id, *sorted(partitions))


def encode_rows(topic_id: int, inserted: Sequence[tuple[Any, ...]]) -> bytes | None:
    """A ring that carries the rows of an append (``log.append``'s layout), or None if too big."""
    size = 0
    by_partition: dict[int, list[ReadRow]] = {}
    for row in inserted:
        size += len(row[9])
        if size > MAX_ROWS_BYTES:
            return None
        rows = by_partition.get(row[1])
        if rows is None:
            rows = by_partition[row[1]] = []
        rows.append(read_row(row))
    payload = _ROWS_ENCODER.encode(list(by_partition.items()))
    return _ROWS_HEAD.pack(_ROWS_MARK, topic_id) + payload


def read_ring(data: bytes) -> tuple[int, frozenset[int] | None, dict[int, list[ReadRow]]] | None:
    """(topic id, partitions or None for all, rows carried by partition), or None if no ring."""
    if len(data) >= _ROWS_HEAD.size and _TOPIC.unpack_from(data)[0] == _ROWS_MARK:
        _, topic_id = _ROWS_HEAD.unpack_from(data)
        try:
            pages = _ROWS_DECODER.decode(data[_ROWS_HEAD.size :])
        except msgspec.DecodeError:
            return topic_id, None, {}  # damaged or cut short: still a ring for the whole topic
        rows = {partition: page for partition, page in pages if page}
        return topic_id, frozenset(rows), rows
    plain = decode(data)
    return None if plain is None else (*plain, {})


def decode(data: bytes) -> tuple[int, frozenset[int] | None] | None:
    """(topic id, partitions or None for all), or None for a datagram that is not a ring."""
    size = len(data) - _TOPIC.size
    if size < 0 or size % _PARTITION.size:
        return None
    (topic_id,) = _TOPIC.unpack_from(data)
    if not size:
        return topic_id, None
    return topic_id, frozenset(struct.unpack_from(f"<{size // 4}I", data, _TOPIC.size))


# --- addresses --------------------------------------------------------------------------


def bells_dir(db_path: Path) -> Path:
    """Where the bells of a database's readers live: a folder beside the file."""
    return db_path.with_name(db_path.name + ".bells")


def new_address(db_path: Path) -> bytes | None:
    """A fresh address for a bell of ``db_path``; None where no address fits."""
    db_path = Path(os.path.abspath(db_path))
    name = f"{os.getpid()}-{secrets.token_hex(4)}"
    path = os.fsencode(bells_dir(db_path) / f"{name}.sock")
    if len(path) <= MAX_PATH_BYTES:
        return path
    if sys.platform != "linux":
        return None
    digest = hashlib.blake2b(os.fsencode(db_path), digest_size=8).hexdigest()
    return f"\0nemesis-bell/{digest}/{name}".encode()


def _is_our_file(address: bytes) -> bool:
    # Only files shaped like a bell are ever removed: the address came from
    # the database, and connect() refuses on any file that is not a socket.
    if address.startswith(b"\0"):
        return False
    path = Path(os.fsdecode(address))
    return path.suffix == ".sock" and path.parent.name.endswith(".bells")


def sweep(directory: Path) -> int:
    """Removes the socket files of bells nobody listens on any more; returns how many."""
    removed = 0
    try:
        entries = list(directory.glob("*.sock"))
    except OSError:
        return 0
    for entry in entries:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            # Connecting a datagram socket sends nothing: a live bell does not notice.
            probe.connect(os.fsencode(entry))
        except ConnectionRefusedError:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed += 1
        except OSError:
            pass  # not ours to judge (permissions, a name too long): leave it
        finally:
            probe.close()
    return removed


# --- the receiving end --------------------------------------------------------------------


class Bell:
    """A broker's bound datagram socket; rings wake its readers through ``on_ring``."""

    def __init__(
        self, sock: socket.socket, address: bytes, on_ring: Callable[[Rings, RingRows], None]
    ) -> None:
        self._socket = sock
        self.address = address
        self._on_ring = on_ring
        self._uid = os.getuid()
        # Who sent a datagram (its credentials) decides whether its rows are taken.
        self._credentials = _enable_credentials(sock)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._drain)
        self.rings_received = 0
        self.rows_received = 0
        self.wakes = 0

    @classmethod
    def open(cls, db_path: Path, on_ring: Callable[[Rings, RingRows], None]) -> Bell:
        """Binds a new bell for ``db_path`` on the running loop; OSError if none can be bound."""
        address = new_address(db_path)
        if address is None:
            raise OSError(f"no AF_UNIX address fits a bell for {db_path}")
        if not address.startswith(b"\0"):
            directory = bells_dir(Path(os.path.abspath(db_path)))
            directory.mkdir(exist_ok=True)
            sweep(directory)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.bind(address)
            return cls(sock, address, on_ring)
        except BaseException:
            sock.close()
            raise

    def _drain(self) -> None:
        # All pending rings are taken at once and merged, so a burst of appends
        # costs each reader one wake, not one per datagram.
        rings: dict[int, frozenset[int] | None] = {}
        carried: dict[int, dict[int, list[ReadRow]]] = {}
        for _ in range(MAX_DRAIN):
            try:
                data, trusted = self._receive()
            except BlockingIOError:
                break
            except OSError as exc:
                logger.warning("bell %r: receive failed: %s", self.address, exc)
                break
            ring = read_ring(data)
            if ring is None:
                continue
            self.rings_received += 1
            topic_id, partitions, rows = ring
            if rows and trusted:
                self.rows_received += 1
                pages = carried.setdefault(topic_id, {})
                for partition, page in rows.items():
                    pages.setdefault(partition, []).extend(page)
            if topic_id in rings:
                known = rings[topic_id]
                rings[topic_id] = (
                    None if known is None or partitions is None else known | partitions
                )
            else:
                rings[topic_id] = partitions
        if rings:
            self.wakes += 1
            self._on_ring(rings, carried)

    def _receive(self) -> tuple[bytes, bool]:
        """One datagram, and whether its sender runs as this user."""
        if not self._credentials:
            return self._socket.recv(_RECV_BYTES), False
        data, ancillary, flags, _ = self._socket.recvmsg(_RECV_BYTES, _ANCILLARY_BYTES)
        if flags & _MSG_TRUNC:
            return data, False
        for level, kind, value in ancillary:
            if level == _SOL_SOCKET and kind == _SCM_CREDENTIALS:
                _, uid, _ = _CREDENTIALS.unpack_from(value)
                return data, uid == self._uid
        return data, False

    def close(self) -> None:
        """Stops listening and removes the socket file."""
        if self._socket.fileno() < 0:
            return
        self._loop.remove_reader(self._socket.fileno())
        self._socket.close()
        if not self.address.startswith(b"\0"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address)


_SCM_CREDENTIALS: int | None = getattr(socket, "SCM_CREDENTIALS", None)
# Plain ints: the socket module's are enum members, and their `&` and `==` cost a
# call into the enum machinery for every ring received.
_MSG_TRUNC = int(socket.MSG_TRUNC)
_SOL_SOCKET = int(socket.SOL_SOCKET)
_ANCILLARY_BYTES = socket.CMSG_SPACE(_CREDENTIALS.size) if hasattr(socket, "CMSG_SPACE") else 0


def _enable_credentials(sock: socket.socket) -> bool:
    """Asks the kernel to attach each sender's credentials (Linux); False where it cannot."""
    option = getattr(socket, "SO_PASSCRED", None)
    if option is None or _SCM_CREDENTIALS is None:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, option, 1)
    except OSError:
        return False
    return True


# --- the sending end ----------------------------------------------------------------------


@dataclass(slots=True)
class _TopicBells:
    addresses: list[bytes]
    refresh_at: float  # monotonic


@dataclass(frozen=True, slots=True)
class RingerStatistics:
    """What a broker's writers rang."""

    sent: int
    dropped: int  # a full queue or an unreachable socket: the reader polls instead
    dead_removed: int  # bells of processes that died, removed when rung
    refreshes: int  # reads of the bells table


class Ringer:
    """Rings the bells of a topic after an append; used only on the write thread.

    The bells of each topic are cached and re-read every ``refresh_s``, or at
    the next ring after one turned out dead: a writer with no reader to ring
    pays a clock read per append.
    """

    def __init__(self, clock: Clock, *, refresh_s: float = REFRESH_S) -> None:
        self._clock = clock
        self._refresh_s = refresh_s
        # This broker's own bell: its readers are woken in process (``tail``).
        self.own_address: bytes | None = None
        self._topics: dict[int, _TopicBells] = {}
        self._dead: dict[bytes, float] = {}  # address -> monotonic time it was found dead
        self._socket: socket.socket | None = None
        self._sent = 0
        self._dropped = 0
        self._dead_removed = 0
        self._refreshes = 0

    def ring(
        self,
        conn: sqlite3.Connection,
        topic_id: int,
        partitions: Iterable[int],
        inserted: Sequence[tuple[Any, ...]] = (),
    ) -> None:
        """Rings every live bell of ``topic_id``: call it after the append committed.

        ``partitions`` (those appended to, repeats allowed) is only consumed
        when there is a bell to ring; so are ``inserted``, the committed rows
        in ``log.append``'s layout, which the ring carries when they are small.
        """
        now = self._clock.monotonic()
        bells = self._topics.get(topic_id)
        if bells is None or now >= bells.refresh_at:
            bells = self._refresh(conn, topic_id, now)
        if not bells.addresses:
            return
        sock = self._socket
        if sock is None:
            sock = self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
        payload = encode_rows(topic_id, inserted) if inserted else None
        if payload is None:
            payload = encode(topic_id, set(partitions))
        gone: list[bytes] = []
        for address in bells.addresses:
            try:
                sock.sendto(payload, address)
            except BlockingIOError:
                # The reader's queue is full of rings: it is awake already.
                self._dropped += 1
            except (ConnectionRefusedError, FileNotFoundError):
                self._bury(address, now)
                gone.append(address)
            except PermissionError as exc:
                # Another user's reader: it polls. Not retried until the next refresh.
                self._dropped += 1
                gone.append(address)
                logger.debug("cannot ring bell %r: %s", address, exc)
            except OSError as exc:
                # ENOBUFS and the like: a lost ring costs the reader one poll interval.
                self._dropped += 1
                logger.debug("ring to bell %r dropped: %s", address, exc)
            else:
                self._sent += 1
        if gone:
            bells.addresses = [a for a in bells.addresses if a not in gone]

    def _refresh(self, conn: sqlite3.Connection, topic_id: int, now: float) -> _TopicBells:
        previous = self._topics.get(topic_id)
        self._refreshes += 1
        try:
            found = lookup(conn, topic_id, self._clock.time())
        except sqlite3.Error as exc:
            # The append has committed already: a failed lookup must not fail it.
            logger.warning("could not read the bells of topic %d: %s", topic_id, exc)
            found = previous.addresses if previous is not None else []
        if self._dead:
            self._dead = {a: t for a, t in self._dead.items() if now - t < DEAD_MEMORY_S}
        own = self.own_address
        bells = _TopicBells(
            [a for a in found if a != own and a not in self._dead], now + self._refresh_s
        )
        self._topics[topic_id] = bells
        return bells

    def _bury(self, address: bytes, now: float) -> None:
        # Nobody is bound there: its process died (a closing bell removes its
        # own row first). Its row expires with its lease; until then skip it.
        self._dead[address] = now
        self._dead_removed += 1
        for other in self._topics.values():
            other.refresh_at = min(other.refresh_at, now)
        if _is_our_file(address):
            try:
                os.unlink(address)
            except FileNotFoundError:
                pass  # another writer was first
            except OSError as exc:
                logger.debug("could not remove the dead bell %r: %s", address, exc)

    def forget(self, topic_id: int) -> None:
        """Drops the cached bells of a dropped topic."""
        self._topics.pop(topic_id, None)

    def statistics(self) -> RingerStatistics:
        """Counters since the broker opened."""
        return RingerStatistics(
            sent=self._sent,
            dropped=self._dropped,
            dead_removed=self._dead_removed,
            refreshes=self._refreshes,
        )

    def close(self) -> None:
        """Closes the sending socket; call it once the write thread has stopped."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
