"""Topic admin on YDB: create, add consumers, list, describe (with lag), drop.

Topic names are paths under the backend's directory (``<database>/<directory>``).
YDB has no cheap "list topics": ``list_topics`` walks that directory with
the scheme client, one ``ListDirectory`` call per sub-directory, down to
``MAX_LIST_DEPTH`` levels and at most ``MAX_LISTED`` topics. Point the
backend's ``directory`` at a folder of its own (``nemesis``) rather than
the database root of a busy database.

``describe_topic`` costs one ``DescribeTopic`` and one ``DescribeConsumer``
per consumer (the committed offsets live in the consumer's statistics).

Directories. The Topic API creates a topic in its parent directory and does
not create missing directories, so ``create_topic`` first makes every
missing directory on the way with the scheme client (``MakeDirectory``, one
level at a time, once per admin). A directory that cannot be made is a
BrokerError naming it, not a missing topic.

Existence. The server answers SUCCESS to a create of a topic that exists
(whatever its settings), so existence is never read from a create's status:
``create_topic`` describes first, creates only what is missing, and adds
the consumers an existing topic lacks with explicit alters.

A topic name that starts with ``/`` is an absolute path inside the database
(``connection.object_path``).

Topics Nemesis owns. The consumers of the retry tiers and of the replay
topics (``INTERNAL_TOPIC_PREFIXES``) are always *important*: YDB deletes
nothing such a consumer has not committed, whatever the retention, so a
paused integration loses none of its retries or replays. The price is disk:
a topic of an integration that is gone keeps growing until it is dropped
(``ydb topic drop``). A consumer registered before, not important,
is made important by ``add_consumer``.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol, cast

import ydb
from ydb import (
    TopicAlterConsumer,
    TopicClientAsyncIO,
    TopicConsumer,
    TopicConsumerDescription,
    TopicDescription,
)
from ydb.aio.driver import Driver

from nemesis.broker.port import ConsumerSpec, PartitionInfo, Seek
from nemesis.broker.port import TopicDescription as PortDescription
from nemesis.broker.ydb.connection import object_path
from nemesis.broker.ydb.errors import topic_call
from nemesis.broker.ydb.mapping import unix_seconds
from nemesis.errors import BrokerError, TopicExists, TopicNotFound

MAX_LIST_DEPTH = 4
MAX_LISTED = 10_000

# The topics Nemesis creates for itself (nemesis.runtime.retries: tier_topic, replay_topic).
INTERNAL_TOPIC_PREFIXES = ("nemesis.retry.", "nemesis.replay.")


def is_internal(topic: str) -> bool:
    """Whether ``topic`` is a retry tier or replay topic of Nemesis' own."""
    return topic.rsplit("/", 1)[-1].startswith(INTERNAL_TOPIC_PREFIXES)


class SchemeEntry(Protocol):
    """What ``list_topics`` reads of the SDK's (untyped) scheme entries."""

    @property
    def name(self) -> str: ...

    @property
    def type(self) -> ydb.SchemeEntryType: ...


class Directory(Protocol):
    @property
    def children(self) -> Sequence[SchemeEntry]: ...


ListDirectory = Callable[[str], Awaitable[Directory]]
MakeDirectory = Callable[[str], Awaitable[object]]


