"""Nemesis' HTTP/1.1 transport against real servers: nginx, uvicorn, aiohttp.web, Node.

Each case runs against every server of ``conftest.real_server`` and checks
what the runner would see (the ``DeliveryResult``) and how the connections
were used (the transport's statistics).
"""

from __future__ import annotations

import asyncio

from nemesis.broker.port import Message
from nemesis.config.models import TargetConfig
from nemesis.delivery.h1 import H1Transport
from nemesis.delivery.port import Event, Outcome
from tests.conformance.conftest import RealServer
from tests.operability import wait_until_true

PAYLOAD = b'{"order": {"id": 17, "city": "msk", "amount": 250.5}}'


def event(offset: int = 41) -> Event:
    message = Message("orders", 3, offset, PAYLOAD, key="customer-9", created_at=1764480000.25)
    return Event(message=message, id=f"orders/3/{offset}", type="order.created")


def transport(url: str, max_connections: int = 4) -> H1Transport:
    target = TargetConfig.model_validate({"url": url, "timeout_s": 5})
    return H1Transport(target, integration="conformance", max_connections=max_connections)


async def test_concurrent_deliveries_share_keep_alive_connections(real_server: RealServer) -> None:
    sender = transport(real_server.url("/ok"), max_connections=8)
    try:
        results = await asyncio.gather(*(sender.deliver(event(n)) for n in range(200)))
        batch = await sender.deliver_batch([event(1), event(2)])
    finally:
        await sender.close()

    assert {result.outcome for result in [*results, batch]} == {Outcome.DELIVERED}
    assert {result.status for result in results} == {204}
    stats = sender.statistics()
    assert stats.requests == 201
    assert 1 <= stats.connects <= 8


async def test_statuses_map_as_the_table_says(real_server: RealServer) -> None:
    cases = {"/status/422": (Outcome.DEAD, 422), "/status/503": (Outcome.RETRY, 503)}
    for path, (outcome, status) in cases.items():
        sender = transport(real_server.url(path))
        try:
            first = await sender.deliver(event())
            second = await sender.deliver(event(42))
        finally:
            await sender.close()

        for result in (first, second):
            assert (result.outcome, result.status) == (outcome, status)
            assert result.error == f"HTTP {status}: answered {status}"
        # The body was read whole: the connection served both requests.
        assert sender.statistics().connects == 1


async def test_a_chunked_body_is_read(real_server: RealServer) -> None:
    sender = transport(real_server.url("/chunked"))
    try:
        first = await sender.deliver(event())
        second = await sender.deliver(event(42))
    finally:
        await sender.close()

    for result in (first, second):
        assert (result.outcome, result.error) == (Outcome.RETRY, "HTTP 503: answered in chunks")
    assert sender.statistics().connects == 1


async def test_connection_close_is_honoured(real_server: RealServer) -> None:
    sender = transport(real_server.url("/close"))
    try:
        results = [await sender.deliver(event(n)) for n in range(3)]
    finally:
        await sender.close()

    assert [result.outcome for result in results] == [Outcome.DELIVERED] * 3
    stats = sender.statistics()
    assert (stats.connects, stats.idle_connections) == (3, 0)


async def test_a_connection_the_server_closed_while_idle_is_replaced(
    real_server: RealServer,
) -> None:
    sender = transport(real_server.url("/ok"))
    try:
        assert (await sender.deliver(event(1))).outcome is Outcome.DELIVERED
        # The server closes the idle connection after its keep-alive period; the
        # transport sees the close and drops the connection from its pool.
        await wait_until_true(lambda: sender.statistics().discarded == 1)
        result = await sender.deliver(event(2))
    finally:
        await sender.close()

    assert result.outcome is Outcome.DELIVERED
    stats = sender.statistics()
    assert (stats.requests, stats.connects, stats.discarded) == (2, 2, 1)
