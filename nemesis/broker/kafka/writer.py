"""The Kafka writer: one producer id over the backend's shared aiokafka producer.

Partitions. A message goes to its ``partition`` if given, else to the
partition of its key by Kafka's own partitioner (murmur2, as the Java
client: keys written by Nemesis and by other producers of a topic meet in
the same partition), else, when it carries a seqno, to the producer's home
partition (the partition of the producer id, so that a retried batch reaches
the partition that de-duplicates it), else to a partition the client picks.

Acknowledgement. ``write`` returns when the broker acknowledged every
message with ``acks=all`` (every in-sync replica has it), within its
timeout. With the idempotent producer (``idempotent_producer: true``) the
client's own retries of a batch whose answer was lost are not written twice.

De-duplication (the port's seqno). Kafka's idempotence is per producer
*session*, not per application producer id, so the port's rule — a message
whose seqno is not above the last seqno its producer wrote to that partition
is skipped — is kept here: the last seqno per partition is remembered, and
on a writer's first seqno write to a partition (and after a write that
failed, when what reached the broker is unknown) it is found by reading the
partition's last ``dedup_lookback_messages`` records back for the
``__producer`` header. So a restarted writer, or the retry of a timed-out
write, skips what is already there, as long as it is within the lookback
and no other process writes with the same producer id at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.partitioner import murmur2

from nemesis.broker.kafka.errors import broker_error
from nemesis.broker.kafka.mapping import headers_of, record_key, record_value
from nemesis.broker.port import OutgoingMessage, WriteResult, WriteStatus, key_bytes

logger = logging.getLogger(__name__)

# (topic, partition, producer id) -> the last seqno that producer wrote there (0: none).
LastSeqno = Callable[[str, int, str], Awaitable[int]]


def partition_of_key(key: str, partitions: int) -> int:
    """Kafka's default partition for a key: murmur2 of its bytes, as the Java client."""
    return int(murmur2(key_bytes(key)) & 0x7FFFFFFF) % partitions


def default_producer_id() -> str:
    """A random producer id: de-duplication only within one writer's life."""
    return f"nemesis-{secrets.token_hex(8)}"


class KafkaWriter:
    """Writes to one topic as one producer; see the module docstring."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        *,
        topic: str,
        producer_id: str,
        partitions: int,
        last_seqno: LastSeqno,
    ) -> None:
        if partitions < 1:
            raise ValueError("a topic has at least one partition")
        self._producer = producer
        self._topic = topic
        self._producer_id = producer_id
        self._partitions = partitions
        self._last_seqno = last_seqno
        self._home = partition_of_key(producer_id, partitions)
        self._known: dict[int, int] = {}  # partition -> last seqno written there
        self._lock = asyncio.Lock()  # seqno writes one at a time: each reads what the last wrote
        self._closed = False

    @property
    def producer_id(self) -> str:
        return self._producer_id

    @property
    def closed(self) -> bool:
        return self._closed

    def _partition(self, message: OutgoingMessage) -> int | None:
        if message.partition is not None:
            if not 0 <= message.partition < self._partitions:
                raise ValueError(
                    f"partition {message.partition} out of range: {self._topic} has"
                    f" {self._partitions}"
                )
            return message.partition
        if message.key is not None:
            return partition_of_key(message.key, self._partitions)
        if message.seqno is not None:
            return self._home
        return None

    async def write(
        self, messages: Sequence[OutgoingMessage], timeout_s: float = 10.0
    ) -> Sequence[WriteResult]:
        """Writes and waits for the broker's acknowledgement of every message (or raises)."""
        if self._closed:
            raise RuntimeError("the writer is closed")
        if not messages:
            return []
        targets = [self._partition(m) for m in messages]
        if all(m.seqno is None for m in messages):
            return await self._send(messages, targets, [True] * len(messages), timeout_s)
        async with self._lock:
            return await self._write_seqnos(messages, targets, timeout_s)

    async def _write_seqnos(
        self, messages: Sequence[OutgoingMessage], targets: list[int | None], timeout_s: float
    ) -> Sequence[WriteResult]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        last = dict(self._known)
        send: list[bool] = []
        for message, partition in zip(messages, targets, strict=True):
            if message.seqno is None or partition is None:
                send.append(True)
                continue
            if partition not in last:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    async with asyncio.timeout(max(remaining, 0.0)):
                        last[partition] = await self._last_seqno(
                            self._topic, partition, self._producer_id
                        )
                except TimeoutError as exc:
                    raise broker_error(exc, f"find the last seqno in {self._topic}") from exc
            fresh = message.seqno > last[partition]
            send.append(fresh)
            if fresh:
                last[partition] = message.seqno
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            results = await self._send(messages, targets, send, max(remaining, 0.0))
        except BaseException:
            # What reached the broker is unknown: the next write looks it up again.
            for partition in {p for p in targets if p is not None}:
                self._known.pop(partition, None)
            raise
        self._known.update(last)
        return results

    async def _send(
        self,
        messages: Sequence[OutgoingMessage],
        targets: list[int | None],
        send: list[bool],
        timeout_s: float,
    ) -> list[WriteResult]:
        producer, topic, producer_id = self._producer, self._topic, self._producer_id
        what = f"write {len(messages)} messages to {topic}"
        futures: list[Any] = []
        try:
            async with asyncio.timeout(timeout_s):
                for message, partition, fresh in zip(messages, targets, send, strict=True):
                    if not fresh:
                        futures.append(None)
                        continue
                    futures.append(
                        await producer.send(
                            topic,
                            record_value(message),
                            key=record_key(message),
                            partition=partition,
                            headers=headers_of(message, producer_id, message.seqno),
                        )
                    )
                acked = await asyncio.gather(*(f for f in futures if f is not None))
        except (KafkaError, TimeoutError) as exc:
            for future in futures:
                if future is not None and not future.done():
                    future.add_done_callback(_consume_exception)
            raise broker_error(exc, what) from exc
        results: list[WriteResult] = []
        metadata = iter(acked)
        for partition, future in zip(targets, futures, strict=True):
            if future is None:
                own = partition if partition is not None else self._home
                results.append(WriteResult(WriteStatus.DUPLICATE, own, None))
                continue
            record = next(metadata)
            results.append(WriteResult(WriteStatus.WRITTEN, record.partition, record.offset))
        return results

    async def close(self, timeout_s: float = 5.0) -> None:
        """Nothing of its own to close: the producer is the backend's, flushed when it closes."""
        self._closed = True


def _consume_exception(future: Any) -> None:
    if not future.cancelled():
        future.exception()
