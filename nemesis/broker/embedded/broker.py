"""The embedded broker: admin, writers and readers over one SQLite file."""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from nemesis.aio import TaskScope
from nemesis.broker.embedded import leases, log
from nemesis.broker.embedded.bells import Bell, Ringer, RingerStatistics, RingRows, Rings
from nemesis.broker.embedded.db import Checkpoint, Database, checkpoint
from nemesis.broker.embedded.reader import EmbeddedReader, Wakeups
from nemesis.broker.embedded.tail import TailCache
from nemesis.broker.port import (
    ConsumerSpec,
    OutgoingMessage,
    TopicDescription,
    WriteResult,
)
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.errors import BrokerError

logger = logging.getLogger(__name__)

# Small enough that retention and topic purges never hold the write lock for
# more than a few milliseconds; appends queue behind them on the same thread.
DELETE_BATCH = 1000
ADMIN_TIMEOUT_S = 30.0
CHECKPOINT_INTERVAL_S = 1.0
# A WAL this long (4 KiB pages: 64 MB) is restarted even when appends never pause (see
# checkpoint). Each restart holds appends up for a few ms (1.5-6 measured); at 1,000
# single-message appends a second (about 2,800 frames) that is once every six seconds.
RESTART_WAL_FRAMES = 16_384


class EmbeddedAdmin:
    """Creates, describes and drops topics in the broker's file."""

    def __init__(self, broker: EmbeddedBroker) -> None:
        self._broker = broker

    async def create_topic(
        self,
        name: str,
        *,
        partitions: int,
        consumers: Sequence[ConsumerSpec] = (),
        retention_s: float | None = None,
        exist_ok: bool = False,
    ) -> None:
        """Creates a topic; ``retention_s`` None takes the backend's default (0: keep forever)."""
        if partitions < 1:
            raise ValueError("a topic needs at least one partition")
        if retention_s is None:
            retention_s = self._broker.config.retention
        broker = self._broker
        await broker.db.writer.run(
            partial(
                log.create_topic,
                name=name,
                partitions=partitions,
                consumers=tuple(consumers),
                retention_s=retention_s or None,
                exist_ok=exist_ok,
                now=broker.clock.time(),
            ),
            timeout_s=ADMIN_TIMEOUT_S,
        )

    async def add_consumer(self, topic: str, consumer: ConsumerSpec) -> None:
        """Registers a consumer; a consumer that exists already is left alone."""
        broker = self._broker
        await broker.db.writer.run(
            partial(log.add_consumer, topic=topic, consumer=consumer, now=broker.clock.time()),
            timeout_s=ADMIN_TIMEOUT_S,
        )

    async def list_topics(self) -> Sequence[str]:
        """Every topic name, sorted."""
        return await self._broker.db.reader.run(log.list_topics, timeout_s=ADMIN_TIMEOUT_S)

    async def describe_topic(self, name: str) -> TopicDescription:
        """Offsets per partition and committed offsets per consumer (for lag)."""
        return await self._broker.db.reader.run(
            partial(log.describe_topic, name=name), timeout_s=ADMIN_TIMEOUT_S
        )

    async def drop_topic(self, name: str) -> None:
        """Deletes a topic; its readers fail with TopicNotFound at their next heartbeat."""
        broker = self._broker
        ringer = broker.ringer

        def drop(conn: sqlite3.Connection) -> int:
            topic_id = log.drop_topic(conn, name)
            ringer.forget(topic_id)  # on the write thread, where the ringer lives
            return topic_id

        topic_id = await broker.db.writer.run(drop, timeout_s=ADMIN_TIMEOUT_S)
        broker.forget_topic(topic_id)
        await broker.purge_dropped()


