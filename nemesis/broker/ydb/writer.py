"""The YDB writer: one SDK writer per partition it writes to, each its own producer.

Partitions. A YDB writer session writes to one partition, so a writer keeps
a lane (an SDK writer with ``partition_id``) per partition it has used,
opened on first use. Each lane writes as its own producer, ``<producer
id>.p<partition>`` (``lane_producer_id``): YDB binds a producer id to the
first partition it writes to (for 14 days) and refuses it on any other,
with an error the SDK does not retry. A message goes to its ``partition`` if given, else to
``partition_for_key(key)`` (``nemesis.broker.port``: the embedded backend's hash too), else to
the producer's home partition, ``partition_for_key(producer_id)``. Unkeyed
messages are not spread round-robin as on the embedded backend: a retry of
a batch must reach the partition that de-duplicates it, and writers with
different (random) producer ids spread over the partitions anyway.

De-duplication. YDB skips a message whose seqno is not above the last seqno
of its producer *in that partition*; a lane's producer id names the
partition, so a reopened lane finds its own last seqno and nothing else's.
Seqnos are always explicit here (``auto_seqno=False``): a message with a
seqno keeps it, one without gets the lane's next. A seqno at or below the
lane's last is reported as a duplicate without being sent (the SDK would
raise on it), and one the server skips is a duplicate too.

Acknowledgement. ``write`` returns when the server acknowledged every
message (``write_with_ack``), bounded by ``timeout_s``. A lane that timed
out or failed is closed and reopened on the next write: the new session
learns the server's last seqno, so a retry of the batch with the same
seqnos writes exactly what was missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from ydb import TopicClientAsyncIO, TopicWriterAsyncIO, TopicWriterMessage, issues
from ydb._topic_writer.topic_writer import PublicWriteResult

from nemesis.broker.port import OutgoingMessage, WriteResult, WriteStatus, partition_for_key
from nemesis.broker.ydb.errors import broker_error
from nemesis.broker.ydb.mapping import to_sdk_message
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.errors import BrokerError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Lane:
    """One partition's SDK writer, and the last seqno it has sent."""

    partition: int
    sdk: TopicWriterAsyncIO
    last_seqno: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class YdbWriter:
    """Writes to one topic as one producer; see the module docstring."""

    def __init__(
        self,
        topics: TopicClientAsyncIO,
        *,
        topic: str,
        path: str,
        producer_id: str,
        partitions: int,
        open_timeout_s: float = 10.0,
        close_timeout_s: float = 5.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if partitions < 1:
            raise ValueError("a topic has at least one partition")
        self._topics = topics
        self._topic = topic
        self._path = path
        self._producer_id = producer_id
        self._partitions = partitions
        self._open_timeout_s = open_timeout_s
        self._close_timeout_s = close_timeout_s
        self._clock = clock
        self._lanes: dict[int, _Lane] = {}
        self._opening: dict[int, asyncio.Lock] = {}
        self._closed = False

    @property
    def producer_id(self) -> str:
        return self._producer_id

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def closed(self) -> bool:
        return self._closed

    def partition_of(self, message: OutgoingMessage) -> int:
        """Where ``message`` goes (see the module docstring)."""
        if message.partition is not None:
            if not 0 <= message.partition < self._partitions:
                raise ValueError(
                    f"partition {message.partition} is out of range for {self._topic}"
                    f" ({self._partitions} partitions)"
                )
            return message.partition
        key = message.key if message.key is not None else self._producer_id
        return partition_for_key(key, self._partitions)

    async def write(
        self, messages: Sequence[OutgoingMessage], timeout_s: float = 10.0
    ) -> Sequence[WriteResult]:
        """Writes ``messages`` and waits for the server's acks; per message, written or skipped.

        On BrokerTimeout the batch may or may not have been written: retry
        it with the same seqnos and what was written is skipped.
        """
        if self._closed:
            raise RuntimeError("the writer is closed")
        if not messages:
            return []
        by_partition: dict[int, list[int]] = {}
        for index, message in enumerate(messages):
            by_partition.setdefault(self.partition_of(message), []).append(index)
        results: list[WriteResult | None] = [None] * len(messages)
        deadline = asyncio.get_running_loop().time() + timeout_s
        # Every lane runs to its own end: one lane's failure must not cancel
        # another's write half-way (its acks would be lost to the caller).
        outcomes = await asyncio.gather(
            *(
                self._write_lane(partition, indexes, messages, results, deadline)
                for partition, indexes in by_partition.items()
            ),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return [r for r in results if r is not None]

    async def _write_lane(
        self,
        partition: int,
        indexes: list[int],
        messages: Sequence[OutgoingMessage],
        results: list[WriteResult | None],
        deadline: float,
    ) -> None:
        lane = await self._lane(partition, deadline)
        async with lane.lock:
            if self._lanes.get(partition) is not lane:
                # Closed by a failure of another write while this one waited for it.
                lane = await self._lane(partition, deadline)
            await self._send(lane, indexes, messages, results, deadline)

    async def _send(
        self,
        lane: _Lane,
        indexes: list[int],
        messages: Sequence[OutgoingMessage],
        results: list[WriteResult | None],
        deadline: float,
    ) -> None:
        now = self._clock.time()
        last = lane.last_seqno
        sending: list[int] = []
        batch: list[TopicWriterMessage | str | bytes] = []
        for index in indexes:
            message = messages[index]
            seqno = message.seqno if message.seqno is not None else last + 1
            if seqno <= last:
                results[index] = WriteResult(WriteStatus.DUPLICATE, lane.partition, None)
                continue
            last = seqno
            sending.append(index)
            batch.append(to_sdk_message(message, seqno, now))
        if not batch:
            return
        what = f"write {len(batch)} messages to {self._topic}[{lane.partition}]"
        try:
            async with asyncio.timeout(_remaining(deadline)):
                acks = await lane.sdk.write_with_ack(batch)
        except (issues.Error, TimeoutError) as exc:
            await self._discard(lane)
            raise broker_error(exc, what) from exc
        except BaseException:
            await self._discard(lane)
            raise
        lane.last_seqno = last
        acks = acks if isinstance(acks, list) else [acks]
        for index, ack in zip(sending, acks, strict=True):
            results[index] = _result(ack, lane.partition)

    async def _lane(self, partition: int, deadline: float) -> _Lane:
        lane = self._lanes.get(partition)
        if lane is not None:
            return lane
        async with self._opening.setdefault(partition, asyncio.Lock()):
            lane = self._lanes.get(partition)
            if lane is not None:
                return lane
            producer_id = lane_producer_id(self._producer_id, partition)
            sdk = self._topics.writer(
                self._path,
                producer_id=producer_id,
                partition_id=partition,
                auto_seqno=False,
                auto_created_at=False,
            )
            what = f"open a writer on {self._topic}[{partition}] as {producer_id}"
            try:
                timeout_s = min(self._open_timeout_s, _remaining(deadline))
                async with asyncio.timeout(timeout_s):
                    info = await sdk.wait_init()
            except (issues.Error, TimeoutError) as exc:
                await _close_quietly(sdk, self._close_timeout_s)
                raise broker_error(exc, what) from exc
            except BaseException:
                await _close_quietly(sdk, self._close_timeout_s)
                raise
            lane = _Lane(partition, sdk, info.last_seqno or 0)
            self._lanes[partition] = lane
            return lane

    async def _discard(self, lane: _Lane) -> None:
        if self._lanes.get(lane.partition) is lane:
            del self._lanes[lane.partition]
        await _close_quietly(lane.sdk, self._close_timeout_s)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Closes every lane; nothing is buffered, as every write waited for its acks."""
        if self._closed:
            return
        self._closed = True
        lanes = list(self._lanes.values())
        self._lanes.clear()
        for lane in lanes:
            await _close_quietly(lane.sdk, timeout_s)


def _result(ack: object, partition: int) -> WriteResult:
    if isinstance(ack, PublicWriteResult.Written):
        return WriteResult(WriteStatus.WRITTEN, partition, ack.offset)
    if isinstance(ack, PublicWriteResult.Skipped):
        return WriteResult(WriteStatus.DUPLICATE, partition, None)
    # WrittenInTx comes only from a transaction's writer, which this is not.
    raise BrokerError(f"unexpected write acknowledgement {ack!r}")


def _remaining(deadline: float) -> float:
    return max(deadline - asyncio.get_running_loop().time(), 0.0)


async def _close_quietly(sdk: TopicWriterAsyncIO, timeout_s: float) -> None:
    """Closes an SDK writer without flushing; its failure is logged, not raised."""
    closing = asyncio.ensure_future(sdk.close(flush=False))
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(closing)
    except TimeoutError:
        logger.warning("a topic writer did not close in %.1fs", timeout_s)
    except issues.Error as exc:
        # The error that stopped the writer, re-raised by close: reported already.
        logger.debug("topic writer closed after an error: %s", exc)
    with contextlib.suppress(asyncio.CancelledError):
        if closing.done() and not closing.cancelled():
            closing.exception()


def lane_producer_id(producer_id: str, partition: int) -> str:
    """The producer id a writer's lane for ``partition`` writes as (see the module docstring)."""
    return f"{producer_id}.p{partition}"


def default_producer_id() -> str:
    """A random producer id: de-duplication only within one writer's life."""
    return f"nemesis-{secrets.token_hex(8)}"
