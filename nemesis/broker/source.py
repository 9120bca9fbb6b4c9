"""The source port: where an integration's messages come from, and how each is acknowledged.

A *source* hands out messages and is told which of them finished. It is all
the runner needs to read: a log (Kafka, YDB, the embedded log) is one source,
a queue (the SQS API) another. What tells them apart is the rule that turns
finished messages into progress at the source:

* ``AckOrder.PREFIX`` (a log): a partition's position moves only past a
  contiguous run of finished messages, so a message that does not finish
  holds back everything read after it in its partition. The runner tracks the
  runs and commits the finished prefix of each partition session.
* ``AckOrder.ANY`` (a queue): each message is acknowledged on its own (SQS:
  deleted by its receipt handle), in whatever order it finished; one that
  does not finish holds back nothing but itself.

A source's messages are ``broker.port.Message`` values: a queue fills
``topic`` with the queue's name, ``partition`` with 0 (or its shard where it
has one), ``offset`` with a number of its own that grows with each message
it hands out (unique per session, never a position to seek to), and
``session`` with a session that stays alive for the source's lifetime.
``metadata`` carries the queue's message attributes and the source's own
(the message id, the receive count) under the names the source documents.

The log, where there is one, is apart from the source: retry tiers and replay
are topics of a log backend (``broker.port.Broker``), which may be another
system than the source (a queue whose tiers live on Kafka), or none at all for
a source that can give a message back to come again later (``Releases``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from nemesis.broker.port import Message, PartitionSession


class AckOrder(enum.Enum):
    PREFIX = "prefix"  # a log: commit the contiguous finished run of each partition session
    ANY = "any"  # a queue: acknowledge each finished message on its own


class Source(Protocol):
    """What an integration reads: messages in, acknowledgements out."""

    @property
    def ack_order(self) -> AckOrder: ...

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        """Up to ``max_messages``; an empty sequence when nothing arrived in ``timeout_s``.

        An idle source costs nothing: a receive with nothing to read waits
        (a long poll) rather than loops.
        """
        ...

    async def commit(self, messages: Sequence[Message]) -> None:
        """Acknowledges finished messages of one session.

        ``PREFIX``: a contiguous run in offset order. ``ANY``: any finished
        messages, in any order. Messages of a dead session are ignored (they
        come again to whoever reads them next).
        """
        ...

    def pause(self, session: PartitionSession) -> None:
        """Stop handing out messages of this session until ``resume`` (flow control)."""
        ...

    def resume(self, session: PartitionSession) -> None: ...

    def interrupt(self) -> None:
        """Makes a ``receive`` waiting now return at once; nothing read is lost by it."""
        ...

    def sessions(self) -> Sequence[PartitionSession]:
        """The sessions this source holds now."""
        ...

    def stalled(self) -> Mapping[tuple[str, int], str]:
        """Sessions held and delivering nothing, by (topic, partition), with the reason."""
        ...

    async def close(self, timeout_s: float = 5.0) -> None: ...


@runtime_checkable
class Releases(Protocol):
    """A source that can give a message back to come again after a delay (SQS: visibility).

    With it, retries need no tier topics: a failed message is released for
    its tier's delay and comes back with its receive count grown by one, the
    attempt it is (``attempt``). A released message is finished for its
    reader: acknowledging it afterwards (``commit``) does nothing, so the
    runner finishes it like any other and it is not deleted.
    """

    @property
    def max_release_delay_s(self) -> float:
        """The longest delay the source can give (SQS: 12 hours of visibility timeout)."""
        ...

    async def release(self, messages: Sequence[Message], delay_s: float) -> None:
        """Hands ``messages`` back unacknowledged, to be received again after ``delay_s``."""
        ...

    def attempt(self, message: Message) -> int:
        """Which delivery of ``message`` this is, 1 the first time (SQS: its receive count)."""
        ...


@runtime_checkable
class TakesRequeues(Protocol):
    """A source a dead letter can be sent back to (``nemesis.dlq.requeue``), not a log's replay.

    Its dead letters keep ``return_address`` in their metadata: what a
    requeue needs to reach the source again, from any process with access.
    """

    def return_address(self) -> Mapping[str, str]: ...
