"""YDB topic admin: descriptions from the SDK's result types, listing, idempotent creation.

The topic client here is a stand-in for the SDK's ``TopicClientAsyncIO`` that
keeps topics in memory and answers with the SDK's own result classes and
errors, so that the adapter's side (paths, exist_ok, consumers, lag) runs
as it would against a server.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import ydb
from ydb import (
    TopicAlterConsumer,
    TopicClientAsyncIO,
    TopicConsumer,
    TopicConsumerDescription,
    TopicDescription,
    issues,
)
from ydb._grpc.grpcwrapper.ydb_topic_public_types import (
    PublicPartitionConsumerStats,
    PublicPartitionStats,
)
from ydb.aio.driver import Driver

from nemesis.broker.port import Broker, ConsumerSpec
from nemesis.broker.ydb import YdbAdmin, YdbBroker
from nemesis.broker.ydb.admin import Directory, consumer_offsets, topic_description
from nemesis.config.models import YdbBackendConfig
from nemesis.errors import BrokerError, TopicExists, TopicNotFound
from tests.contract import test_broker as contract
from tests.contract.conftest import Backend
from tests.kafka_broker import Namespace

WRITTEN = datetime.datetime(2026, 11, 30, 12, 0, 0)  # naive UTC


def scheme_entry(name: str, kind: ydb.SchemeEntryType = ydb.SchemeEntryType.TOPIC) -> Any:
    entry = cast(Callable[..., Any], ydb.SchemeEntry)  # untyped in the SDK
    return entry(name, "root", kind, [], [], 0)


def partition_stats(
    start: int, end: int, written: datetime.datetime | None
) -> PublicPartitionStats:
    return PublicPartitionStats(
        partition_start=start,
        partition_end=end,
        store_size_bytes=0,
        last_write_time=written,
        max_write_time_lag=None,
        bytes_written=None,
        partition_node_id=1,
    )


def described(
    path: str,
    partitions: int,
    consumers: Sequence[str],
    retention_s: float | None,
    important: frozenset[str] | set[str] = frozenset(),
    starts: dict[int, int] | None = None,
) -> TopicDescription:
    return TopicDescription(
        self=scheme_entry(path.rsplit("/", 1)[-1]),
        min_active_partitions=partitions,
        max_active_partitions=partitions,
        partition_count_limit=0,
        partitions=[
            TopicDescription.PartitionInfo(
                partition_id=p,
                active=True,
                child_partition_ids=[],
                parent_partition_ids=[],
                partition_stats=partition_stats(
                    (starts or {}).get(p, 2), 10 + p, WRITTEN if p == 0 else None
                ),
            )
            for p in range(partitions)
        ],
        retention_period=datetime.timedelta(seconds=retention_s) if retention_s else None,
        retention_storage_mb=0,
        supported_codecs=[],
        partition_write_speed_bytes_per_second=0,
        partition_write_burst_bytes=0,
        attributes={},
        consumers=[TopicConsumer(name, important=name in important) for name in consumers],
        metering_mode=None,
        topic_stats=None,
        auto_partitioning_settings=None,
    )


def consumer_description(name: str, committed: dict[int, int]) -> TopicConsumerDescription:
    return TopicConsumerDescription(
        self=scheme_entry(name),
        consumer=TopicConsumer(name),
        partitions=[
            TopicConsumerDescription.PartitionInfo(
                partition_id=p,
                active=True,
                child_partition_ids=[],
                parent_partition_ids=[],
                partition_stats=None,
                partition_consumer_stats=PublicPartitionConsumerStats(
                    last_read_offset=offset,
                    committed_offset=offset,
                    read_session_id="",
                    partition_read_session_create_time=None,
                    last_read_time=None,
                    max_read_time_lag=None,
                    max_write_time_lag=None,
                    max_committed_time_lag=None,
                    bytes_read=None,
                    reader_name="",
                    connection_node_id=0,
                ),
                partition_location=None,
            )
            for p, offset in committed.items()
        ],
    )


@dataclass
class Topic:
    partitions: int
    consumers: list[str]
    retention_s: float | None
    committed: dict[str, dict[int, int]] = field(default_factory=dict)
    important: set[str] = field(default_factory=set)
    starts: dict[int, int] = field(default_factory=dict)  # retained start, 2 unless expired

    def expire(self) -> None:
        """The retention passes over every message: YDB deletes what no important
        consumer still needs (an ordinary consumer's unread messages go too)."""
        for p in range(self.partitions):
            end = 10 + p
            needed = [self.committed.get(c, {}).get(p, 0) for c in self.important]
            self.starts[p] = max(self.starts.get(p, 2), min([end, *needed]))


class TopicService:
    """The SDK topic client's admin calls over topics kept in memory, with the server's rules.

    Also the scheme client's ``make_directory``: the Topic API creates a topic
    only in a directory that exists (the database root always does), and a
    directory only in one that exists.
    """

    def __init__(self, database: str = "/local") -> None:
        self.topics: dict[str, Topic] = {}
        self.directories: set[str] = {database}
        self.calls: list[str] = []
        self.denied = False  # the caller may not make directories

    async def make_directory(self, path: str) -> None:
        self.calls.append(f"mkdir {path}")
        if self.denied:
            raise issues.Unauthorized(f"access denied: {path}")
        parent = path.rsplit("/", 1)[0]
        if parent not in self.directories:
            raise issues.SchemeError(f"path {parent} does not exist")
        if path in self.topics:
            raise issues.SchemeError(f"{path} is a topic")
        self.directories.add(path)

    async def create_topic(self, path: str, **settings: Any) -> None:
        self.calls.append(f"create {path}")
        consumers: Sequence[TopicConsumer] = settings["consumers"]
        names = [c.name for c in consumers]
        for name in names:
            _check_consumer_name(name)
        if len(set(names)) < len(names):
            # ydb/core/persqueue/public/schema/validation.cpp (ValidateConsumersConfig):
            # a name twice in a create is BAD_REQUEST (ALREADY_EXISTS only in an alter).
            raise issues.BadRequest(f"Duplicate consumer name in {names}")
        if path in self.topics:
            # The create path never sets FailOnExist, and the scheme request's
            # reporting turns StatusAlreadyExists into SUCCESS, settings untouched:
            # ydb/services/persqueue_v1/actors/schema_actors.cpp
            # (TCreateTopicActor::FillProposeRequest), ydb/core/grpc_services/
            # rpc_scheme_base.h (ExecComplete + StatusAlreadyExists -> SUCCESS),
            # ydb/core/persqueue/public/schema/schema_operation.cpp (the same, newer).
            return
        parent = path.rsplit("/", 1)[0]
        if parent not in self.directories:
            # The Topic API works in the parent directory and makes none.
            raise issues.SchemeError(f"path {parent} does not exist")
        retention = settings["retention_period"]
        self.topics[path] = Topic(
            settings["min_active_partitions"],
            names,
            retention.total_seconds() if retention else None,
            important={c.name for c in consumers if c.important},
        )

    async def alter_topic(
        self,
        path: str,
        add_consumers: Sequence[TopicConsumer] = (),
        alter_consumers: Sequence[TopicAlterConsumer] = (),
    ) -> None:
        self.calls.append(f"alter {path}")
        topic = self._topic(path)
        for altered in alter_consumers:
            if altered.name not in topic.consumers:
                # ydb/services/lib/actors/pq_schema_actor.cpp (FillProposeRequestImpl
                # of an AlterTopicRequest): "consumer ... in alter_consumers is missing".
                raise issues.NotFound(f"consumer '{altered.name}' in alter_consumers is missing")
        for added in add_consumers:
            _check_consumer_name(added.name)
            if added.name in topic.consumers:
                # ydb/services/lib/actors/pq_schema_actor.cpp: an alter's duplicate
                # consumer is CheckConfig(..., ALREADY_EXISTS) ("Duplicate consumer
                # name"); validation.cpp keeps ALREADY_EXISTS for EOperation::Alter.
                # Nothing of the alter is applied.
                raise issues.AlreadyExists(f"Duplicate consumer name {added.name}")
        for added in add_consumers:
            topic.consumers.append(added.name)
            if added.important:
                topic.important.add(added.name)
        for altered in alter_consumers:
            if altered.set_important:
                topic.important.add(altered.name)

    async def list_directory(self, path: str) -> Directory:
        """The scheme client's listing of what this service holds (topics, directories)."""
        if path not in self.directories:
            raise issues.SchemeError(f"path {path} not found")
        children = [
            scheme_entry(child.rsplit("/", 1)[-1], kind)
            for names, kind in (
                (self.topics, ydb.SchemeEntryType.TOPIC),
                (self.directories, ydb.SchemeEntryType.DIRECTORY),
            )
            for child in sorted(names)
            if child.rsplit("/", 1)[0] == path
        ]
        return Listing(children)

    async def describe_topic(self, path: str, include_stats: bool = False) -> TopicDescription:
        topic = self._topic(path)
        return described(
            path,
            topic.partitions,
            topic.consumers,
            topic.retention_s,
            important=topic.important,
            starts=topic.starts,
        )

    async def describe_consumer(
        self, path: str, consumer: str, *, include_stats: bool = False
    ) -> TopicConsumerDescription:
        return consumer_description(consumer, self._topic(path).committed.get(consumer, {}))

    async def drop_topic(self, path: str) -> None:
        self._topic(path)
        del self.topics[path]

    def _topic(self, path: str) -> Topic:
        if path not in self.topics:
            raise issues.SchemeError(f"path {path} not found")
        return self.topics[path]


def _check_consumer_name(name: str) -> None:
    # ydb/services/lib/actors/pq_schema_actor.cpp (AddReadRuleToConfig): a name with
    # "/" or "|" "has illegal symbols", an empty one is forbidden; both BAD_REQUEST.
    if not name or "/" in name or "|" in name:
        raise issues.BadRequest(f"consumer '{name}' has illegal symbols")


@dataclass
class Listing:
    children: list[Any]


def lister(tree: dict[str, list[Any]]) -> Any:
    async def list_directory(path: str) -> Directory:
        if path not in tree:
            raise issues.SchemeError(f"path {path} not found")
        return Listing(tree[path])

    return list_directory


def admin_over(service: TopicService, tree: dict[str, list[Any]] | None = None) -> YdbAdmin:
    return YdbAdmin(
        cast(TopicClientAsyncIO, service),
        lister(tree or {}),
        make_directory=service.make_directory,
        database="/local",
        directory="nemesis",
        default_retention_s=86400.0,
        timeout_s=1.0,
    )


async def test_create_is_idempotent_with_exist_ok_and_adds_missing_consumers() -> None:
    service = TopicService()
    admin = admin_over(service)
    await admin.create_topic("orders", partitions=3, consumers=[ConsumerSpec("a")])
    assert service.topics["/local/nemesis/orders"] == Topic(3, ["a"], 86400.0)
    with pytest.raises(TopicExists, match="create topic orders"):
        await admin.create_topic("orders", partitions=3)
    await admin.create_topic(
        "orders", partitions=9, consumers=[ConsumerSpec("a"), ConsumerSpec("b")], exist_ok=True
    )
    assert service.topics["/local/nemesis/orders"] == Topic(3, ["a", "b"], 86400.0)
    await admin.add_consumer("orders", ConsumerSpec("b"))  # there already: no alter
    assert service.calls.count("alter /local/nemesis/orders") == 1
    with pytest.raises(ValueError, match="partition"):
        await admin.create_topic("x", partitions=0)
    await admin.create_topic("forever", partitions=1, retention_s=0)
    assert service.topics["/local/nemesis/forever"].retention_s is None


def broker_over(service: TopicService) -> YdbBroker:
    return YdbBroker(
        cast(Driver, object()),
        YdbBackendConfig(endpoint="grpc://localhost:2136", database="/local", directory="nemesis"),
        owns_driver=False,
        topics=cast(TopicClientAsyncIO, service),
        list_directory=service.list_directory,
        make_directory=service.make_directory,
    )


@dataclass
class FakeBackend:
    """What the contract's admin cases use of a backend, over one TopicService."""

    service: TopicService = field(default_factory=TopicService)
    names: Namespace = field(default_factory=Namespace)
    kind: str = "ydb"

    async def broker(self) -> Broker:
        return broker_over(self.service)


async def test_the_contracts_topic_lifecycle_holds_against_the_servers_answers() -> None:
    """tests/contract/test_broker.py::test_topic_lifecycle, on a service that answers
    SUCCESS to a create of a topic that exists, as the server does."""
    await contract.test_topic_lifecycle(cast(Backend, FakeBackend()))


async def test_create_of_an_existing_topic_adds_and_raises_by_describing_not_by_status() -> None:
    service = TopicService()
    admin = admin_over(service)
    topic = "nemesis.retry.orders.1"
    await admin.create_topic(topic, partitions=1, consumers=[ConsumerSpec("a")])
    path = f"/local/nemesis/{topic}"
    service.topics[path].important.clear()  # registered before as an ordinary consumer
    with pytest.raises(TopicExists, match=f"create topic {topic}"):
        await admin.create_topic(topic, partitions=1, consumers=[ConsumerSpec("b")])
    assert service.topics[path].consumers == ["a"]
    await admin.create_topic(
        topic, partitions=4, consumers=[ConsumerSpec("a"), ConsumerSpec("b")], exist_ok=True
    )
    # The missing consumer added, both important (Nemesis' own topic), the topic as it was.
    assert service.topics[path] == Topic(1, ["a", "b"], 86400.0, important={"a", "b"})


class AnotherProcessAdds(TopicService):
    """Another process adds consumer ``a`` (ordinary) right after each describe."""

    async def describe_topic(self, path: str, include_stats: bool = False) -> TopicDescription:
        answer = await super().describe_topic(path, include_stats)
        if "a" not in self.topics[path].consumers:
            self.topics[path].consumers.append("a")
        return answer


async def test_a_consumer_added_meanwhile_is_not_an_error_and_is_made_important() -> None:
    service = AnotherProcessAdds()
    admin = admin_over(service)
    topic = "nemesis.replay.orders"
    await admin.create_topic(topic, partitions=1)
    path = f"/local/nemesis/{topic}"
    service.topics[path].consumers.clear()
    await admin.add_consumer(topic, ConsumerSpec("a"))
    assert service.topics[path].consumers == ["a"]
    assert service.topics[path].important == {"a"}


async def test_a_create_naming_a_consumer_twice_names_it_once() -> None:
    service = TopicService()
    await admin_over(service).create_topic(
        "orders", partitions=1, consumers=[ConsumerSpec("a"), ConsumerSpec("a")]
    )
    assert service.topics["/local/nemesis/orders"].consumers == ["a"]


async def test_the_fake_answers_as_the_server_does() -> None:
    service = TopicService()
    await service.create_topic(
        "/local/t", min_active_partitions=1, retention_period=None, consumers=[TopicConsumer("a")]
    )
    await service.create_topic(  # exists: SUCCESS, nothing changed
        "/local/t", min_active_partitions=5, retention_period=None, consumers=[TopicConsumer("b")]
    )
    assert service.topics["/local/t"].consumers == ["a"]
    with pytest.raises(issues.AlreadyExists):
        await service.alter_topic("/local/t", add_consumers=[TopicConsumer("a")])
    with pytest.raises(issues.BadRequest):
        await service.create_topic(
            "/local/u",
            min_active_partitions=1,
            retention_period=None,
            consumers=[TopicConsumer("a"), TopicConsumer("a")],
        )
    for illegal in ("team/a", "a|b", ""):
        with pytest.raises(issues.BadRequest):
            await service.alter_topic("/local/t", add_consumers=[TopicConsumer(illegal)])


async def test_describe_gives_offsets_and_each_consumers_committed_offset() -> None:
    service = TopicService()
    admin = admin_over(service)
    await admin.create_topic(
        "orders", partitions=2, consumers=[ConsumerSpec("b"), ConsumerSpec("a")]
    )
    service.topics["/local/nemesis/orders"].committed = {"a": {0: 7, 1: 1}}
    description = await admin.describe_topic("orders")
    assert (description.name, description.consumers, description.retention_s) == (
        "orders",
        ["a", "b"],
        86400.0,
    )
    p0, p1 = description.partitions
    assert (p0.partition, p0.start_offset, p0.end_offset) == (0, 2, 10)
    assert p0.last_written_at == WRITTEN.replace(tzinfo=datetime.UTC).timestamp()
    assert p1.last_written_at is None
    # Never committed, or committed below the retained start, reads from the start.
    assert (p0.committed, p1.committed) == ({"a": 7, "b": 2}, {"a": 2, "b": 2})
    with pytest.raises(TopicNotFound, match="describe topic nothing"):
        await admin.describe_topic("nothing")


def test_description_and_consumer_offsets_from_the_sdks_types() -> None:
    offsets = consumer_offsets(consumer_description("c", {0: 5, 3: 9}))
    assert offsets == {0: 5, 3: 9}
    description = topic_description("t", described("/local/t", 1, ["c"], None), {0: {"c": 1}})
    assert description.retention_s is None
    assert description.partitions[0].committed == {"c": 2}


async def test_list_walks_the_directory_and_skips_ydbs_own() -> None:
    tree = {
        "/local/nemesis": [
            scheme_entry("orders"),
            scheme_entry("retry", ydb.SchemeEntryType.DIRECTORY),
            scheme_entry(".sys", ydb.SchemeEntryType.DIRECTORY),
            scheme_entry("dlq", ydb.SchemeEntryType.TABLE),
        ],
        "/local/nemesis/retry": [scheme_entry("a.1"), scheme_entry("a.2")],
        "/local/nemesis/.sys": [scheme_entry("secret")],
    }
    assert await admin_over(TopicService(), tree).list_topics() == [
        "orders",
        "retry/a.1",
        "retry/a.2",
    ]
    assert await admin_over(TopicService(), {}).list_topics() == []  # no directory: no topics


async def test_a_reader_needs_a_registered_consumer() -> None:
    service = TopicService()
    broker = YdbBroker(
        cast(Driver, object()),
        YdbBackendConfig(endpoint="grpc://localhost:2136", database="/local", directory="nemesis"),
        owns_driver=False,
        topics=cast(TopicClientAsyncIO, service),
        list_directory=lister({}),
        make_directory=service.make_directory,
    )
    await broker.admin.create_topic("orders", partitions=1)
    with pytest.raises(TopicNotFound, match="no consumer billing"):
        await broker.reader("orders", "billing")
    with pytest.raises(TopicNotFound):
        await broker.writer("missing")
    await broker.close()
    with pytest.raises(RuntimeError, match="closed"):
        await broker.writer("orders")


async def test_create_makes_the_missing_directories_first_once() -> None:
    service = TopicService()
    admin = admin_over(service)
    await admin.create_topic("retry/orders.1", partitions=1)
    assert service.calls == [
        "mkdir /local/nemesis",
        "mkdir /local/nemesis/retry",
        "create /local/nemesis/retry/orders.1",
    ]
    await admin.create_topic("retry/orders.2", partitions=1)
    assert service.calls[-1] == "create /local/nemesis/retry/orders.2"
    assert service.calls.count("mkdir /local/nemesis") == 1
    # Topics at the database root need no directory.
    service.calls.clear()
    await YdbAdmin(
        cast(TopicClientAsyncIO, service),
        lister({}),
        make_directory=service.make_directory,
        database="/local",
        directory="",
        default_retention_s=0,
        timeout_s=1.0,
    ).create_topic("orders", partitions=1)
    assert service.calls == ["create /local/orders"]


async def test_a_directory_that_cannot_be_made_is_a_clear_error_not_a_missing_topic() -> None:
    service = TopicService()
    service.denied = True
    with pytest.raises(BrokerError, match="create directory /local/nemesis") as raised:
        await admin_over(service).create_topic("orders", partitions=1)
    assert not isinstance(raised.value, TopicNotFound)
    # A topic of the directory's name in the way.
    service = TopicService()
    service.directories.add("/local/nemesis")
    service.topics["/local/nemesis/retry"] = Topic(1, [], None)
    with pytest.raises(BrokerError, match="create directory /local/nemesis/retry") as raised:
        await admin_over(service).create_topic("retry/orders.1", partitions=1)
    assert not isinstance(raised.value, TopicNotFound)
