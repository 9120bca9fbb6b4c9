"""Topic admin on Kafka: create, consumers, list, describe (offsets and lag), drop.

Consumers. Kafka has no list of a topic's consumers: a consumer group exists
once it has members or committed offsets. ``add_consumer`` therefore commits
the partitions' start offsets for a group that has none on the topic (a group
that reads it already, or has committed, is left alone), so the consumer is
registered, shows in ``describe_topic`` and starts at the oldest retained
message, as on the other backends. Kafka takes no commit from outside a group
that has members: registering a group whose members read other topics only
is refused (``BrokerError``), never reported as done. A topic's consumers
are the groups with committed offsets on it. A cluster may hold thousands of
groups: the group list, and which of them have offsets on a topic, are asked
for at most every ``GROUPS_TTL_S``; in between, a describe asks only the
topic's known groups.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.structs import OffsetAndMetadata

from nemesis.broker.kafka.config import KafkaBackendConfig
from nemesis.broker.kafka.connection import client_settings, close_leftover_connections
from nemesis.broker.kafka.decoding import undecodable
from nemesis.broker.kafka.errors import (
    broker_error,
    error_for_code,
    kafka_call,
    kafka_call_retrying,
)
from nemesis.broker.kafka.mapping import PRODUCER_HEADER, SEQNO_HEADER, header_value
from nemesis.broker.port import (
    ConsumerSpec,
    PartitionInfo,
    Seek,
    StartFrom,
    TopicDescription,
)
from nemesis.errors import BrokerError, TopicExists, TopicNotFound

GROUPS_TTL_S = 30.0
# The metadata of the commit that registers a consumer (see add_consumer).
REGISTERED = "nemesis:registered"
_TOPIC_EXISTS = 36
_UNKNOWN_TOPIC = 3


class KafkaAdmin:
    """The port's topic admin over an aiokafka admin client and a group-less consumer."""

    def __init__(
        self, client: AIOKafkaAdminClient, peeker: Peeker, config: KafkaBackendConfig
    ) -> None:
        self._client = client
        self._peeker = peeker
        self._config = config
        self._timeout_s = config.request_timeout_s
        self._groups: tuple[float, list[str]] | None = None
        # topic -> (when found, the groups with offsets on it)
        self._topic_groups: dict[str, tuple[float, list[str]]] = {}

    # --- topics -----------------------------------------------------------------

    async def create_topic(
        self,
        name: str,
        *,
        partitions: int,
        consumers: Sequence[ConsumerSpec] = (),
        retention_s: float | None = None,
        exist_ok: bool = False,
    ) -> None:
        retention = self._config.retention if retention_s is None else retention_s
        topic = NewTopic(
            name,
            partitions,
            self._config.replication_factor,
            # 0 means "keep forever", as on the embedded backend; Kafka says -1.
            topic_configs={"retention.ms": str(int(retention * 1000)) if retention else "-1"},
        )
        response = await kafka_call(
            f"create topic {name}",
            self._client.create_topics([topic], timeout_ms=int(self._timeout_s * 1000)),
            self._timeout_s,
        )
        for _, code, message in _topic_errors(response):
            if code == _TOPIC_EXISTS:
                if not exist_ok:
                    raise TopicExists(f"topic {name} exists")
            elif code:
                raise error_for_code(code, f"create topic {name}", message)
        await self._wait_for_metadata(name)
        for consumer in consumers:
            await self.add_consumer(name, consumer)

    async def _wait_for_metadata(self, name: str) -> None:
        """Until every broker knows the new topic's partitions with leaders.

        Brokers learn of a topic from the controller each at its own pace, and
        the next call may ask any of them: one that has not heard of it yet
        would say the topic does not exist.
        """
        deadline = time.monotonic() + self._timeout_s
        nodes = [broker.nodeId for broker in self._client._client.cluster.brokers()] or [None]
        for node in nodes:
            while True:
                try:
                    await self.partitions(name, node=node)
                except TopicNotFound:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
                except BrokerError:
                    break  # a broker that does not answer cannot say "no such topic" either
                else:
                    break

    async def list_topics(self) -> Sequence[str]:
        """Every topic but the broker's internal ones (``__consumer_offsets``...), sorted."""
        names = await kafka_call_retrying("list topics", self._client.list_topics, self._timeout_s)
        return sorted(str(n) for n in names if not str(n).startswith("__"))

    async def partitions(self, name: str, *, node: int | None = None) -> int:
        """The number of partitions of a topic (TopicNotFound if it does not exist).

        Asks ``node`` once, or any broker: one that is down is a retriable
        error, and the retry asks another.
        """
        # Not describe_topics: its metadata request lets a broker with
        # auto.create.topics.enable create the topic it is asked about.
        request = MetadataRequest([name], allow_auto_topic_creation=False)
        what = f"describe topic {name}"
        if node is None:
            response = await kafka_call_retrying(
                what, lambda: self._client._send_request(request), self._timeout_s
            )
        else:
            response = await kafka_call(
                what, self._client._send_request(request, node), self._timeout_s
            )
        for topic in response.to_object()["topics"]:
            if topic["topic"] != name:
                continue
            if topic["error_code"]:
                if topic["error_code"] == _UNKNOWN_TOPIC:
                    raise TopicNotFound(f"topic {name} does not exist")
                raise error_for_code(topic["error_code"], f"describe topic {name}")
            if topic["partitions"] and all(p["leader"] >= 0 for p in topic["partitions"]):
                return len(topic["partitions"])
        raise TopicNotFound(f"topic {name} does not exist")

    async def drop_topic(self, name: str) -> None:
        response = await kafka_call(
            f"drop topic {name}",
            self._client.delete_topics([name], timeout_ms=int(self._timeout_s * 1000)),
            self._timeout_s,
        )
        for _, code, *_rest in response.topic_error_codes:
            if code == _UNKNOWN_TOPIC:
                raise TopicNotFound(f"topic {name} does not exist")
            if code:
                raise error_for_code(code, f"drop topic {name}")
        await self._until_unlisted(name)
        self._forget_groups()

    async def _until_unlisted(self, name: str) -> None:
        """Waits until the brokers' metadata no longer lists a dropped topic.

        DeleteTopics answers once the controller has recorded the deletion; each
        broker applies it to the metadata it serves a moment later, so a listing
        right after the answer may still name the topic. A drop is done when the
        topic is gone from what readers and writers see, or after the timeout
        (the deletion itself is final either way).
        """
        deadline = time.monotonic() + self._timeout_s
        pause = 0.01
        while name in await self.list_topics() and time.monotonic() < deadline:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)

    # --- consumers ----------------------------------------------------------------

    async def add_consumer(self, topic: str, consumer: ConsumerSpec) -> None:
        """Registers a consumer group on a topic at its oldest messages (see the module doc)."""
        tps = [TopicPartition(topic, p) for p in range(await self.partitions(topic))]
        committed = await self._committed(consumer.name, tps)
        if any(offset >= 0 for offset in committed.values()):
            return
        starts = await self._peeker.beginning_offsets(tps)
        # Marked as a registration: a reader with another start (latest, a time) takes
        # such a partition as never committed.
        offsets = {tp: OffsetAndMetadata(offset, REGISTERED) for tp, offset in starts.items()}
        if not await self._commit_as(
            consumer.name, offsets, f"register {consumer.name} on {topic}"
        ) and not await self.is_registered(topic, consumer.name):
            # The group has members, and none of them read this topic (they would have
            # committed on it): Kafka takes no commit from outside a group with members.
            raise BrokerError(
                f"cannot register consumer {consumer.name} on topic {topic}: the Kafka"
                f" consumer group {consumer.name} has live members reading other topics, and"
                " a group with members takes no commit from outside it; give the"
                " integration a consumer of its own (source.consumer), or stop the group's"
                " other readers first"
            )
        self._forget_groups()

    async def _commit_as(
        self, group: str, offsets: dict[TopicPartition, OffsetAndMetadata], what: str
    ) -> bool:
        """Commits for a group from outside it; False when the group has members (refused).

        A group with members is asked first and left alone: Kafka would refuse
        the commit (UNKNOWN_MEMBER_ID), and aiokafka logs each refusal at ERROR.
        """
        if await self.live_readers("", group):
            return False
        member = AIOKafkaConsumer(
            **client_settings(self._config), group_id=group, enable_auto_commit=False
        )
        await kafka_call(what, member.start(), self._config.connect_timeout_s)
        try:
            member.assign(list(offsets))
            async with asyncio.timeout(self._timeout_s):
                await member.commit(offsets)
        except CommitFailedError:
            return False
        except (KafkaError, TimeoutError) as exc:
            raise broker_error(exc, what) from exc
        finally:
            await asyncio.shield(member.stop())
            await asyncio.sleep(0.05)  # see close_leftover_connections
            close_leftover_connections(member)
        return True

    async def never_read(self, group: str, tps: list[TopicPartition]) -> list[TopicPartition]:
        """The partitions the group never committed a read of (none, or its registration)."""
        offsets = await kafka_call_retrying(
            f"committed offsets of {group}",
            lambda: self._client.list_consumer_group_offsets(group, partitions=tps),
            self._timeout_s,
        )
        read = {
            tp for tp, meta in offsets.items() if meta.offset >= 0 and meta.metadata != REGISTERED
        }
        return [tp for tp in tps if tp not in read]

    async def start_positions(
        self, group: str, tps: list[TopicPartition], start_from: StartFrom
    ) -> dict[TopicPartition, int]:
        """Where a reader starts on the partitions ``group`` never read, for ``start_from``."""
        fresh = await self.never_read(group, tps)
        if not fresh or start_from.kind == "earliest":
            return {}
        if start_from.kind == "latest":
            return await self._ends(fresh)
        assert start_from.at is not None
        by_time = await self.offsets_for_time(fresh[0].topic, start_from.at)
        return {tp: by_time[tp.partition] for tp in fresh}

    # --- offsets for operators ----------------------------------------------------

    async def offsets_for_time(self, topic: str, at: float) -> Mapping[int, int]:
        """Per partition, the first offset written at or after ``at``; the end if none."""
        tps = [TopicPartition(topic, p) for p in range(await self.partitions(topic))]
        found = await self._peeker.offsets_for_times({tp: int(at * 1000) for tp in tps})
        ends = await self._ends(tps)
        # None, or (Tansu) a timestamp of -1: no message at or after ``at``.
        return {
            tp.partition: (
                found[tp].offset
                if found.get(tp) is not None and found[tp].timestamp >= 0
                else ends[tp]
            )
            for tp in tps
        }

    async def _ends(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        starts = await self._peeker.beginning_offsets(tps)
        tails = await self._peeker.tails(tps, starts, await self._peeker.end_offsets(tps))
        return {tp: tails[tp][0] for tp in tps}

    async def seek(self, topic: str, consumer: str, partition: int, offset: int) -> Seek:
        """Moves a group's committed offset; refused while the group has members."""
        count = await self.partitions(topic)
        if not 0 <= partition < count:
            raise ValueError(f"partition {partition} is out of range: {topic} has {count}")
        tp = TopicPartition(topic, partition)
        start = (await self._peeker.beginning_offsets([tp]))[tp]
        end = (await self._ends([tp]))[tp]
        committed = (await self._committed(consumer, [tp]))[tp]
        before = max(committed, start) if committed >= 0 else start
        after = min(max(offset, start), end)
        moved = await self._commit_as(
            consumer, {tp: OffsetAndMetadata(after, "")}, f"seek {consumer} on {topic}"
        )
        if not moved:
            raise BrokerError(
                f"consumer {consumer} of {topic} has live readers: Kafka moves the offsets of"
                " a group without members only; stop (or pause) its readers first"
            )
        self._forget_groups()
        return Seek(partition, before, after)

    async def live_readers(self, topic: str, consumer: str) -> Sequence[str]:
        """The group's members now (by member id); the group may read other topics too."""
        described = await kafka_call(
            f"describe group {consumer}",
            self._client.describe_consumer_groups([consumer]),
            self._timeout_s,
        )
        members: list[str] = []
        for response in described:
            for group in response.groups:
                members.extend(str(member[0]) for member in group[5])
        return sorted(members)

    async def write_times(self, topic: str, offsets: Mapping[int, int]) -> Mapping[int, float]:
        """Left out on Kafka: telling it takes a fetch per partition (not cheap)."""
        return {}

    async def is_registered(self, topic: str, consumer: str) -> bool:
        """Whether a group has committed offsets on a topic (asked now, never cached)."""
        tps = [TopicPartition(topic, p) for p in range(await self.partitions(topic))]
        return any(offset >= 0 for offset in (await self._committed(consumer, tps)).values())

    async def _committed_by_group(
        self, tps: list[TopicPartition]
    ) -> dict[str, dict[TopicPartition, int]]:
        topic = tps[0].topic
        known = self._topic_groups.get(topic)
        fresh = known is not None and time.monotonic() - known[0] < GROUPS_TTL_S
        groups = known[1] if known is not None and fresh else await self._group_names()
        committed: dict[str, dict[TopicPartition, int]] = {}
        for group in groups:
            offsets = await self._committed(group, tps)
            if any(offset >= 0 for offset in offsets.values()):
                committed[group] = offsets
        if not fresh:
            self._topic_groups[topic] = (time.monotonic(), sorted(committed))
        return committed

    def _forget_groups(self) -> None:
        self._groups = None
        self._topic_groups.clear()

    async def _committed(self, group: str, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The group's committed offset per partition; -1 where it has none."""
        offsets = await kafka_call_retrying(
            f"committed offsets of {group}",
            lambda: self._client.list_consumer_group_offsets(group, partitions=tps),
            self._timeout_s,
        )
        found = {tp: int(meta.offset) for tp, meta in offsets.items()}
        return {tp: found.get(tp, -1) for tp in tps}

    async def _group_names(self) -> list[str]:
        cached = self._groups
        if cached is not None and time.monotonic() - cached[0] < GROUPS_TTL_S:
            return cached[1]
        listed = await kafka_call_retrying(
            "list consumer groups", self._client.list_consumer_groups, self._timeout_s
        )
        names = sorted({str(group[0]) for group in listed})
        self._groups = (time.monotonic(), names)
        return names

    # --- describe -----------------------------------------------------------------

    async def describe_topic(self, name: str) -> TopicDescription:
        """Start and end offsets per partition and every group's committed offsets (for lag)."""
        count = await self.partitions(name)
        tps = [TopicPartition(name, p) for p in range(count)]
        starts = await self._peeker.beginning_offsets(tps)
        tails = await self._peeker.tails(tps, starts, await self._peeker.end_offsets(tps))
        committed = await self._committed_by_group(tps)
        partitions = [
            PartitionInfo(
                partition=tp.partition,
                start_offset=starts[tp],
                end_offset=tails[tp][0],
                last_written_at=tails[tp][1],
                # No commit yet, or one below the retained start, reads as the start.
                committed={g: max(offsets[tp], starts[tp]) for g, offsets in committed.items()},
            )
            for tp in tps
        ]
        return TopicDescription(
            name=name,
            partitions=partitions,
            consumers=sorted(committed),
            retention_s=await self._retention_s(name),
        )

    async def _retention_s(self, name: str) -> float | None:
        resource = ConfigResource(ConfigResourceType.TOPIC, name)
        responses = await kafka_call(
            f"describe configs of {name}",
            self._client.describe_configs([resource]),
            self._timeout_s,
        )
        for response in responses:
            for resource_answer in response.resources:
                for entry in resource_answer[4]:
                    if entry[0] == "retention.ms":
                        retention_ms = int(entry[1])
                        return None if retention_ms < 0 else retention_ms / 1000
        return None


class Peeker:
    """A consumer outside any group: offsets, and the look back for a producer's last seqno."""

    def __init__(self, config: KafkaBackendConfig) -> None:
        self._config = config
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        self._timeout_s = config.request_timeout_s

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                **client_settings(self._config),
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
            )
            await kafka_call("connect", consumer.start(), self._config.connect_timeout_s)
            self._consumer = consumer
        return self._consumer

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        async with self._lock:
            consumer = await self._started()
            found = await kafka_call(
                "start offsets", consumer.beginning_offsets(tps), self._timeout_s
            )
        return {tp: int(found[tp]) for tp in tps}

    async def offsets_for_times(
        self, stamps: dict[TopicPartition, int]
    ) -> dict[TopicPartition, Any]:
        async with self._lock:
            consumer = await self._started()
            found = await kafka_call(
                "offsets for a time", consumer.offsets_for_times(stamps), self._timeout_s
            )
        return dict(found)

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        async with self._lock:
            consumer = await self._started()
            found = await kafka_call("end offsets", consumer.end_offsets(tps), self._timeout_s)
        return {tp: int(found[tp]) for tp in tps}

    async def tails(
        self,
        tps: list[TopicPartition],
        starts: dict[TopicPartition, int],
        ends: dict[TopicPartition, int],
    ) -> dict[TopicPartition, tuple[int, float | None]]:
        """(end offset, time of the last record) per partition, from reading its last record.

        Kafka keeps no time per partition: the last record's timestamp is it.
        The read also corrects an end offset that a broker reports short (Tansu
        0.6 answers the last batch's first offset + 1). A last batch that cannot
        be decoded (``nemesis.broker.kafka.decoding``) gives its end and time
        from its header.
        """
        found: dict[TopicPartition, tuple[int, float | None]] = {tp: (ends[tp], None) for tp in tps}
        readable = [tp for tp in tps if ends[tp] > starts[tp]]
        if not readable:
            return found
        what = f"read the last records of {tps[0].topic}"
        async with self._lock:
            consumer = await self._started()
            consumer.assign(readable)
            try:
                for tp in readable:
                    consumer.seek(tp, ends[tp] - 1)
                deadline = time.monotonic() + self._timeout_s
                while readable and time.monotonic() < deadline:
                    batches = await self._last_records(consumer, readable, found, what)
                    if batches is None:
                        break
                    for tp, records in batches.items():
                        if not records:
                            continue
                        last = records[-1]
                        end = max(found[tp][0], last.offset + 1)
                        found[tp] = (end, last.timestamp / 1000 if last.timestamp else None)
            finally:
                consumer.assign([])
        return found

    async def _last_records(
        self,
        consumer: AIOKafkaConsumer,
        readable: list[TopicPartition],
        found: dict[TopicPartition, tuple[int, float | None]],
        what: str,
    ) -> Mapping[TopicPartition, Sequence[Any]] | None:
        """One read of ``tails``; None when nothing came. Takes undecodable partitions out."""
        try:
            batches = await kafka_call(
                what, consumer.getmany(*readable, timeout_ms=200), self._timeout_s
            )
        except Exception as exc:
            bad = undecodable(
                exc.__cause__ if isinstance(exc, BrokerError) and exc.__cause__ else exc
            )
            if bad is None:
                raise
            tp = TopicPartition(bad.topic, bad.partition)
            found[tp] = (max(found[tp][0], bad.next_offset), bad.written_at)
            consumer.pause(tp)
            readable.remove(tp)
            return {TopicPartition(bad.topic, p): records for p, records in bad.taken.items()}
        return batches or None

    async def last_seqno(self, topic: str, partition: int, producer_id: str) -> int:
        """The highest seqno ``producer_id`` wrote in the partition's last records; 0 if none."""
        lookback = self._config.dedup_lookback_messages
        if lookback == 0:
            return 0
        tp = TopicPartition(topic, partition)
        last = 0
        async with self._lock:
            consumer = await self._started()
            what = f"read back {topic}[{partition}]"
            ends = await kafka_call(what, consumer.end_offsets([tp]), self._timeout_s)
            starts = await kafka_call(what, consumer.beginning_offsets([tp]), self._timeout_s)
            end, start = int(ends[tp]), int(starts[tp])
            if end <= start:
                return 0
            consumer.assign([tp])
            try:
                consumer.seek(tp, max(start, end - lookback))
                position = max(start, end - lookback)
                while position < end:
                    batches = await kafka_call(
                        what, consumer.getmany(tp, timeout_ms=1000), self._timeout_s
                    )
                    for record in batches.get(tp, ()):
                        position = record.offset + 1
                        if header_value(record, PRODUCER_HEADER) != producer_id:
                            continue
                        seqno = header_value(record, SEQNO_HEADER)
                        if seqno is not None and seqno.isdigit():
                            last = max(last, int(seqno))
                    if not batches:
                        position = await kafka_call(what, consumer.position(tp), self._timeout_s)
            finally:
                consumer.assign([])
        return last

    @property
    def consumer(self) -> AIOKafkaConsumer | None:
        return self._consumer

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()


def _topic_errors(response: Any) -> list[tuple[str, int, str | None]]:
    """(topic, error code, message) from a CreateTopics response of any version."""
    out: list[tuple[str, int, str | None]] = []
    for entry in response.topic_errors:
        topic, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 and isinstance(entry[2], str) else None
        out.append((str(topic), int(code), message))
    return out