class EmbeddedWriter:
    """Appends to one topic as one producer; one transaction per ``write``."""

    def __init__(self, broker: EmbeddedBroker, topic: log.Topic, producer_id: str) -> None:
        self._broker = broker
        self._target = log.AppendTarget(topic, producer_id)
        self._closed = False

    @property
    def producer_id(self) -> str:
        return self._target.producer_id

    @property
    def topic(self) -> str:
        return self._target.topic.name

    async def write(
        self, messages: Sequence[OutgoingMessage], timeout_s: float = 10.0
    ) -> Sequence[WriteResult]:
        """Appends ``messages`` durably and returns, per message, its partition and offset.

        On BrokerTimeout the batch may or may not have been written: retry
        it with the same seqnos and the duplicates are skipped.
        """
        if self._closed:
            raise RuntimeError("the writer is closed")
        if not messages:
            return []
        broker = self._broker
        batch, target, clock, ringer = tuple(messages), self._target, broker.clock, broker.ringer

        def append(conn: sqlite3.Connection) -> log.Appended:
            # The time is read under the write lock, not when the write was queued.
            appended = log.append(conn, target, batch, clock.time)
            if appended.rows:
                # Rung from the write thread right after the commit, so readers
                # elsewhere start reading while this result travels to the loop.
                ringer.ring(conn, target.topic.id, (row[1] for row in appended.rows), appended.rows)
            return appended

        appended = await broker.db.writer.run(append, timeout_s=timeout_s)
        if appended.rows:
            broker.appended(self._target.topic, appended.rows)
        return appended.results

    async def close(self, timeout_s: float = 5.0) -> None:
        """Nothing is buffered: every write has committed by the time it returned."""
        self._closed = True
        self._broker.forget_writer(self)


@dataclass(frozen=True, slots=True)
class BellStatistics:
    """A broker's side of the cross-process wake-ups (see ``bells``)."""

    address: bytes | None  # None: no reader yet, bells disabled, or none could be bound
    rings_received: int
    wakes: int  # rings arrive in bursts; each burst wakes the readers once
    rung: RingerStatistics
    rows_received: int = 0  # rings that carried their append's rows (taken into the cache)


