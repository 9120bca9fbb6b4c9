"""The YDB backend's offsets for operators, on the SDK's own read stream and admin stand-ins.

The read streams are the fakes of test_ydb_streams (the SDK's real reader
over an in-memory gRPC stream), the admin calls the in-memory topic service
of test_ydb_admin, which now also takes ``CommitOffset``. What is checked is
what the backend asks of YDB: the read session's ``read_from``, and the
commit that a seek sends.
"""

from __future__ import annotations

import datetime
from typing import Any, cast

import pytest
from ydb import TopicClientAsyncIO
from ydb._grpc.grpcwrapper.ydb_topic import StreamReadMessage
from ydb.aio.driver import Driver

from nemesis.broker.port import ConsumerSpec, StartFrom
from nemesis.broker.ydb import YdbBroker
from nemesis.config.models import YdbBackendConfig
from nemesis.errors import BrokerError
from nemesis.testing.clock import FakeClock
from tests.test_ydb_admin import TopicService, consumer_description, lister
from tests.test_ydb_streams import Grpc, ReadServer, grpc, topics

__all__ = ["grpc", "topics"]  # fixtures of test_ydb_streams, used here

AT = datetime.datetime(2026, 12, 1, 9, 0, tzinfo=datetime.UTC)


class Topics(TopicService):
    """The in-memory admin calls, with the SDK's real reader over the fake read stream."""

    def __init__(self, client: TopicClientAsyncIO) -> None:
        super().__init__()
        self.client = client
        self.commits: list[tuple[str, str, int, int]] = []
        self.sessions: dict[int, str] = {}  # partition -> read session id holding it

    def reader(self, *args: Any, **kwargs: Any) -> Any:
        return self.client.reader(*args, **kwargs)

    async def commit_offset(self, path: str, consumer: str, partition_id: int, offset: int) -> None:
        self.commits.append((path, consumer, partition_id, offset))
        self._topic(path).committed.setdefault(consumer, {})[partition_id] = offset

    async def describe_consumer(
        self, path: str, consumer: str, *, include_stats: bool = False
    ) -> Any:
        description = consumer_description(consumer, self._topic(path).committed.get(consumer, {}))
        for partition in description.partitions:
            stats = partition.partition_consumer_stats
            session = self.sessions.get(partition.partition_id)
            if stats is not None and session is not None:
                stats.read_session_id = session
                stats.reader_name = "billing-reader"
        return description


def broker_over(service: Topics, clock: FakeClock | None = None) -> YdbBroker:
    return YdbBroker(
        cast(Driver, object()),
        YdbBackendConfig(endpoint="grpc://localhost:2136", database="/local", directory=""),
        owns_driver=False,
        topics=cast(TopicClientAsyncIO, service),
        list_directory=lister({}),
        make_directory=service.make_directory,
        clock=clock or FakeClock(wall_start=AT.timestamp() + 3600),
    )


async def read_settings(grpc: Grpc) -> StreamReadMessage.InitRequest.TopicReadSettings:
    server = await ReadServer.accept(grpc)
    (settings,) = server.init.topics_read_settings
    assert settings.path == "/local/orders"
    return settings


async def orders(service: Topics, committed: dict[int, int] | None = None) -> YdbBroker:
    broker = broker_over(service)
    await broker.admin.create_topic("orders", partitions=2, consumers=[ConsumerSpec("billing")])
    if committed is not None:
        service.topics["/local/orders"].committed["billing"] = committed
    return broker


