"""``nemesis.testing.FakeTransport``: answers from a function, read by the contract's own table."""

from __future__ import annotations

import asyncio

from nemesis.broker.port import Message
from nemesis.delivery.contract import WireError, WireFailure
from nemesis.delivery.port import Event, Outcome
from nemesis.testing import FakeRequest, FakeTransport, Reply

PAYLOAD = b'{"n": 1, "card": "4111111111111111"}'


def event(offset: int = 0, attempt: int = 1) -> Event:
    message = Message(topic="orders", partition=0, offset=offset, value=PAYLOAD)
    return Event(message, id=f"orders:0:{offset}", type="order", attempt=attempt)


async def test_an_answer_means_what_it_means_on_the_wire() -> None:
    answers = {
        0: Reply(204),
        1: Reply(200, {"Nemesis-Verdict": "drop"}),
        2: Reply(503, {"retry-after": "7"}, body=b"busy: " + PAYLOAD),
        3: Reply(422),
    }
    transport = FakeTransport(lambda request: answers[request.events[0].message.offset])

    results = [await transport.deliver(event(offset)) for offset in range(4)]

    assert [r.outcome for r in results] == [
        Outcome.DELIVERED,
        Outcome.DROPPED,
        Outcome.RETRY,
        Outcome.DEAD,
    ]
    assert results[2].retry_after_s == 7
    # The error text redacts the payload, as a real transport's does.
    assert results[2].error is not None
    assert "4111" not in results[2].error
    assert transport.done_ids() == {"orders:0:0", "orders:0:1"}


async def test_no_answer_is_a_retry_without_a_status() -> None:
    transport = FakeTransport(lambda request: WireError(WireFailure.REFUSED))

    result = await transport.deliver(event())

    assert (result.outcome, result.status, result.error) == (
        Outcome.RETRY,
        None,
        "connection refused",
    )
    assert transport.done_ids() == set()


async def test_an_answer_may_be_held_back_and_requests_are_recorded() -> None:
    gate = asyncio.Event()

    async def answer(request: FakeRequest) -> Reply:
        await gate.wait()
        return Reply(200)

    transport = FakeTransport(answer)
    first = asyncio.create_task(transport.deliver(event(0)))
    batch = asyncio.create_task(transport.deliver_batch([event(1), event(2, attempt=3)]))
    await asyncio.sleep(0)
    assert transport.in_flight == 2
    assert [r.result for r in transport.requests] == [None, None]
    gate.set()
    await asyncio.gather(first, batch)

    assert transport.max_in_flight == 2
    assert [(r.number, r.batch, len(r.events)) for r in transport.requests] == [
        (1, False, 1),
        (2, True, 2),
    ]
    assert len(transport.attempts_of("orders:0:2")) == 1
    assert transport.done_ids() == {"orders:0:0", "orders:0:1", "orders:0:2"}