class EmbeddedBroker:
    """The embedded backend: topics in one SQLite file, shared by the processes of one machine."""

    def __init__(
        self,
        db: Database,
        config: EmbeddedBackendConfig,
        *,
        clock: Clock,
        member_id: str,
        housekeeping_interval_s: float,
        wakeups: Wakeups | None = None,
    ) -> None:
        self.db = db
        self.config = config
        self.clock = clock
        self.member_id = member_id
        self.wakeups = wakeups or Wakeups()
        # Touched only on the write thread (and by close, once it stopped).
        self.ringer = Ringer(clock)
        self._bell: Bell | None = None
        self._bell_failed = False
        self._admin = EmbeddedAdmin(self)
        self._housekeeping_interval_s = housekeeping_interval_s
        self._readers: dict[int, set[EmbeddedReader]] = {}
        self._writers: set[EmbeddedWriter] = set()
        self._tail = TailCache()
        self._reader_numbers = itertools.count(1)
        # Owns the housekeeping loop: a failure is logged with its traceback and the
        # loop started again (``_housekeeping_failed``); close() cancels and awaits it.
        self._background = TaskScope("embedded broker", self._housekeeping_failed)
        self._housekeeping_running = False
        self._closed = False

    @property
    def path(self) -> Path:
        return self.db.path

    @property
    def admin(self) -> EmbeddedAdmin:
        return self._admin

    async def reader(self, topic: str, consumer: str) -> EmbeddedReader:
        """Joins ``consumer``'s readers of ``topic`` and takes this reader's share of partitions."""
        self._check_open()
        found = await self.db.reader.run(
            partial(log.find_consumer, topic=topic, consumer=consumer), timeout_s=ADMIN_TIMEOUT_S
        )
        bell = self._open_bell()
        reader = EmbeddedReader(
            db=self.db,
            tail=self._tail,
            topic=found,
            consumer=consumer,
            member_id=f"{self.member_id}/{next(self._reader_numbers)}",
            lease_s=self.config.lease_s,
            clock=self.clock,
            on_rebalance=self._poke_siblings,
            on_close=self._forget_reader,
            wakeups=self.wakeups,
            bell=None if bell is None else bell.address,
        )
        try:
            await reader.start(timeout_s=max(self.config.lease_s, 5.0))
        except BrokerError:
            # The first heartbeat may have taken leases before it failed.
            await reader.close()
            raise
        self._readers.setdefault(found.id, set()).add(reader)
        # Siblings in this process hand over their excess now rather than at
        # their next heartbeat; other processes notice within lease_s / 3.
        self._poke_siblings(reader)
        return reader

    async def writer(self, topic: str, producer_id: str | None = None) -> EmbeddedWriter:
        """A writer for ``topic``, with a random producer id unless one is given."""
        self._check_open()
        found = await self.db.reader.run(
            partial(log.find_topic, name=topic), timeout_s=ADMIN_TIMEOUT_S
        )
        writer = EmbeddedWriter(self, found, producer_id or f"nemesis-{secrets.token_hex(8)}")
        self._writers.add(writer)
        return writer

    def appended(self, topic: log.Topic, rows: Sequence[tuple[Any, ...]]) -> None:
        """Hands committed rows to this broker's readers of the topic, and wakes them."""
        readers = self._readers.get(topic.id)
        if not readers:
            return
        self._tail.add(topic.id, topic.partitions, rows)
        for reader in readers:
            reader.wake()

    def _open_bell(self) -> Bell | None:
        """This broker's bell, bound when its first reader starts; None if it cannot be."""
        if self._bell is None and self.wakeups.bells and not self._bell_failed:
            try:
                self._bell = Bell.open(self.path, self._on_rings)
            except OSError as exc:
                # Readers poll instead; worth one warning, not one per reader.
                self._bell_failed = True
                logger.warning(
                    "no bell for readers of %s (they poll for other processes' appends): %s",
                    self.path,
                    exc,
                )
            else:
                self.ringer.own_address = self._bell.address
        return self._bell

    def _on_rings(self, rings: Rings, carried: RingRows) -> None:
        for topic_id, partitions in rings.items():
            readers = self._readers.get(topic_id)
            if not readers:
                continue
            rows = carried.get(topic_id)
            fed: frozenset[int] = frozenset()
            if rows:
                fed = self._tail.extend(topic_id, next(iter(readers)).partition_count, rows)
            # Partitions whose rows are not all in the cache now: the file must be read.
            unfed = None if partitions is None else partitions - fed
            for reader in readers:
                if fed:
                    reader.fed(fed)
                if unfed is None or unfed:
                    reader.ring(unfed)

    def bell_statistics(self) -> BellStatistics:
        """What this broker's bell received and its writers rang."""
        bell = self._bell
        return BellStatistics(
            address=None if bell is None else bell.address,
            rings_received=0 if bell is None else bell.rings_received,
            rows_received=0 if bell is None else bell.rows_received,
            wakes=0 if bell is None else bell.wakes,
            rung=self.ringer.statistics(),
        )

    def forget_topic(self, topic_id: int) -> None:
        """Drops what this broker keeps in memory about a dropped topic."""
        self._tail.forget(topic_id)

    def forget_writer(self, writer: EmbeddedWriter) -> None:
        """Called by a writer that closed."""
        self._writers.discard(writer)

    def _forget_reader(self, reader: EmbeddedReader) -> None:
        readers = self._readers.get(reader.topic_id)
        if readers is not None:
            readers.discard(reader)
            if not readers:
                del self._readers[reader.topic_id]
                self._tail.forget(reader.topic_id)
        self._poke_siblings(reader)

    def _poke_siblings(self, reader: EmbeddedReader) -> None:
        for sibling in self._readers.get(reader.topic_id, ()):
            if sibling is not reader and sibling.consumer == reader.consumer:
                sibling.poke()

    # --- housekeeping -------------------------------------------------------------------

    async def housekeeping(self) -> int:
        """Deletes expired messages and the remains of dropped topics; returns how many."""
        deleted = await self.purge_dropped()
        candidates = await self.db.maintenance.run(
            partial(log.expiry_candidates, now=self.clock.time()), timeout_s=ADMIN_TIMEOUT_S
        )
        for candidate in candidates:
            while True:
                count = await self.db.writer.run(
                    partial(log.expire, candidate=candidate, batch=DELETE_BATCH),
                    timeout_s=ADMIN_TIMEOUT_S,
                )
                deleted += count
                if count < DELETE_BATCH:
                    break
        return deleted

    async def purge_dropped(self) -> int:
        """Deletes the messages of dropped topics, a batch per transaction."""
        deleted = 0
        while count := await self.db.writer.run(
            partial(log.purge_dropped, batch=DELETE_BATCH), timeout_s=ADMIN_TIMEOUT_S
        ):
            deleted += count
        return deleted

    async def checkpoint(self) -> Checkpoint:
        """Copies the WAL into the database file, mostly off the write path.

        SQLite restarts the WAL from its beginning at the first write after
        everything in it was copied. Under a steady stream of appends the
        maintenance thread's copy never gets there: appends land while it
        runs (fsyncs included, tens of milliseconds), and the WAL grew until
        the backstop (``BACKSTOP_CHECKPOINT_PAGES``, 200 MB; measured with
        tests/bench/delivery.py (e): 169 MB after 15 s at 1,000 msg/s), whose
        checkpoint on commit then stalled an append for tens of milliseconds.
        So once the WAL reaches ``RESTART_WAL_FRAMES``, the write thread copies
        what was appended meanwhile, with no append of this broker beside it:
        a few milliseconds on the write path, and the next append restarts
        the WAL (then cut back to ``WAL_SIZE_LIMIT_BYTES`` if it grew beyond).
        """
        done = await self.db.maintenance.run(checkpoint, timeout_s=ADMIN_TIMEOUT_S)
        if done.wal_frames >= RESTART_WAL_FRAMES:
            done = await self.db.writer.run(checkpoint, timeout_s=ADMIN_TIMEOUT_S)
        return done

    def start_housekeeping(self) -> None:
        """Starts the periodic checkpoint and retention task (stopped by ``close``)."""
        if not self._housekeeping_running:
            self._housekeeping_running = True
            self._background.start(
                self._housekeeping_loop(), name=f"nemesis-housekeeping:{self.path.name}"
            )

    def _housekeeping_failed(self, error: BaseException) -> None:
        # Not a broker error (those are retried in the loop): a bug. Checkpoints must go
        # on, or the WAL grows without bound: log it loudly and start the loop again (it
        # waits a checkpoint interval before its first round, so a bug cannot spin).
        logger.error("housekeeping of %s failed; starting it again", self.path, exc_info=error)
        self._housekeeping_running = False
        if not self._closed:
            self.start_housekeeping()

    async def _housekeeping_loop(self) -> None:
        # Checkpoints often, so the WAL stays small (reads through a long WAL
        # slow down); retention rarely, it has minutes or days of slack.
        next_retention = self.clock.monotonic() + self._housekeeping_interval_s
        while True:
            await self.clock.sleep(CHECKPOINT_INTERVAL_S)
            try:
                await self.checkpoint()
                if self.clock.monotonic() < next_retention:
                    continue
                next_retention = self.clock.monotonic() + self._housekeeping_interval_s
                deleted = await self.housekeeping()
            except BrokerError as exc:
                logger.warning("housekeeping of %s failed, retrying later: %s", self.path, exc)
                continue
            if deleted:
                logger.info("housekeeping deleted %d messages from %s", deleted, self.path)

    # --- lifecycle ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the broker is closed")

    async def close(self, timeout_s: float = 5.0) -> None:
        """Closes readers (releasing their leases), writers, and the file."""
        if self._closed:
            return
        self._closed = True
        await self._background.aclose()
        readers = [r for group in self._readers.values() for r in group]
        for reader in readers:
            await reader.close(timeout_s)
        for writer in list(self._writers):
            await writer.close(timeout_s)
        try:
            await self.db.close(timeout_s)
        finally:
            # After the readers left (their bell rows are gone) and the write
            # thread stopped (nothing rings any more).
            if self._bell is not None:
                self._bell.close()
            self.ringer.close()


