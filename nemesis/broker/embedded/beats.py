"""One lease heartbeat for every reader of a process, and one watch for lost rings.

Each reader must renew its leases every ``lease_s / 3`` (``leases``). Done by
each reader on its own, a process with a thousand readers would wake a
thousand times per interval and send as many jobs to the write thread. One
task beats for all of them: at each round, every reader due within the next half
interval is renewed in one job on the write thread, so readers that started
at different times fall into step after their first shared round. In that
job one transaction renews every lease of the process (``leases.renew_all``),
and only the readers whose consumer changed run the full protocol, a
transaction each. A reader not yet settled (its share is still held by
another member) is beaten sooner; a reader that is poked (a sibling joined
or left) beats at once on its own (``EmbeddedReader.poke``).

A failed round (the write thread timed out) is retried at half the interval;
a topic that was dropped fails its readers alone, and a bug fails the readers
of its round at once (their leases would no longer be renewed).

The watch (``Watch``) is the other periodic look: rings (``bells``) wake
readers when other processes append, and a ring can be lost. Instead of every
belled reader polling the file for that, one query per interval reads the sum
of the end offsets of every topic read here and rings the readers of the
topics that moved.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol

from nemesis.aio import first_of
from nemesis.broker.embedded import leases
from nemesis.broker.embedded.db import Database
from nemesis.clock import Clock
from nemesis.errors import BrokerError, TopicNotFound

logger = logging.getLogger(__name__)


class BeatJob(NamedTuple):
    """One reader's part of a shared round, as the write thread needs it."""

    topic_id: int
    consumer: str
    member_id: str
    held: dict[int, int]
    bell: bytes | None
    # The members its last heartbeat saw, when nothing since calls for the full protocol
    # (it holds its whole share and was not poked); None: run the full protocol.
    members: tuple[str, ...] | None = None


class Beating(Protocol):
    """What a shared round needs of a reader (``EmbeddedReader`` is one)."""

    beat_due: float  # monotonic (clock) time of its next shared beat
    beat_lock: asyncio.Lock  # one heartbeat of the reader at a time

    def beat_job(self) -> BeatJob | None:
        """What the round renews for it; None once it is closed."""
        ...

    def beat_answer(self, held: dict[int, int], result: leases.HeartbeatResult) -> None:
        """The full protocol's answer for it."""
        ...

    def beat_renewed(self, held: dict[int, int], expires_at: float) -> None:
        """The process renewal kept every lease of ``held`` until ``expires_at``."""
        ...

    def beat_failed(self, error: BrokerError) -> None:
        """Its heartbeat failed (its topic was dropped, say)."""
        ...

    def beat_bug(self, error: BaseException) -> None:
        """The round failed with a bug."""
        ...

    def beat_interval(self, interval_s: float) -> float:
        """How long until its next beat."""
        ...


@dataclass(frozen=True, slots=True)
class BeatStatistics:
    rounds: int  # jobs sent to the write thread
    beats: int  # reader heartbeats they carried
    failures: int  # rounds that failed (retried)
    full: int = 0  # heartbeats that ran the full protocol (the others: one renewal for all)


