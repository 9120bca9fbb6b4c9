"""The embedded reader: leased partition sessions, fair reads, fenced commits."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from nemesis.aio import TaskScope, first_of
from nemesis.broker.embedded import leases, log
from nemesis.broker.embedded.beats import BeatJob, SharedHeartbeat
from nemesis.broker.embedded.db import Database
from nemesis.broker.embedded.tail import ReadRow, TailCache
from nemesis.broker.port import EARLIEST, Message, PartitionSession, StartFrom, run_session
from nemesis.clock import Clock
from nemesis.errors import BrokerError, TopicNotFound

logger = logging.getLogger(__name__)

# While the tail cache keeps answering, a reader without a bell still reads
# the file this often: appends from other processes show up only there. A
# belled reader is rung for those (see ``bells``) and allows a lost ring a
# poll interval instead.
TAIL_WINDOW_S = 0.01
# A read that has started may finish after the caller's wait budget ran out;
# one that takes longer than this means the read thread is stuck.
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Wakeups:
    """How readers learn of appends from other processes: bells first, polling as the fallback.

    A reader polls the file soon after data (the next message is likely
    close behind), doubling the interval while nothing comes, up to a cap.
    With a bell, rings carry the fast path, and what is left to catch (a lost
    ring, a writer that has not seen the bell yet) is caught by the broker's
    watch: every ``belled_poll_max_s`` one query for the end offsets of every
    topic this process reads, ringing the readers of partitions that moved. A
    belled reader's own polls back off up to ``belled_poll_max_s`` and then
    stop (the watch looks as often), so an idle one costs nothing.
    While rings keep a belled reader's tail cache answering, the file is
    still read every ``belled_tail_window_s`` (a ring lost while data flows).
    """

    bells: bool = True
    poll_min_s: float = 0.002
    poll_max_s: float = 0.05
    belled_poll_max_s: float = 1.0
    belled_tail_window_s: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.poll_min_s <= min(self.poll_max_s, self.belled_poll_max_s):
            raise ValueError("poll intervals must be positive, the minimum below the maximums")
        if self.belled_tail_window_s <= 0:
            raise ValueError("the tail window must be positive")


class EmbeddedSession:
    """A lease on one partition held by one reader; its id is the lease generation."""

    __slots__ = (
        "_alive",
        "_id",
        "_partition",
        "_topic",
        "caught_up",
        "committed",
        "expires_at",
        "holder",
        "paused",
        "position",
    )

    def __init__(
        self,
        topic: str,
        partition: int,
        generation: int,
        *,
        holder: str,
        position: int,
        expires_at: float,
    ) -> None:
        self._topic = topic
        self.holder = holder  # the member id of the reader that holds it
        self._partition = partition
        self._id = generation
        self._alive = True
        self.paused = False
        self.position = position  # next offset to deliver
        self.committed = position  # highest offset committed through this session
        self.expires_at = expires_at
        # The last file read reached the partition's end: nothing is waiting in
        # the file except what other processes wrote since (see _read_tail).
        self.caught_up = False

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
        """Marks the session dead: its partition is gone, its messages are stale."""
        self._alive = False

    def __repr__(self) -> str:
        state = "alive" if self._alive else "dead"
        return f"<EmbeddedSession {self._topic}[{self._partition}] gen={self._id} {state}>"


@dataclass(frozen=True, slots=True)
class PartitionStatistics:
    """One held partition, as seen by its reader."""

    partition: int
    session_id: int
    paused: bool
    position: int  # next offset to deliver
    committed: int  # next offset to read after a restart, as far as this reader knows
    lease_expires_at: float


@dataclass(frozen=True, slots=True)
class ReaderStatistics:
    """A snapshot of one reader for metrics and the admin API."""

    topic: str
    consumer: str
    member_id: str
    members: int  # live readers of this consumer, at the last heartbeat
    partitions: tuple[PartitionStatistics, ...]
    paused: int
    closed: bool
    rings: int  # rings from other processes' writers that woke this reader
    belled: bool  # other processes' writers can ring it (it polls less often)
    file_reads: int = 0  # reads that went to the file (on the read thread)
    watch_rings: int = 0  # the broker's watch saw data this reader had not read (lost rings)
    cache_reads: int = 0  # reads answered from the tail cache (in the loop)


class EmbeddedReader:
    """Reads one topic as one consumer from the partitions this member leases.

    Delivery is at least once: a read position lives in memory per session
    and starts at the committed offset, so whatever was delivered but not
    committed when a session ends is delivered again by its next owner.
    """

    def __init__(
        self,
        *,
        db: Database,
        tail: TailCache,
        topic: log.Topic,
        consumer: str,
        member_id: str,
        lease_s: float,
        clock: Clock,
        on_rebalance: Callable[[EmbeddedReader], None],
        on_close: Callable[[EmbeddedReader], None],
        wakeups: Wakeups,
        bell: bytes | None = None,
        commit_timeout_s: float = 10.0,
        start_from: StartFrom = EARLIEST,
        beats: SharedHeartbeat | None = None,
    ) -> None:
        self._db = db
        self._start_from = start_from
        self._tail = tail
        # When the tail cache began answering instead of the file (see _read_tail).
        self._tail_since: float | None = None
        self._topic = topic
        self._consumer = consumer
        self._member_id = member_id
        self._lease_s = lease_s
        self._clock = clock
        self._on_rebalance = on_rebalance
        self._on_close = on_close
        self._commit_timeout_s = commit_timeout_s
        self._sessions: dict[int, EmbeddedSession] = {}
        self._members = 0
        self._member_ids: tuple[str, ...] = ()  # sorted, at the last heartbeat
        self._settled = False
        self._turn = 0  # rotates which partition is read first
        self._bell = bell  # the address writers in other processes ring, if any
        self._poll_min_s = wakeups.poll_min_s
        # A belled reader's lost rings are caught by the broker's watch (see Wakeups).
        self._poll_max_s = wakeups.belled_poll_max_s if bell else wakeups.poll_max_s
        self._poll_s = self._poll_min_s
        # How long the tail cache may answer before the file is read anyway. Without
        # a bell, other processes' appends show up only there; with one, they ring
        # (with their rows, or to have the file read), so only a lost ring is left to
        # catch, and that is allowed a while.
        self._tail_window_s = wakeups.belled_tail_window_s if bell else TAIL_WINDOW_S
        self._dirty = False  # set by wake(): something may be readable now
        # Set by ring(): another process appended, so the file has rows the
        # tail cache cannot have; and when the tail window is over. The next
        # read goes to the file.
        self._rung = False
        self._rings = 0
        self._watch_rings = 0  # the broker's watch, not a bell, sent this reader to the file
        self._file_reads = 0
        self._cache_reads = 0
        # The last read reached the end of every partition it read, at this loop time.
        self._drained = False
        self._read_at = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._interrupted = False
        # Called by wake(): the multi-topic reader this one is a part of waits for it.
        self.on_wake: Callable[[], None] | None = None
        # The broker's shared heartbeat, which renews this reader's leases with every
        # other reader's of the process (None: this reader beats on its own).
        self._beats = beats
        self.beat_due = 0.0  # monotonic (clock) time of the next shared beat
        self.poked = False  # poke() asked for a beat (see _beat_when_poked)
        self._poked_beat = False  # that beat runs
        self._receive_lock = asyncio.Lock()
        self.beat_lock = asyncio.Lock()  # one heartbeat of this reader at a time
        self._poke = asyncio.Event()
        # Owns the heartbeat: its failure ends the sessions at once (``_heartbeat_failed``).
        self._background = TaskScope(f"reader {member_id}", self._heartbeat_failed)
        self._failure: BrokerError | None = None
        self._closed = False

    @property
    def topic(self) -> str:
        return self._topic.name

    @property
    def topic_id(self) -> int:
        return self._topic.id

    @property
    def consumer(self) -> str:
        return self._consumer

    @property
    def member_id(self) -> str:
        return self._member_id

    async def start(self, timeout_s: float) -> None:
        """Joins the consumer's members, takes a first share, and starts heartbeating."""
        await self.heartbeat(timeout_s)
        if self._beats is not None:
            self._beats.add(self)
            return
        self._background.start(
            self._heartbeat_loop(), name=f"nemesis-lease:{self._topic.name}:{self._member_id}"
        )

    # --- reading ------------------------------------------------------------------

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        """Up to ``max_messages`` from live, unpaused sessions; empty after ``timeout_s``.

        Messages come in offset order within each partition, and partitions
        share the batch evenly. A write through the same broker wakes a
        waiting receive at once, and so does the ring of a writer in another
        process (see ``bells``); polling the file, every few ms after data
        and less often when idle, catches what no ring announced.
        """
        if max_messages < 1:
            raise ValueError("max_messages must be at least 1")
        if self._closed:
            raise RuntimeError("the reader is closed")
        self._raise_if_failed()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._interrupted = False
        async with self._receive_lock:
            # With a bell, a reader that read every partition to its end has
            # nothing new until a wake or a ring says so, or until its next
            # poll is due (for a lost ring). Without one, every receive reads.
            read_now = (
                self._dirty
                or self._rung
                or not (self._bell and self._drained)
                or loop.time() - self._read_at >= self._poll_s
            )
            while not self._closed:
                if read_now:
                    announced = self._dirty and self._bell is not None
                    self._dirty = False
                    self._read_at = loop.time()
                    batch = await self._read(
                        max_messages, max(deadline - loop.time(), READ_TIMEOUT_S)
                    )
                    if batch:
                        # Data no ring announced: more may follow unannounced, so poll
                        # soon. Announced data says nothing about lost rings: polling
                        # soon after it would read the file between rings for nothing.
                        if not announced:
                            self._poll_s = self._poll_min_s
                        return batch
                    self._raise_if_failed()
                remaining = deadline - loop.time()
                if remaining <= 0 or self.interrupted():
                    break
                read_now = True
                if not self._dirty:
                    poll_s = self._poll_s
                    await self._wait(min(remaining, poll_s))
                    self._poll_s = self._backoff(poll_s)
                    if self.interrupted():
                        break
                    if (
                        self._bell
                        and self._drained
                        and not (self._dirty or self._rung)
                        and loop.time() - self._read_at < poll_s
                    ):
                        # The time is up before the next poll is due, and nothing was
                        # announced: nothing to read. (Reading anyway made every idle
                        # receive end with a trip to the file.)
                        break
        return ()

    async def try_receive(self, max_messages: int) -> Sequence[Message]:
        """What ``receive`` would read now, without waiting (a multi-topic reader's part).

        Reads when something was announced or a poll is due, else returns
        nothing at once; ``poll_due_in`` says when the next poll is due.
        """
        if self._closed:
            raise RuntimeError("the reader is closed")
        self._raise_if_failed()
        loop = asyncio.get_running_loop()
        async with self._receive_lock:
            if not (
                self._dirty
                or self._rung
                or not (self._bell and self._drained)
                or loop.time() - self._read_at >= self._poll_s
            ):
                return ()
            announced = self._dirty and self._bell is not None
            self._dirty = False
            self._read_at = loop.time()
            batch = await self._read(max_messages, READ_TIMEOUT_S)
            if batch:
                if not announced:
                    self._poll_s = self._poll_min_s
                return batch
            self._raise_if_failed()
            if not announced:
                self._poll_s = self._backoff(self._poll_s)
            return ()

    def _backoff(self, poll_s: float) -> float:
        """The poll interval after one that found nothing: twice as long, up to the cap.

        A belled reader stops polling past its cap: the broker's watch looks
        for what no ring announced that often, for every reader at once.
        """
        following = poll_s * 2
        if following <= self._poll_max_s:
            return following
        return math.inf if self._bell else self._poll_max_s

    def poll_due_in(self) -> float:
        """Seconds until this reader should look at the file again though nothing rang."""
        if self._dirty or self._rung:
            return 0.0
        if not self._bell:
            # Without a bell every look reads the file: paced by the poll interval.
            return max(0.0, self._read_at + self._poll_s - asyncio.get_running_loop().time())
        if not self._drained:
            return 0.0
        return max(0.0, self._read_at + self._poll_s - asyncio.get_running_loop().time())

    async def _read(self, max_messages: int, timeout_s: float) -> list[Message]:
        self._expire_sessions()
        sessions = [s for s in self._sessions.values() if not s.paused]
        if not sessions:
            self._drained = True  # a new session or a resume wakes the reader
            return []
        sessions.sort(key=lambda s: s.partition)
        self._turn = (self._turn + 1) % len(sessions)
        sessions = sessions[self._turn :] + sessions[: self._turn]
        from_tail = self._read_tail(sessions, max_messages)
        if from_tail is not None:
            self._cache_reads += 1
            return from_tail
        self._file_reads += 1
        # Cleared before the read: a ring that comes while it runs may announce
        # rows it does not see, and must cause another read.
        self._rung = False
        requests = [log.ReadRequest(s, s.position) for s in sessions]
        await self._db.reader.run(
            partial(log.read, topic=self._topic, requests=requests, max_messages=max_messages),
            timeout_s=timeout_s,
        )
        self._tail_since = None
        for request in requests:
            if isinstance(request.session, EmbeddedSession):
                request.session.caught_up = request.exhausted
        self._drained = all(r.exhausted for r in requests)
        return self._advance(requests)

    def _read_tail(
        self, sessions: list[EmbeddedSession], max_messages: int
    ) -> list[Message] | None:
        """Messages straight from the tail cache, or None when the file must be read.

        The file is read instead when a partition may have a backlog there
        (it was not caught up at the last file read), and at once after a ring
        that carried no rows (or rows the cache could not continue with). It
        is also read at least every tail window while the cache keeps
        answering: a poll interval with a bell (for a lost ring), TAIL_WINDOW_S
        without one (writers in other processes only show up in the file
        then); the rows the cache holds go out first, and the next receive
        reads the file at once, so that this look is not on their way.
        """
        if self._rung:
            return None
        now = asyncio.get_running_loop().time()
        look_due = self._tail_since is not None and now - self._tail_since > self._tail_window_s
        tail, topic_id = self._tail, self._topic.id
        covered = []
        for session in sessions:
            if tail.get(topic_id, session.partition, session.position, 1):
                covered.append(session)
            elif not session.caught_up:
                return None
        if not covered:
            return None
        if look_due:
            # The file next, at once (not as announced data: what it finds, no ring told of).
            self._rung = True
        elif self._tail_since is None:
            self._tail_since = now
        requests = [log.ReadRequest(s, s.position) for s in covered]
        log.fill(self._topic.name, requests, max_messages, partial(_from_tail, tail, topic_id))
        # The sessions left out are caught up with the file.
        self._drained = all(r.exhausted for r in requests)
        return self._advance(requests)

    def _advance(self, requests: list[log.ReadRequest]) -> list[Message]:
        pages: list[list[Message]] = []
        for request in requests:
            session = request.session
            # Ended or paused while the read ran: drop the page, keep the position.
            if (
                not request.messages
                or not session.alive
                or not isinstance(session, EmbeddedSession)
                or session.paused
            ):
                continue
            session.position = request.messages[-1].offset + 1
            pages.append(request.messages)
        if len(pages) <= 1:
            return pages[0] if pages else []
        # One partition's page after another (which one comes first turns with
        # every read): a consumer tracks and queues each page at once, where
        # interleaved messages would cost it a lookup per message.
        return list(itertools.chain.from_iterable(pages))

    async def _wait(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiter = waiter
        # A bare timer and future: asyncio.wait_for would create a task per wait,
        # and this runs once per idle poll.
        timer = loop.call_later(seconds, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def wake(self) -> None:
        """Something may be readable now (an append, a new lease, a resume)."""
        self._dirty = True
        waiter = self._waiter
        if waiter is not None:
            _resolve(waiter)
        if self.on_wake is not None:
            self.on_wake()

    def interrupted(self) -> bool:
        """``interrupt`` was called since the current ``receive`` began."""
        return self._interrupted

    def stalled(self) -> Mapping[tuple[str, int], str]:
        """None here: every message of an assigned partition is read (see the broker port)."""
        return {}

    def interrupt(self) -> None:
        """Makes a waiting ``receive`` return now (see the broker port)."""
        self._interrupted = True
        waiter = self._waiter
        if waiter is not None:
            _resolve(waiter)

    @property
    def partition_count(self) -> int:
        """The topic's partitions (this reader may hold fewer)."""
        return self._topic.partitions

    def fed(self, partitions: frozenset[int]) -> None:
        """Another process appended to ``partitions`` and its ring put the rows in the cache."""
        if self._sessions.keys().isdisjoint(partitions):
            return
        self._rings += 1
        self.wake()

    def ring(self, partitions: frozenset[int] | None) -> None:
        """Another process appended to ``partitions`` (None: any) and rang this reader's bell."""
        if partitions is not None and self._sessions.keys().isdisjoint(partitions):
            return
        self._rung = True
        self._rings += 1
        self.wake()

    def watched(self, ends: Mapping[int, int]) -> None:
        """The broker's watch saw the end offsets of partitions move (maybe a lost ring).

        The file is read for them, unless this reader has read that far already or
        the tail cache holds what it has not (those rows woke it when they came).
        """
        tail, topic_id = self._tail, self._topic.id
        for partition, end in ends.items():
            session = self._sessions.get(partition)
            if session is None or session.position >= end:
                continue
            # The cache holds a contiguous run: its first and last rows say it has them all.
            if tail.get(topic_id, partition, session.position, 1) and tail.get(
                topic_id, partition, end - 1, 1
            ):
                continue
            self._rung = True
            self._watch_rings += 1
            self.wake()
            return

    def _expire_sessions(self) -> None:
        # A lease that ran out without a renewal (a heartbeat that failed or
        # could not run) may be taken by another member any moment now.
        now = self._clock.time()
        for partition, session in list(self._sessions.items()):
            if now > session.expires_at:
                logger.warning(
                    "lease on %s[%d] for %s expired before it was renewed",
                    self._topic.name,
                    partition,
                    self._consumer,
                )
                session.end()
                del self._sessions[partition]

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    # --- committing -----------------------------------------------------------------

    async def commit(self, messages: Sequence[Message]) -> None:
        """Commits a run of one session's messages in read order: the offset becomes last + 1.

        The runner hands over the contiguous done prefix in read order; its
        offsets are consecutive except where retention deleted messages the
        reader had not reached yet. Ignored when the session has ended, here
        or in the file (the lease row must still name this session's
        generation, checked in the same transaction as the update); a commit
        never moves an offset back.
        """
        if not messages:
            return
        session = run_session(messages, EmbeddedSession, lambda s: s.holder == self._member_id)
        offset = messages[-1].offset + 1
        if not session.alive or offset <= session.committed:
            return
        fenced = await self._db.writer.run(
            partial(
                leases.commit_offset,
                topic_id=self._topic.id,
                consumer=self._consumer,
                partition=session.partition,
                owner=self._member_id,
                generation=session.id,
                offset=offset,
                now=self._clock.time(),
            ),
            timeout_s=self._commit_timeout_s,
        )
        if not fenced:
            logger.info("commit on %s ignored: the partition was taken over", session)
            self._end_session(session.partition, session)
            return
        session.committed = max(session.committed, offset)

    # --- flow control and introspection -------------------------------------------------

    def pause(self, session: PartitionSession) -> None:
        """Stops delivering this session's messages until ``resume``."""
        own = self._own(session)
        if own is not None:
            own.paused = True

    def resume(self, session: PartitionSession) -> None:
        """Delivers this session's messages again."""
        own = self._own(session)
        if own is not None and own.paused:
            own.paused = False
            self.wake()

    def _own(self, session: PartitionSession) -> EmbeddedSession | None:
        own = self._sessions.get(session.partition)
        if own is not session:
            return None  # ended already (or never ours): nothing to pause
        return own

    def sessions(self) -> Sequence[PartitionSession]:
        """The live sessions, by partition."""
        return [self._sessions[p] for p in sorted(self._sessions)]

    def statistics(self) -> ReaderStatistics:
        """Partitions held, paused, and read/commit positions."""
        held = tuple(
            PartitionStatistics(
                partition=s.partition,
                session_id=s.id,
                paused=s.paused,
                position=s.position,
                committed=s.committed,
                lease_expires_at=s.expires_at,
            )
            for _, s in sorted(self._sessions.items())
        )
        return ReaderStatistics(
            topic=self._topic.name,
            consumer=self._consumer,
            member_id=self._member_id,
            members=self._members,
            partitions=held,
            paused=sum(p.paused for p in held),
            closed=self._closed,
            rings=self._rings,
            belled=self._bell is not None,
            file_reads=self._file_reads,
            cache_reads=self._cache_reads,
            watch_rings=self._watch_rings,
        )

    # --- leases ---------------------------------------------------------------------------

    async def heartbeat(self, timeout_s: float | None = None) -> None:
        """Renews this member's leases and rebalances now, instead of at the next beat."""
        async with self.beat_lock:
            if self._closed:
                return
            held = {p: s.id for p, s in self._sessions.items()}
            result = await self._db.writer.run(
                partial(
                    _heartbeat_job,
                    clock=self._clock,
                    topic_id=self._topic.id,
                    consumer=self._consumer,
                    member_id=self._member_id,
                    held=held,
                    lease_s=self._lease_s,
                    bell=self._bell,
                    start_from=self._start_from,
                ),
                timeout_s=self._lease_s if timeout_s is None else timeout_s,
            )
            self._apply(held, result)

    def _apply(self, held: dict[int, int], result: leases.HeartbeatResult) -> None:
        if self._closed:
            return  # close() released everything; this answer is stale
        self._members = result.members
        self._member_ids = result.member_ids
        self._settled = result.settled
        for partition in result.kept:
            session = self._sessions.get(partition)
            if session is not None and session.id == held[partition]:
                session.expires_at = result.expires_at
        for partition in (*result.released, *result.lost):
            self._end_session(partition, None, generation=held[partition])
        for acquired in result.acquired:
            previous = self._sessions.get(acquired.partition)
            if previous is not None:
                previous.end()
            self._sessions[acquired.partition] = EmbeddedSession(
                self._topic.name,
                acquired.partition,
                acquired.generation,
                holder=self._member_id,
                position=acquired.position,
                expires_at=result.expires_at,
            )
        if result.acquired:
            self.wake()
        if result.released:
            self._on_rebalance(self)

    def _end_session(
        self, partition: int, session: EmbeddedSession | None, generation: int | None = None
    ) -> None:
        current = self._sessions.get(partition)
        if current is None:
            return
        if (session is not None and current is not session) or (
            generation is not None and current.id != generation
        ):
            return
        current.end()
        del self._sessions[partition]

    def poke(self) -> None:
        """Asks for a heartbeat now: a sibling reader joined or let partitions go."""
        if self._beats is None:
            self._poke.set()
            return
        # With the shared heartbeat: the full protocol now, on its own (pokes are rare).
        self.poked = True
        if not self._poked_beat and not self._closed:
            self._poked_beat = True
            self._background.start(self._beat_when_poked(), name=f"nemesis-poke:{self._member_id}")

    async def _beat_when_poked(self) -> None:
        try:
            # Again for a poke that came while a beat ran: it may not have seen that change.
            while self.poked and not self._closed:
                self.poked = False
                try:
                    await self.heartbeat()
                except TopicNotFound as exc:
                    self._fail(exc)
                    return
                except BrokerError as exc:
                    # The shared heartbeat renews it at its next round.
                    logger.warning("lease heartbeat for %s failed: %s", self._member_id, exc)
                    return
        finally:
            self._poked_beat = False

    # --- the shared heartbeat's side (``beats``) -----------------------------------

    def beat_job(self) -> BeatJob | None:
        """What a shared round renews for this reader; None once it is closed.

        Settled: the round may renew it without the full protocol, if its
        consumer's members and its leases are as it last saw them.
        """
        if self._closed:
            return None
        return BeatJob(
            topic_id=self._topic.id,
            consumer=self._consumer,
            member_id=self._member_id,
            held={p: s.id for p, s in self._sessions.items()},
            bell=self._bell,
            members=(self._member_ids or None) if self._settled else None,
        )

    def beat_answer(self, held: dict[int, int], result: leases.HeartbeatResult) -> None:
        self._apply(held, result)

    def beat_renewed(self, held: dict[int, int], expires_at: float) -> None:
        """The process renewal kept every lease of ``held`` until ``expires_at``."""
        if self._closed:
            return
        for partition, generation in held.items():
            session = self._sessions.get(partition)
            if session is not None and session.id == generation:
                session.expires_at = expires_at

    def beat_failed(self, error: BrokerError) -> None:
        self._fail(error)

    def beat_bug(self, error: BaseException) -> None:
        """The shared round failed with a bug: as ``_heartbeat_failed``."""
        self._heartbeat_failed(error)

    def beat_interval(self, interval_s: float) -> float:
        """Until the whole share is held, check back soon (see ``_heartbeat_loop``)."""
        return interval_s if self._settled else interval_s / 4

    def _heartbeat_failed(self, error: BaseException) -> None:
        # Not a broker error (those are retried in the loop): a bug. The leases are
        # no longer renewed, so the sessions end now; receive() raises it to the runner.
        failure = BrokerError(f"the lease heartbeat of {self._member_id} failed: {error!r}")
        failure.__cause__ = error
        self._fail(failure)

    async def _heartbeat_loop(self) -> None:
        interval = self._lease_s / 3
        delay = interval
        while True:
            await self._sleep_or_poke(delay)
            # Cleared before the beat, not before the sleep: a poke that comes
            # while a beat runs must cause another one.
            self._poke.clear()
            try:
                await self.heartbeat()
            except TopicNotFound as exc:
                self._fail(exc)
                return
            except BrokerError as exc:
                # Retried at the next beat; if none succeeds before the leases
                # run out, receive() ends the sessions on its own.
                logger.warning("lease heartbeat for %s failed: %s", self._member_id, exc)
                delay = interval / 2
                continue
            # Until the whole share is held, check back soon: the members that
            # must let partitions go do so at their own next beat.
            delay = interval if self._settled else interval / 4

    async def _sleep_or_poke(self, seconds: float) -> None:
        await first_of(self._clock.sleep(seconds), self._poke.wait())

    def _fail(self, error: BrokerError) -> None:
        self._failure = error
        for session in self._sessions.values():
            session.end()
        self._sessions.clear()
        self.wake()

    # --- closing ----------------------------------------------------------------------------

    async def close(self, timeout_s: float = 5.0) -> None:
        """Releases every lease at once, so other members take over without waiting for expiry."""
        if self._closed:
            return
        self._closed = True
        if self._beats is not None:
            self._beats.remove(self)
        await self._background.aclose()
        for session in self._sessions.values():
            session.end()
        held = {p: s.id for p, s in self._sessions.items()}
        self._sessions.clear()
        self.wake()
        try:
            await self._db.writer.run(
                partial(
                    _heartbeat_job,
                    clock=self._clock,
                    topic_id=self._topic.id,
                    consumer=self._consumer,
                    member_id=self._member_id,
                    held=held,
                    lease_s=self._lease_s,
                    leaving=True,
                ),
                timeout_s=timeout_s,
            )
        except TopicNotFound:
            pass  # dropped: nothing left to release
        except BrokerError as exc:
            logger.warning(
                "%s could not release its leases (they expire on their own): %s",
                self._member_id,
                exc,
            )
        finally:
            self._on_close(self)


def _heartbeat_job(
    conn: sqlite3.Connection,
    *,
    clock: Clock,
    topic_id: int,
    consumer: str,
    member_id: str,
    held: dict[int, int],
    lease_s: float,
    bell: bytes | None = None,
    leaving: bool = False,
    start_from: StartFrom = EARLIEST,
) -> leases.HeartbeatResult:
    # The time is read on the write thread, when the transaction starts, not
    # when the job was queued: expiry decisions must use the time they run at.
    return leases.heartbeat(
        conn,
        topic_id=topic_id,
        consumer=consumer,
        member_id=member_id,
        held=held,
        now=clock.time(),
        lease_s=lease_s,
        bell=bell,
        leaving=leaving,
        start_from=start_from,
    )


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _from_tail(
    tail: TailCache, topic_id: int, partition: int, position: int, limit: int, _bytes: int
) -> list[ReadRow]:
    # Rows the cache holds are in memory already: a read of them is not held to a byte budget.
    return tail.get(topic_id, partition, position, limit)
