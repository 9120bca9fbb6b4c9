"""nemesis.testing.HandlerServer: the ledger and each scripting feature, over real sockets."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from nemesis.broker.port import Message
from nemesis.config.models import TargetConfig
from nemesis.delivery.cloudevents import BATCH_CONTENT_TYPE, batch_body
from nemesis.delivery.http import http_transport
from nemesis.delivery.port import Event, Outcome
from nemesis.testing import HandlerServer, Ledger

CE_HEADERS = {
    "content-type": "application/json",
    "ce-specversion": "1.0",
    "ce-source": "nemesis/test",
    "ce-type": "order.created",
    "ce-topic": "orders",
    "ce-partition": "2",
    "ce-attempt": "1",
}


def ce_headers(id_: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**CE_HEADERS, "ce-id": id_, "ce-offset": "0", **(extra or {})}


def event(id_: str, payload: bytes = b'{"n": 1}', content_type: str = "application/json") -> Event:
    message = Message(topic="orders", partition=2, offset=5, value=payload, key="k")
    return Event(message=message, id=id_, type="order.created", content_type=content_type)


@pytest.fixture
async def server() -> AsyncIterator[HandlerServer]:
    async with HandlerServer(seed=7) as handler:
        yield handler


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    client: aiohttp.ClientSession,
    server: HandlerServer,
    id_: str,
    body: bytes = b"{}",
    *,
    extra: dict[str, str] | None = None,
) -> aiohttp.ClientResponse:
    async with client.post(server.url, data=body, headers=ce_headers(id_, extra)) as response:
        await response.read()
        return response


async def test_records_a_binary_mode_delivery(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    before_wall, before = time.time(), time.monotonic()

    response = await post(
        client, server, "id-1", b'{"a": 1}', extra={"ce-partitionkey": "%F0%9F%94%91"}
    )

    assert response.status == 200
    [entry] = server.ledger.entries
    assert (entry.id, entry.topic, entry.partition, entry.offset, entry.attempt) == (
        "id-1",
        "orders",
        2,
        0,
        1,
    )
    assert (entry.type, entry.source, entry.key) == ("order.created", "nemesis/test", "🔑")
    assert (entry.body, entry.content_type, entry.mode) == (
        b'{"a": 1}',
        "application/json",
        "binary",
    )
    assert entry.headers["ce-partitionkey"] == "%F0%9F%94%91"
    assert (entry.request, entry.connection, entry.receipt, entry.status) == (1, 1, 1, 200)
    assert before <= entry.received_monotonic <= time.monotonic()
    assert before_wall <= entry.received_wall <= time.time()
    assert (server.requests, server.ledger.requests) == (1, 1)


async def test_behave_answers_every_request(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    server.behave(503, body="down for maintenance", headers={"Retry-After": "30"})

    async with client.post(server.url, headers=ce_headers("a")) as response:
        text = await response.text()

    assert (response.status, text, response.headers["Retry-After"]) == (
        503,
        "down for maintenance",
        "30",
    )
    assert server.ledger.entries[0].status == 503
    assert server.ledger.done_ids() == set()


async def test_fail_ids(server: HandlerServer, client: aiohttp.ClientSession) -> None:
    server.fail_ids({"bad-1", "bad-2"}, status=422)

    statuses = {id_: (await post(client, server, id_)).status for id_ in ("ok", "bad-1", "bad-2")}

    assert statuses == {"ok": 200, "bad-1": 422, "bad-2": 422}
    assert server.ledger.done_ids() == {"ok"}
    assert server.ledger.ids() == {"ok", "bad-1", "bad-2"}


async def test_fail_first_attempts_then_succeed(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    server.fail_first(2)

    statuses = [(await post(client, server, "x")).status for _ in range(3)]
    other = await post(client, server, "y")
    again = await post(client, server, "x")

    assert statuses == [503, 503, 200]
    assert (other.status, again.status) == (503, 200)
    assert [entry.receipt for entry in server.ledger.by_id("x")] == [1, 2, 3, 4]
    assert server.ledger.counts() == {"x": 4, "y": 1}
    assert server.ledger.duplicates() == {"x": 2}


async def test_when_predicate_limited_times(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    rule = server.when(lambda entry: entry.key == "vip", status=429, times=2)

    statuses = [
        (await post(client, server, f"v{n}", extra={"ce-partitionkey": "vip"})).status
        for n in range(3)
    ]
    plain = await post(client, server, "p")

    assert statuses == [429, 429, 200]
    assert plain.status == 200
    assert (rule.used, rule.exhausted) == (2, True)


async def test_earlier_rules_win_and_rules_can_be_removed(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    first = server.fail_ids({"a"}, status=409)
    server.when(lambda entry: True, status=500)

    assert (await post(client, server, "a")).status == 409
    assert (await post(client, server, "b")).status == 500
    server.remove(first)
    assert (await post(client, server, "a")).status == 500
    server.reset()
    assert (await post(client, server, "a")).status == 200


async def test_fixed_delay(server: HandlerServer, client: aiohttp.ClientSession) -> None:
    server.delay(0.2)

    started = time.monotonic()
    await post(client, server, "slow")

    assert time.monotonic() - started >= 0.2


async def test_random_delays_answer_out_of_order(server: HandlerServer) -> None:
    server.delay(0.0, 0.2)
    answered: list[int] = []

    async def deliver(client: aiohttp.ClientSession, n: int) -> None:
        await post(client, server, str(n))
        answered.append(n)

    connector = aiohttp.TCPConnector(limit=20)
    async with aiohttp.ClientSession(connector=connector) as client:
        await asyncio.gather(*(deliver(client, n) for n in range(20)))

    assert sorted(answered) == list(range(20))
    assert answered != sorted(answered)


async def test_hang_until_release(server: HandlerServer, client: aiohttp.ClientSession) -> None:
    server.hang()
    request = asyncio.create_task(post(client, server, "held"))
    await server.ledger.wait_until(lambda ledger: ledger.requests == 1, timeout_s=2.0)
    await asyncio.sleep(0.05)
    assert not request.done()
    assert server.pending == 1

    server.release()
    response = await asyncio.wait_for(request, 2.0)

    assert response.status == 200
    assert server.pending == 0
    assert (await post(client, server, "not held")).status == 200


async def test_rule_can_hang_one_id(server: HandlerServer, client: aiohttp.ClientSession) -> None:
    server.when(lambda entry: entry.id == "stuck", status=200, hang=True)
    stuck = asyncio.create_task(post(client, server, "stuck"))
    await server.ledger.wait_until(lambda ledger: "stuck" in ledger.ids(), timeout_s=2.0)

    assert (await post(client, server, "free")).status == 200
    assert not stuck.done()
    server.release()
    assert (await asyncio.wait_for(stuck, 2.0)).status == 200


async def test_refuse_and_accept_connections_on_the_same_port(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    port = server.port
    await post(client, server, "before")

    await server.refuse_connections()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    await server.accept_connections()

    assert server.port == port
    assert (await post(client, server, "after")).status == 200
    assert server.ledger.done_ids() == {"before", "after"}


async def test_disconnect_instead_of_answering(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    server.fail_ids({"crash"}, status=500)
    server.when(lambda entry: entry.id == "drop-me", disconnect=True)

    with pytest.raises(aiohttp.ServerDisconnectedError):
        await post(client, server, "drop-me")

    assert server.ledger.entries[0].status == 0
    assert not server.ledger.entries[0].done


@pytest.mark.parametrize(("verdict", "done"), [("drop", True), ("dead", False), ("retry", False)])
async def test_verdict_headers(
    server: HandlerServer, client: aiohttp.ClientSession, verdict: str, done: bool
) -> None:
    server.behave(200, headers={"nemesis-verdict": verdict})

    response = await post(client, server, "v")

    assert response.headers["nemesis-verdict"] == verdict
    [entry] = server.ledger.entries
    assert (entry.verdict, entry.done) == (verdict, done)


async def test_batch_request_gives_one_entry_per_event(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    events = [event("b1"), event("b2", b"\x00\x01", "application/octet-stream"), event("b3")]
    body = batch_body(events, "nemesis/test")

    async with client.post(
        server.url, data=body, headers={"content-type": BATCH_CONTENT_TYPE}
    ) as r:
        assert r.status == 200

    assert server.requests == 1
    entries = server.ledger.entries
    assert [(entry.id, entry.mode, entry.batch_size) for entry in entries] == [
        ("b1", "batch", 3),
        ("b2", "batch", 3),
        ("b3", "batch", 3),
    ]
    assert [entry.body for entry in entries] == [b'{"n":1}', b"\x00\x01", b'{"n":1}']
    assert {(entry.topic, entry.partition, entry.offset, entry.key) for entry in entries} == {
        ("orders", 2, 5, "k")
    }
    assert server.ledger.done_ids() == {"b1", "b2", "b3"}


async def test_rule_matches_a_batch_when_any_event_matches(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    server.fail_ids({"b2"}, status=422)
    body = batch_body([event("b1"), event("b2")], "nemesis/test")

    async with client.post(
        server.url, data=body, headers={"content-type": BATCH_CONTENT_TYPE}
    ) as r:
        assert r.status == 422

    assert [entry.status for entry in server.ledger.entries] == [422, 422]


async def test_invalid_batch_answers_400(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    headers = {"content-type": BATCH_CONTENT_TYPE}
    for body in (b"[not json", b'{"an": "object"}', b"[1, 2]", b'[{"data_base64": "%%%"}]'):
        async with client.post(server.url, data=body, headers=headers) as response:
            assert response.status == 400

    assert server.ledger.ids() == set()
    assert server.requests == 4


async def test_predicate_errors_answer_500_and_are_logged(
    server: HandlerServer, client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    server.when(lambda entry: 1 / 0 > 0)

    with caplog.at_level(logging.ERROR, logger="nemesis.testing.handler"):
        response = await post(client, server, "boom")

    assert response.status == 500
    assert "rule predicate failed" in caplog.text


async def test_wait_for_distinct_done_ids(
    server: HandlerServer, client: aiohttp.ClientSession
) -> None:
    server.fail_first(1)
    waiting = asyncio.create_task(server.ledger.wait_for(2, timeout_s=5.0))

    for id_ in ("a", "b", "a", "b"):
        await post(client, server, id_)

    await waiting
    with pytest.raises(TimeoutError, match=r"3 ids done not met after 0\.05s"):
        await server.ledger.wait_for(3, timeout_s=0.05)


async def test_counts_tcp_connections(server: HandlerServer) -> None:
    async with aiohttp.ClientSession() as pooled:
        for n in range(3):
            await post(pooled, server, f"p{n}")
    assert server.connections == 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
        for n in range(3):
            await post(fresh, server, f"f{n}")
    assert server.connections == 4
    assert [entry.connection for entry in server.ledger.entries] == [1, 1, 1, 2, 3, 4]


async def test_pipelined_answers_keep_request_order(server: HandlerServer) -> None:
    server.when(lambda entry: entry.id == "first", status=201, delay_s=0.1)
    request = b"POST / HTTP/1.1\r\nhost: x\r\nce-id: %s\r\ncontent-length: 0\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(request % b"first" + request % b"second")
        first = await reader.readuntil(b"\r\n\r\n")
        second = await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()
        await writer.wait_closed()

    assert first.startswith(b"HTTP/1.1 201 Created\r\n")
    assert second.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_ledger_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    async with HandlerServer(ledger_path=path) as server:
        server.fail_first(1, status=503)
        delivering = http_transport(
            TargetConfig(url=server.url), integration="test", max_connections=2
        )
        try:
            await delivering.deliver(event("one", b"\xff binary", "application/octet-stream"))
            await delivering.deliver(event("one", b"\xff binary", "application/octet-stream"))
            await delivering.deliver_batch([event("two"), event("three")])
        finally:
            await delivering.close()
        in_memory = [entry.to_json() for entry in server.ledger]

    loaded = Ledger.load(path)

    assert [entry.to_json() for entry in loaded] == in_memory
    assert loaded.entries[0].body == b"\xff binary"
    assert loaded.requests == 3
    assert loaded.counts() == {"one": 2, "two": 1, "three": 1}
    assert loaded.done_ids() == {"one"}  # the batch got 503: two and three were first arrivals


async def test_standalone_process(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "nemesis.testing.handler",
        "--port",
        "0",
        "--ledger",
        str(path),
        "--fail-first",
        "1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 20.0)
        url = line.decode().removeprefix("listening on ").strip()
        delivering = http_transport(TargetConfig(url=url), integration="test", max_connections=1)
        try:
            first = await delivering.deliver(event("sub-1"))
            second = await delivering.deliver(event("sub-1"))
        finally:
            await delivering.close()
    finally:
        process.terminate()
        _, stderr = await asyncio.wait_for(process.communicate(), 10.0)

    assert process.returncode == 0
    assert stderr == b""
    assert (first.outcome, second.outcome) == (Outcome.RETRY, Outcome.DELIVERED)
    loaded = Ledger.load(path)
    assert [entry.status for entry in loaded] == [503, 200]
    assert loaded.done_ids() == {"sub-1"}
