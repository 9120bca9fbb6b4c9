"""Nemesis' own topics on YDB outlive a pause: important consumers, and lag against retention.

The admin's stand-in plays YDB's retention: when it passes, a partition
keeps only what an *important* consumer has not committed; an ordinary
consumer's unread messages are deleted.
"""

from __future__ import annotations

from typing import cast

from ydb import TopicClientAsyncIO
from ydb.aio.driver import Driver

from nemesis.broker.port import ConsumerSpec
from nemesis.broker.ydb import YdbBroker
from nemesis.broker.ydb.admin import INTERNAL_TOPIC_PREFIXES, is_internal
from nemesis.config.models import YdbBackendConfig
from nemesis.runtime.lag import LagMonitor, LagTarget
from nemesis.topology import replay_topic, tier_topic
from tests.test_ydb_admin import Topic, TopicService, admin_over, lister


def test_the_internal_prefixes_are_the_runtimes_topic_names() -> None:
    assert is_internal(tier_topic("orders", 2))
    assert is_internal(replay_topic("orders"))
    assert tier_topic("x", 1).startswith(INTERNAL_TOPIC_PREFIXES[0])
    assert not is_internal("orders")
    assert not is_internal("/local/shop/orders")


async def test_a_paused_integrations_retry_tier_keeps_its_messages_past_the_retention() -> None:
    service = TopicService()
    admin = admin_over(service)
    tier = tier_topic("orders", 1)
    # As the runtime asks for it: an ordinary consumer spec.
    await admin.create_topic(tier, partitions=2, consumers=[ConsumerSpec("orders")])
    topic = service.topics[f"/local/nemesis/{tier}"]
    topic.committed = {"orders": {0: 4, 1: 3}}
    topic.expire()  # the integration stayed paused for longer than the retention
    description = await admin.describe_topic(tier)
    assert [p.start_offset for p in description.partitions] == [4, 3]
    assert [p.end_offset - p.committed["orders"] for p in description.partitions] == [6, 8]

    # A source topic's consumer stays ordinary: its unread messages expire.
    await admin.create_topic("orders", partitions=1, consumers=[ConsumerSpec("billing")])
    source = service.topics["/local/nemesis/orders"]
    source.committed = {"billing": {0: 4}}
    source.expire()
    assert (await admin.describe_topic("orders")).partitions[0].start_offset == 10


async def test_a_consumer_registered_before_is_made_important() -> None:
    service = TopicService()
    admin = admin_over(service)
    replay = replay_topic("orders")
    service.directories.add("/local/nemesis")
    service.topics[f"/local/nemesis/{replay}"] = Topic(1, ["orders"], 86400.0)
    await admin.add_consumer(replay, ConsumerSpec("orders"))
    assert service.topics[f"/local/nemesis/{replay}"].important == {"orders"}
    await admin.add_consumer(replay, ConsumerSpec("orders"))  # important already: no call
    assert service.calls.count(f"alter /local/nemesis/{replay}") == 1


async def test_lag_carries_the_topics_retention() -> None:
    service = TopicService()
    broker = YdbBroker(
        cast(Driver, object()),
        YdbBackendConfig(
            endpoint="grpc://localhost:2136", database="/local", directory="nemesis", retention=3600
        ),
        owns_driver=False,
        topics=cast(TopicClientAsyncIO, service),
        list_directory=lister({}),
        make_directory=service.make_directory,
    )
    await broker.admin.create_topic("orders", partitions=1, consumers=[ConsumerSpec("billing")])
    target = LagTarget("orders", "main", "orders", "billing")
    monitor = LagMonitor(broker, lambda: [target])
    await monitor.refresh()
    [lag] = monitor.lags([target])
    assert lag.retention_s == 3600
    await broker.close()
