"""The YDB reader: one SDK topic reader per (topic, consumer), adapted to the port.

Partition sessions. YDB assigns partitions to read sessions and rebalances
them between the readers of a consumer. The SDK reports no session starts
or stops to its caller (3.33: the event handler's start and stop callbacks
are never called), so the reader reads the SDK read stream's own table of
partition sessions (``mapping.sdk_partition_sessions``): a session is
listed from its start, before any message of it arrived, and known dead
when the SDK marks it closed; its messages then have ``alive == False``
and are dropped, never committed. Another reader (or this one, after a
reconnect) receives them again.

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
here, in the session's stash, up to ``stash_limit`` messages and
``stash_bytes`` bytes. Past either, the session *spills*: its stash is
dropped and so is everything that arrives for it while paused, so the
reader keeps taking messages from the SDK and the other partitions keep
flowing. What was dropped is not committed; at the resume the reader opens
a new SDK reader (a new read session), and the server sends every partition
again from its committed offset. The cost of a long pause on YDB is
therefore the paused partition's traffic, read and dropped, and one reader
reconnect at its resume, in which the other partitions' uncommitted
messages are delivered again (at-least-once); the embedded backend pauses
one partition exactly.

Codecs. RAW and GZIP are the SDK's; ZSTD is decoded here (``zstandard``).
A batch in LZOP parks its partition: nothing more of that session is
handed out or committed, the reason is logged and kept in ``statistics``,
and the other partitions keep flowing (the SDK would fail the whole read
stream, and every restart would meet the same batch). A codec the SDK does
not know at all (a custom one) fails the reader with a BrokerError naming
it.

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
import datetime
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import zstandard
from ydb import (
    TopicClientAsyncIO,
    TopicReaderAsyncIO,
    TopicReaderBatch,
    TopicReaderMessage,
    TopicReaderSelector,
    issues,
)
from ydb._grpc.grpcwrapper.ydb_topic import Codec
from ydb._topic_reader.datatypes import PartitionSession as SdkSession
from ydb._topic_reader.topic_reader_asyncio import (
    PublicTopicReaderPartitionExpiredError,
    PublicTopicReaderUnexpectedCodecError,
)

from nemesis.broker.port import Message, PartitionSession, run_session
from nemesis.broker.ydb.errors import broker_error
from nemesis.broker.ydb.mapping import (
    Undecodable,
    YdbSession,
    sdk_partition_sessions,
    sdk_session,
    session_key,
    to_message,
)
from nemesis.errors import BrokerError

logger = logging.getLogger(__name__)

# How long closing the SDK reader may take when a spilled session's resume reopens it.
_REOPEN_CLOSE_S = 5.0

CODEC_NAMES: Mapping[int, str] = {
    Codec.CODEC_RAW: "RAW",
    Codec.CODEC_GZIP: "GZIP",
    Codec.CODEC_LZOP: "LZOP",
    Codec.CODEC_ZSTD: "ZSTD",
}
DECODED = "RAW, GZIP and ZSTD"


def zstd_decompress(data: bytes) -> bytes:
    """A ZSTD message, one frame or several, with or without the content size in its header."""
    with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True) as stream:
        return stream.read()


def _undecodable(codec: int, data: bytes) -> bytes:
    return Undecodable(data, codec)


def decoders() -> dict[int, Callable[[bytes], bytes]]:
    """The SDK reader's decoders beyond its own RAW and GZIP (see the module docstring)."""
    return {
        Codec.CODEC_ZSTD: zstd_decompress,
        Codec.CODEC_LZOP: functools.partial(_undecodable, Codec.CODEC_LZOP),
    }


def open_sdk_reader(
    topics: TopicClientAsyncIO,
    path: str | Sequence[str],
    consumer: str,
    buffer_size_bytes: int,
    read_from: datetime.datetime | None = None,
) -> TopicReaderAsyncIO:
    """An SDK reader of ``path`` (or of several) as ``consumer`` with this module's decoders.

    ``read_from`` (a time; one path only) makes the server skip the messages
    written before it, on every partition of this read session.
    """
    selector: str | TopicReaderSelector | list[str | TopicReaderSelector]
    if isinstance(path, str):
        selector = path if read_from is None else TopicReaderSelector(path, read_from=read_from)
    elif read_from is None:
        selector = list(path)
    else:
        raise ValueError("read_from applies to a reader of one topic")
    return topics.reader(
        selector,
        consumer=consumer,
        buffer_size_bytes=buffer_size_bytes,
        decoders=decoders(),
    )


def topic_of_path(path: str, names: Sequence[str]) -> str | None:
    """Which of ``names`` the server's topic ``path`` is: the name itself or its last part(s)."""
    path = path.rstrip("/")
    matching = [name for name in names if path == name or path.endswith("/" + name)]
    return max(matching, key=len, default=None)


