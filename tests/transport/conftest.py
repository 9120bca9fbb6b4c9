"""The transports the contract suite runs against, each with a real handler server on 127.0.0.1.

A ``Kit`` is one transport and its handler side: it builds the transport,
scripts the handler's answer in the contract's terms (``Reply``) and reports
what arrived. The suite (``test_transport_contract.py``) is written once
against ``Kit``; a new transport joins it with one more ``Kit`` and its entry
in ``KITS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import pytest
from aiohttp import web

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import TargetConfig
from nemesis.delivery import signing
from nemesis.delivery.contract import GrpcCode
from nemesis.delivery.grpc import GrpcTransport
from nemesis.delivery.h1 import H1Transport
from nemesis.delivery.http import HttpTransport
from nemesis.delivery.port import Transport
from nemesis.proto.nemesis.v1 import handler_pb2 as pb
from nemesis.testing import HandlerServer
from nemesis.testing.ledger import LedgerEntry
from tests.test_grpc_delivery import Answer, GrpcHandler
from tests.transport.proxy import ResettingProxy

INTEGRATION = "orders-to-loyalty"
OVERSIZED_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Reply:
    """What the handler answers, in the contract's terms."""

    status: int  # an HTTP status or a gRPC code number
    words: str = ""  # the body of an HTTP answer, the details of a gRPC status
    verdict: str | None = None  # nemesis-verdict
    retry_after: str | None = None  # retry-after
    pushback_ms: str | None = None  # grpc-retry-pushback-ms (gRPC only)
    hang: bool = False  # no answer until the test ends


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as the handler saw it."""

    ids: tuple[str, ...]  # the events' ids, in order
    batch: bool
    signature: str | None  # the webhook-signature header / metadata


@dataclass
class Kit(ABC):
    """One transport and a real handler for it."""

    protocol: str
    # The statuses of each class of the outcome table.
    classes: Mapping[str, Sequence[int]]
    proxy: ResettingProxy
    transports: list[Transport] = field(default_factory=list)
    # One entry per request a signature-checking handler saw: (signature, whether it verified).
    checked: list[tuple[str | None, bool]] = field(default_factory=list)

    @property
    @abstractmethod
    def url(self) -> str:
        """The handler's URL (through the proxy)."""

    @abstractmethod
    def refused_url(self) -> str:
        """A URL on 127.0.0.1 where nothing listens."""

    @abstractmethod
    def make_transport(
        self,
        target: TargetConfig,
        clock: Clock,
    ) -> Transport:
        """The transport under test for ``target``."""

    @abstractmethod
    def reply(self, reply: Reply) -> None:
        """The handler answers every later request so."""

    @abstractmethod
    def reply_oversized(self) -> None:
        """The handler answers with far more bytes than a transport reads."""

    @abstractmethod
    def reset_mid_answer(self) -> None:
        """The handler's connection is reset after each request arrives, before its answer."""

    @abstractmethod
    async def check_signatures(self, secrets: Sequence[bytes], now: float) -> str:
        """A handler that verifies signatures as a team's would (401 / UNAUTHENTICATED when
        wrong, missing or stale at ``now``); its URL. Each request's verdict goes to ``checked``.
        """

    @abstractmethod
    def arrivals(self) -> list[Arrival]:
        """The requests that arrived, in order."""

    @abstractmethod
    def status_text(self, status: int) -> str:
        """How the error text names a status: ``HTTP 503``, ``gRPC UNAVAILABLE``."""

    # The status a result carries when the connection was refused or reset.
    no_answer_status: int | None = None
    # What a handler answers to a refused signature: 401, UNAUTHENTICATED.
    unauthenticated_status: int = 401

    def transport(
        self,
        *,
        url: str | None = None,
        timeout_s: float = 2.0,
        headers: dict[str, str] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        **target: object,
    ) -> Transport:
        """A transport to the handler (closed at the end of the test)."""
        config = TargetConfig.model_validate(
            {"url": url or self.url, "timeout_s": timeout_s, "headers": headers or {}, **target}
        )
        made = self.make_transport(config, clock)
        self.transports.append(made)
        return made

    async def close(self) -> None:
        for made in self.transports:
            await made.close()