class SharedHeartbeat:
    """Renews the leases of every registered reader from one task (see the module docstring)."""

    def __init__(self, db: Database, *, clock: Clock, lease_s: float, member_prefix: str) -> None:
        self._db = db
        self._prefix = member_prefix  # every member id of this process starts with it
        self._clock = clock
        self._lease_s = lease_s
        self.interval_s = lease_s / 3
        self._readers: set[Beating] = set()
        self._changed = asyncio.Event()
        self._rounds = 0
        self._beats = 0
        self._failures = 0
        self._full = 0

    def add(self, reader: Beating) -> None:
        """Beats for ``reader`` from now on (it has just beaten itself)."""
        reader.beat_due = self._clock.monotonic() + reader.beat_interval(self.interval_s)
        self._readers.add(reader)
        self._changed.set()

    def remove(self, reader: Beating) -> None:
        self._readers.discard(reader)

    @property
    def readers(self) -> int:
        return len(self._readers)

    def statistics(self) -> BeatStatistics:
        return BeatStatistics(self._rounds, self._beats, self._failures, self._full)

    async def run(self) -> None:
        """Beats until cancelled."""
        while True:
            now = self._clock.monotonic()
            due_at = min((r.beat_due for r in self._readers), default=None)
            self._changed.clear()
            if due_at is None:
                await self._changed.wait()
                continue
            if due_at > now:
                await first_of(self._clock.sleep(due_at - now), self._changed.wait())
                continue
            horizon = now + self.interval_s / 2
            due = [r for r in self._readers if r.beat_due <= horizon]
            if due:
                await self.beat(due)

    async def beat(self, readers: Sequence[Beating]) -> None:
        """One round for ``readers``: one job on the write thread."""
        locked: list[Beating] = []
        taken: list[tuple[Beating, BeatJob]] = []
        try:
            for reader in readers:
                # Held from the snapshot of what it holds until the answer is applied.
                await reader.beat_lock.acquire()
                locked.append(reader)
                job = reader.beat_job()
                if job is not None:
                    taken.append((reader, job))
            if not taken:
                return
            self._rounds += 1
            self._beats += len(taken)
            try:
                answers, full = await self._db.writer.run(
                    partial(
                        _beat_all,
                        clock=self._clock,
                        lease_s=self._lease_s,
                        prefix=self._prefix,
                        jobs=[job for _, job in taken],
                    ),
                    timeout_s=self._lease_s,
                )
            except BrokerError as exc:
                # Retried soon; if no round succeeds before the leases run out, each
                # reader's receive() ends its sessions on its own.
                self._failures += 1
                logger.warning("lease heartbeat of %d readers failed: %s", len(taken), exc)
                retry_at = self._clock.monotonic() + self.interval_s / 2
                for reader, _ in taken:
                    reader.beat_due = retry_at
                return
            except Exception as exc:
                # A bug: these leases are no longer renewed, so their sessions end now.
                logger.exception("lease heartbeat of %d readers failed", len(taken))
                for reader, _ in taken:
                    self.remove(reader)
                    reader.beat_bug(exc)
                return
            self._full += full
            now = self._clock.monotonic()
            for (reader, job), answer in zip(taken, answers, strict=True):
                if isinstance(answer, float):
                    reader.beat_renewed(job.held, answer)
                elif isinstance(answer, TopicNotFound):
                    self.remove(reader)
                    reader.beat_failed(answer)
                    continue
                else:
                    reader.beat_answer(job.held, answer)
                reader.beat_due = now + reader.beat_interval(self.interval_s)
        finally:
            for reader in locked:
                reader.beat_lock.release()


def _beat_all(
    conn: sqlite3.Connection,
    *,
    clock: Clock,
    lease_s: float,
    prefix: str,
    jobs: Sequence[BeatJob],
) -> tuple[list[leases.HeartbeatResult | TopicNotFound | float], int]:
    """One round: a renewal of the whole process, then the full protocol where needed.

    A settled reader whose consumer's members and leases are as it last saw
    them is renewed by ``leases.renew_all`` (three statements for the whole
    process); the others run ``leases.heartbeat``, a transaction each. Returns
    the answers (for a renewed reader, just its leases' new expiry) and how
    many ran the full protocol.
    """
    answers: list[leases.HeartbeatResult | TopicNotFound | float | None] = [None] * len(jobs)
    quick = [index for index, job in enumerate(jobs) if job.members is not None]
    if quick:
        holdings = []
        for index in quick:
            job = jobs[index]
            assert job.members is not None
            holdings.append(
                leases.Holding(job.topic_id, job.consumer, job.member_id, job.held, job.members)
            )
        # A member of this host whose process is gone (a kill -9 before a restart)
        # sends its consumer's readers through the full protocol, which frees its leases.
        expires_at, stale = leases.renew_all(
            conn,
            owner_prefix=prefix,
            holdings=holdings,
            now=clock.time(),
            lease_s=lease_s,
            gone=leases.is_dead_neighbour,
        )
        for index, is_stale in zip(quick, stale, strict=True):
            if not is_stale:
                answers[index] = expires_at
    done: list[leases.HeartbeatResult | TopicNotFound | float] = []
    full = 0
    for job, answer in zip(jobs, answers, strict=True):
        if answer is None:
            full += 1
            try:
                answer = leases.heartbeat(
                    conn,
                    topic_id=job.topic_id,
                    consumer=job.consumer,
                    member_id=job.member_id,
                    held=job.held,
                    now=clock.time(),
                    lease_s=lease_s,
                    bell=job.bell,
                )
            except TopicNotFound as exc:
                answer = exc
        done.append(answer)
    return done, full


