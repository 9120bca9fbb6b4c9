"""Acknowledgement tracking per session: the commit rule of a source's ``ack_order``.

Messages of one session are read in offset order but finish in any order
(many workers per session). What may be committed depends on the source
(``nemesis.broker.source.AckOrder``):

* ``PREFIX`` (a log, ``PartitionAcks``): an offset may be committed only when
  every message before it is done, so each partition session keeps its
  read-but-not-committed messages in read order and, on demand, hands out the
  contiguous done prefix (uForwarder's AckTrackingQueue). A message that never
  finishes holds its partition's commit point where it is; the runner bounds
  how many messages may pile up behind it by pausing that partition (see
  ``outstanding``) or by holding it back (``blocked``).
* ``ANY`` (a queue, ``AnyOrderAcks``): each done message is committable at
  once, whatever is unfinished before it; nothing is ever ``blocked``.

Sessions are tracked apart: when a session dies (a revoked partition)
everything tracked for it is forgotten, never committed; the new owner reads
those messages again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from nemesis.broker.port import Message, PartitionSession
from nemesis.broker.source import AckOrder

SessionKey = tuple[str, int, int]  # topic, partition, session id


def session_key(message: Message) -> SessionKey:
    session_id = message.session.id if message.session is not None else 0
    return (message.topic, message.partition, session_id)


@dataclass(frozen=True, slots=True)
class PartitionStats:
    topic: str
    partition: int
    outstanding: int  # read, not committed
    unfinished: int  # read, not done
    oldest_unfinished_offset: int | None
    oldest_unfinished_written_at: float | None


class SessionAcks(Protocol):
    """The read-but-not-committed messages of one session, under one commit rule."""

    @property
    def session(self) -> PartitionSession | None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def outstanding(self) -> int:
        """Messages read and not yet committed (done ones waiting for the commit included)."""
        ...

    @property
    def unfinished(self) -> int: ...

    @property
    def blocked(self) -> bool:
        """Whether nothing of it can be committed for an unfinished message (held back)."""
        ...

    def extend(self, messages: Sequence[Message]) -> None:
        """Tracks a run of messages of this session, in increasing offset order."""
        ...

    def ack(self, message: Message) -> bool:
        """Marks a message done; False if it is not tracked (or was done already)."""
        ...

    def ack_all(self, messages: Sequence[Message]) -> int:
        """Marks messages done, as ``ack`` would each; returns how many were newly done."""
        ...

    def take_committable(self) -> list[Message]:
        """Removes and returns what may be committed now, in one commit of the session."""
        ...

    def oldest_unfinished(self) -> Message | None: ...

    def clear(self) -> int:
        """Forgets everything; returns how many unfinished messages were dropped."""
        ...


class PartitionAcks:
    """The read-but-not-committed messages of one partition session, in read order.

    Kept as the messages themselves in a deque plus the set of done offsets:
    adding a run of messages is one ``deque.extend`` and the commit point moves
    with ``popleft``, with no per-message record (this runs for every message).
    """

    __slots__ = ("_done", "_pending", "_unfinished", "session")

    def __init__(self, session: PartitionSession | None) -> None:
        self.session = session
        self._pending: deque[Message] = deque()
        self._done: set[int] = set()  # offsets of done messages still in _pending
        self._unfinished = 0

    @property
    def alive(self) -> bool:
        return self.session is None or self.session.alive

    @property
    def outstanding(self) -> int:
        """Messages read and not yet committed (done ones waiting behind a gap included)."""
        return len(self._pending)

    @property
    def unfinished(self) -> int:
        return self._unfinished

    def add(self, message: Message) -> None:
        self.extend((message,))

    def extend(self, messages: Sequence[Message]) -> None:
        """Tracks a run of messages of this session, in increasing offset order."""
        if not messages:
            return
        pending = self._pending
        previous = pending[-1].offset if pending else -1
        for message in messages:
            # One comparison per message: offsets only ever grow within a session.
            if message.offset <= previous:
                raise ValueError(
                    f"offset {message.offset} read after {previous} "
                    f"in {message.topic}/{message.partition}"
                )
            previous = message.offset
        pending.extend(messages)
        self._unfinished += len(messages)

    def ack(self, message: Message) -> bool:
        """Marks a message done; False if it is not tracked (or was done already)."""
        offset, pending, done = message.offset, self._pending, self._done
        # Tracked messages are exactly the pending ones; offsets between them that
        # were never read (gaps) are never acknowledged by the runner.
        if not pending or offset < pending[0].offset or offset > pending[-1].offset:
            return False
        if offset in done:
            return False
        done.add(offset)
        self._unfinished -= 1
        return True

    def ack_all(self, messages: Sequence[Message]) -> int:
        """Marks messages done, as ``ack`` would each; returns how many were newly done."""
        pending = self._pending
        if not pending:
            return 0
        low, high, done = pending[0].offset, pending[-1].offset, self._done
        before = len(done)
        done.update([m.offset for m in messages if low <= m.offset <= high])
        acked = len(done) - before
        self._unfinished -= acked
        return acked

    def take_committable(self) -> list[Message]:
        """Removes and returns the contiguous done prefix, in offset order."""
        pending, done = self._pending, self._done
        taken: list[Message] = []
        while pending and pending[0].offset in done:
            message = pending.popleft()
            done.discard(message.offset)
            taken.append(message)
        return taken

    @property
    def blocked(self) -> bool:
        """Whether its first uncommitted message is unfinished: nothing of it can be committed."""
        pending = self._pending
        return bool(pending) and pending[0].offset not in self._done

    def oldest_unfinished(self) -> Message | None:
        done = self._done
        for message in self._pending:
            if message.offset not in done:
                return message
        return None

    def clear(self) -> int:
        """Forgets everything; returns how many unfinished messages were dropped."""
        dropped = self._unfinished
        self._pending.clear()
        self._done.clear()
        self._unfinished = 0
        return dropped


class AnyOrderAcks:
    """The read-but-not-committed messages of one queue session: each done one is committable.

    Kept as two dicts by offset (insertion order is read order): the
    unfinished messages and the done ones not yet taken for a commit.
    """

    __slots__ = ("_done", "_last", "_open", "session")

    def __init__(self, session: PartitionSession | None) -> None:
        self.session = session
        self._open: dict[int, Message] = {}
        self._done: dict[int, Message] = {}
        self._last = -1

    @property
    def alive(self) -> bool:
        return self.session is None or self.session.alive

    @property
    def outstanding(self) -> int:
        return len(self._open) + len(self._done)

    @property
    def unfinished(self) -> int:
        return len(self._open)

    @property
    def blocked(self) -> bool:
        return False  # an unfinished message holds back nothing but itself

    def extend(self, messages: Sequence[Message]) -> None:
        previous, opened = self._last, self._open
        for message in messages:
            # A source's offsets grow within a session: one comparison keeps them unique.
            if message.offset <= previous:
                raise ValueError(
                    f"offset {message.offset} read after {previous} "
                    f"in {message.topic}/{message.partition}"
                )
            previous = message.offset
            opened[previous] = message
        self._last = previous

    def ack(self, message: Message) -> bool:
        found = self._open.pop(message.offset, None)
        if found is None:
            return False
        self._done[message.offset] = found
        return True

    def ack_all(self, messages: Sequence[Message]) -> int:
        ack = self.ack
        return sum(1 for message in messages if ack(message))

    def take_committable(self) -> list[Message]:
        """Every done message, in the order they finished."""
        taken = list(self._done.values())
        self._done.clear()
        return taken

    def oldest_unfinished(self) -> Message | None:
        return next(iter(self._open.values()), None)

    def clear(self) -> int:
        dropped = len(self._open)
        self._open.clear()
        self._done.clear()
        return dropped


class AckTracker:
    """Acknowledgements of every session a runner holds, under its source's ``ack_order``."""

    def __init__(self, order: AckOrder = AckOrder.PREFIX) -> None:
        self._partitions: dict[SessionKey, SessionAcks] = {}
        self._unfinished = 0
        self.order = order
        self._kind: type[PartitionAcks] | type[AnyOrderAcks] = _ACKS_OF[order]

    def use(self, order: AckOrder) -> None:
        """Takes the commit rule of the source just opened; nothing may be tracked yet."""
        if self._partitions:
            raise RuntimeError("the commit rule changes only while nothing is tracked")
        self.order = order
        self._kind = _ACKS_OF[order]

    @property
    def unfinished(self) -> int:
        """Messages read and not done, across all live sessions (the buffer's fill)."""
        return self._unfinished

    @property
    def outstanding(self) -> int:
        return sum(p.outstanding for p in self._partitions.values())

    def partitions(self) -> Iterator[SessionAcks]:
        return iter(list(self._partitions.values()))

    def partition_of(self, message: Message) -> SessionAcks | None:
        return self._partitions.get(session_key(message))

    def add(self, message: Message) -> SessionAcks:
        return self.extend((message,))

    def extend(self, messages: Sequence[Message]) -> SessionAcks:
        """Tracks a run of messages of one session, in increasing offset order."""
        key = session_key(messages[0])
        acks = self._partitions.get(key)
        if acks is None:
            acks = self._partitions[key] = self._kind(messages[0].session)
        acks.extend(messages)
        self._unfinished += len(messages)
        return acks

    def acked(self, count: int) -> None:
        """Counts ``count`` messages marked done through their ``PartitionAcks`` directly.

        The runner keeps each message's ``PartitionAcks`` (``extend`` returns it)
        and acknowledges there, then reports how many acks took (returned True).
        A forgotten session's ``PartitionAcks`` is empty and refuses every ack.
        """
        self._unfinished -= count

    def ack(self, message: Message) -> bool:
        """Marks a message done; a message of a forgotten session is ignored."""
        acks = self._partitions.get(session_key(message))
        if acks is None or not acks.ack(message):
            return False
        self._unfinished -= 1
        return True

    def take_committable(self) -> list[list[Message]]:
        """What each live session may commit now (a log's: its done prefix); dead ones are
        forgotten."""
        runs: list[list[Message]] = []
        for key, acks in list(self._partitions.items()):
            if not acks.alive:
                self._unfinished -= acks.clear()
                del self._partitions[key]
                continue
            run = acks.take_committable()
            if run:
                runs.append(run)
        return runs

    def forget_dead(self) -> int:
        """Drops dead sessions at once; returns how many unfinished messages went with them."""
        dropped = 0
        for key, acks in list(self._partitions.items()):
            if not acks.alive:
                dropped += acks.clear()
                del self._partitions[key]
        self._unfinished -= dropped
        return dropped

    def statistics(self) -> list[PartitionStats]:
        stats = []
        for (topic, partition, _), acks in self._partitions.items():
            oldest = acks.oldest_unfinished()
            stats.append(
                PartitionStats(
                    topic=topic,
                    partition=partition,
                    outstanding=acks.outstanding,
                    unfinished=acks.unfinished,
                    oldest_unfinished_offset=None if oldest is None else oldest.offset,
                    oldest_unfinished_written_at=None if oldest is None else oldest.written_at,
                )
            )
        return stats


_ACKS_OF: dict[AckOrder, type[PartitionAcks] | type[AnyOrderAcks]] = {
    AckOrder.PREFIX: PartitionAcks,
    AckOrder.ANY: AnyOrderAcks,
}
