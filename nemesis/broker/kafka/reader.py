"""The Kafka reader: one consumer-group member per (topic, consumer), adapted to the port.

Partition sessions. The group (id: the port's consumer name) assigns the
topic's partitions to its members. Each partition assigned to this member
is a ``KafkaSession``; the rebalance listener ends it the moment the group
revokes the partition (``on_partitions_revoked`` runs before the member
rejoins), so its messages still queued or in flight are stale at once:
neither delivered further nor committed. aiokafka rebalances eagerly: every
rebalance revokes every partition and assigns anew, so a partition that
stays with this member gets a new session, whose messages start at the
group's committed offset.

Committing. ``commit`` commits the offset after a run's last message for its
partition, through the group: aiokafka sends the member id and the group
generation with it, so the coordinator refuses a commit from a member the
group has moved on from (``CommitFailedError``: illegal generation, unknown
member, rebalance in progress). Such a refusal ends the session here, as a
revocation would: the partition may belong to another member already, which
reads the uncommitted messages again.

Receiving. ``getmany`` honours its timeout except while a rebalance is in
progress, when it waits for the new assignment however long that takes; so
each receive also runs under a deadline. Cancelling it cannot lose records:
aiokafka takes them from its buffer and returns without awaiting in between.

Pausing. ``pause`` stops fetching one partition (Kafka pauses per
partition, exactly): a poison message holds only its own partition back.

Stalling. A record batch the client cannot decode (an unknown codec id, a
codec whose library is missing, compressed bytes that do not decompress, a
CRC that does not match) stalls its partition alone: the reader hands out
what the failed fetch had taken (``nemesis.broker.kafka.decoding``),
stops fetching the partition for the rest of its session and names it, with
the batch's offset and the reason, in ``stalled``; the other partitions
keep flowing. Nothing past the batch is committed, so the partition's lag
shows what waits behind it. A new session (a rebalance, a reader restart)
reads the batch again; an operator passes over it by moving the group's
committed offset (``nemesis offsets``, see ``docs/kafka.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from nemesis.aio import first_of
from nemesis.broker.kafka.connection import close_leftover_connections
from nemesis.broker.kafka.decoding import Undecodable, undecodable
from nemesis.broker.kafka.errors import broker_error, describe
from nemesis.broker.kafka.mapping import KafkaSession, to_message
from nemesis.broker.port import Message, PartitionSession, run_session
from nemesis.errors import BrokerError

logger = logging.getLogger(__name__)

# Where a reader starts on newly assigned partitions its group never read (by partition).
StartPositions = Callable[[list[Any]], Awaitable[dict[Any, int]]]

# Added to a receive's timeout for the client's own wait to end first.
_RECEIVE_SLACK_S = 0.5


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    def __init__(self, reader: KafkaReader) -> None:
        self._reader = reader

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self._reader._revoked(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self._reader._assigned(assigned)
        await self._reader._position(assigned)


class KafkaReader:
    """Reads one topic as one consumer group member; see the module docstring."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        *,
        topic: str,
        group: str,
        commit_timeout_s: float,
        leave_timeout_s: float = 0.0,
        start_positions: StartPositions | None = None,
    ) -> None:
        self._consumer = consumer
        self._start_positions = start_positions
        self._leave_timeout_s = leave_timeout_s
        self._topic = topic
        self._group = group
        self._commit_timeout_s = commit_timeout_s
        self._sessions: dict[int, KafkaSession] = {}
        # partition -> (its session when it stalled, why): see "Stalling" in the module doc.
        self._stalls: dict[int, tuple[KafkaSession, str]] = {}
        self._serials = itertools.count(1)
        self._closing: asyncio.Future[Any] | None = None
        self._dropped = 0
        self._closed = False
        self._wake: asyncio.Event | None = None  # set by interrupt() while a receive waits
        self.listener = _Listener(self)

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def consumer(self) -> str:
        return self._group

    @property
    def closed(self) -> bool:
        return self._closed

    # --- group membership ---------------------------------------------------------

    def _revoked(self, partitions: Any) -> None:
        for tp in partitions:
            session = self._sessions.pop(tp.partition, None) if tp.topic == self._topic else None
            if session is not None:
                session.end()
        logger.info(
            "%s as %s: partitions revoked %s", self._topic, self._group, _numbers(partitions)
        )

    def _assigned(self, partitions: Any) -> None:
        for tp in partitions:
            if tp.topic != self._topic:
                continue
            previous = self._sessions.get(tp.partition)
            if previous is not None:
                previous.end()
            self._sessions[tp.partition] = KafkaSession(
                self._topic, tp.partition, next(self._serials), owner=self
            )
        logger.info(
            "%s as %s: partitions assigned %s", self._topic, self._group, _numbers(partitions)
        )

    async def _position(self, partitions: Any) -> None:
        """Moves newly assigned partitions the group never read to where reading starts.

        The client starts fetching a new assignment from the group's committed
        offset (its registration) while this runs: the partitions stay paused
        until they are moved, so no record from before the start is handed out.
        """
        mine = [tp for tp in partitions if tp.topic == self._topic]
        if self._start_positions is None or not mine:
            return
        self._consumer.pause(*mine)  # before the first await: no fetch is handed out
        try:
            positions = await self._start_positions(mine)
        except BrokerError as exc:
            # The group's own position (its registration, or auto_offset_reset) stands.
            logger.warning("%s as %s: start position unknown: %s", self._topic, self._group, exc)
            positions = {}
        for tp, offset in positions.items():
            self._consumer.seek(tp, offset)
        assigned = self._consumer.assignment()
        self._consumer.resume(*[tp for tp in mine if tp in assigned])

    # --- receiving ----------------------------------------------------------------

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        """Up to ``max_messages`` of live, unpaused sessions; empty after ``timeout_s``."""
        if max_messages < 1:
            raise ValueError("max_messages must be at least 1")
        if self._closed:
            raise RuntimeError("the reader is closed")
        wake = self._wake = asyncio.Event()
        fetch = asyncio.ensure_future(
            self._consumer.getmany(
                timeout_ms=max(int(timeout_s * 1000), 0), max_records=max_messages
            )
        )
        try:
            # getmany waits with no limit of its own while a rebalance is in progress;
            # interrupt() ends the wait at once. A fetch cancelled here loses nothing:
            # aiokafka keeps fetched records until a getmany hands them out.
            await first_of(fetch, wake.wait(), timeout_s=max(timeout_s, 0.0) + _RECEIVE_SLACK_S)
        except Exception as exc:
            # A batch the client cannot decode raises whatever it is (KafkaError, zlib's,
            # a codec library's); only the frames of the failure tell it apart.
            found = undecodable(exc)
            if found is not None and found.topic == self._topic:
                return self._stall(found)
            if isinstance(exc, KafkaError):
                raise broker_error(exc, f"receive from {self._topic} as {self._group}") from exc
            raise
        finally:
            self._wake = None
        if not fetch.done() or fetch.cancelled():
            return ()  # interrupted, or a rebalance is in progress: nothing to hand out
        return self._messages(fetch.result())

    def _messages(self, batches: Mapping[Any, Sequence[Any]]) -> list[Message]:
        """The records of live sessions as messages; those of ended sessions are dropped."""
        out: list[Message] = []
        for tp, records in batches.items():
            partition = tp if isinstance(tp, int) else tp.partition
            session = self._sessions.get(partition)
            if session is None or not session.alive:
                self._dropped += len(records)
                continue
            out.extend(to_message(record, session) for record in records)
        return out

    def _stall(self, found: Undecodable) -> list[Message]:
        """Stops fetching the partition of a batch that cannot be decoded; hands out the rest."""
        session = self._sessions.get(found.partition)
        if session is not None and session.alive:
            reason = (
                f"{found.topic}[{found.partition}] offset {found.offset}: a record batch"
                f" (offsets {found.offset}-{found.next_offset - 1}) Nemesis cannot decode"
                f" ({describe(found.error)}): the partition is stalled"
            )
            self._stalls[found.partition] = (session, reason)
            # Paused in the client for good (``resume`` leaves it): it drops its buffer of
            # the partition and fetches nothing more of it in this session.
            self._consumer.pause(TopicPartition(self._topic, found.partition))
            logger.error("reader of %s as %s: %s", self._topic, self._group, reason)
        return self._messages(found.taken)

    # --- committing ---------------------------------------------------------------

    async def commit(self, messages: Sequence[Message]) -> None:
        """Commits the offset after a run of one session's messages, fenced by the generation."""
        if not messages:
            return
        session = run_session(messages, KafkaSession, lambda s: s.owner is self)
        if not session.alive:
            return
        tp = TopicPartition(self._topic, session.partition)
        what = f"commit {self._topic}[{session.partition}] up to {messages[-1].offset}"
        try:
            async with asyncio.timeout(self._commit_timeout_s):
                await self._consumer.commit({tp: messages[-1].offset + 1})
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved on (a newer generation, or the partition is no longer ours):
            # the coordinator refused the commit. The partition's next owner reads on
            # from the last accepted commit.
            logger.info("%s refused, the partition session ends: %s", what, describe(exc))
            session.end()
            if self._sessions.get(session.partition) is session:
                del self._sessions[session.partition]
        except (KafkaError, TimeoutError) as exc:
            raise broker_error(exc, what) from exc

    # --- flow control and introspection ---------------------------------------------

    def pause(self, session: PartitionSession) -> None:
        """Stops fetching this session's partition until ``resume``."""
        own = self._own(session)
        if own is not None and not own.paused:
            own.paused = True
            self._consumer.pause(TopicPartition(self._topic, own.partition))

    def resume(self, session: PartitionSession) -> None:
        own = self._own(session)
        if own is not None and own.paused:
            own.paused = False
            if own.partition not in self.stalled_partitions():
                self._consumer.resume(TopicPartition(self._topic, own.partition))

    def _own(self, session: PartitionSession) -> KafkaSession | None:
        if not isinstance(session, KafkaSession) or session.owner is not self:
            return None
        if not session.alive or self._sessions.get(session.partition) is not session:
            return None
        return session

    def stalled(self) -> Mapping[tuple[str, int], str]:
        """The partitions stalled on a batch that cannot be decoded, with the reason."""
        return {(self._topic, p): why for p, why in self.stalled_partitions().items()}

    def stalled_partitions(self) -> dict[int, str]:
        """Stalls of the sessions held now; those of ended sessions are forgotten."""
        for partition, (session, _) in list(self._stalls.items()):
            if not session.alive or self._sessions.get(partition) is not session:
                del self._stalls[partition]
        return {partition: why for partition, (_, why) in self._stalls.items()}

    def interrupt(self) -> None:
        """Makes a waiting ``receive`` return now, with nothing (see the broker port)."""
        if self._wake is not None:
            self._wake.set()

    def sessions(self) -> Sequence[PartitionSession]:
        """The partitions the group assigns to this member now, one session each."""
        return sorted((s for s in self._sessions.values() if s.alive), key=lambda s: s.partition)

    @property
    def dropped(self) -> int:
        """Records fetched for partitions that were revoked before they were handed out."""
        return self._dropped

    # --- closing ------------------------------------------------------------------

    async def close(self, timeout_s: float = 5.0) -> None:
        """Leaves the group; uncommitted messages go to the partitions' next owners.

        Waits at least ``leave_timeout_s``: a member leaving while the group
        rebalances first waits for its pending join, up to the session timeout.
        """
        timeout_s = max(timeout_s, self._leave_timeout_s)
        if self._closed:
            return
        self._closed = True
        for session in self._sessions.values():
            session.end()
        self._sessions.clear()
        # Shielded: a stop cut short would leave the client's background tasks running;
        # on timeout it finishes on its own (the group expires the member meanwhile).
        closing = self._closing = asyncio.ensure_future(self._consumer.stop())
        closing.add_done_callback(_consume_exception)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(closing)
            await asyncio.sleep(0.05)  # see close_leftover_connections
            close_leftover_connections(self._consumer)
            return
        logger.warning(
            "reader of %s as %s did not stop in %.1fs", self._topic, self._group, timeout_s
        )


def _numbers(partitions: Any) -> list[int]:
    return sorted(tp.partition for tp in partitions)


def _consume_exception(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        logger.warning("a Kafka client stopped with an error: %s", describe(exc))