def default_member_id() -> str:
    """host:pid:random:node: unique per broker, readable, and says where it runs (see leases)."""
    return leases.local_member_id()


async def open_embedded(
    config: EmbeddedBackendConfig | str | os.PathLike[str],
    *,
    data_dir: str | os.PathLike[str] = ".",
    clock: Clock = SYSTEM_CLOCK,
    member_id: str | None = None,
    housekeeping_interval_s: float = 5.0,
    wakeups: Wakeups | None = None,
) -> EmbeddedBroker:
    """Opens (creating if needed) the broker's SQLite file and starts its housekeeping.

    ``config`` is the backend section of ``nemesis.yaml`` or just a path; a
    relative path is taken from ``data_dir``. ``member_id`` names this
    process in the lease tables (default host:pid:random). ``wakeups`` sets
    how readers learn of other processes' appends (default: bells, and
    polling as the fallback).
    """
    if not isinstance(config, EmbeddedBackendConfig):
        config = EmbeddedBackendConfig(path=os.fspath(config))
    path = Path(data_dir, config.path)
    db = Database(path)
    await db.open(timeout_s=ADMIN_TIMEOUT_S)
    broker = EmbeddedBroker(
        db,
        config,
        clock=clock,
        member_id=member_id or default_member_id(),
        housekeeping_interval_s=housekeeping_interval_s,
        wakeups=wakeups,
    )
    broker.start_housekeeping()
    return broker