class HttpKit(Kit):
    """The aiohttp transport and ``nemesis.testing.HandlerServer``."""

    def __init__(self, server: HandlerServer, proxy: ResettingProxy) -> None:
        super().__init__(
            protocol="http",
            classes={
                "delivered": [200, 201, 202, 204, 299],
                "dead": [400, 409, 410, 413, 415, 422],
                "come back later": [408, 425, 429],
                "misconfigured": [401, 403, 404, 405],
                "failed": [500, 502, 503, 504, 599],
                "unlisted": [301, 302, 303, 307, 308, 402, 406, 411, 418, 451, 600, 999],
            },
            proxy=proxy,
        )
        self.server = server
        self.runners: list[web.AppRunner] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}/"

    def refused_url(self) -> str:
        return f"http://127.0.0.1:{free_port()}/"

    def make_transport(self, target: TargetConfig, clock: Clock) -> Transport:
        return HttpTransport(target, integration=INTEGRATION, max_connections=4, clock=clock)

    def reply(self, reply: Reply) -> None:
        headers = {}
        if reply.verdict is not None:
            headers["Nemesis-Verdict"] = reply.verdict
        if reply.retry_after is not None:
            headers["Retry-After"] = reply.retry_after
        self.server.reset()
        self.server.behave(
            reply.status, headers=headers, body=reply.words, delay_s=30 if reply.hang else 0
        )

    def reply_oversized(self) -> None:
        self.server.behave(503, body=b"x" * OVERSIZED_BYTES)

    def reset_mid_answer(self) -> None:
        loop = asyncio.get_running_loop()

        def reset(entry: object) -> bool:
            loop.call_soon(self.proxy.reset_all)
            return True

        self.server.when(reset, hang=True)

    def arrivals(self) -> list[Arrival]:
        by_request: dict[int, list[LedgerEntry]] = {}
        for entry in self.server.ledger.entries:
            by_request.setdefault(entry.request, []).append(entry)
        return [
            Arrival(
                tuple(entry.id or "" for entry in entries),
                entries[0].mode == "batch",
                entries[0].headers.get(signing.WEBHOOK_SIGNATURE_HEADER),
            )
            for entries in by_request.values()
        ]

    async def check_signatures(self, secrets: Sequence[bytes], now: float) -> str:
        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            header = request.headers.get(signing.WEBHOOK_SIGNATURE_HEADER)
            try:
                signing.verify_http(request.headers.items(), body, secrets, now=now)
            except signing.SignatureError as refused:
                self.checked.append((header, False))
                return web.Response(status=401, text=str(refused))
            self.checked.append((header, True))
            return web.Response(status=204)

        app = web.Application()
        app.router.add_post("/", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}/"

    async def close(self) -> None:
        await super().close()
        for runner in self.runners:
            await runner.cleanup()

    def status_text(self, status: int) -> str:
        return f"HTTP {status}"


class H1Kit(HttpKit):
    """Nemesis' own HTTP/1.1 transport and ``nemesis.testing.HandlerServer``."""

    def make_transport(self, target: TargetConfig, clock: Clock) -> Transport:
        return H1Transport(target, integration=INTEGRATION, max_connections=4, clock=clock)


