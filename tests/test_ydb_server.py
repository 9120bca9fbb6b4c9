"""What only a YDB server can confirm about the points the fakes were taught (see the README).

Run against a server named by ``NEMESIS_YDB_ENDPOINT`` (``.github/workflows/ydb.yml``
starts one); skipped with that reason otherwise. Each case works in a fresh,
nested directory that does not exist yet, and drops its topics at the end.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import pytest
import ydb
import zstandard

from nemesis.backends.ydb import YdbStateConfig
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage, WriteStatus
from nemesis.broker.ydb import YdbBroker, open_ydb
from nemesis.broker.ydb.reader import YdbReader
from nemesis.fleet.port import MemberInfo
from nemesis.fleet.ydb import open_ydb_state
from nemesis.topology import tier_topic
from tests.contract.conftest import needs_ydb, ydb_backend_config

pytestmark = [needs_ydb, pytest.mark.timeout(120)]


@pytest.fixture
async def broker() -> AsyncIterator[YdbBroker]:
    # Two levels that do not exist: create_topic must make them.
    directory = f"nemesis-server/{secrets.token_hex(4)}/topics"
    opened = await open_ydb(ydb_backend_config(directory))
    try:
        yield opened
    finally:
        for topic in await opened.admin.list_topics():
            await opened.admin.drop_topic(topic)
        await opened.close()


async def receive_all(reader: YdbReader, count: int, timeout_s: float = 30.0) -> list[Message]:
    received: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(received) < count:
        assert time.monotonic() < deadline, f"received {len(received)} of {count}"
        received.extend(await reader.receive(100, 0.5))
    return received


async def test_a_topic_in_directories_that_do_not_exist_is_created(broker: YdbBroker) -> None:
    await broker.admin.create_topic("retry/orders.1", partitions=1)
    assert await broker.admin.list_topics() == ["retry/orders.1"]


async def test_one_writer_writes_every_partition_and_each_deduplicates(
    broker: YdbBroker,
) -> None:
    await broker.admin.create_topic("orders", partitions=3)
    batch = [OutgoingMessage(value=b"%d" % p, partition=p, seqno=1) for p in range(3)]
    writer = await broker.writer("orders", producer_id="shop")
    results = await writer.write(batch)
    assert [(r.status, r.partition) for r in results] == [
        (WriteStatus.WRITTEN, p) for p in range(3)
    ]
    await writer.close()
    again = await broker.writer("orders", producer_id="shop")  # a restart
    assert [r.status for r in await again.write(batch)] == [WriteStatus.DUPLICATE] * 3


async def test_an_absolute_topic_name_is_the_same_topic(broker: YdbBroker) -> None:
    await broker.admin.create_topic("orders", partitions=1, consumers=[ConsumerSpec("billing")])
    absolute = broker.admin.path("orders")
    assert absolute.startswith(broker.config.database.rstrip("/") + "/")
    assert await broker.admin.consumers(absolute) == ["billing"]
    writer = await broker.writer(absolute)
    await writer.write([OutgoingMessage(value=b"x")])
    reader = await broker.reader(absolute, "billing")
    [message] = await receive_all(reader, 1)
    assert message.value == b"x"


async def test_zstd_messages_of_another_producer_are_decoded(broker: YdbBroker) -> None:
    await broker.admin.create_topic("orders", partitions=1, consumers=[ConsumerSpec("billing")])
    zstd = ydb.TopicCodec(ydb.TopicCodec.ZSTD)
    sdk_writer = broker.topics.writer(
        broker.admin.path("orders"),
        producer_id="java-shop",
        codec=zstd,
        encoders={zstd: lambda data: zstandard.compress(data)},
    )
    await sdk_writer.write_with_ack([b"order-%d" % n for n in range(3)])
    await sdk_writer.close()
    reader = await broker.reader("orders", "billing")
    assert [m.value for m in await receive_all(reader, 3)] == [b"order-0", b"order-1", b"order-2"]


async def test_partitions_are_listed_before_any_message(broker: YdbBroker) -> None:
    await broker.admin.create_topic("orders", partitions=2, consumers=[ConsumerSpec("billing")])
    reader = await broker.reader("orders", "billing")
    deadline = time.monotonic() + 30
    while len(reader.sessions()) < 2:
        assert time.monotonic() < deadline, "the partitions were never assigned"
        assert await reader.receive(10, 0.5) == ()
    assert sorted(s.partition for s in reader.sessions()) == [0, 1]


async def test_a_retry_tiers_consumer_is_important(broker: YdbBroker) -> None:
    topic = tier_topic("orders", 1)
    await broker.admin.create_topic(topic, partitions=1, consumers=[ConsumerSpec("orders")])
    described = await broker.topics.describe_topic(broker.admin.path(topic))
    assert [(c.name, c.important) for c in described.consumers] == [("orders", True)]


async def test_a_paused_partition_past_its_stash_lets_the_others_flow(broker: YdbBroker) -> None:
    await broker.admin.create_topic("orders", partitions=2, consumers=[ConsumerSpec("billing")])
    small = YdbBroker(
        broker.driver,
        broker.config.model_copy(update={"pause_stash_messages": 3}),
        owns_driver=False,
    )
    writer = await broker.writer("orders")
    await writer.write([OutgoingMessage(value=b"first", partition=0)])
    reader = await small.reader("orders", "billing")
    [head] = await receive_all(reader, 1)
    assert head.session is not None
    reader.pause(head.session)
    await writer.write([OutgoingMessage(value=b"a%d" % n, partition=0) for n in range(20)])
    await writer.write([OutgoingMessage(value=b"b%d" % n, partition=1) for n in range(20)])
    others = await _of_partition(reader, 1, 20)
    assert [m.offset for m in others] == list(range(20))
    deadline = time.monotonic() + 30
    while not reader.statistics().spilled:  # partition 0's 20 may come after partition 1's
        assert time.monotonic() < deadline, "the paused partition never spilled"
        assert await reader.receive(100, 0.5) == ()
    reader.resume(head.session)
    # Everything uncommitted comes again, from a new read session.
    again = await _of_partition(reader, 0, 21)
    assert [m.offset for m in again] == list(range(21))
    assert reader.statistics().reopens == 1
    await small.close()


async def _of_partition(reader: YdbReader, partition: int, count: int) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + 30
    while len(got) < count:
        assert time.monotonic() < deadline, f"partition {partition} delivered {len(got)} of {count}"
        got.extend(m for m in await reader.receive(100, 0.5) if m.partition == partition)
    return got


async def test_the_fleet_state_store_on_ydb_tables_and_two_writers_at_once() -> None:
    """The YQL of ``nemesis.fleet.ydb`` as the server runs it, reads after writes in one
    transaction included; two replicas writing at once conflict and are run again."""
    config = YdbStateConfig(path=f"nemesis-server/{secrets.token_hex(4)}/fleet")
    connection = ydb_backend_config("")
    one = await open_ydb_state(config, connection=connection)
    two = await open_ydb_state(config, connection=connection)
    try:
        a = MemberInfo("host-a-1-aaaaaa", "host-a", 1, started_at=1000.0)
        joined = await one.heartbeat(a, now=1000.0, lease_s=10)
        assert await two.generation() == joined
        await one.assign("orders", a.member_id, now=1000.0)
        await one.assign("orders", a.member_id, now=2000.0)  # exists: keeps its since
        version = await two.set_overrides("orders", {"delivery.workers": 8}, set_by="b", now=1.0)
        await asyncio.gather(
            *(
                store.assign(f"team-{n}", a.member_id, now=1.0)
                for n in range(4)
                for store in (one, two)
            )
        )
        view = await one.view()
        assert view.generation == version + 4
        first = view.assignments[0]
        assert (first.integration, first.since) == ("orders", 1000.0)
        assert len(view.assignments) == 5
        assert view.overrides_of("orders")["delivery.workers"].value == 8
        await two.leave(a.member_id)
        assert (await one.view()).assignments == ()
    finally:
        await one.close()
        await two.close()
