"""An SQS queue as an integration's source, through ``nemesis validate`` and ``nemesis run``.

The queue is on a real SQS-API server (moto, ElasticMQ: tests/sqs_servers.py);
the proxy is the CLI in a subprocess, its handler a real HTTP server on loopback.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from nemesis.testing import HandlerServer
from tests.conftest import Workspace, kill_hard, stop_gracefully
from tests.sqs_servers import REGION, SqsServer, aws_env, eventually, queue_name, sqs_server

__all__ = ["aws_env", "sqs_server"]

# Real servers, moto answering one call at a time: a case waits minutes on a loaded host
# before it is taken for hung (its own waits bound each step).
pytestmark = [pytest.mark.usefixtures("aws_env"), pytest.mark.timeout(400)]

aiobotocore_session: Any = pytest.importorskip("aiobotocore.session")


def sqs_integration(name: str, queue: str, endpoint: str, url: str, extra: str = "") -> str:
    return (
        f"name: {name}\n"
        "owners: [team-test]\n"
        "source:\n"
        "  kind: sqs\n"
        f"  queue: {queue}\n"
        f"  endpoint_url: '{endpoint}'\n"
        f"  region: {REGION}\n"
        f"  consumer: {name}\n"
        "  wait_time_s: 1\n" + extra + f"target: {{url: '{url}', timeout_s: 5}}\n"
        "delivery: {workers: 16, buffer: 200}\n"
        "retry: {tiers: [100ms, 200ms]}\n"
    )


async def make_queue(server: SqsServer, name: str) -> str:
    async with aiobotocore_session.get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=server.endpoint
    ) as client:
        answer = await client.create_queue(QueueName=name)
    return str(answer["QueueUrl"])


async def send(server: SqsServer, url: str, bodies: list[str]) -> None:
    async with aiobotocore_session.get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=server.endpoint
    ) as client:
        for start in range(0, len(bodies), 10):
            entries = [
                {"Id": str(n), "MessageBody": body}
                for n, body in enumerate(bodies[start : start + 10])
            ]
            answer = await client.send_message_batch(QueueUrl=url, Entries=entries)
            assert not answer.get("Failed"), answer


async def queue_counts(server: SqsServer, url: str) -> tuple[int, int]:
    """Visible and in-flight messages of the queue."""
    async with aiobotocore_session.get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=server.endpoint
    ) as client:
        answer = await client.get_queue_attributes(
            QueueUrl=url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )
    attributes = answer["Attributes"]
    return (
        int(attributes["ApproximateNumberOfMessages"]),
        int(attributes["ApproximateNumberOfMessagesNotVisible"]),
    )


def test_validate_accepts_an_sqs_source_and_names_bad_fields(tmp_path: Path) -> None:
    workspace = Workspace(tmp_path)
    workspace.write_config()
    workspace.write_integration(
        "fine", sqs_integration("fine", "orders", "http://127.0.0.1:9324", "http://127.0.0.1:9/")
    )
    fine = workspace.cli("validate", "nemesis.yaml", "integrations")
    assert fine.returncode == 0, fine.stdout + fine.stderr

    workspace.write_integration(
        "bad",
        "name: bad\n"
        "owners: [team-test]\n"
        "source:\n"
        "  kind: sqs\n"
        "  queue: 'bad name!'\n"
        "  consumer: bad\n"
        "  visibility_timeout_s: 1\n"
        "  regoin: eu-west-1\n"
        "target: {url: 'http://127.0.0.1:9/'}\n",
    )
    bad = workspace.cli("validate", "nemesis.yaml", "integrations")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
    out = bad.stdout + bad.stderr
    for field in ("source.queue", "source.visibility_timeout_s", "source.regoin"):
        assert re.search(rf"^integrations/bad\.yaml:\d+: {field}: ", out, re.MULTILINE), out

    workspace.write_integration(
        "bad",
        "name: bad\nowners: [team-test]\n"
        "source: {kind: sqs, consumer: bad}\n"
        "target: {url: 'http://127.0.0.1:9/'}\n",
    )
    neither = workspace.cli("validate", "nemesis.yaml", "integrations")
    assert neither.returncode == 1, neither.stdout + neither.stderr
    assert "name the queue by `queue`" in neither.stdout + neither.stderr


def test_the_example_in_docs_validates(tmp_path: Path) -> None:
    text = (Path(__file__).parents[1] / "docs" / "sqs.md").read_text()
    [example] = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:] if "kind: sqs" in b]
    workspace = Workspace(tmp_path)
    workspace.write_config()
    workspace.write_integration("orders", example)
    checked = workspace.cli("validate", "nemesis.yaml", "integrations")
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_run_delivers_a_queue_and_dead_letters_a_poison_message(
    workspace: Workspace, sqs_server: SqsServer
) -> None:
    queue = queue_name("orders")
    url = await make_queue(sqs_server, queue)
    count = 300
    bodies = [json.dumps({"id": f"order-{n}"}) for n in range(count)]
    bodies.append(json.dumps({"id": "poison"}))
    await send(sqs_server, url, bodies)

    async with HandlerServer() as handler:
        handler.when(lambda entry: b"poison" in entry.body, status=422, body="never valid")
        workspace.write_integration(
            "loyalty", sqs_integration("loyalty", queue, sqs_server.endpoint, handler.url)
        )
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(count, timeout_s=120)

        async def drained() -> bool:
            return await queue_counts(sqs_server, url) == (0, 0)

        await eventually(drained, "the queue empty, every message deleted", timeout_s=120)

        async def dead_lettered() -> bool:
            listed = workspace.cli("dlq", "list", "--json")
            assert listed.returncode == 0, listed.stderr
            return len(listed.stdout.splitlines()) >= 1

        await eventually(dead_lettered, "the poison message in the DLQ", timeout_s=60)
        assert await stop_gracefully(proxy) == 0, workspace.logs()
        delivered = {json.loads(e.body)["id"] for e in handler.ledger if e.done}

    assert delivered == {f"order-{n}" for n in range(count)}
    listed = workspace.cli("dlq", "list", "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert len(rows) == 1, rows
    assert rows[0]["http_status"] == 422
    assert json.loads(rows[0]["payload"]) == {"id": "poison"}
    assert await queue_counts(sqs_server, url) == (0, 0)


async def test_a_proxy_killed_mid_run_loses_nothing_after_a_restart(
    workspace: Workspace, sqs_server: SqsServer
) -> None:
    queue = queue_name("killed")
    url = await make_queue(sqs_server, queue)
    count = 300
    await send(sqs_server, url, [json.dumps({"id": f"order-{n}"}) for n in range(count)])

    async with HandlerServer(seed=5) as handler:
        handler.delay(0.0, 0.02)
        # The first try of every seventh message fails: some are in retry tiers at the kill.
        failing = {f"order-{n}" for n in range(0, count, 7)}
        handler.when(
            lambda entry: entry.receipt == 1 and json.loads(entry.body)["id"] in failing,
            status=503,
        )
        extra = "  visibility_timeout_s: 3\n"
        workspace.write_integration(
            "loyalty", sqs_integration("loyalty", queue, sqs_server.endpoint, handler.url, extra)
        )
        first = await workspace.start("run")
        await handler.ledger.wait_for(50, timeout_s=120)
        kill_hard(first)
        await first.wait()

        second = await workspace.start("run")

        async def all_delivered() -> bool:
            done = {json.loads(e.body)["id"] for e in handler.ledger if e.done}
            return len(done) == count

        await eventually(all_delivered, f"all {count} messages delivered", timeout_s=180)

        async def drained() -> bool:
            return await queue_counts(sqs_server, url) == (0, 0)

        await eventually(drained, "the queue empty, every message deleted", timeout_s=120)
        assert await stop_gracefully(second) == 0, workspace.logs()
        delivered = {json.loads(e.body)["id"] for e in handler.ledger if e.done}

    assert delivered == {f"order-{n}" for n in range(count)}
    listed = workspace.cli("dlq", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == "", listed.stdout


async def send_many(server: SqsServer, url: str, bodies: list[str], senders: int = 8) -> None:
    """Sends ``bodies`` ten to a call, from several calls at once."""
    async with aiobotocore_session.get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=server.endpoint
    ) as client:
        starts = iter(range(0, len(bodies), 10))

        async def sender() -> None:
            for start in starts:
                chunk = bodies[start : start + 10]
                entries = [{"Id": str(n), "MessageBody": body} for n, body in enumerate(chunk)]
                answer = await client.send_message_batch(QueueUrl=url, Entries=entries)
                assert not answer.get("Failed"), answer

        await asyncio.gather(*(sender() for _ in range(senders)))


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_ten_thousand_messages_through_a_kill_9(
    workspace: Workspace, sqs_server: SqsServer
) -> None:
    if sqs_server.name == "moto":
        # moto answers every call in Python, one at a time: 10,000 messages take it minutes
        # on a busy host. The kill above (300 messages) and the replicas' test run on it.
        pytest.skip("10,000 messages run on ElasticMQ; moto is too slow for them")
    queue = queue_name("ten-thousand")
    url = await make_queue(sqs_server, queue)
    count = 10_000
    await send_many(sqs_server, url, [json.dumps({"id": f"order-{n}"}) for n in range(count)])

    async with HandlerServer(seed=11) as handler:
        handler.delay(0.0, 0.005)
        extra = "  visibility_timeout_s: 10\n"
        workspace.write_integration(
            "loyalty", sqs_integration("loyalty", queue, sqs_server.endpoint, handler.url, extra)
        )
        first = await workspace.start("run")
        await handler.ledger.wait_for(count // 5, timeout_s=120)
        kill_hard(first)
        await first.wait()
        # What the dead proxy held: hidden until its visibility runs out (10 s), so this is
        # read well before any of it comes back. Only these can be delivered twice.
        _, held = await queue_counts(sqs_server, url)
        second = await workspace.start("run")

        async def all_delivered() -> bool:
            return len({e.id for e in handler.ledger if e.done}) >= count

        await eventually(all_delivered, f"all {count} messages delivered", timeout_s=240)

        async def drained() -> bool:
            return await queue_counts(sqs_server, url) == (0, 0)

        await eventually(drained, "the queue empty, every message deleted", timeout_s=120)
        assert await stop_gracefully(second) == 0, workspace.logs()
        done = [e for e in handler.ledger if e.done]

    delivered = Counter(json.loads(e.body)["id"] for e in done)
    assert set(delivered) == {f"order-{n}" for n in range(count)}
    duplicates = sum(n - 1 for n in delivered.values())
    assert duplicates <= held, (duplicates, held)
    print(f"{sqs_server.name}: kill -9 at {count // 5}: {held} held, {duplicates} duplicates")
