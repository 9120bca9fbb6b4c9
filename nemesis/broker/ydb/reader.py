"""The YDB reader: one SDK topic reader per (topic, consumer), adapted to the port.

Partition sessions. YDB assigns partitions to read sessions and rebalances
them between the readers of a consumer; the SDK hides the start and stop of
partition sessions (no callbacks), so a session is seen here when its first
message arrives and is known dead when the SDK marks it closed: its
messages then have ``alive == False`` and are dropped, never committed.
Another reader (or this one, after a reconnect) receives them again.

Receiving. The SDK's ``receive_batch`` waits forever (it retries retriable
errors under the hood), so every call is bounded by the caller's timeout.
The bound is ``asyncio.wait`` on one long-lived receive task, not
``asyncio.wait_for``: cancelling a receive that has just popped a batch
would lose those messages, and a lost message is worse than a redelivered
one on YDB, because commit ranges chain (see ``commit``): the commits of
later messages would leave a gap the server never closes, and the
partition's committed offset would stall until the session ended. A task
that outlives one ``receive`` simply hands its batch to the next.

Pausing. The SDK cannot pause one partition: the server keeps sending
whatever fits in the reader's buffer. A paused session's messages are held
here, in the session's stash, up to ``stash_limit`` messages. When a paused
session's stash is full, the reader stops taking messages from the SDK
altogether until that session is resumed or ends: the SDK's buffer fills
and the server stops sending for every partition of this reader. So on YDB
a long pause bounds memory at the price of head-of-line blocking across the
reader's partitions (the embedded backend pauses one partition exactly).

Committing. ``commit`` uses ``commit_with_ack`` and waits for the server's
acknowledgement (bounded by a timeout), rather than the fire-and-forget
``commit``: the runner reports commits and their failures, and the final
commit at shutdown must have reached the server before the reader closes;
``commit`` would also silently ignore a session that expired, which is
exactly the rebalance the runner should hear about (here as a no-op on a
dead session, like the embedded backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ydb import TopicReaderAsyncIO, TopicReaderBatch, TopicReaderMessage, issues
from ydb._grpc.grpcwrapper.ydb_topic import Codec
from ydb._topic_reader.topic_reader_asyncio import PublicTopicReaderPartitionExpiredError

from nemesis.broker.port import Message, PartitionSession
from nemesis.broker.ydb.errors import broker_error
from nemesis.broker.ydb.mapping import YdbSession, sdk_session, session_key, to_message

logger = logging.getLogger(__name__)

# How often a reader stalled on a full stash checks whether its session ended.
_STALL_CHECK_S = 0.1


@dataclass(frozen=True, slots=True)
class ReaderStatistics:
    """A snapshot of one YDB reader for metrics and the admin API."""

    topic: str
    consumer: str
    sessions: int
    paused: int
    stashed: int  # received from the SDK, not yet handed out
    inflight: int  # handed out, not yet committed
    dropped: int  # received for sessions that had ended already
    stalled: bool  # a paused session's stash is full: nothing is taken from the SDK
    closed: bool


class YdbReader:
    """Reads one topic as one consumer through the SDK; see the module docstring."""

    def __init__(
        self,
        sdk: TopicReaderAsyncIO,
        *,
        topic: str,
        consumer: str,
        stash_limit: int = 1000,
        commit_timeout_s: float = 10.0,
    ) -> None:
        if stash_limit < 1:
            raise ValueError("stash_limit must be at least 1")
        self._sdk = sdk
        self._topic = topic
        self._consumer = consumer
        self._stash_limit = stash_limit
        self._commit_timeout_s = commit_timeout_s
        self._sessions: dict[tuple[int, int], YdbSession] = {}
        self._serials = itertools.count(1)
        self._pending: asyncio.Task[TopicReaderBatch | None] | None = None
        self._resumed = asyncio.Event()
        self._closing: asyncio.Task[None] | None = None
        self._dropped = 0
        self._closed = False

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def consumer(self) -> str:
        return self._consumer

    @property
    def closed(self) -> bool:
        return self._closed

    # --- receiving ----------------------------------------------------------------

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        """Up to ``max_messages`` of live, unpaused sessions; empty after ``timeout_s``."""
        if max_messages < 1:
            raise ValueError("max_messages must be at least 1")
        if self._closed:
            raise RuntimeError("the reader is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self._forget_dead_sessions()
            ready = self._take_stashed(max_messages)
            if ready:
                return ready
            remaining = deadline - loop.time()
            if self._stalled():
                if remaining <= 0:
                    return ()
                # A session that ends rather than resumes is noticed at the next check.
                await self._until_resumed(min(remaining, _STALL_CHECK_S))
                continue
            batch = await self._next_batch(max_messages, remaining)
            if batch is not None:
                admitted = self._admit(batch, max_messages)
                if admitted:
                    return admitted
            elif loop.time() >= deadline:
                return ()

    async def _next_batch(self, max_messages: int, timeout_s: float) -> TopicReaderBatch | None:
        """The SDK's next batch; None after ``timeout_s``, or sooner if a session resumed."""
        pending = self._pending
        if pending is None:
            pending = asyncio.ensure_future(self._sdk.receive_batch(max_messages=max_messages))
            self._pending = pending
        if not pending.done():
            # A resume hands out the stash at once, rather than after the next batch.
            self._resumed.clear()
            resumed = asyncio.ensure_future(self._resumed.wait())
            try:
                await asyncio.wait(
                    (pending, resumed),
                    timeout=max(timeout_s, 0.0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                resumed.cancel()
            if not pending.done():
                return None
        self._pending = None
        try:
            return pending.result()
        except issues.Error as exc:
            raise broker_error(exc, f"receive from {self._topic} as {self._consumer}") from exc

    async def _until_resumed(self, timeout_s: float) -> None:
        self._resumed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._resumed.wait()

    def _admit(self, batch: TopicReaderBatch, max_messages: int) -> list[Message]:
        """Maps a batch; hands out up to ``max_messages``, stashes the rest and the paused."""
        out: list[Message] = []
        for received in batch.messages:
            session = self._session_of(received)
            if session is None:
                self._dropped += 1
                continue
            message = to_message(self._topic, received, session)
            # Behind messages already stashed, so a partition stays in offset order.
            if session.paused or session.stash or len(out) >= max_messages:
                session.stash.append((message, received))
                continue
            session.inflight[message.offset] = received
            out.append(message)
        return out

    def _session_of(self, received: TopicReaderMessage) -> YdbSession | None:
        """The session of a received message; None when it ended already (a stale message)."""
        sdk = sdk_session(received)
        key = session_key(sdk)
        session = self._sessions.get(key)
        if session is None:
            if sdk.closed:
                return None
            session = YdbSession(self._topic, sdk, next(self._serials), owner=self)
            self._sessions[key] = session
        return session if session.alive else None

    def _take_stashed(self, max_messages: int) -> list[Message]:
        out: list[Message] = []
        for session in self._sessions.values():
            if session.paused or not session.stash:
                continue
            taken = session.stash[: max_messages - len(out)]
            del session.stash[: len(taken)]
            for message, received in taken:
                session.inflight[message.offset] = received
                out.append(message)
            if len(out) >= max_messages:
                break
        return out

    def _stalled(self) -> bool:
        return any(s.paused and len(s.stash) >= self._stash_limit for s in self._sessions.values())

    def _forget_dead_sessions(self) -> None:
        for key, session in list(self._sessions.items()):
            if not session.alive:
                # Its stash and in-flight messages are stale: the next owner reads them again.
                self._dropped += len(session.stash)
                del self._sessions[key]

    # --- committing ---------------------------------------------------------------

    async def commit(self, messages: Sequence[Message]) -> None:
        """Commits a run of one session's messages in offset order, and waits for the ack.

        The SDK gives every message a commit range that starts where the
        previous message of its session ended, so a run's range is [first's
        start, last offset + 1) and consecutive runs chain without gaps.
        Ignored when the session has ended, before or while the commit is on
        its way (``TopicReaderPartitionExpiredError``): the partition's new
        owner reads those messages again.
        """
        if not messages:
            return
        session = messages[0].session
        if not isinstance(session, YdbSession) or session.owner is not self:
            raise ValueError("messages were not received by this reader")
        for previous, message in itertools.pairwise(messages):
            if message.session is not session or message.offset <= previous.offset:
                raise ValueError("commit takes one partition session's messages in offset order")
        if not session.alive:
            return
        if any(m.offset not in session.inflight for m in messages):
            raise ValueError("messages were not received by this reader, or were committed already")
        # From the oldest uncommitted message of the session: a run whose commit
        # failed is covered by the next one, as on the embedded backend (the
        # ranges must not leave a gap, or the committed offset would stop there).
        last = messages[-1].offset
        covered = [received for offset, received in session.inflight.items() if offset <= last]
        run = TopicReaderBatch(
            messages=covered,
            _partition_session=session.sdk,
            _bytes_size=0,
            _codec=Codec(Codec.CODEC_RAW),
        )
        # Shielded: a timeout here must not cancel the SDK's ack future, which
        # the SDK later resolves from its read loop (resolving a cancelled
        # future there would break the whole stream).
        acked = asyncio.ensure_future(self._sdk.commit_with_ack(run))
        acked.add_done_callback(_consume_exception)
        try:
            async with asyncio.timeout(self._commit_timeout_s):
                await asyncio.shield(acked)
        except PublicTopicReaderPartitionExpiredError:
            logger.info("commit on %s ignored: the partition session ended", session)
            return
        except (issues.Error, TimeoutError) as exc:
            raise broker_error(
                exc, f"commit {self._topic}[{session.partition}] up to {messages[-1].offset}"
            ) from exc
        for received in covered:
            session.inflight.pop(received.offset, None)

    # --- flow control and introspection ---------------------------------------------

    def pause(self, session: PartitionSession) -> None:
        """Holds this session's messages back until ``resume`` (see the module docstring)."""
        own = self._own(session)
        if own is not None:
            own.paused = True

    def resume(self, session: PartitionSession) -> None:
        """Hands this session's messages out again, the held ones first."""
        own = self._own(session)
        if own is not None and own.paused:
            own.paused = False
            self._resumed.set()

    def _own(self, session: PartitionSession) -> YdbSession | None:
        if not isinstance(session, YdbSession) or session.owner is not self:
            return None
        return session if session.alive else None

    def sessions(self) -> Sequence[PartitionSession]:
        """The live sessions this reader has received messages from, by partition.

        A partition assigned to this reader shows up with its first message:
        the SDK reports no session starts.
        """
        self._forget_dead_sessions()
        return sorted(self._sessions.values(), key=lambda s: (s.partition, s.id))

    def statistics(self) -> ReaderStatistics:
        """Sessions, paused, held and in-flight messages, for metrics and the admin API."""
        live = [s for s in self._sessions.values() if s.alive]
        return ReaderStatistics(
            topic=self._topic,
            consumer=self._consumer,
            sessions=len(live),
            paused=sum(s.paused for s in live),
            stashed=sum(len(s.stash) for s in live),
            inflight=sum(len(s.inflight) for s in live),
            dropped=self._dropped,
            stalled=self._stalled(),
            closed=self._closed,
        )

    # --- closing ------------------------------------------------------------------

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stops reading; uncommitted messages go to the partitions' next owners."""
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, issues.Error):
                await pending
        # Without flush: every commit this reader made was awaited already.
        self._closing = await close_sdk_reader(
            self._sdk, timeout_s, f"reader of {self._topic} as {self._consumer}"
        )
        for session in self._sessions.values():
            session.stash.clear()
            session.inflight.clear()
        self._sessions.clear()


async def close_sdk_reader(
    sdk: TopicReaderAsyncIO, timeout_s: float, what: str
) -> asyncio.Task[None] | None:
    """Closes an SDK reader without flushing, waiting at most ``timeout_s``.

    Shielded: on timeout the SDK finishes closing its stream on its own
    rather than being cancelled half-way (which would leave its background
    tasks running); the unfinished close is returned, for the caller to
    keep a reference to.
    """
    closing = asyncio.ensure_future(sdk.close(flush=False))
    closing.add_done_callback(_consume_exception)
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(closing)
    except TimeoutError:
        logger.warning("%s did not close in %.1fs", what, timeout_s)
        return closing
    except issues.Error as exc:
        logger.warning("%s closed with an error: %s", what, exc)
    return None


def _consume_exception(task: asyncio.Future[None]) -> None:
    # The outcome of a shielded call whose waiter gave up is nobody's business
    # any more; retrieving it keeps asyncio from logging it as never retrieved.
    if not task.cancelled():
        task.exception()