@dataclass(frozen=True, slots=True)
class ReaderStatistics:
    """A snapshot of one YDB reader for metrics and the admin API."""

    topic: str
    consumer: str
    sessions: int
    paused: int
    stashed: int  # received from the SDK, not yet handed out
    stashed_bytes: int
    inflight: int  # handed out, not yet committed
    dropped: int  # received and not handed out: ended, spilled or parked sessions
    spilled: int  # paused sessions past the stash limits: read again after their resume
    reopens: int  # SDK readers opened again for a spilled session's resume
    parked: Mapping[int, str]  # partition -> why nothing of it is handed out
    closed: bool


class YdbReader:
    """Reads one topic as one consumer through the SDK; see the module docstring."""

    def __init__(
        self,
        open_sdk: Callable[[], TopicReaderAsyncIO],
        *,
        reopen_sdk: Callable[[], Awaitable[TopicReaderAsyncIO]] | None = None,
        topic: str,
        consumer: str,
        stash_limit: int = 1000,
        stash_bytes: int = 8 * 1024 * 1024,
        commit_timeout_s: float = 10.0,
        topics: Sequence[str] = (),
    ) -> None:
        """``topic`` names the reader (in logs and statistics); ``topics``, when it reads
        several, are their names: each session's topic is found from its path.
        ``reopen_sdk`` opens the SDK reader of a spilled session's resume (default:
        ``open_sdk`` again)."""
        if stash_limit < 1 or stash_bytes < 1:
            raise ValueError("stash_limit and stash_bytes must be at least 1")
        self._open_sdk = open_sdk
        self._reopen_sdk_reader = reopen_sdk
        self._sdk = open_sdk()
        self._topic = topic
        self._topics = tuple(topics) or (topic,)
        self._consumer = consumer
        self._stash_limit = stash_limit
        self._stash_bytes = stash_bytes
        self._reopen = False  # a spilled session resumed: read everything again
        self._reopens = 0
        self._commit_timeout_s = commit_timeout_s
        self._sessions: dict[tuple[int, int], YdbSession] = {}
        self._serials = itertools.count(1)
        self._pending: asyncio.Task[TopicReaderBatch | None] | None = None
        self._resumed = asyncio.Event()  # a session resumed, or interrupt() was called
        self._interrupted = False
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
        self._interrupted = False
        while True:
            if self._reopen:
                await self._reopen_sdk()
            self._sync_sessions()
            ready = self._take_stashed(max_messages)
            if ready:
                return ready
            remaining = deadline - loop.time()
            batch = await self._next_batch(max_messages, remaining)
            if batch is not None:
                admitted = self._admit(batch, max_messages)
                if admitted:
                    return admitted
            elif loop.time() >= deadline or self.interrupted():
                return ()

    def interrupted(self) -> bool:
        """``interrupt`` was called since the current ``receive`` began."""
        return self._interrupted

    def interrupt(self) -> None:
        """Makes a waiting ``receive`` return now; the SDK's pending receive is kept."""
        self._interrupted = True
        self._resumed.set()

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
        except PublicTopicReaderUnexpectedCodecError as exc:
            raise BrokerError(
                f"receive from {self._topic} as {self._consumer}: a message is compressed with"
                f" a codec Nemesis cannot decode ({exc}); it reads {DECODED}"
            ) from exc
        except issues.Error as exc:
            raise broker_error(exc, f"receive from {self._topic} as {self._consumer}") from exc

    async def _reopen_sdk(self) -> None:
        """A new SDK reader, so that the server sends every partition from its committed offset."""
        # First the new reader: if that fails, the next receive tries again.
        if self._reopen_sdk_reader is not None:
            fresh = await self._reopen_sdk_reader()
        else:
            fresh = self._open_sdk()
        self._reopen = False
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()  # what it held is read again by the new reader
            with contextlib.suppress(asyncio.CancelledError, issues.Error):
                await pending
        old, self._sdk = self._sdk, fresh
        self._reopens += 1
        logger.info("reader of %s as %s: reading again after a spilled pause", *self._names)
        for session in self._sessions.values():
            self._dropped += len(session.stash)
            session.stash.clear()
            session.stash_bytes = 0
        self._sessions.clear()
        self._closing = await close_sdk_reader(
            old, _REOPEN_CLOSE_S, f"reader of {self._topic} as {self._consumer}"
        )

    @property
    def _names(self) -> tuple[str, str]:
        return self._topic, self._consumer

    def _admit(self, batch: TopicReaderBatch, max_messages: int) -> list[Message]:
        """Maps a batch; hands out up to ``max_messages``, stashes the rest and the paused."""
        out: list[Message] = []
        for received in batch.messages:
            session = self._session_of(received)
            if session is None or session.spilled or session.parked is not None:
                self._dropped += 1
                continue
            if isinstance(received.data, Undecodable):
                self._park(session, received.offset, received.data.codec)
                continue
            message = to_message(session.topic, received, session)
            # Behind messages already stashed, so a partition stays in offset order.
            if session.paused or session.stash or len(out) >= max_messages:
                self._hold(session, message, received)
                continue
            session.inflight[message.offset] = received
            out.append(message)
        return out

    def _hold(self, session: YdbSession, message: Message, received: TopicReaderMessage) -> None:
        size = len(message.value)
        if session.paused and (
            len(session.stash) >= self._stash_limit
            or session.stash_bytes + size > self._stash_bytes
        ):
            logger.info(
                "%s is paused past %d messages or %d bytes: its messages are dropped"
                " and read again after its resume",
                session,
                self._stash_limit,
                self._stash_bytes,
            )
            self._drop_stash(session)
            self._dropped += 1
            session.spilled = True
            return
        session.stash.append((message, received))
        session.stash_bytes += size

    def _drop_stash(self, session: YdbSession) -> None:
        self._dropped += len(session.stash)
        session.stash.clear()
        session.stash_bytes = 0

    def _park(self, session: YdbSession, offset: int, codec: int) -> None:
        name = CODEC_NAMES.get(codec, str(codec))
        session.parked = (
            f"{session.topic}[{session.partition}] offset {offset} is compressed with {name},"
            f" which Nemesis cannot decode (it reads {DECODED}): the partition is parked"
        )
        logger.error("reader of %s as %s: %s", self._topic, self._consumer, session.parked)
        self._drop_stash(session)
        self._dropped += 1

    def _session_of(self, received: TopicReaderMessage) -> YdbSession | None:
        """The session of a received message; None when it ended already (a stale message)."""
        sdk = sdk_session(received)
        key = session_key(sdk)
        session = self._sessions.get(key)
        if session is None:
            if sdk.closed:
                return None
            session = self._add_session(sdk)
        return session if session.alive else None

    def _add_session(self, sdk: SdkSession) -> YdbSession:
        topic = self._topic
        if len(self._topics) > 1:
            topic = topic_of_path(sdk.topic_path, self._topics) or topic
        session = YdbSession(topic, sdk, next(self._serials), owner=self)
        self._sessions[session_key(sdk)] = session
        return session

    def _take_stashed(self, max_messages: int) -> list[Message]:
        out: list[Message] = []
        for session in self._sessions.values():
            if session.paused or not session.stash:
                continue
            taken = session.stash[: max_messages - len(out)]
            del session.stash[: len(taken)]
            for message, received in taken:
                session.stash_bytes -= len(message.value)
                session.inflight[message.offset] = received
                out.append(message)
            if len(out) >= max_messages:
                break
        return out

    def _sync_sessions(self) -> None:
        """Forgets the sessions that ended; adds those the SDK started (module docstring)."""
        for key, session in list(self._sessions.items()):
            if not session.alive:
                # Its stash and in-flight messages are stale: the next owner reads them again.
                self._dropped += len(session.stash)
                del self._sessions[key]
        for sdk in sdk_partition_sessions(self._sdk):
            if session_key(sdk) not in self._sessions:
                self._add_session(sdk)

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
        session = run_session(messages, YdbSession, lambda s: s.owner is self)
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
                exc, f"commit {session.topic}[{session.partition}] up to {messages[-1].offset}"
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
        """Hands this session's messages out again, the held ones first.

        A spilled session's messages are read again from the committed offsets
        by a new SDK reader, at the next ``receive`` (see the module docstring).
        """
        own = self._own(session)
        if own is not None and own.paused:
            own.paused = False
            if own.spilled:
                self._reopen = True
            self._resumed.set()

    def _own(self, session: PartitionSession) -> YdbSession | None:
        if not isinstance(session, YdbSession) or session.owner is not self:
            return None
        return session if session.alive else None

    def sessions(self) -> Sequence[PartitionSession]:
        """The live sessions of this reader, by partition, from their start on."""
        self._sync_sessions()
        return sorted(self._sessions.values(), key=lambda s: (s.partition, s.id))

    def stalled(self) -> Mapping[tuple[str, int], str]:
        """The parked partitions (a codec Nemesis cannot decode), with the reason."""
        return {
            (s.topic, s.partition): s.parked
            for s in self._sessions.values()
            if s.alive and s.parked is not None
        }

    def statistics(self) -> ReaderStatistics:
        """Sessions, paused, held and in-flight messages, for metrics and the admin API."""
        if not self._closed:
            self._sync_sessions()
        live = [s for s in self._sessions.values() if s.alive]
        return ReaderStatistics(
            topic=self._topic,
            consumer=self._consumer,
            sessions=len(live),
            paused=sum(s.paused for s in live),
            stashed=sum(len(s.stash) for s in live),
            stashed_bytes=sum(s.stash_bytes for s in live),
            inflight=sum(len(s.inflight) for s in live),
            dropped=self._dropped,
            spilled=sum(s.spilled for s in live),
            reopens=self._reopens,
            parked={s.partition: s.parked for s in live if s.parked is not None},
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