async def test_a_time_is_the_read_sessions_read_from_for_a_consumer_that_never_committed(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    service = Topics(topics)
    broker = await orders(service, {0: 0, 1: 0})
    reader = await broker.reader("orders", "billing", start_from=StartFrom("time", AT.timestamp()))
    try:
        settings = await read_settings(grpc)
        assert settings.read_from == AT
    finally:
        await reader.close()


async def test_latest_is_read_from_now(topics: TopicClientAsyncIO, grpc: Grpc) -> None:
    service = Topics(topics)
    clock = FakeClock(wall_start=AT.timestamp())
    broker = broker_over(service, clock)
    await broker.admin.create_topic("orders", partitions=1, consumers=[ConsumerSpec("billing")])
    reader = await broker.reader("orders", "billing", start_from=StartFrom("latest"))
    try:
        assert (await read_settings(grpc)).read_from == AT
    finally:
        await reader.close()


@pytest.mark.parametrize("start", [StartFrom("latest"), StartFrom("time", AT.timestamp())])
async def test_a_consumer_that_committed_reads_from_its_commit_whatever_the_start(
    topics: TopicClientAsyncIO, grpc: Grpc, start: StartFrom
) -> None:
    service = Topics(topics)
    broker = await orders(service, {0: 0, 1: 4})
    reader = await broker.reader("orders", "billing", start_from=start)
    try:
        assert (await read_settings(grpc)).read_from is None
    finally:
        await reader.close()


async def test_earliest_sets_no_read_from(topics: TopicClientAsyncIO, grpc: Grpc) -> None:
    service = Topics(topics)
    broker = await orders(service)
    reader = await broker.reader("orders", "billing")
    try:
        assert (await read_settings(grpc)).read_from is None
    finally:
        await reader.close()


async def test_seek_commits_the_offset_clamped_to_the_retained_range(
    topics: TopicClientAsyncIO,
) -> None:
    service = Topics(topics)
    broker = await orders(service, {0: 8, 1: 0})
    # The stand-in's partitions hold offsets 2..10 (partition 0) and 2..11 (partition 1).
    moved = await broker.admin.seek("orders", "billing", 0, 3)
    assert (moved.partition, moved.before, moved.after) == (0, 8, 3)
    moved = await broker.admin.seek("orders", "billing", 1, 99)
    assert (moved.before, moved.after) == (2, 11)  # never committed: it reads from the start
    moved = await broker.admin.seek("orders", "billing", 0, 0)
    assert (moved.before, moved.after) == (3, 2)
    assert service.commits == [
        ("/local/orders", "billing", 0, 3),
        ("/local/orders", "billing", 1, 11),
        ("/local/orders", "billing", 0, 2),
    ]
    with pytest.raises(ValueError, match="partition 2 is out of range"):
        await broker.admin.seek("orders", "billing", 2, 0)


async def test_live_readers_are_the_read_sessions_the_server_reports(
    topics: TopicClientAsyncIO,
) -> None:
    service = Topics(topics)
    broker = await orders(service, {0: 1, 1: 1})
    assert await broker.admin.live_readers("orders", "billing") == []
    service.sessions = {0: "session-a", 1: "session-a"}
    assert await broker.admin.live_readers("orders", "billing") == ["billing-reader (session-a)"]


async def test_a_lookup_by_time_says_ydb_has_none(topics: TopicClientAsyncIO) -> None:
    broker = await orders(Topics(topics))
    with pytest.raises(BrokerError, match="cannot look up an offset by time"):
        await broker.admin.offsets_for_time("orders", AT.timestamp())
    assert await broker.admin.write_times("orders", {0: 3}) == {}


async def test_a_reopened_read_session_keeps_the_read_from_while_a_partition_never_committed(
    topics: TopicClientAsyncIO, grpc: Grpc
) -> None:
    """A spilled pause's resume opens the SDK reader again: a partition that never committed
    keeps its start there (it would fall back to its oldest message); once every partition
    has committed, the new session has no read_from, which would skip what a seek put back."""
    service = Topics(topics)
    broker = await orders(service, {0: 0, 1: 0})
    reader = await broker.reader("orders", "billing", start_from=StartFrom("time", AT.timestamp()))
    try:
        assert (await read_settings(grpc)).read_from == AT
        reopen = reader._reopen_sdk_reader  # what a resume after a spill calls
        assert reopen is not None
        for committed, read_from in (({0: 4, 1: 0}, AT), ({0: 4, 1: 2}, None)):
            service.topics["/local/orders"].committed["billing"] = committed
            reopened = await reopen()
            try:
                assert (await read_settings(grpc)).read_from == read_from
            finally:
                await reopened.close()
    finally:
        await reader.close()
