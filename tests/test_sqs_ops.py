"""Operating a queue source: its lag in /metrics, ``nemesis queues describe``, bad input, replicas.

Against both SQS-API servers the tests start (moto, ElasticMQ: tests/sqs_servers.py),
through the real CLI in subprocesses and a real handler on 127.0.0.1.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemesis.testing import HandlerServer
from tests.conftest import Workspace, kill_hard, stop_gracefully
from tests.kafka_broker import free_port
from tests.operability import samples, value_of
from tests.sqs_servers import (
    REGION,
    SqsServer,
    aws_env,
    eventually,
    queue_name,
    sqs_server,
    start_moto,
)
from tests.test_sqs_e2e import make_queue, queue_counts, send, sqs_integration

__all__ = ["aws_env", "sqs_server"]

# Real servers, moto answering one call at a time: a case waits minutes on a loaded host
# before it is taken for hung (its own waits bound each step).
pytestmark = [pytest.mark.usefixtures("aws_env"), pytest.mark.timeout(400)]

aiobotocore_session: Any = pytest.importorskip("aiobotocore.session")


async def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.get(f"http://127.0.0.1:{port}/metrics")
    answer.raise_for_status()
    return samples(answer.text)


async def scrape_or_none(port: int) -> dict[str, list[tuple[dict[str, str], float]]] | None:
    try:
        return await scrape(port)
    except httpx.HTTPError:
        return None  # not listening yet


def one(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return value_of(found, name, **labels)


def has(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> bool:
    return any(
        all(sample.get(k) == v for k, v in labels.items()) for sample, _ in found.get(name, [])
    )


@pytest.mark.timeout(300)
async def test_the_lag_of_a_queue_is_its_counts_and_its_oldest_message(
    workspace: Workspace, sqs_server: SqsServer
) -> None:
    queue = queue_name("lag")
    url = await make_queue(sqs_server, queue)
    port = free_port()
    workspace.write_config(f"admin: {{port: {port}}}\nmetrics: {{lag_refresh_s: 1}}\n")
    main = {"integration": "lagging", "flow": "main"}
    lag = {**main, "topic": queue, "partition": "0"}
    async with HandlerServer() as handler:
        handler.hang()
        workspace.write_integration(
            "lagging", sqs_integration("lagging", queue, sqs_server.endpoint, handler.url)
        )
        proxy = await workspace.start("run")

        # Idle: nothing behind, and every empty long poll is a read.
        async def idle_and_reading() -> bool:
            found = await scrape_or_none(port)
            if found is None or not has(found, "nemesis_commit_lag_messages", **lag):
                return False
            since_read = one(found, "nemesis_seconds_since_last_read", **main)
            since_start = one(found, "nemesis_seconds_since_last_commit", **main)
            return (
                one(found, "nemesis_commit_lag_messages", **lag) == 0
                and one(found, "nemesis_commit_lag_seconds", **lag) == 0
                and since_start > 4
                and since_read + 3 < since_start
            )

        await eventually(idle_and_reading, "an idle queue read, with no lag", timeout_s=90)

        # Five messages held by a handler that does not answer: in flight, and ageing.
        await send(sqs_server, url, [json.dumps({"n": n}) for n in range(5)])

        async def five_in_flight() -> bool:
            found = await scrape(port)
            labels = {"integration": "lagging", "queue": queue}
            return (
                one(found, "nemesis_queue_in_flight_messages", **labels) == 5
                and one(found, "nemesis_queue_visible_messages", **labels) == 0
                and one(found, "nemesis_queue_delayed_messages", **labels) == 0
                and one(found, "nemesis_commit_lag_messages", **lag) == 5
                and has(found, "nemesis_commit_lag_seconds", **lag)
                and one(found, "nemesis_commit_lag_seconds", **lag) >= 2
            )

        await eventually(five_in_flight, "five messages in flight, the oldest 2 s old")

        handler.release()
        await handler.ledger.wait_for(5, timeout_s=60)

        async def caught_up() -> bool:
            found = await scrape(port)
            return (
                one(found, "nemesis_commit_lag_messages", **lag) == 0
                and one(found, "nemesis_commit_lag_seconds", **lag) == 0
            )

        await eventually(caught_up, "no lag once the messages are deleted")
        assert await stop_gracefully(proxy) == 0, workspace.logs()


async def make_queue_with(server: SqsServer, name: str, **attributes: str) -> str:
    if name.endswith(".fifo"):
        attributes = {"FifoQueue": "true", "ContentBasedDeduplication": "true", **attributes}
    async with aiobotocore_session.get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=server.endpoint
    ) as client:
        answer = await client.create_queue(QueueName=name, Attributes=attributes)
        url = str(answer["QueueUrl"])
    return url


async def queue_arn(server: SqsServer, url: str) -> str:
    async with aiobotocore_session.get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=server.endpoint
    ) as client:
        answer = await client.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])
    return str(answer["Attributes"]["QueueArn"])


async def test_queues_describe_through_the_cli(workspace: Workspace, sqs_server: SqsServer) -> None:
    dead = queue_name("dead")
    arn = await queue_arn(sqs_server, await make_queue_with(sqs_server, dead))
    standard = queue_name("described")
    policy = json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": "4"})
    url = await make_queue_with(sqs_server, standard, VisibilityTimeout="45", RedrivePolicy=policy)
    await send(sqs_server, url, ["one", "two", "three"])
    fifo = queue_name("ordered", fifo=True)
    fifo_url = await make_queue_with(sqs_server, fifo)
    for name, queue in (("plain", standard), ("ordered", fifo)):
        workspace.write_integration(
            name, sqs_integration(name, queue, sqs_server.endpoint, "http://127.0.0.1:9/")
        )

    # By the integration's name, as a table.
    shown = workspace.cli("queues", "describe", "plain")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in shown.stdout.splitlines())
    assert lines["integration"] == "plain"
    assert lines["queue"] == f"{standard}  standard"
    assert lines["url"] == url
    assert lines["visible"] == "3"
    assert lines["in flight"] == "0"
    assert lines["visibility timeout"] == "45s"
    assert arn in lines["redrive policy"]
    assert "after 4 receives" in lines["redrive policy"]

    # By the queue's name, as JSON.
    shown = workspace.cli("queues", "describe", fifo, "--json")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    document = json.loads(shown.stdout)
    assert document["integration"] == "ordered"
    assert document["url"] == fifo_url
    assert document["fifo"] is True
    assert (document["visible"], document["in_flight"], document["delayed"]) == (0, 0, 0)
    assert document["redrive_policy"] is None

    # A name no integration reads, and an integration whose queue is gone.
    unknown = workspace.cli("queues", "describe", "nothing-here")
    assert unknown.returncode == 1
    assert "no integration" in unknown.stderr, unknown.stderr
    assert "plain (" in unknown.stderr, unknown.stderr
    workspace.write_integration(
        "gone", sqs_integration("gone", queue_name("gone"), sqs_server.endpoint, "http://x/")
    )
    gone = workspace.cli("queues", "describe", "gone")
    assert gone.returncode == 1
    assert "Traceback" not in gone.stderr
    assert "the queue does not exist" in gone.stderr, gone.stderr


async def test_validate_online_names_a_missing_queue_and_refused_credentials(
    workspace: Workspace, sqs_server: SqsServer, tmp_path: Path
) -> None:
    present = queue_name("present")
    await make_queue(sqs_server, present)
    absent = queue_name("absent")
    workspace.write_integration(
        "present", sqs_integration("present", present, sqs_server.endpoint, "http://x/")
    )
    workspace.write_integration(
        "absent", sqs_integration("absent", absent, sqs_server.endpoint, "http://x/")
    )
    guarded = start_moto(tmp_path / "moto-auth", authenticate=True)
    try:
        workspace.write_integration(
            "refused", sqs_integration("refused", present, guarded.endpoint, "http://x/")
        )
        checked = workspace.cli("validate", "--online", "nemesis.yaml", "integrations")
    finally:
        guarded.stop()
    out = checked.stdout + checked.stderr
    assert checked.returncode == 1, out
    assert "Traceback" not in out
    assert re.search(
        rf"^integrations/absent\.yaml:\d+: source\.queue: queue {absent} at .*does not exist",
        out,
        re.MULTILINE,
    ), out
    assert re.search(
        r"^integrations/refused\.yaml:\d+: source: .*credentials refused", out, re.MULTILINE
    ), out
    assert "present.yaml" not in out, out


@pytest.mark.timeout(300)
async def test_run_names_a_bad_queue_and_keeps_its_other_integrations(
    workspace: Workspace, sqs_server: SqsServer, tmp_path: Path
) -> None:
    good = queue_name("good")
    url = await make_queue(sqs_server, good)
    absent = queue_name("absent")
    # The largest message SQS takes (256 KiB, no attributes), beside small ones.
    biggest = json.dumps({"n": "big", "pad": ""})
    biggest = biggest[:-2] + "x" * (262_144 - len(biggest)) + '"}'
    assert len(biggest.encode()) == 262_144
    await send(sqs_server, url, [json.dumps({"n": n}) for n in range(20)] + [biggest])
    guarded = start_moto(tmp_path / "moto-auth", authenticate=True)
    try:
        async with HandlerServer() as handler:
            for name, queue, endpoint in (
                ("good", good, sqs_server.endpoint),
                ("missing", absent, sqs_server.endpoint),
                ("refused", good, guarded.endpoint),
            ):
                workspace.write_integration(
                    name, sqs_integration(name, queue, endpoint, handler.url)
                )
            proxy = await workspace.start("run")
            await handler.ledger.wait_for(21, timeout_s=120)
            await workspace.wait_for_log(
                proxy, f"integration missing, flow main failed: queue {absent}"
            )
            await workspace.wait_for_log(proxy, "integration refused, flow main failed: queue")
            assert await stop_gracefully(proxy) == 0, workspace.logs()
            sizes = sorted(len(entry.body) for entry in handler.ledger if entry.done)
    finally:
        guarded.stop()
    logs = workspace.logs()
    assert "Traceback" not in logs, logs
    missing = [line for line in logs.splitlines() if "integration missing" in line]
    assert any("does not exist" in line for line in missing), missing
    refused = [line for line in logs.splitlines() if "integration refused" in line]
    assert any("credentials refused" in line for line in refused), refused
    assert len(sizes) == 21
    assert sizes[-1] >= 262_144  # the body, as it was sent, inside the event
    assert await queue_counts(sqs_server, url) == (0, 0)


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_two_replicas_share_a_queue(tmp_path: Path, sqs_server: SqsServer) -> None:
    queue = queue_name("shared")
    url = await make_queue(sqs_server, queue)
    count, buffer = 600, 50
    a, b = Workspace(tmp_path / "a"), Workspace(tmp_path / "b")
    ports = {}
    for space in (a, b):
        space.root.mkdir()
        ports[space.root.name] = port = free_port()
        # One backend, DLQ and fleet state (data_dir) for both: two replicas of one fleet.
        space.write_config(f"admin: {{port: {port}}}\n")
        text = (space.root / "nemesis.yaml").read_text()
        text = text.replace(f"path: {space.db_path}", f"path: {a.db_path}")
        text = text.replace("data_dir: .", f"data_dir: {a.root}")
        (space.root / "nemesis.yaml").write_text(text)
    try:
        async with HandlerServer(seed=3) as handler:
            handler.delay(0.005, 0.02)
            for space in (a, b):
                text = sqs_integration("shared", queue, sqs_server.endpoint, handler.url)
                text = text.replace("buffer: 200", f"buffer: {buffer}")
                text = text.replace(
                    "timeout_s: 5}", f"timeout_s: 5, headers: {{x-proxy: {space.root.name}}}}}"
                )
                space.write_integration("shared", "replicas: all\n" + text)
            proxies = [await a.start("run"), await b.start("run")]

            async def both_reading() -> bool:
                for port in ports.values():
                    found = await scrape_or_none(port)
                    running = {"integration": "shared", "flow": "main", "state": "running"}
                    if found is None or not has(found, "nemesis_runner_state", **running):
                        return False
                    if one(found, "nemesis_runner_state", **running) != 1:
                        return False
                return True

            await eventually(both_reading, "both replicas reading the queue", timeout_s=120)
            await send(sqs_server, url, [json.dumps({"n": n}) for n in range(count)])
            await handler.ledger.wait_for(count, timeout_s=180)

            async def drained() -> bool:
                return await queue_counts(sqs_server, url) == (0, 0)

            await eventually(drained, "the queue empty, every message deleted", timeout_s=120)
            for proxy, space in zip(proxies, (a, b), strict=True):
                assert await stop_gracefully(proxy) == 0, space.logs()
        done = [e for e in handler.ledger if e.done]
    finally:
        for space in (a, b):
            for process in space.processes:
                if process.returncode is None:
                    kill_hard(process)
                    await process.wait()
            for log_file in space.log_files:
                log_file.close()
    delivered = Counter(json.loads(e.body)["n"] for e in done)
    assert set(delivered) == set(range(count))
    # Without a crash a message comes twice only when its visibility ran out under load:
    # at most what the two replicas held at once.
    duplicates = sum(n - 1 for n in delivered.values())
    assert duplicates <= 2 * buffer, duplicates
    shares = Counter(e.headers.get("x-proxy") for e in done)
    assert shares["a"] > 0, shares  # each replica took a share
    assert shares["b"] > 0, shares
    print(f"{sqs_server.name}: replicas' shares {dict(shares)}, {duplicates} duplicates")
