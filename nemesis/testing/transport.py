"""A transport answering in-process from a function: runner tests without a socket.

Give it a function from a request to an answer, the way httpx's
``MockTransport`` takes a handler::

    def answer(request: FakeRequest) -> Reply:
        if request.events[0].attempt == 1:
            return Reply(503)                   # the first try of each fails
        return Reply(200)

    transport = FakeTransport(answer)
    runner = IntegrationRunner(config, broker, transport)
    ...
    await wait_until(lambda: len(transport.done_ids()) == 100)

The function may be a coroutine function (to hold an answer back, or wait
for the test), and may return a ``WireError`` for a request that got no
answer (a refused connection, a timeout). An answer goes through the handler
contract's own table (``nemesis.delivery.contract``) as an HTTP answer: its
status, ``nemesis-verdict`` and ``Retry-After`` mean what they mean on the
wire. What it leaves out is the wire itself (connections, headers, encoding):
tests of those use a real handler (``nemesis.testing.HandlerServer``).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.delivery.contract import Contract, WireError
from nemesis.delivery.port import DeliveryResult, Event


@dataclass(frozen=True, slots=True)
class Reply:
    """What the fake handler answers: an HTTP status, headers (lowercase names) and a body."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass(slots=True)
class FakeRequest:
    """One request the transport was asked to send, and what came of it."""

    events: tuple[Event, ...]
    batch: bool  # deliver_batch (a batch of one included), not deliver
    number: int  # 1 for the first request the transport got
    result: DeliveryResult | None = None  # None while it waits for its answer


Respond = Callable[[FakeRequest], "Reply | WireError | Awaitable[Reply | WireError]"]


class FakeTransport:
    """A ``Transport`` (``nemesis.delivery.port``) whose handler is a function, in-process."""

    def __init__(self, respond: Respond | None = None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._respond: Respond = respond or (lambda request: Reply(200))
        self._contract = Contract(clock=clock)
        self._clock = clock
        self.requests: list[FakeRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0  # the most requests waiting for an answer at once
        self.closed = False

    async def deliver(self, event: Event) -> DeliveryResult:
        return await self._send((event,), batch=False)

    async def deliver_batch(self, events: Sequence[Event]) -> DeliveryResult:
        return await self._send(tuple(events), batch=True)

    async def close(self) -> None:
        self.closed = True

    def done_ids(self) -> set[str]:
        """The event ids answered with an outcome that finishes them (delivered or dropped)."""
        return {
            event.id
            for request in self.requests
            if request.result is not None and request.result.outcome.done
            for event in request.events
        }

    def attempts_of(self, event_id: str) -> list[FakeRequest]:
        """The requests that carried ``event_id``, in the order they were sent."""
        return [r for r in self.requests if any(e.id == event_id for e in r.events)]

    async def _send(self, events: tuple[Event, ...], *, batch: bool) -> DeliveryResult:
        if self.closed:
            raise RuntimeError("the transport is closed")
        request = FakeRequest(events, batch, len(self.requests) + 1)
        self.requests.append(request)
        started = self._clock.monotonic()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            answer = self._respond(request)
            if inspect.isawaitable(answer):
                answer = await answer
        finally:
            self.in_flight -= 1
        sent = [event.body for event in events]
        if isinstance(answer, WireError):
            result = self._contract.wire_error(answer, started)
        else:
            headers = {name.lower(): value for name, value in answer.headers.items()}
            result = self._contract.http_answer(answer.status, headers, answer.body, sent, started)
        request.result = result
        return result
