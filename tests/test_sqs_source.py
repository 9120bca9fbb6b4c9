"""The SQS source against two real SQS-API servers (moto, ElasticMQ): tests/sqs_servers.py."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import get_session

from nemesis.broker.source import AckOrder, Releases
from nemesis.broker.sqs import (
    META_MESSAGE_ID,
    META_RECEIVE_COUNT,
    SqsSource,
    SqsSourceConfig,
    open_sqs_source,
)
from nemesis.errors import BrokerAccessDenied, BrokerError, TopicNotFound
from tests.sqs_servers import (
    REGION,
    SqsServer,
    aws_env,
    eventually,
    queue_name,
    sqs_server,
    start_moto,
)

__all__ = ["aws_env", "sqs_server"]

pytestmark = pytest.mark.usefixtures("aws_env")


@asynccontextmanager
async def admin(server: SqsServer) -> AsyncIterator[Any]:
    async with get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=server.endpoint
    ) as client:
        yield client


async def make_queue(server: SqsServer, name: str, **attributes: str) -> str:
    if name.endswith(".fifo"):
        attributes = {"FifoQueue": "true", "ContentBasedDeduplication": "true", **attributes}
    async with admin(server) as client:
        answer = await client.create_queue(QueueName=name, Attributes=attributes)
    return str(answer["QueueUrl"])


async def send(server: SqsServer, url: str, bodies: list[str], group: str | None = None) -> None:
    async with admin(server) as client:
        for body in bodies:
            extra: dict[str, Any] = {} if group is None else {"MessageGroupId": group}
            await client.send_message(
                QueueUrl=url,
                MessageBody=body,
                MessageAttributes={"kind": {"DataType": "String", "StringValue": "test"}},
                **extra,
            )


def config(server: SqsServer, name: str, **overrides: Any) -> SqsSourceConfig:
    settings: dict[str, Any] = {
        "queue": name,
        "endpoint_url": server.endpoint,
        "region": REGION,
        "wait_time_s": 1,
        "visibility_timeout_s": 30,
    }
    settings.update(overrides)
    return SqsSourceConfig.model_validate(settings)


async def receive_all(source: SqsSource, count: int, timeout_s: float = 60) -> list[Any]:
    got: list[Any] = []

    async def more() -> bool:
        got.extend(await source.receive(count - len(got), 1))
        return len(got) >= count

    await eventually(more, f"{count} messages received", timeout_s)
    return got


async def counts(source: SqsSource) -> tuple[int, int]:
    stats = await source.stats()
    return stats.visible, stats.in_flight


async def test_receive_and_delete_in_any_order(sqs_server: SqsServer) -> None:
    name = queue_name()
    await make_queue(sqs_server, name)
    await send(sqs_server, await make_queue(sqs_server, name), [f"m{i}" for i in range(25)])
    source = await open_sqs_source(config(sqs_server, name))
    try:
        assert source.ack_order is AckOrder.ANY
        assert isinstance(source, Releases)
        messages = await receive_all(source, 25)
        assert sorted(m.value for m in messages) == sorted(f"m{i}".encode() for i in range(25))
        assert len({m.offset for m in messages}) == 25
        first = messages[0]
        assert first.topic == name
        assert first.partition == 0
        assert first.alive
        assert first.metadata["kind"] == "test"
        assert first.metadata[META_RECEIVE_COUNT] == "1"
        assert first.metadata["nemesis-event-id"] == first.metadata[META_MESSAGE_ID]
        assert first.written_at > 0
        random.shuffle(messages)
        for message in messages:
            await source.commit([message])

        async def empty() -> bool:
            return await counts(source) == (0, 0)

        await eventually(empty, "every message deleted")
        assert await source.receive(10, 1) == []
    finally:
        await source.close()


async def test_release_with_delay_comes_back_counted(sqs_server: SqsServer) -> None:
    name = queue_name()
    await send(sqs_server, await make_queue(sqs_server, name), ["again"])
    source = await open_sqs_source(config(sqs_server, name))
    try:
        [message] = await receive_all(source, 1)
        await source.release([message], 1)
        [back] = await receive_all(source, 1)
        assert back.value == b"again"
        assert back.metadata[META_MESSAGE_ID] == message.metadata[META_MESSAGE_ID]
        assert back.metadata["nemesis-event-id"] == message.metadata["nemesis-event-id"]
        assert back.metadata[META_RECEIVE_COUNT] == "2"
        await source.commit([back])
    finally:
        await source.close()


async def test_extension_keeps_a_slow_message_hidden(sqs_server: SqsServer) -> None:
    name = queue_name()
    await send(sqs_server, await make_queue(sqs_server, name), ["slow"])
    holder = await open_sqs_source(config(sqs_server, name, visibility_timeout_s=3))
    other = await open_sqs_source(config(sqs_server, name, visibility_timeout_s=3))
    try:
        [held] = await receive_all(holder, 1)
        # Four times the visibility timeout, at least (load only makes it longer): without
        # the extension the message would be visible to the other reader by then.
        loop = asyncio.get_running_loop()
        until = loop.time() + 12
        while loop.time() < until:
            assert await other.receive(10, 1) == [], "an extended message was redelivered"
        await holder.commit([held])
    finally:
        await holder.close()
        await other.close()


async def test_a_stuck_message_comes_back_when_its_visibility_runs_out(
    sqs_server: SqsServer,
) -> None:
    name = queue_name()
    await send(sqs_server, await make_queue(sqs_server, name), ["stuck"])
    dead = await open_sqs_source(config(sqs_server, name, visibility_timeout_s=2))
    [stuck] = await receive_all(dead, 1)
    # The holder dies: nothing extends or releases what it held.
    assert dead._extender is not None
    dead._extender.cancel()
    dead._held.clear()
    other = await open_sqs_source(config(sqs_server, name))
    try:
        [again] = await receive_all(other, 1)
        assert again.metadata[META_MESSAGE_ID] == stuck.metadata[META_MESSAGE_ID]
        assert int(again.metadata[META_RECEIVE_COUNT]) >= 2
        await other.commit([again])
    finally:
        await other.close()
        await dead.close()


async def test_fifo_orders_per_group_and_a_failing_group_blocks_only_itself(
    sqs_server: SqsServer,
) -> None:
    name = queue_name(fifo=True)
    url = await make_queue(sqs_server, name)
    await send(sqs_server, url, ["a1", "a2", "a3"], group="a")
    await send(sqs_server, url, ["b1", "b2", "b3"], group="b")
    source = await open_sqs_source(config(sqs_server, name))
    try:
        assert source.fifo
        seen: dict[str, list[str]] = {"a": [], "b": []}
        failed_once = False
        done = 0

        async def step() -> bool:
            nonlocal failed_once, done
            failing: set[str | None] = set()
            for message in await source.receive(10, 1):
                body = message.value.decode()
                assert message.key == body[0]
                # A batch may hold several messages of a group: behind a failed one, the
                # rest of its group goes back too (a reader with `ordering: key` does so).
                if message.key in failing or (body == "a1" and not failed_once):
                    failed_once = True
                    failing.add(message.key)
                    await source.release([message], 2)
                    continue
                seen[body[0]].append(body)
                await source.commit([message])
                done += 1
            return done == 6

        await eventually(step, "both groups delivered")
        assert seen["b"] == ["b1", "b2", "b3"]
        if sqs_server.name == "moto":
            # moto does not keep a group's order across a visibility change: after the
            # release it hands a2 and a3 out in any order. ElasticMQ (and SQS) do keep it.
            assert sorted(seen["a"]) == ["a1", "a2", "a3"]
        else:
            assert seen["a"] == ["a1", "a2", "a3"]
    finally:
        await source.close()


async def test_a_queue_that_does_not_exist(sqs_server: SqsServer) -> None:
    with pytest.raises(TopicNotFound, match="does not exist"):
        await open_sqs_source(config(sqs_server, queue_name("absent")))


async def test_no_credentials(sqs_server: SqsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    name = queue_name()
    await make_queue(sqs_server, name)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(BrokerAccessDenied, match="no AWS credentials"):
        await open_sqs_source(config(sqs_server, name))


async def test_a_message_over_the_limits(sqs_server: SqsServer) -> None:
    name = queue_name()
    await make_queue(sqs_server, name)
    source = await open_sqs_source(config(sqs_server, name))
    try:
        with pytest.raises(BrokerError, match="over SQS's limit"):
            await source.send(b"x" * 262_145)
        with pytest.raises(BrokerError, match="not UTF-8"):
            await source.send(b"\xff")
        await source.send(b"fits", {"kind": "requeued"})
        [back] = await receive_all(source, 1)
        assert back.metadata["kind"] == "requeued"
        await source.commit([back])
    finally:
        await source.close()


async def test_bad_credentials_are_refused(tmp_path: Path) -> None:
    server = start_moto(tmp_path / "moto-auth", authenticate=True)
    try:
        with pytest.raises(BrokerAccessDenied, match="credentials refused"):
            await open_sqs_source(config(server, queue_name()))
    finally:
        server.stop()


def test_config_names_one_queue() -> None:
    with pytest.raises(ValueError, match="one of them"):
        SqsSourceConfig.model_validate({"region": REGION})
    with pytest.raises(ValueError, match="queue"):
        SqsSourceConfig.model_validate({"queue": "bad name!"})


async def test_close_hands_back_what_was_held_and_interrupt_ends_a_long_poll(
    sqs_server: SqsServer,
) -> None:
    name = queue_name()
    await send(sqs_server, await make_queue(sqs_server, name), ["held"])
    first = await open_sqs_source(config(sqs_server, name, visibility_timeout_s=600))
    [held] = await receive_all(first, 1)
    await first.close()
    assert not held.alive
    assert first.sessions() == []
    # Released at close: the next reader has it long before its 600 s would run out.
    other = await open_sqs_source(config(sqs_server, name, wait_time_s=20))
    try:
        [again] = await receive_all(other, 1)
        assert again.metadata[META_MESSAGE_ID] == held.metadata[META_MESSAGE_ID]
        await other.commit([again])
        waiting = asyncio.create_task(other.receive(10, 600))
        await asyncio.sleep(0.2)
        other.interrupt()
        assert await asyncio.wait_for(waiting, 60) == []
        [session] = other.sessions()
        other.pause(session)
        await send(sqs_server, other.queue_url, ["after pause"])
        assert await other.receive(10, 1) == []  # paused: nothing handed out
        other.resume(session)
        [late] = await receive_all(other, 1)
        assert late.value == b"after pause"
        await other.commit([late])
    finally:
        await other.close()


async def test_counts_and_the_queues_own_redrive_policy(sqs_server: SqsServer) -> None:
    dead_name = queue_name("dead")
    dead_url = await make_queue(sqs_server, dead_name)
    async with admin(sqs_server) as client:
        answer = await client.get_queue_attributes(QueueUrl=dead_url, AttributeNames=["QueueArn"])
    arn = answer["Attributes"]["QueueArn"]
    name = queue_name()
    policy = f'{{"deadLetterTargetArn": "{arn}", "maxReceiveCount": "5"}}'
    url = await make_queue(sqs_server, name, RedrivePolicy=policy)
    await send(sqs_server, url, ["one", "two", "three"])
    source = await open_sqs_source(config(sqs_server, name))
    try:
        assert source.redrive_policy is not None
        assert int(source.redrive_policy["maxReceiveCount"]) == 5

        async def three_visible() -> bool:
            return await counts(source) == (3, 0)

        await eventually(three_visible, "three visible messages counted")
        messages = await receive_all(source, 3)

        async def three_in_flight() -> bool:
            return await counts(source) == (0, 3)

        await eventually(three_in_flight, "three messages counted in flight")
        stats = await source.stats()
        assert stats.held_here == 3
        assert stats.oldest_held_age_s is not None
        assert stats.since_last_receive_s is not None
        await source.commit(messages)
    finally:
        await source.close()
