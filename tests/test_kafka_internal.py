"""On Kafka, an integration's internal flows (retry tiers, replay) are one group member.

The proxy runs in the test's process against one real Kafka-protocol broker
(Tansu) shared by the module; each case names its integration and topics
with a prefix of its own. Group members are counted as the consumers the
backend opens for readers, with what each subscribes to (Tansu's
DescribeGroups lists no members, so the broker cannot be asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer

import nemesis.broker.kafka.broker as kafka_broker_module
from nemesis.broker.kafka.broker import KafkaBroker, open_kafka
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.config.models import IntegrationConfig
from nemesis.dlq.sqlite import open_sqlite_dlq
from nemesis.runtime.app import Proxy
from nemesis.runtime.internal import FlowReader
from nemesis.runtime.retries import replay_topic, tier_topic
from nemesis.testing import HandlerServer
from tests.kafka_broker import Namespace, TansuBroker, kafka_backend_config, start_tansu

pytestmark = pytest.mark.timeout(120)

INTERNAL_FLOWS = ("retry-1", "retry-2", "replay")
INTERNAL_PARTITIONS = 4  # the supervisor's default


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    broker = start_tansu(tmp_path_factory.mktemp("tansu"))
    yield broker
    broker.stop()


@pytest.fixture
def members(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[str, ...]]]:
    """(group, topics) of every consumer the backend opens for a reader."""
    opened: list[tuple[str, tuple[str, ...]]] = []

    class Counted(AIOKafkaConsumer):  # type: ignore[misc]  # aiokafka is untyped
        def subscribe(self, topics: Any, **options: Any) -> Any:
            opened.append((self._group_id, tuple(topics)))
            return super().subscribe(topics, **options)

    monkeypatch.setattr(kafka_broker_module, "AIOKafkaConsumer", Counted)
    return opened


def integration(name: str, url: str) -> IntegrationConfig:
    return IntegrationConfig.model_validate(
        {
            "name": name,
            "owners": [f"team-{name}"],
            "source": {"topic": f"{name}-src", "consumer": name},
            "target": {"url": url, "timeout_s": 2},
            "retry": {"tiers": ["300ms", "1s"]},
            "breaker": {"min_requests": 100_000},
        }
    )


@contextlib.asynccontextmanager
async def running(
    broker: KafkaBroker, config: IntegrationConfig, tmp_path: Path
) -> AsyncIterator[Proxy]:
    dlq = await open_sqlite_dlq(tmp_path / f"dlq-{id(broker)}.db")
    proxy = Proxy(broker, {config.name: config}, dlq=dlq)
    task = asyncio.create_task(proxy.run())
    try:
        yield proxy
    finally:
        proxy.stop()
        await task
        await dlq.close()


def internal_held(proxy: Proxy, name: str) -> set[tuple[str, int]]:
    """The internal (topic, partition)s this proxy's internal flows hold now."""
    runners = proxy.groups[name].runners if name in proxy.groups else {}
    held: set[tuple[str, int]] = set()
    for flow in INTERNAL_FLOWS:
        runner = runners.get(flow)
        reader = getattr(runner, "_reader", None)
        if reader is not None:
            held.update((s.topic, s.partition) for s in reader.sessions())
    return held


async def until(check: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        outcome = check()
        if outcome if isinstance(outcome, bool) else await outcome:
            return
        assert time.monotonic() < deadline, f"not reached in time: {what}"
        await asyncio.sleep(0.2)


async def test_a_retried_message_goes_through_tier_1_over_one_member_for_the_internal_flows(
    tansu: TansuBroker, tmp_path: Path, members: list[tuple[str, tuple[str, ...]]]
) -> None:
    name = Namespace()("it")
    broker = await open_kafka(kafka_backend_config(tansu.bootstrap))
    try:
        await broker.admin.create_topic(f"{name}-src", partitions=2, consumers=[ConsumerSpec(name)])
        await (await broker.writer(f"{name}-src")).write(
            [OutgoingMessage(orjson.dumps({"n": n})) for n in range(3)]
        )
        async with HandlerServer() as handler:
            handler.fail_first(1, status=503)
            async with running(broker, integration(name, handler.url), tmp_path) as proxy:
                await handler.ledger.wait_for(3, timeout_s=60)
                runners = proxy.groups[name].runners
                assert all(isinstance(runners[f]._reader, FlowReader) for f in INTERNAL_FLOWS)
                assert runners["retry-1"].statistics().messages_read == 3
        for event_id in handler.ledger.ids():
            assert [e.attempt for e in handler.ledger.by_id(event_id)] == [1, 2]
        internal = (tier_topic(name, 1), tier_topic(name, 2), replay_topic(name))
        # Two members of the integration's group: the main flow's, and one for all
        # the internal flows (five, one per flow, before).
        assert sorted(members) == sorted([(name, (f"{name}-src",)), (name, internal)])
    finally:
        await broker.close()


async def test_two_proxies_split_the_internal_partitions_and_hand_over_on_stop(
    tansu: TansuBroker, tmp_path: Path, members: list[tuple[str, tuple[str, ...]]]
) -> None:
    name = Namespace()("it")
    internal = {
        (topic, p)
        for topic in (tier_topic(name, 1), tier_topic(name, 2), replay_topic(name))
        for p in range(INTERNAL_PARTITIONS)
    }
    first_broker = await open_kafka(kafka_backend_config(tansu.bootstrap))
    second_broker = await open_kafka(kafka_backend_config(tansu.bootstrap))
    try:
        await first_broker.admin.create_topic(
            f"{name}-src", partitions=2, consumers=[ConsumerSpec(name)]
        )
        async with HandlerServer() as handler:
            config = integration(name, handler.url)
            async with running(first_broker, config, tmp_path) as first:
                await until(lambda: internal_held(first, name) == internal, "the first holds all")
                async with running(second_broker, config, tmp_path) as second:

                    def split() -> bool:
                        held = internal_held(first, name), internal_held(second, name)
                        return all(held) and not held[0] & held[1] and held[0] | held[1] == internal

                    await until(split, "the two proxies split the internal partitions")
                await until(lambda: internal_held(first, name) == internal, "the first takes all")
        internal_members = [m for m in members if m[1] != (f"{name}-src",)]
        assert len(internal_members) == 2  # one per proxy
    finally:
        await second_broker.close()
        await first_broker.close()
