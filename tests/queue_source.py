"""A test double: an in-memory queue source (``AckOrder.ANY``), for runner tests.

Not a backend: it stands for a queue (SQS-like) in tests of the runner's
any-order commit rule. Messages are handed out once, in order, each with a
growing offset in one session that lives as long as the source; a commit
acknowledges (deletes) exactly the messages given, in any order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nemesis.broker.port import Message
from nemesis.broker.source import AckOrder


@dataclass(frozen=True, slots=True)
class QueueSession:
    topic: str
    partition: int = 0
    id: int = 1
    alive: bool = True


@dataclass
class MemoryQueue:
    """The queue behind the source: what waits, and what was acknowledged, in order."""

    name: str = "jobs"
    waiting: deque[Message] = field(default_factory=deque)
    acknowledged: list[int] = field(default_factory=list)  # offsets, in commit order
    handed_out: int = 0
    _next: int = 0

    def put(self, *values: bytes) -> None:
        session = SESSIONS.setdefault(self.name, QueueSession(self.name))
        for value in values:
            self.waiting.append(Message(self.name, 0, self._next, value, session=session))
            self._next += 1


SESSIONS: dict[str, QueueSession] = {}


class MemoryQueueSource:
    """``Source`` over a ``MemoryQueue``: each message acknowledged on its own."""

    def __init__(self, queue: MemoryQueue) -> None:
        self.queue = queue
        self._wake = asyncio.Event()
        self.paused = False
        self.closed = False

    @property
    def ack_order(self) -> AckOrder:
        return AckOrder.ANY

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        if not self.queue.waiting or self.paused:
            self._wake.clear()
            try:
                async with asyncio.timeout(min(timeout_s, 0.05)):
                    await self._wake.wait()
            except TimeoutError:
                pass
            if self.paused:
                return ()
        taken: list[Message] = []
        while self.queue.waiting and len(taken) < max_messages:
            taken.append(self.queue.waiting.popleft())
        self.queue.handed_out += len(taken)
        return taken

    async def commit(self, messages: Sequence[Message]) -> None:
        self.queue.acknowledged.extend(m.offset for m in messages)

    def pause(self, session: object) -> None:
        self.paused = True

    def resume(self, session: object) -> None:
        self.paused = False
        self._wake.set()

    def interrupt(self) -> None:
        self._wake.set()

    def sessions(self) -> Sequence[QueueSession]:
        return [SESSIONS.setdefault(self.queue.name, QueueSession(self.queue.name))]

    def stalled(self) -> Mapping[tuple[str, int], str]:
        return {}

    async def close(self, timeout_s: float = 5.0) -> None:
        self.closed = True
