"""One embedded reader over several topics: a part per topic, one wait for all.

Each part is an ordinary ``EmbeddedReader`` of one topic (its leases, rings,
tail cache and commits are its own); what the parts share is the waiting.
``receive`` asks each part for what it can read now, without waiting, and
when none has anything it waits once: for a part's wake-up (an append, a
ring, a new lease, a resume), for the earliest poll a part has due, for the
timeout, or for ``interrupt``. So an integration's retry tiers and replay
topic cost one waiting reader instead of one each, and, like a single
reader, nothing while no one writes to them.

Parts are read in turns (the first part of one read is the second of the
next), so a busy topic does not starve the others; commits, pauses and
sessions go to the part of the session's topic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from nemesis.broker.embedded.reader import EmbeddedReader, ReaderStatistics
from nemesis.broker.port import Message, PartitionSession


class EmbeddedMultiReader:
    """Reads several topics as one consumer (see the module docstring)."""

    def __init__(self, parts: Sequence[EmbeddedReader]) -> None:
        if not parts:
            raise ValueError("a multi-topic reader needs at least one part")
        self._parts = list(parts)
        self._by_topic = {part.topic: part for part in parts}
        if len(self._by_topic) != len(self._parts):
            raise ValueError("each topic may have one part only")
        self._turn = 0
        self._waiter: asyncio.Future[None] | None = None
        self._woken = False
        self._interrupted = False
        self._closed = False
        for part in parts:
            part.on_wake = self._wake

    @property
    def topics(self) -> list[str]:
        return [part.topic for part in self._parts]

    @property
    def parts(self) -> Sequence[EmbeddedReader]:
        return tuple(self._parts)

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        """Up to ``max_messages`` of one part; empty after ``timeout_s`` or an ``interrupt``."""
        if max_messages < 1:
            raise ValueError("max_messages must be at least 1")
        if self._closed:
            raise RuntimeError("the reader is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._interrupted = False
        parts = self._parts
        while True:
            self._woken = False
            self._turn = (self._turn + 1) % len(parts)
            for index in range(len(parts)):
                if self.interrupted():
                    return ()
                part = parts[(self._turn + index) % len(parts)]
                batch = await part.try_receive(max_messages)
                if batch:
                    return batch
            remaining = deadline - loop.time()
            if remaining <= 0 or self.interrupted():
                return ()
            if self._woken:
                continue  # woken while the parts were being read: look again
            poll_s = min(part.poll_due_in() for part in parts)
            await self._wait(min(remaining, poll_s))
            if self.interrupted():
                return ()

    async def _wait(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(seconds, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        self._woken = True
        waiter = self._waiter
        if waiter is not None:
            _resolve(waiter)

    def interrupted(self) -> bool:
        """``interrupt`` (or ``close``) was called since the current ``receive`` began."""
        return self._interrupted or self._closed

    def stalled(self) -> Mapping[tuple[str, int], str]:
        """None here: every message of an assigned partition is read (see the broker port)."""
        return {}

    def interrupt(self) -> None:
        """Makes a waiting ``receive`` return now (see the broker port)."""
        self._interrupted = True
        waiter = self._waiter
        if waiter is not None:
            _resolve(waiter)

    async def commit(self, messages: Sequence[Message]) -> None:
        """Commits a run of one partition session's messages (through its topic's part)."""
        if not messages:
            return
        await self._part(messages[0].topic).commit(messages)

    def pause(self, session: PartitionSession) -> None:
        part = self._by_topic.get(session.topic)
        if part is not None:
            part.pause(session)

    def resume(self, session: PartitionSession) -> None:
        part = self._by_topic.get(session.topic)
        if part is not None:
            part.resume(session)

    def sessions(self) -> Sequence[PartitionSession]:
        """The live sessions of every part, by topic and partition."""
        return [session for part in self._parts for session in part.sessions()]

    def statistics(self) -> list[ReaderStatistics]:
        """Each part's statistics, in the order of the topics."""
        return [part.statistics() for part in self._parts]

    async def close(self, timeout_s: float = 5.0) -> None:
        """Closes every part (each releases its leases)."""
        if self._closed:
            return
        self._closed = True
        self.interrupt()
        for part in self._parts:
            await part.close(timeout_s)

    def _part(self, topic: str) -> EmbeddedReader:
        part = self._by_topic.get(topic)
        if part is None:
            raise ValueError(f"this reader does not read {topic}")
        return part


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