class YdbAdmin:
    """Topic admin over the SDK's topic client and scheme client."""

    def __init__(
        self,
        topics: TopicClientAsyncIO,
        list_directory: ListDirectory,
        *,
        make_directory: MakeDirectory,
        database: str,
        directory: str,
        default_retention_s: float,
        timeout_s: float,
    ) -> None:
        self._topics = topics
        self._list_directory = list_directory
        self._make_directory = make_directory
        self._made: set[str] = set()  # directories known to exist
        self._database = database
        self._directory = directory
        self._default_retention_s = default_retention_s
        self._timeout_s = timeout_s

    def path(self, name: str) -> str:
        """The absolute YDB path of a topic."""
        return object_path(self._database, self._directory, name)

    async def create_topic(
        self,
        name: str,
        *,
        partitions: int,
        consumers: Sequence[ConsumerSpec] = (),
        retention_s: float | None = None,
        exist_ok: bool = False,
    ) -> None:
        """Creates a topic; with ``exist_ok`` an existing one keeps its settings and gains
        the missing consumers. ``retention_s`` None takes the backend's default; 0 leaves
        it to the server's default (YDB has no "keep forever")."""
        if partitions < 1:
            raise ValueError("a topic needs at least one partition")
        if retention_s is None:
            retention_s = self._default_retention_s
        retention = datetime.timedelta(seconds=retention_s) if retention_s else None
        try:
            described: TopicDescription | None = await self._describe(name)
        except TopicNotFound:
            described = None
        if described is not None:
            if not exist_ok:
                raise TopicExists(f"create topic {name}: the topic exists")
        else:
            await self._create(name, partitions, consumers, retention)
            if not consumers:
                return
            # A create that raced another process's answers SUCCESS too: look again.
            described = await self._describe(name)
        for consumer in _unique(consumers):
            await self._ensure_consumer(name, _spec(name, consumer), described)

    async def _create(
        self,
        name: str,
        partitions: int,
        consumers: Sequence[ConsumerSpec],
        retention: datetime.timedelta | None,
    ) -> None:
        path = self.path(name)
        parent = path.rsplit("/", 1)[0]
        await self.make_directories(parent)
        try:
            await topic_call(
                f"create topic {name}",
                self._topics.create_topic(
                    path,
                    min_active_partitions=partitions,
                    max_active_partitions=partitions,
                    retention_period=retention,
                    consumers=[_consumer(_spec(name, c)) for c in _unique(consumers)],
                ),
                self._timeout_s,
            )
        except TopicNotFound as exc:
            # The server's word for a parent directory that is not there (any more).
            self._made.discard(parent)
            raise BrokerError(f"{exc} (is the directory {parent} there?)") from exc

    async def make_directories(self, path: str) -> None:
        """Makes ``path`` and every missing directory above it, up to the database root.

        BrokerError naming the directory when one cannot be made (access, a
        topic or table of that name in the way).
        """
        root = self._database.rstrip("/")
        if path in self._made or not path.startswith(root + "/"):
            return  # known, or the database root itself
        levels = path[len(root) + 1 :].split("/")
        for depth in range(1, len(levels) + 1):
            directory = "/".join([root, *levels[:depth]])
            if directory in self._made:
                continue
            try:
                await topic_call(
                    f"create directory {directory}",
                    self._make_directory(directory),
                    self._timeout_s,
                )
            except TopicExists:
                pass  # made meanwhile by another process
            except TopicNotFound as exc:  # the scheme's error, for a directory: not a topic
                raise BrokerError(str(exc)) from exc
            self._made.add(directory)

    async def add_consumer(self, topic: str, consumer: ConsumerSpec) -> None:
        """Registers a consumer; one that exists already is left alone (but for importance:
        the consumers of Nemesis' own topics are made important, see the module docstring)."""
        await self._ensure_consumer(topic, _spec(topic, consumer), await self._describe(topic))

    async def _ensure_consumer(
        self, topic: str, consumer: ConsumerSpec, described: TopicDescription
    ) -> None:
        """Adds ``consumer`` unless ``described`` has it, and makes it important if it must be.

        The server answers ALREADY_EXISTS to an added consumer that is there
        (one added meanwhile by another process): the topic is described again
        and the importance checked on what is there.
        """
        existing = next((c for c in described.consumers if c.name == consumer.name), None)
        if existing is None:
            try:
                await topic_call(
                    f"add consumer {consumer.name} to {topic}",
                    self._topics.alter_topic(self.path(topic), add_consumers=[_consumer(consumer)]),
                    self._timeout_s,
                )
            except TopicExists:
                described = await self._describe(topic)
                existing = next((c for c in described.consumers if c.name == consumer.name), None)
                if existing is None:
                    raise
            else:
                return
        if consumer.important and not existing.important:
            await topic_call(
                f"make consumer {consumer.name} of {topic} important",
                self._topics.alter_topic(
                    self.path(topic),
                    alter_consumers=[TopicAlterConsumer(consumer.name, set_important=True)],
                ),
                self._timeout_s,
            )

    async def list_topics(self) -> Sequence[str]:
        """Topic names under the backend's directory, sorted (see the module docstring)."""
        found: list[str] = []
        pending: list[tuple[str, int]] = [("", 0)]
        while pending and len(found) < MAX_LISTED:
            relative, depth = pending.pop()
            path = object_path(self._database, self._directory, relative)
            try:
                directory = await topic_call(
                    f"list {path}", self._list_directory(path), self._timeout_s
                )
            except TopicNotFound:
                continue  # the directory does not exist (yet): no topics in it
            for entry in directory.children:
                name = f"{relative}/{entry.name}" if relative else entry.name
                if entry.type == ydb.SchemeEntryType.TOPIC:
                    found.append(name)
                elif (
                    entry.type == ydb.SchemeEntryType.DIRECTORY
                    and depth + 1 < MAX_LIST_DEPTH
                    and not entry.name.startswith(".")  # .sys, .tmp: YDB's own
                ):
                    pending.append((name, depth + 1))
        return sorted(found)[:MAX_LISTED]

    async def describe_topic(self, name: str) -> PortDescription:
        """Offsets per partition and committed offsets per consumer (for lag)."""
        described = await self._describe(name, include_stats=True)
        consumers = sorted(c.name for c in described.consumers)
        committed: dict[int, dict[str, int]] = {p.partition_id: {} for p in described.partitions}
        for consumer in consumers:
            about = await topic_call(
                f"describe consumer {consumer} of {name}",
                self._topics.describe_consumer(self.path(name), consumer, include_stats=True),
                self._timeout_s,
            )
            for partition, offset in consumer_offsets(about).items():
                committed.setdefault(partition, {})[consumer] = offset
        return topic_description(name, described, committed)

    async def drop_topic(self, name: str) -> None:
        """Deletes a topic; its readers fail at their next read."""
        await topic_call(
            f"drop topic {name}", self._topics.drop_topic(self.path(name)), self._timeout_s
        )

    async def offsets_for_time(self, topic: str, at: float) -> Mapping[int, int]:
        """YDB has no lookup of an offset by time: a reader's ``read_from`` is its only use."""
        raise BrokerError(
            f"topic {topic}: YDB cannot look up an offset by time; seek to an offset,"
            " or to earliest or latest"
        )

    async def seek(self, topic: str, consumer: str, partition: int, offset: int) -> Seek:
        """Sets the committed offset with ``CommitOffset``, outside any read session.

        Without a read session id the server interrupts the read session
        holding the partition; the partition is then assigned again and read
        from the new offset. (The messages the old session had handed out
        are dropped by the reader as stale, see ``reader``.)
        """
        described = await self._describe(topic, include_stats=True)
        found = next((p for p in described.partitions if p.partition_id == partition), None)
        if found is None:
            raise ValueError(
                f"partition {partition} is out of range: topic {topic} has"
                f" {len(described.partitions)}"
            )
        stats = found.partition_stats
        start = stats.partition_start if stats is not None else 0
        end = stats.partition_end if stats is not None else 0
        before = max((await self.committed(topic, consumer)).get(partition, 0), start)
        after = min(max(offset, start), end)
        await topic_call(
            f"commit offset {after} of {topic}/{partition} for {consumer}",
            self._topics.commit_offset(self.path(topic), consumer, partition, after),
            self._timeout_s,
        )
        return Seek(partition, before, after)

    async def live_readers(self, topic: str, consumer: str) -> Sequence[str]:
        """The read sessions holding a partition of ``consumer``, as the server reports them."""
        about = await self._describe_consumer(topic, consumer)
        sessions = {
            f"{stats.reader_name or 'reader'} ({stats.read_session_id})"
            for p in about.partitions
            if (stats := p.partition_consumer_stats) is not None and stats.read_session_id
        }
        return sorted(sessions)

    async def write_times(self, topic: str, offsets: Mapping[int, int]) -> Mapping[int, float]:
        """Not cheap on YDB (it would take a read): nothing."""
        return {}

    async def committed(self, topic: str, consumer: str) -> dict[int, int]:
        """``consumer``'s committed offset per partition, as the server reports it (0: never)."""
        return consumer_offsets(await self._describe_consumer(topic, consumer))

    async def _describe_consumer(self, topic: str, consumer: str) -> TopicConsumerDescription:
        return await topic_call(
            f"describe consumer {consumer} of {topic}",
            self._topics.describe_consumer(self.path(topic), consumer, include_stats=True),
            self._timeout_s,
        )

    async def partitions(self, name: str) -> int:
        """How many partitions a topic has (TopicNotFound if there is no such topic)."""
        return len((await self._describe(name)).partitions)

    async def consumers(self, name: str) -> Sequence[str]:
        """The consumers registered on a topic."""
        return [c.name for c in (await self._describe(name)).consumers]

    async def _describe(self, name: str, include_stats: bool = False) -> TopicDescription:
        return await topic_call(
            f"describe topic {name}",
            self._topics.describe_topic(self.path(name), include_stats=include_stats),
            self._timeout_s,
        )