class GrpcKit(Kit):
    """The grpcio transport and ``tests.test_grpc_delivery.GrpcHandler``."""

    def __init__(self, handler: GrpcHandler, proxy: ResettingProxy) -> None:
        super().__init__(
            protocol="grpc",
            classes={
                "delivered": [GrpcCode.OK],
                "dead": [
                    GrpcCode.INVALID_ARGUMENT,
                    GrpcCode.FAILED_PRECONDITION,
                    GrpcCode.OUT_OF_RANGE,
                    GrpcCode.ALREADY_EXISTS,
                ],
                "come back later": [GrpcCode.RESOURCE_EXHAUSTED, GrpcCode.ABORTED],
                "misconfigured": [
                    GrpcCode.UNAUTHENTICATED,
                    GrpcCode.PERMISSION_DENIED,
                    GrpcCode.UNIMPLEMENTED,
                    GrpcCode.NOT_FOUND,
                ],
                "failed": [
                    GrpcCode.UNAVAILABLE,
                    GrpcCode.INTERNAL,
                    GrpcCode.DEADLINE_EXCEEDED,
                    GrpcCode.UNKNOWN,
                    GrpcCode.DATA_LOSS,
                    GrpcCode.CANCELLED,
                ],
                "unlisted": [],  # every gRPC code is listed
            },
            proxy=proxy,
            no_answer_status=GrpcCode.UNAVAILABLE,
            unauthenticated_status=GrpcCode.UNAUTHENTICATED,
        )
        self.handler = handler

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.proxy.port}"

    def refused_url(self) -> str:
        return f"grpc://127.0.0.1:{free_port()}"

    def make_transport(self, target: TargetConfig, clock: Clock) -> Transport:
        return GrpcTransport(target, integration=INTEGRATION, max_connections=4, clock=clock)

    def reply(self, reply: Reply) -> None:
        trailers = []
        if reply.verdict is not None:
            trailers.append(("nemesis-verdict", reply.verdict))
        if reply.retry_after is not None:
            trailers.append(("retry-after", reply.retry_after))
        if reply.pushback_ms is not None:
            trailers.append(("grpc-retry-pushback-ms", reply.pushback_ms))
        answer = Answer(
            _grpc_code(reply.status), reply.words, tuple(trailers), 30.0 if reply.hang else 0.0
        )
        self.handler.script = lambda events: answer

    def reply_oversized(self) -> None:
        answer = Answer(padding_bytes=OVERSIZED_BYTES)
        self.handler.script = lambda events: answer

    def reset_mid_answer(self) -> None:
        loop = asyncio.get_running_loop()

        def reset(events: Sequence[pb.Event]) -> Answer:
            loop.call_soon(self.proxy.reset_all)
            return Answer(delay_s=30.0)

        self.handler.script = reset

    def arrivals(self) -> list[Arrival]:
        return [
            Arrival(
                tuple(event.id for event in call.events),
                call.method == "DeliverBatch",
                call.metadata.get(signing.WEBHOOK_SIGNATURE_HEADER),
            )
            for call in self.handler.calls
        ]

    async def check_signatures(self, secrets: Sequence[bytes], now: float) -> str:
        def check(
            method: str, events: Sequence[pb.Event], metadata: Mapping[str, str]
        ) -> Answer | None:
            header = metadata.get(signing.WEBHOOK_SIGNATURE_HEADER)
            batch = method == "DeliverBatch"
            try:
                signing.verify_grpc(metadata, events, secrets, batch=batch, now=now)
            except signing.SignatureError as refused:
                self.checked.append((header, False))
                return Answer(grpc.StatusCode.UNAUTHENTICATED, str(refused))
            self.checked.append((header, True))
            return None

        self.handler.check = check
        return self.url

    def status_text(self, status: int) -> str:
        return f"gRPC {GrpcCode(status).name}"


def _grpc_code(number: int) -> grpc.StatusCode:
    return next(code for code in grpc.StatusCode if code.value[0] == number)


def free_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@contextlib.asynccontextmanager
async def http_kit() -> AsyncIterator[Kit]:
    """The aiohttp transport, ``HandlerServer`` behind a proxy."""
    async with HandlerServer() as server, ResettingProxy(server.port) as proxy:
        made = HttpKit(server, proxy)
        try:
            yield made
        finally:
            await made.close()
            server.release()


@contextlib.asynccontextmanager
async def h1_kit() -> AsyncIterator[Kit]:
    """Nemesis' own HTTP/1.1 transport, ``HandlerServer`` behind a proxy."""
    async with HandlerServer() as server, ResettingProxy(server.port) as proxy:
        made = H1Kit(server, proxy)
        try:
            yield made
        finally:
            await made.close()
            server.release()


@contextlib.asynccontextmanager
async def grpc_kit() -> AsyncIterator[Kit]:
    """The grpcio transport, ``GrpcHandler`` behind a proxy."""
    async with GrpcHandler() as handler, ResettingProxy(handler.port) as proxy:
        made = GrpcKit(handler, proxy)
        try:
            yield made
        finally:
            await made.close()


# Every transport the suite runs against: a new transport is one more entry.
KITS: Mapping[str, Callable[[], contextlib.AbstractAsyncContextManager[Kit]]] = {
    "http": http_kit,
    "h1": h1_kit,
    "grpc": grpc_kit,
}


@pytest.fixture(params=list(KITS))
async def kit(request: pytest.FixtureRequest) -> AsyncIterator[Kit]:
    """Each transport in turn, with a real handler server of its protocol."""
    async with KITS[request.param]() as made:
        yield made