class Watch:
    """Rings the readers of partitions whose end offsets moved (see the module docstring)."""

    def __init__(
        self,
        db: Database,
        *,
        clock: Clock,
        interval_s: float,
        topics: Callable[[], Sequence[int]],
        ring: Callable[[int, Mapping[int, int]], None],
    ) -> None:
        self._db = db
        self._clock = clock
        self.interval_s = interval_s
        self._topics = topics
        self._ring = ring
        self._sums: dict[int, int] = {}
        self._total: tuple[int, int] | None = None  # (partitions, sum of their end offsets)
        self._ends: dict[int, dict[int, int]] = {}
        self.rounds = 0

    async def run(self) -> None:
        """Looks every ``interval_s`` until cancelled."""
        while True:
            await self._clock.sleep(self.interval_s)
            try:
                await self.look()
            except BrokerError as exc:
                logger.warning("watching end offsets failed, trying again: %s", exc)

    async def look(self) -> None:
        """One look: rings the readers of every partition whose end moved since the last.

        One query sums each topic's end offsets; only the topics whose sum
        changed are looked at partition by partition. The first look at a
        topic rings its readers for every partition: what moved before it, no
        one saw.
        """
        topics = self._topics()
        if not topics:
            return
        self.rounds += 1
        timeout_s = max(self.interval_s * 10, 10.0)
        total = await self._db.reader.run(_end_total, timeout_s=timeout_s)
        if total == self._total and set(topics) <= self._sums.keys():
            return  # no end offset moved anywhere: nothing to look at
        self._total = total
        sums = await self._db.reader.run(
            partial(_end_sums, topics=tuple(topics)), timeout_s=timeout_s
        )
        moved = [t for t, total in sums.items() if self._sums.get(t) != total]
        self._sums = sums
        for topic_id in list(self._ends):
            if topic_id not in sums:
                del self._ends[topic_id]
        if not moved:
            return
        ends = await self._db.reader.run(
            partial(_ends_of, topics=tuple(moved)), timeout_s=timeout_s
        )
        for topic_id, partitions in ends.items():
            known = self._ends.get(topic_id, {})
            changed = {p: end for p, end in partitions.items() if known.get(p) != end}
            self._ends[topic_id] = partitions
            if changed:
                self._ring(topic_id, changed)


def _end_total(conn: sqlite3.Connection) -> tuple[int, int]:
    """How many partitions there are and the sum of their end offsets: one row, in C."""
    row = conn.execute("SELECT COUNT(*), TOTAL(end_offset) FROM partitions").fetchone()
    return int(row[0]), int(row[1])


def _end_sums(conn: sqlite3.Connection, *, topics: tuple[int, ...]) -> dict[int, int]:
    wanted = set(topics)
    return {
        int(topic_id): int(total)
        for topic_id, total in conn.execute(
            "SELECT topic_id, SUM(end_offset) FROM partitions GROUP BY topic_id"
        )
        if topic_id in wanted
    }


def _ends_of(conn: sqlite3.Connection, *, topics: tuple[int, ...]) -> dict[int, dict[int, int]]:
    ends: dict[int, dict[int, int]] = {}
    for topic_id in topics:
        ends[topic_id] = {
            int(partition): int(end)
            for partition, end in conn.execute(
                "SELECT partition_id, end_offset FROM partitions WHERE topic_id = ?", (topic_id,)
            )
        }
    return ends
