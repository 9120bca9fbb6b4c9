"""A log as a source: a topic reader whose commits follow the contiguous-prefix rule.

A log's reader (``broker.port.TopicReader``) already hands out messages and
takes commits of runs of one partition session; what makes it a *source*
(``broker.source.Source``) is the rule the runner applies to what finished:
``AckOrder.PREFIX``, the contiguous done run of each partition session
(``nemesis.runtime.acks.PartitionAcks``). ``LogSource`` says so and passes
every call on to the reader unchanged, so a log backend read through it
behaves exactly as its reader does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

from nemesis.broker.port import EARLIEST, Broker, Message, PartitionSession, StartFrom, TopicReader
from nemesis.broker.source import AckOrder, Source

# What a runner is given to read from: it opens the source when it starts.
SourceOpener = Callable[[], Awaitable[Source]]


class LogSource:
    """A ``TopicReader`` seen as a ``Source`` with the log's commit rule (``PREFIX``)."""

    def __init__(self, reader: TopicReader) -> None:
        self.reader = reader

    @property
    def ack_order(self) -> AckOrder:
        return AckOrder.PREFIX

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        return await self.reader.receive(max_messages, timeout_s)

    async def commit(self, messages: Sequence[Message]) -> None:
        """Commits a contiguous run of one partition session, in offset order."""
        await self.reader.commit(messages)

    def pause(self, session: PartitionSession) -> None:
        self.reader.pause(session)

    def resume(self, session: PartitionSession) -> None:
        self.reader.resume(session)

    def interrupt(self) -> None:
        self.reader.interrupt()

    def sessions(self) -> Sequence[PartitionSession]:
        return self.reader.sessions()

    def stalled(self) -> Mapping[tuple[str, int], str]:
        return self.reader.stalled()

    async def close(self, timeout_s: float = 5.0) -> None:
        await self.reader.close(timeout_s)


def log_source(
    broker: Broker,
    topic: str | Sequence[str],
    consumer: str,
    *,
    start_from: StartFrom | Callable[[], StartFrom] = EARLIEST,
) -> SourceOpener:
    """Opens ``broker``'s reader of ``topic`` as ``consumer``, as a source, when called.

    ``start_from`` may be a function: it is asked when the source opens (a
    duration back from now counts from then).
    """

    async def open_log() -> Source:
        start = start_from() if callable(start_from) else start_from
        return LogSource(await broker.reader(topic, consumer, start_from=start))

    return open_log
