"""Failures on a queue, through ``nemesis run``: retries by visibility, the DLQ, requeue.

Against both SQS-API servers (moto, ElasticMQ: tests/sqs_servers.py), with the
proxy as the CLI in a subprocess and its handler a real HTTP server on
loopback. The handler sees the queue's receive count through
``forward_headers``: a message retried by release comes back from the queue
with it grown, and it is the attempt (``ce-attempt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from nemesis.dlq import DeadLetterFilter, Status
from nemesis.testing import HandlerServer
from nemesis.testing.ledger import LedgerEntry
from tests.conftest import Workspace, stop_gracefully
from tests.sqs_servers import REGION, SqsServer, aws_env, eventually, queue_name, sqs_server
from tests.test_sqs_e2e import queue_counts

__all__ = ["aws_env", "sqs_server"]

# Real servers, moto answering one call at a time: a case waits minutes on a loaded host
# before it is taken for hung (its own waits bound each step).
pytestmark = [pytest.mark.usefixtures("aws_env"), pytest.mark.timeout(400)]

aiobotocore_session: Any = pytest.importorskip("aiobotocore.session")


def integration(
    name: str, queue: str, endpoint: str, url: str, *, tiers: str, extra: str = ""
) -> str:
    return (
        f"name: {name}\n"
        "owners: [team-test]\n"
        "source:\n"
        "  kind: sqs\n"
        f"  queue: {queue}\n"
        f"  endpoint_url: '{endpoint}'\n"
        f"  region: {REGION}\n"
        f"  consumer: {name}\n"
        "  wait_time_s: 1\n"
        "  forward_headers: [sqs-receive-count]\n"
        f"target: {{url: '{url}', timeout_s: 5}}\n"
        f"retry: {{tiers: {tiers}}}\n"
        "breaker: {cooldown_s: 1}\n" + extra
    )


@asynccontextmanager
async def admin(server: SqsServer) -> AsyncIterator[Any]:
    async with aiobotocore_session.get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=server.endpoint
    ) as client:
        yield client


async def make_queue(server: SqsServer, name: str) -> str:
    attributes = {}
    if name.endswith(".fifo"):
        attributes = {"FifoQueue": "true", "ContentBasedDeduplication": "true"}
    async with admin(server) as client:
        answer = await client.create_queue(QueueName=name, Attributes=attributes)
    return str(answer["QueueUrl"])


async def send(server: SqsServer, url: str, bodies: list[str], group: str | None = None) -> None:
    async with admin(server) as client:
        for body in bodies:
            extra: dict[str, Any] = {} if group is None else {"MessageGroupId": group}
            await client.send_message(QueueUrl=url, MessageBody=body, **extra)


def body_id(entry: LedgerEntry) -> str:
    return str(json.loads(entry.body)["id"])


def arrivals(handler: HandlerServer, id_: str) -> list[LedgerEntry]:
    return [entry for entry in handler.ledger if body_id(entry) == id_]


def dead_rows(workspace: Workspace) -> list[dict[str, Any]]:
    listed = workspace.cli("dlq", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return [json.loads(line) for line in listed.stdout.splitlines()]


async def test_a_failed_message_is_retried_by_visibility_at_the_tier_delays(
    workspace: Workspace, sqs_server: SqsServer
) -> None:
    queue = queue_name("retried")
    url = await make_queue(sqs_server, queue)
    await send(sqs_server, url, [json.dumps({"id": n}) for n in ("flaky", "a", "b", "c")])

    async with HandlerServer() as handler:
        handler.when(lambda e: body_id(e) == "flaky" and e.receipt <= 2, status=503)
        workspace.write_integration(
            "loyalty",
            integration("loyalty", queue, sqs_server.endpoint, handler.url, tiers="[1s, 2s]"),
        )
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(4, timeout_s=120)

        async def drained() -> bool:
            return await queue_counts(sqs_server, url) == (0, 0)

        await eventually(drained, "the queue empty, every message deleted", timeout_s=120)
        assert await stop_gracefully(proxy) == 0, workspace.logs()

    flaky = arrivals(handler, "flaky")
    assert [e.status for e in flaky] == [503, 503, 200], flaky
    # The attempt is the queue's receive count: each retry came back from the queue.
    assert [e.attempt for e in flaky] == [1, 2, 3]
    assert [e.headers["sqs-receive-count"] for e in flaky] == ["1", "2", "3"]
    assert len({e.id for e in flaky}) == 1  # one event id across receives
    # Each retry waited at least its tier's delay (a lower bound: load only lengthens it).
    waits = [b.received_monotonic - a.received_monotonic for a, b in itertools.pairwise(flaky)]
    assert waits[0] >= 1.0, waits
    assert waits[1] >= 2.0, waits
    for other in ("a", "b", "c"):
        assert [e.attempt for e in arrivals(handler, other)] == [1]
    assert dead_rows(workspace) == []
    # No tier topics: the retries waited in the queue, not on the backend.
    topics = workspace.cli("topics", "list")
    assert topics.returncode == 0, topics.stderr
    assert "nemesis.retry.loyalty" not in topics.stdout


async def test_a_message_past_its_tiers_is_dead_lettered_with_its_receive_count_and_requeued(
    workspace: Workspace, sqs_server: SqsServer
) -> None:
    queue = queue_name("poison")
    url = await make_queue(sqs_server, queue)
    await send(sqs_server, url, [json.dumps({"id": "poison"})])
    accept = False

    async with HandlerServer() as handler:
        handler.when(lambda e: body_id(e) == "poison" and not accept, status=503)
        workspace.write_integration(
            "loyalty",
            integration("loyalty", queue, sqs_server.endpoint, handler.url, tiers="[1s, 1s]"),
        )
        proxy = await workspace.start("run")

        async def trickle() -> None:
            # Other messages pass meanwhile: the evidence that the failure is the message's
            # own, not the handler's, which the policy needs before it dead-letters.
            async with admin(sqs_server) as client:
                for n in range(10_000):
                    entries = [
                        {"Id": str(i), "MessageBody": json.dumps({"id": f"good-{n}-{i}"})}
                        for i in range(5)
                    ]
                    await client.send_message_batch(QueueUrl=url, Entries=entries)
                    await asyncio.sleep(0.2)

        sender = asyncio.create_task(trickle())
        try:

            async def dead_lettered() -> bool:
                return len(dead_rows(workspace)) == 1

            await eventually(dead_lettered, "the poison message in the DLQ", timeout_s=90)
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        [row] = dead_rows(workspace)
        assert row["reason"] == "retries_exhausted", row
        assert row["http_status"] == 503
        assert row["source"].startswith(f"{queue}/0@")
        # Released twice (tiers), then the third receive's failures were in place.
        assert row["metadata"]["sqs-receive-count"] == "3", row["metadata"]
        assert row["attempts"] >= 3
        assert row["metadata"]["sqs-queue-url"] == url
        first = arrivals(handler, "poison")
        assert {e.id for e in first} == {row["event_id"]}
        assert [e.headers["sqs-receive-count"] for e in first][:3] == ["1", "2", "3"]

        accept = True
        requeued = workspace.cli("dlq", "requeue", row["id"], "--yes")
        assert requeued.returncode == 0, requeued.stdout + requeued.stderr

        async def delivered_again() -> bool:
            return any(e.done for e in arrivals(handler, "poison"))

        await eventually(delivered_again, "the requeued message delivered", timeout_s=120)

        async def drained() -> bool:
            return await queue_counts(sqs_server, url) == (0, 0)

        await eventually(drained, "the queue empty, every message deleted", timeout_s=120)
        assert await stop_gracefully(proxy) == 0, workspace.logs()

    [again] = [e for e in arrivals(handler, "poison") if e.done]
    # Back through the queue: a new message to SQS (received once), the same event.
    assert again.headers["sqs-receive-count"] == "1"
    assert again.attempt == 1
    assert again.id == row["event_id"]
    [after] = dead_rows(workspace)
    assert after["status"] == "requeued"
    assert after["requeue_count"] == 1


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_fifo_a_failing_message_in_one_group_does_not_block_the_others(
    workspace: Workspace, sqs_server: SqsServer, ordering: str
) -> None:
    queue = queue_name("groups", fifo=True)
    url = await make_queue(sqs_server, queue)
    await send(sqs_server, url, [json.dumps({"id": f"a{n}"}) for n in (1, 2)], group="a")
    for group in ("b", "c"):
        await send(sqs_server, url, [json.dumps({"id": f"{group}{n}"}) for n in (1, 2, 3)], group)

    async with HandlerServer() as handler:

        def others_done() -> int:
            return sum(1 for e in handler.ledger if e.done and body_id(e)[0] in "bc")

        # a1 fails until every message of the other groups was delivered: were they held
        # behind it, it would fail for good and land in the DLQ.
        handler.when(lambda e: body_id(e) == "a1" and others_done() < 6, status=503)
        workspace.write_integration(
            "loyalty",
            integration(
                "loyalty",
                queue,
                sqs_server.endpoint,
                handler.url,
                tiers="[1s, 1s, 2s, 4s, 8s, 16s]",
                extra=f"delivery: {{ordering: {ordering}}}\n",
            ),
        )
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(8, timeout_s=180)

        async def drained() -> bool:
            return await queue_counts(sqs_server, url) == (0, 0)

        await eventually(drained, "the queue empty, every message deleted", timeout_s=120)
        assert await stop_gracefully(proxy) == 0, workspace.logs()

    a1 = arrivals(handler, "a1")
    assert a1[0].status == 503, a1
    assert a1[-1].done, a1
    assert dead_rows(workspace) == []
    done = [body_id(e) for e in handler.ledger if e.done]
    assert sorted(done) == ["a1", "a2", "b1", "b2", "b3", "c1", "c2", "c3"]
    for group in "bc":
        assert [i for i in done if i[0] == group] == [f"{group}1", f"{group}2", f"{group}3"]
    if ordering == "key":
        # Ordered: a2 waits behind a1 in its group, whatever a1's retries.
        assert done.index("a1") < done.index("a2")
        assert [e.attempt for e in a1] == list(range(1, len(a1) + 1))
    else:
        # Released: a1's retries came back from the queue, counted by it.
        assert [e.headers["sqs-receive-count"] for e in a1] == [
            str(n) for n in range(1, len(a1) + 1)
        ]


ENDPOINT = "http://127.0.0.1:9324"  # validated, never reached


def test_validate_names_the_retry_mode_and_a_tier_longer_than_visibility(tmp_path: Path) -> None:
    workspace = Workspace(tmp_path)
    workspace.write_config()
    fine = integration("fine", "orders", ENDPOINT, "http://127.0.0.1:9/", tiers="[1m]")
    workspace.write_integration("fine", fine)
    workspace.write_integration(
        "topics",
        integration("topics", "orders", ENDPOINT, "http://127.0.0.1:9/", tiers="[13h]").replace(
            "retry: {tiers: [13h]}", "retry: {tiers: [13h], via: topics}"
        ),
    )
    checked = workspace.cli("validate", "nemesis.yaml", "integrations")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    workspace.write_integration(
        "long",
        integration("long", "orders", ENDPOINT, "http://127.0.0.1:9/", tiers="[1m, 13h]"),
    )
    workspace.write_integration(
        "typo",
        integration("typo", "orders", ENDPOINT, "http://127.0.0.1:9/", tiers="[1m]").replace(
            "retry: {tiers: [1m]}", "retry: {tiers: [1m], via: visibility}"
        ),
    )
    workspace.write_integration(
        "topic",
        "name: topic\nowners: [team-test]\n"
        "source: {topic: orders, consumer: topic}\n"
        "target: {url: 'http://127.0.0.1:9/'}\n"
        "retry: {tiers: [1m], via: release}\n",
    )
    bad = workspace.cli("validate", "nemesis.yaml", "integrations")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
    out = bad.stdout + bad.stderr
    assert re.search(
        r"^integrations/long\.yaml:\d+: retry\.tiers\[1\]: tier 2 \(46800s\) is longer than"
        r" 12 hours, the most a source of kind sqs can hold a message back",
        out,
        re.MULTILINE,
    ), out
    assert re.search(r"^integrations/typo\.yaml:\d+: retry\.via: ", out, re.MULTILINE), out
    assert re.search(
        r"^integrations/topic\.yaml:\d+: retry\.via: release needs a source", out, re.MULTILINE
    ), out
    assert "integrations/fine.yaml" not in out
    assert "integrations/topics.yaml" not in out


async def test_a_fifo_dead_letter_goes_back_to_its_group_each_requeue_a_new_message(
    sqs_server: SqsServer,
) -> None:
    from nemesis.broker.sqs import SqsSourceConfig, open_sqs_source
    from nemesis.broker.sqs.requeue import send_back
    from nemesis.dlq.port import DeadLetterRow, Reason, Status

    name = queue_name("requeued", fifo=True)
    url = await make_queue(sqs_server, name)  # content-based deduplication on
    await send(sqs_server, url, [json.dumps({"id": "x"})], group="g")
    source = await open_sqs_source(
        SqsSourceConfig(queue=name, endpoint_url=sqs_server.endpoint, region=REGION, wait_time_s=1)
    )
    try:
        [first] = await _receive(source, 1)
        await source.commit([first])
        address = dict(source.return_address())
        assert address["sqs-queue-url"] == url
        row = DeadLetterRow(
            id="row-1",
            integration="loyalty",
            event_id=first.metadata["nemesis-event-id"],
            status=Status.DEAD,
            reason=Reason.RETRIES_EXHAUSTED,
            http_status=503,
            error="server_error (http 503)",
            signature="s",
            attempts=3,
            first_failure_at=0.0,
            dead_lettered_at=0.0,
            requeue_count=0,
            last_action=None,
            last_action_by=None,
            last_action_at=None,
            source_topic=name,
            source_partition=0,
            source_offset=first.offset,
            key=first.key,
            stage="delivery",
            metadata={**first.metadata, **address, "traceparent": TRACEPARENT},
            payload=first.value,
            payload_size=len(first.value),
        )
        # Twice: the same body within SQS's deduplication window, each a message of its own.
        for _ in range(2):
            sent, error = await send_back([row])
            assert error is None
            assert sent == ["row-1"]
        again = await _receive(source, 2)
        for message in again:
            assert message.key == "g"
            assert message.value == first.value
            assert message.metadata["nemesis-event-id"] == row.event_id
            assert message.metadata["sqs-receive-count"] == "1"
            assert message.metadata["traceparent"] == TRACEPARENT
            assert message.metadata["sqs-message-id"] != first.metadata["sqs-message-id"]
            assert "sqs-queue-url" not in message.metadata  # never sent as an attribute
        await source.commit(again)

        gone = dataclasses.replace(row, metadata={**row.metadata, "sqs-queue-url": url + "-gone"})
        sent, error = await send_back([gone])
        assert sent == []
        assert error is not None
        assert "does not exist" in str(error)
    finally:
        await source.close()


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def _receive(source: Any, count: int) -> list[Any]:
    got: list[Any] = []

    async def more() -> bool:
        got.extend(await source.receive(count - len(got), 1))
        return len(got) >= count

    await eventually(more, f"{count} messages received")
    return got


async def test_the_viewer_requeues_to_the_queue_and_says_when_it_cannot(
    sqs_server: SqsServer, tmp_path: Path
) -> None:
    import httpx

    from dlq_viewer.testing import STANDARD_ACCESS, integration, letter, sign_in, viewer_env

    name = queue_name("viewed")
    url = await make_queue(sqs_server, name)
    address = {"sqs-region": REGION, "sqs-endpoint-url": sqs_server.endpoint}
    alice = STANDARD_ACCESS.people[0]
    async with viewer_env(
        tmp_path, integrations={"orders-a": integration("orders-a", ["team-a"])}
    ) as env:
        here = letter("orders-a", 1, metadata={**address, "sqs-queue-url": url, "kind": "x"})
        gone = letter("orders-a", 2, metadata={**address, "sqs-queue-url": url + "-gone"})
        await env.store.put([here, gone])
        [here_id] = await env.store.select_ids(DeadLetterFilter(text='ord-1"'), 10)
        [gone_id] = await env.store.select_ids(DeadLetterFilter(text='ord-2"'), 10)
        transport = httpx.ASGITransport(app=env.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://viewer.test") as client:
            csrf = await sign_in(client, alice)
            sent = await client.post(f"/messages/{here_id}/requeue", data={"csrf_token": csrf})
            assert sent.status_code == 303, sent.text
            page = (await client.get(sent.headers["location"])).text
            assert "Sent back to queue orders." in page
            refused = await client.post(f"/messages/{gone_id}/requeue", data={"csrf_token": csrf})
            assert refused.status_code == 503, refused.text
            assert "does not exist" in refused.text
            still_dead = (await client.get(f"/messages/{gone_id}")).text
            assert "Requeue this message to queue orders?" in still_dead
        rows = {row.id: row for row in await env.store.get_many([here_id, gone_id])}
        assert rows[here_id].status is Status.REQUEUED
        assert rows[gone_id].status is Status.DEAD

    async with admin(sqs_server) as client:
        answer = await client.receive_message(
            QueueUrl=url, WaitTimeSeconds=5, MessageAttributeNames=["All"]
        )
    [message] = answer["Messages"]
    assert json.loads(message["Body"]) == {"order_id": "ord-1", "n": 1}
    attributes = {k: v["StringValue"] for k, v in message["MessageAttributes"].items()}
    assert attributes["nemesis-event-id"] == here.event_id
    assert attributes["kind"] == "x"
