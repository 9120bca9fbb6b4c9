"""Nemesis' HTTP/1.1 transport against servers that misbehave, each failure on the outcome table.

A ``RawServer`` on 127.0.0.1 reads each request and answers it with raw
bytes a test scripts: cut connections, early answers, trickling answers,
oversized heads, broken status lines and chunk framing, stray bytes. It
counts the requests that reached it, so that a test can tell that a request
was never sent twice.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType

import pytest

from nemesis.broker.port import Message
from nemesis.config.models import TargetConfig
from nemesis.delivery.h1 import H1Transport
from nemesis.delivery.port import DeliveryResult, Event, Outcome
from nemesis.errors import ConfigError
from tests.operability import wait_until_true

PAYLOAD = b'{"order": {"id": 17, "city": "msk", "amount": 250.5}}'
NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"


@dataclass(frozen=True, slots=True)
class Request:
    """One request as it reached the server."""

    connection: int  # which connection carried it, numbered from 1
    local_address: str  # the address it was sent to
    head: str
    body: bytes

    def header(self, name: str) -> str | None:
        found = re.search(rf"(?im)^{re.escape(name)}: (.*)\r$", self.head)
        return found.group(1) if found else None


# Answers one request: writes to the connection, may close it. Returns False to stop serving it.
Script = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class RawServer:
    """An HTTP/1.1 server on 127.0.0.1 whose answers are raw bytes from ``script``."""

    script: Script
    host: str = "127.0.0.1"
    read_body: bool = True
    port: int = 0
    requests: list[Request] = field(default_factory=list)
    closed_by_client: int = 0  # connections the client closed (EOF between requests)
    _client_closed: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.Server | None = None
    _connections: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        await self._server.wait_closed()

    async def wait_closed_by_client(self, count: int) -> None:
        """Until the client has closed ``count`` connections."""
        while self.closed_by_client < count:
            self._client_closed.clear()
            await self._client_closed.wait()

    def url(self, path: str = "/") -> str:
        return f"http://{self.host}:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = next(self._connections)
        self._writers.add(writer)
        local_address = writer.get_extra_info("sockname")[0]
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                found = re.search(r"(?im)^content-length: (\d+)\r$", head)
                length = int(found.group(1)) if found else 0
                body = await reader.readexactly(length) if self.read_body else b""
                request = Request(number, local_address, head, body)
                self.requests.append(request)
                if not await self.script(request, reader, writer):
                    break
        except asyncio.IncompleteReadError as eof:
            if not eof.partial:
                self.closed_by_client += 1
                self._client_closed.set()
        except ConnectionError:
            pass
        finally:
            writer.transport.abort()
            self._writers.discard(writer)


def event(offset: int = 41, id_: str | None = None) -> Event:
    message = Message("orders", 3, offset, PAYLOAD, key="customer-9", created_at=1764480000.25)
    return Event(message=message, id=id_ or f"orders/3/{offset}", type="order.created")


def make(
    url: str, *, timeout_s: float = 2.0, max_connections: int = 4, **kw: object
) -> H1Transport:
    target = TargetConfig.model_validate({"url": url, "timeout_s": timeout_s, **kw})
    return H1Transport(target, integration="conformance", max_connections=max_connections)


async def deliver(
    server: RawServer, *events: Event, timeout_s: float = 2.0
) -> list[DeliveryResult]:
    transport = make(server.url(), timeout_s=timeout_s)
    try:
        return [await transport.deliver(one) for one in events]
    finally:
        await transport.close()


def answering(*answers: bytes) -> Script:
    """Answers the n-th request of each connection with ``answers[n]`` (the last one after)."""
    served: dict[int, int] = {}

    async def script(request: Request, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        n = served[request.connection] = served.get(request.connection, 0) + 1
        w.write(answers[min(n, len(answers)) - 1])
        await w.drain()
        return True

    return script


def always(answer: bytes, *, keep_open: bool = True) -> Script:
    async def script(_: Request, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(answer)
        await w.drain()
        return keep_open

    return script


# --- the connection goes away ---------------------------------------------------------


async def test_closed_before_the_response_is_a_retry_never_a_resend() -> None:
    async def close_unanswered(request: Request, _: asyncio.StreamReader, w: object) -> bool:
        return False  # read the request, answer nothing, close

    async with RawServer(close_unanswered) as server:
        [result] = await deliver(server, event())

    assert (result.outcome, result.status) == (Outcome.RETRY, None)
    assert result.error == "server disconnected (connection closed before the response)"
    assert len(server.requests) == 1


async def test_a_keep_alive_connection_closed_as_it_is_reused_is_not_resent() -> None:
    # The idle-timeout race: the server takes the second request, then closes unanswered.
    async def one_answer_per_connection(
        request: Request, _: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        served = [r for r in server.requests if r.connection == request.connection]
        if len(served) > 1:
            return False
        w.write(NO_CONTENT)
        return True

    async with RawServer(one_answer_per_connection) as server:
        first, second = await deliver(server, event(1), event(2))

    assert first.outcome is Outcome.DELIVERED
    assert (second.outcome, second.error) == (
        Outcome.RETRY,
        "server disconnected (connection closed before the response)",
    )
    # Two requests reached the server, each once: the second was not sent again.
    assert [(r.connection, r.header("ce-offset")) for r in server.requests] == [(1, "1"), (1, "2")]


async def test_a_connection_closed_right_after_a_keep_alive_answer_is_discarded() -> None:
    async with RawServer(always(NO_CONTENT, keep_open=False)) as server:
        transport = make(server.url())
        try:
            first = await transport.deliver(event(1))
            # The server's FIN arrives while the connection is idle: it leaves the pool.
            await wait_until_true(lambda: transport.statistics().discarded == 1)
            second = await transport.deliver(event(2))
        finally:
            await transport.close()

    assert (first.outcome, second.outcome) == (Outcome.DELIVERED, Outcome.DELIVERED)
    assert [r.connection for r in server.requests] == [1, 2]
    assert transport.statistics().discarded == 1


async def test_reset_before_the_response_is_a_retry() -> None:
    async def reset(_: Request, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        # Linger 0: closing sends RST instead of FIN.
        w.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        return False

    async with RawServer(reset) as server:
        [result] = await deliver(server, event())

    assert result.outcome is Outcome.RETRY
    assert result.error is not None
    assert result.error.startswith("server disconnected (connection")
    assert len(server.requests) == 1


async def test_closed_mid_headers_is_a_retry() -> None:
    async with RawServer(always(b"HTTP/1.1 200 OK\r\nContent-Le", keep_open=False)) as server:
        [result] = await deliver(server, event())

    assert (result.outcome, result.error) == (
        Outcome.RETRY,
        "server disconnected (connection closed before the response)",
    )


async def test_closed_mid_body_the_status_decides() -> None:
    answer = b"HTTP/1.1 503 Busy\r\nContent-Length: 100\r\n\r\nbusy, come ba"
    async with RawServer(always(answer, keep_open=False)) as server:
        [result] = await deliver(server, event())

    assert (result.outcome, result.status, result.error) == (
        Outcome.RETRY,
        503,
        "HTTP 503: busy, come ba",
    )


async def test_a_body_read_until_close_is_read() -> None:
    answer = b"HTTP/1.0 422 Unprocessable\r\n\r\nno such order"
    async with RawServer(always(answer, keep_open=False)) as server:
        [result] = await deliver(server, event())

    assert (result.outcome, result.error) == (Outcome.DEAD, "HTTP 422: no such order")


# --- early, slow, large and broken answers ----------------------------------------------


async def test_an_answer_before_the_body_is_read_counts() -> None:
    big = b"x" * (4 * 1024 * 1024)

    async def refuse_early(
        _: Request, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        w.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 8\r\nConnection: close\r\n\r\ntoo big!")
        await w.drain()
        while await reader.read(65536):  # drain what is still coming, then close
            pass
        return False

    async with RawServer(refuse_early, read_body=False) as server:
        transport = make(server.url())
        message = Message("orders", 3, 41, big)
        try:
            result = await transport.deliver(Event(message=message, id="big", type="t"))
            after = await transport.deliver(event(42))
        finally:
            await transport.close()

    assert (result.outcome, result.status, result.error) == (
        Outcome.DEAD,
        413,
        "HTTP 413: too big!",
    )
    # The connection the handler answered early and closed was not used again.
    assert (after.outcome, after.status) == (Outcome.DEAD, 413)
    assert [r.connection for r in server.requests] == [1, 2]


async def test_a_slowloris_answer_times_out() -> None:
    async def trickle(_: Request, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"z" * 1000:
            w.write(bytes([byte]))
            await asyncio.sleep(0.02)
        return False

    async with RawServer(trickle) as server:
        [result] = await deliver(server, event(), timeout_s=0.3)

    assert (result.outcome, result.error) == (Outcome.RETRY, "timeout after 0.3s")


async def test_oversized_headers_are_too_large() -> None:
    answer = b"HTTP/1.1 200 OK\r\n" + b"X-Padding: " + b"p" * 100_000 + b"\r\n\r\n"
    async with RawServer(always(answer)) as server:
        [result] = await deliver(server, event())

    assert (result.outcome, result.error) == (
        Outcome.RETRY,
        "answer too large: headers over 65536 bytes",
    )


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/9 200 OK\r\n\r\n",
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde",
    ],
)
async def test_a_malformed_answer_is_a_protocol_error(answer: bytes) -> None:
    async with RawServer(always(answer)) as server:
        [result] = await deliver(server, event())

    assert result.outcome is Outcome.RETRY
    assert result.error is not None
    assert result.error.startswith("invalid response: ")


async def test_an_unrequested_protocol_switch_is_a_protocol_error() -> None:
    answer = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n"
    )
    async with RawServer(always(answer)) as server:
        [result] = await deliver(server, event())

    assert (result.outcome, result.error) == (
        Outcome.RETRY,
        "invalid response: unrequested protocol switch",
    )


async def test_chunk_framing_errors_the_status_decides_and_the_connection_is_dropped() -> None:
    broken = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnot hex\r\n0\r\n\r\n"
    async with RawServer(answering(broken, NO_CONTENT)) as server:
        transport = make(server.url())
        try:
            first = await transport.deliver(event(1))
            second = await transport.deliver(event(2))
        finally:
            await transport.close()

    assert (first.outcome, first.status) == (Outcome.DELIVERED, 200)
    assert second.outcome is Outcome.DELIVERED
    assert [r.connection for r in server.requests] == [1, 2]


# --- what an answer may legitimately look like ---------------------------------------------


@pytest.mark.parametrize(
    ("answer", "outcome", "status"),
    [
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
            Outcome.DELIVERED,
            200,
        ),
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + NO_CONTENT, Outcome.DELIVERED, 204),
        (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n", Outcome.RETRY, 304),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 10\r\n\r\n", Outcome.DELIVERED, 204),
        (
            b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"4\r\nbusy\r\n6\r\n again\r\n0\r\nX-Trailer: 1\r\n\r\n",
            Outcome.RETRY,
            503,
        ),
    ],
    ids=["100-continue", "103", "304", "204", "chunked"],
)
async def test_informational_bodiless_and_chunked_answers(
    answer: bytes, outcome: Outcome, status: int
) -> None:
    async with RawServer(always(answer)) as server:
        results = await deliver(server, event(1), event(2))

    for result in results:
        assert (result.outcome, result.status) == (outcome, status)
    if status == 503:
        assert results[0].error == "HTTP 503: busy again"
    # The answers were framed right: one connection served both.
    assert [r.connection for r in server.requests] == [1, 1]


async def test_stray_bytes_after_an_answer_drop_the_connection() -> None:
    async with RawServer(
        answering(NO_CONTENT + b"HTTP/1.1 500 Oops\r\n\r\n", NO_CONTENT)
    ) as server:
        results = await deliver(server, event(1), event(2))

    assert [(r.outcome, r.status) for r in results] == [(Outcome.DELIVERED, 204)] * 2
    assert [r.connection for r in server.requests] == [1, 2]


# --- pool, DNS, headers -----------------------------------------------------------------


async def test_the_pool_never_opens_more_than_its_limit() -> None:
    async def slow(_: Request, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.01)
        w.write(NO_CONTENT)
        return True

    async with RawServer(slow) as server:
        transport = make(server.url(), max_connections=3)
        try:
            results = await asyncio.gather(*(transport.deliver(event(n)) for n in range(30)))
        finally:
            await transport.close()

    assert {r.outcome for r in results} == {Outcome.DELIVERED}
    assert len({r.connection for r in server.requests}) == 3


async def test_idle_connections_are_closed_after_the_keep_alive_period() -> None:
    async with RawServer(always(NO_CONTENT)) as server:
        target = TargetConfig.model_validate({"url": server.url()})
        transport = H1Transport(target, integration="c", max_connections=4, keepalive_s=0.2)
        try:
            await asyncio.gather(*(transport.deliver(event(n)) for n in range(3)))
            opened = transport.statistics().connects
            async with asyncio.timeout(10):
                await server.wait_closed_by_client(opened)
            stats = transport.statistics()
            after = await transport.deliver(event(9))
        finally:
            await transport.close()

    assert (stats.open_connections, stats.idle_connections) == (0, 0)
    assert after.outcome is Outcome.DELIVERED
    assert transport.statistics().connects == opened + 1


async def test_a_request_waiting_for_a_connection_times_out_too() -> None:
    async def hang(_: Request, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(30)
        return False

    async with RawServer(hang) as server:
        transport = make(server.url(), timeout_s=0.3, max_connections=1)
        try:
            first, second = await asyncio.gather(
                transport.deliver(event(1)), transport.deliver(event(2))
            )
        finally:
            await transport.close()

    for result in (first, second):
        assert (result.outcome, result.error) == (Outcome.RETRY, "timeout after 0.3s")
    # The second got a connection only if the first's timeout freed one before its own.
    assert len(server.requests) in (1, 2)
    assert transport.statistics().in_flight == 0


async def test_new_connections_rotate_over_the_resolved_addresses_and_follow_changes() -> None:
    answers: dict[str, list[str]] = {"handler.internal": ["127.0.0.1", "127.0.0.2"]}

    async def resolve(host: str, port: int) -> list[str]:
        return answers[host]

    async def hold(_: Request, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.05)  # the four requests overlap: four connections
        w.write(NO_CONTENT)
        return False  # one request per connection: every delivery opens one

    async with RawServer(hold, host="0.0.0.0") as server:
        target = TargetConfig.model_validate({"url": f"http://handler.internal:{server.port}/"})
        transport = H1Transport(target, integration="c", max_connections=4, resolve=resolve)
        try:
            spread = await asyncio.gather(*(transport.deliver(event(n)) for n in range(4)))
            answers["handler.internal"] = ["127.0.0.3"]
            moved = await transport.deliver(event(5))
        finally:
            await transport.close()

    assert {r.outcome for r in [*spread, moved]} == {Outcome.DELIVERED}
    addresses = [r.local_address for r in server.requests]
    assert sorted(addresses[:4]) == ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]
    assert addresses[4] == "127.0.0.3"
    assert {r.header("host") for r in server.requests} == {f"handler.internal:{server.port}"}


async def test_an_unresolvable_host_is_a_retry() -> None:
    transport = make("http://no-such-host.invalid/")
    try:
        result = await transport.deliver(event())
    finally:
        await transport.close()

    assert (result.outcome, result.error) == (Outcome.RETRY, "cannot resolve no-such-host.invalid")


async def test_metadata_cannot_inject_a_header() -> None:
    async with RawServer(always(NO_CONTENT)) as server:
        [result] = await deliver(server, event(id_="evil\r\nx-injected: 1\r\n\x00"))

    assert result.outcome is Outcome.DELIVERED
    [request] = server.requests
    assert request.header("x-injected") is None
    assert request.header("ce-id") == "evil%0D%0Ax-injected:%201%0D%0A%00"
    assert request.body == PAYLOAD


@pytest.mark.parametrize("value", ["a\r\nx-injected: 1", "a\nb", "a\x00b"])
def test_a_header_with_cr_lf_or_nul_is_refused_when_the_transport_is_made(value: str) -> None:
    with pytest.raises(ConfigError, match="control characters"):
        make("http://127.0.0.1:9/", headers={"x-team": value})


async def test_url_credentials_are_sent_as_basic_and_never_shown() -> None:
    async with RawServer(
        always(b"HTTP/1.1 401 No\r\nContent-Length: 9\r\n\r\npa55w0rd!")
    ) as server:
        url = f"http://svc:pa55w0rd@127.0.0.1:{server.port}/"
        transport = make(url)
        try:
            result = await transport.deliver(event())
        finally:
            await transport.close()

    assert server.requests[0].header("authorization") == "Basic c3ZjOnBhNTV3MHJk"
    assert result.error == "HTTP 401: <redacted>!"
