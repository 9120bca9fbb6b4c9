"""Exactly-once moves on YDB: a batch read, its tier writes, its DLQ rows and its
offsets, in one transaction.

YDB can commit a reader's offsets in a table transaction: a batch received
with ``receive_batch_with_tx(tx)`` is committed when ``tx`` commits, together
with whatever ``tx_writer(tx, topic)`` wrote and the rows ``tx.execute``
changed. ``TransactionalMover`` uses that for one pattern: read a batch,
decide where every message of it goes (``decide``), write the moves, commit.
Either all of it happens or none of it, and a retried transaction reads the
batch again (the SDK reconnects the reader after a rollback).

Where this does not apply: Nemesis' runner hands messages to many workers,
finishes them out of order, and commits the contiguous done prefix later.
A message that fails while earlier ones are still in flight cannot have its
offset committed with its move (YDB refuses an offset range with a gap in a
transaction), so the runner moves first (tier write, or DLQ UPSERT), acks
after, and relies on idempotence instead: the DLQ row is keyed by the event
id, and a duplicate in a retry tier reaches the handler under the same
``ce-id``. See ``nemesis/broker/ydb/README.md``.

Rules the SDK imposes, kept here: the transaction is committed by
``retry_tx_async`` after the callee returns, never by
``execute(commit_tx=True)`` (that would skip the SDK's hooks that commit the
offsets and flush the transaction's writers); ``decide`` may run more than
once for the same messages, so it must not have effects of its own beyond
what it returns (or they must be idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from ydb import TopicReaderAsyncIO, TopicReaderMessage, issues
from ydb.aio.query.pool import QuerySessionPool
from ydb.aio.query.transaction import QueryTxContext

from nemesis.broker.port import Message, OutgoingMessage
from nemesis.broker.ydb.broker import YdbBroker
from nemesis.broker.ydb.errors import broker_error, topic_call
from nemesis.broker.ydb.mapping import (
    YdbSession,
    sdk_session,
    session_key,
    to_message,
    to_sdk_message,
)
from nemesis.broker.ydb.reader import close_sdk_reader
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.dlq.port import DeadLetter
from nemesis.dlq.ydb import YdbDeadLetterStore
from nemesis.errors import TopicNotFound


@dataclass(frozen=True, slots=True)
class Moves:
    """Where the messages of one batch go; a message not named here is simply done."""

    to_topics: Mapping[str, Sequence[OutgoingMessage]] = field(default_factory=dict)
    dead_letters: Sequence[DeadLetter] = ()


Decide = Callable[[Sequence[Message]], Awaitable[Moves]]

# The SDK leaves it untyped: it waits until the reader holds at least one message.
_wait_message = cast(
    Callable[[TopicReaderAsyncIO], Awaitable[None]], TopicReaderAsyncIO.wait_message
)


class TransactionalMover:
    """Reads ``topic`` as ``consumer`` and settles each batch in one YDB transaction."""

    def __init__(
        self,
        broker: YdbBroker,
        pool: QuerySessionPool,
        *,
        topic: str,
        consumer: str,
        dlq: YdbDeadLetterStore | None = None,
        timeout_s: float = 30.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._broker = broker
        self._pool = pool
        self._topic = topic
        self._consumer = consumer
        self._dlq = dlq
        self._timeout_s = timeout_s
        self._clock = clock
        self._sdk: TopicReaderAsyncIO | None = None
        self._waiting: asyncio.Task[None] | None = None
        self._sessions: dict[tuple[int, int], YdbSession] = {}
        self._serials = itertools.count(1)
        self._closing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Opens the mover's own SDK reader (TopicNotFound without the topic or consumer)."""
        if self._consumer not in await self._broker.admin.consumers(self._topic):
            raise TopicNotFound(f"topic {self._topic} has no consumer {self._consumer}")
        self._sdk = self._broker.topics.reader(
            self._broker.admin.path(self._topic), consumer=self._consumer
        )

    async def settle_next(
        self, decide: Decide, *, max_messages: int = 100, wait_s: float = 1.0
    ) -> int:
        """Settles the next batch; how many messages it held (0: none came in ``wait_s``)."""
        sdk = self._sdk
        if sdk is None:
            raise RuntimeError("the mover is not started")
        if not await self._data_arrived(sdk, wait_s):
            return 0
        settled = 0

        async def settle(tx: QueryTxContext) -> None:
            nonlocal settled
            settled = 0
            batch = await sdk.receive_batch_with_tx(tx, max_messages=max_messages)
            if batch is None:
                return
            messages = [self._message(m) for m in batch.messages]
            moves = await decide(messages)
            now = self._clock.time()
            for topic, outgoing in moves.to_topics.items():
                if not outgoing:
                    continue
                writer = self._broker.topics.tx_writer(
                    tx, self._broker.admin.path(topic), auto_created_at=False
                )
                await writer.write([to_sdk_message(m, None, now) for m in outgoing])
            if moves.dead_letters:
                if self._dlq is None:
                    raise RuntimeError("dead letters to write, but the mover has no DLQ store")
                await self._dlq.put_in(tx, moves.dead_letters)
            settled = len(messages)

        await topic_call(
            f"settle a batch of {self._topic} as {self._consumer}",
            self._pool.retry_tx_async(settle),
            self._timeout_s,
        )
        return settled

    async def _data_arrived(self, sdk: TopicReaderAsyncIO, wait_s: float) -> bool:
        # Waiting happens outside the transaction, on a task that outlives one
        # call: wait_message takes nothing from the reader, so giving up on it
        # loses nothing, and no transaction stays open while the topic is idle.
        waiting = self._waiting
        if waiting is None:
            waiting = asyncio.ensure_future(_wait_message(sdk))
            self._waiting = waiting
        await asyncio.wait((waiting,), timeout=wait_s)
        if not waiting.done():
            return False
        self._waiting = None
        try:
            waiting.result()
        except issues.Error as exc:
            raise broker_error(exc, f"read {self._topic} as {self._consumer}") from exc
        return True

    def _message(self, received: TopicReaderMessage) -> Message:
        sdk = sdk_session(received)
        key = session_key(sdk)
        session = self._sessions.get(key)
        if session is None:
            session = YdbSession(self._topic, sdk, next(self._serials), owner=self)
            self._sessions[key] = session
        return to_message(self._topic, received, session)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Closes the mover's reader; a batch not settled is read again by the next reader."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError, issues.Error):
                await waiting
        sdk, self._sdk = self._sdk, None
        if sdk is not None:
            self._closing = await close_sdk_reader(
                sdk, timeout_s, f"transactional reader of {self._topic} as {self._consumer}"
            )
        self._sessions.clear()