def topic_description(
    name: str, described: TopicDescription, committed: dict[int, dict[str, int]]
) -> PortDescription:
    """The port's description of a topic from the SDK's, with committed offsets per consumer."""
    consumers = sorted(c.name for c in described.consumers)
    partitions = []
    for partition in sorted(described.partitions, key=lambda p: p.partition_id):
        stats = partition.partition_stats
        start = stats.partition_start if stats is not None else 0
        end = stats.partition_end if stats is not None else 0
        written = stats.last_write_time if stats is not None else None
        offsets = committed.get(partition.partition_id, {})
        partitions.append(
            PartitionInfo(
                partition=partition.partition_id,
                start_offset=start,
                end_offset=end,
                # YDB reports the epoch for a partition never written to.
                last_written_at=unix_seconds(written) or None,
                # Never committed, or committed below the retained start: reads begin at start.
                committed={c: max(offsets.get(c, 0), start) for c in consumers},
            )
        )
    retention = described.retention_period
    return PortDescription(
        name=name,
        partitions=partitions,
        consumers=consumers,
        retention_s=retention.total_seconds() if retention else None,
    )


def consumer_offsets(described: TopicConsumerDescription) -> dict[int, int]:
    """Committed offset per partition, from a consumer's description with statistics."""
    return {
        p.partition_id: p.partition_consumer_stats.committed_offset
        for p in described.partitions
        if p.partition_consumer_stats is not None
    }


def _consumer(spec: ConsumerSpec) -> TopicConsumer | str:
    return TopicConsumer(spec.name, important=spec.important)


def _unique(consumers: Sequence[ConsumerSpec]) -> list[ConsumerSpec]:
    """The first consumer of each name: the server refuses a create naming one twice."""
    first: dict[str, ConsumerSpec] = {}
    for consumer in consumers:
        first.setdefault(consumer.name, consumer)
    return list(first.values())


def _spec(topic: str, spec: ConsumerSpec) -> ConsumerSpec:
    if is_internal(topic) and not spec.important:
        return dataclasses.replace(spec, important=True)
    return spec


def scheme_lister(driver: Driver) -> ListDirectory:
    """The scheme client's ``list_directory``, typed (the SDK leaves it untyped)."""
    return cast(ListDirectory, driver.scheme_client.list_directory)


def scheme_maker(driver: Driver) -> MakeDirectory:
    """The scheme client's ``make_directory``, typed (the SDK leaves it untyped)."""
    return cast(MakeDirectory, driver.scheme_client.make_directory)
