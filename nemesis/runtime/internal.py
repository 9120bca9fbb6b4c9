"""One reader for an integration's internal flows: its retry tiers and its replay topic.

An integration reads its source topic in its main flow, and each of its
internal topics (``nemesis.retry.<name>.<n>``, ``nemesis.replay.<name>``) in a
flow of its own: each flow keeps its own runner, so a tier still waits for
its head's due time, the ``retry`` and ``replay`` rate limits still apply
separately, and commits stay per partition session of each topic. What they
share is the broker reader: one reader over all the internal topics (the
broker port's ``reader([...], consumer)``), seen by each flow's runner as a
source of its own topic (``FlowReader``, with the log's commit rule). Most
of the time these topics are empty; one waiting reader for four of them is
what keeps an idle integration cheap.

Reading: a flow that wants messages takes them from its queue; when the
queue is empty, one waiting flow at a time (the *pump*) reads the shared
reader and hands what it got to each flow's queue by topic, waking the
flows it fed. A flow that does not read (its buffer is full) keeps a bounded
queue: from ``delivery.buffer`` messages queued, the sessions of its queued
messages are paused at the shared reader (``Why.QUEUED``), until its queue is
back at half of that (the threshold rule of ``nemesis.runtime.pauses``). The
shared reader has one record of paused sessions (``SharedReader.pauses``),
and each flow's runner pauses through it too, so a session the runner paused
stays paused when the queue drains, and the other way round.

The flows are supervised together (``nemesis.runtime.app``): when one fails,
the others stop (draining and committing as at any stop), the shared reader
closes, and all of them start again over a new one; read positions live in
the reader, so no flow may go on over a reader another flow's restart would
have to rewind.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from nemesis.broker.port import Message, PartitionSession, TopicReader
from nemesis.broker.source import AckOrder
from nemesis.runtime.pauses import Pauses, Why, over_buffer


class SharedReader:
    """A broker reader over several topics, handed out as one ``FlowReader`` per topic.

    ``buffer`` gives the flows' ``delivery.buffer`` (asked each time: it
    changes while running), the bound of each flow's queue.
    """

    def __init__(
        self, reader: TopicReader, topics: Sequence[str], buffer: Callable[[], int]
    ) -> None:
        self.reader = reader
        self.buffer = buffer
        self.pauses = Pauses(reader)  # every view's and every flow's pauses of the reader
        self._views = {topic: FlowReader(self, topic) for topic in topics}
        self.pump: FlowReader | None = None
        self.reads = 0  # reads of the shared reader (for tests and statistics)

    def view(self, topic: str) -> FlowReader:
        """The reader of ``topic`` for its flow."""
        return self._views[topic]

    async def read(self, view: FlowReader, max_messages: int, timeout_s: float) -> None:
        """``view`` pumps: one read of the shared reader, handed out by topic."""
        self.pump = view
        try:
            self.reads += 1
            batch = await self.reader.receive(max_messages, timeout_s)
        finally:
            self.pump = None
            for other in self._views.values():
                if other is not view:
                    other.wake()  # one of the waiting flows pumps next
        self._route(batch)

    def _route(self, batch: Sequence[Message]) -> None:
        fed: set[FlowReader] = set()
        for message in batch:
            view = self._views.get(message.topic)
            if view is not None:
                view.queue.append(message)
                fed.add(view)
        for view in fed:
            view.wake()
            view.hold()

    async def close(self, timeout_s: float = 5.0) -> None:
        for view in self._views.values():
            view.close_view()
        await self.reader.close(timeout_s)


class FlowReader:
    """One flow's view of a ``SharedReader``: a source over one topic of the log."""

    def __init__(self, share: SharedReader, topic: str) -> None:
        self._share = share
        self.topic = topic
        self.queue: deque[Message] = deque()
        self._event = asyncio.Event()
        self._interrupted = False
        self._closed = False

    @property
    def ack_order(self) -> AckOrder:
        return AckOrder.PREFIX  # a topic of the log: its partitions commit their done prefix

    @property
    def pauses(self) -> Pauses:
        """The shared reader's record of paused sessions: the flow's runner pauses through it."""
        return self._share.pauses

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        """Up to ``max_messages`` of this topic; empty after ``timeout_s`` or an ``interrupt``."""
        if max_messages < 1:
            raise ValueError("max_messages must be at least 1")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._interrupted = False
        while True:
            if self.queue:
                return self._take(max_messages)
            if self._closed:
                raise RuntimeError("the reader is closed")
            remaining = deadline - loop.time()
            if remaining <= 0 or self.interrupted():
                return ()
            if self._share.pump is None:
                await self._share.read(self, max_messages, remaining)
                continue
            self._event.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._event.wait()
            except TimeoutError:
                return ()

    def _take(self, max_messages: int) -> list[Message]:
        queue = self.queue
        count = min(max_messages, len(queue))
        taken = [queue.popleft() for _ in range(count)]
        pauses = self._share.pauses
        if pauses and not over_buffer(len(queue), self._share.buffer(), paused=True):
            pauses.resume_all(Why.QUEUED, self.topic)
        return taken

    def hold(self) -> None:
        """Pauses the sessions of the queued messages from a buffer's worth of them: the flow
        does not keep up."""
        queue = self.queue
        pauses = self._share.pauses
        holding = pauses and any(pauses.sessions(Why.QUEUED, self.topic))
        if not over_buffer(len(queue), self._share.buffer(), paused=bool(holding)):
            return
        seen: PartitionSession | None = None
        for message in queue:
            session = message.session
            if session is not None and session is not seen and session.alive:
                pauses.pause(session, Why.QUEUED)
                seen = session

    def wake(self) -> None:
        self._event.set()

    def interrupted(self) -> bool:
        return self._interrupted

    def interrupt(self) -> None:
        """Makes a waiting ``receive`` return now (its read of the shared reader too)."""
        self._interrupted = True
        self._event.set()
        if self._share.pump is self:
            self._share.reader.interrupt()

    async def commit(self, messages: Sequence[Message]) -> None:
        if messages and messages[0].alive:
            await self._share.reader.commit(messages)

    def pause(self, session: PartitionSession) -> None:
        """The port's flow control, as ``pauses.pause(session, Why.UNCOMMITTED)``.

        The runner pauses through ``pauses`` with its reasons; this is for a
        caller of the source port that gives none.
        """
        self._share.pauses.pause(session, Why.UNCOMMITTED)

    def resume(self, session: PartitionSession) -> None:
        self._share.pauses.resume(session, Why.UNCOMMITTED)

    def sessions(self) -> Sequence[PartitionSession]:
        return [s for s in self._share.reader.sessions() if s.topic == self.topic]

    def stalled(self) -> Mapping[tuple[str, int], str]:
        stalled = self._share.reader.stalled()
        return {key: why for key, why in stalled.items() if key[0] == self.topic}

    async def close(self, timeout_s: float = 5.0) -> None:
        """The flow is done with it; the shared reader is closed by whoever opened it."""
        self.close_view()

    def close_view(self) -> None:
        self._closed = True
        self.queue.clear()
        self._event.set()
