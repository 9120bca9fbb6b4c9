"""The transport contract suite: every transport, the same cases, a real handler on 127.0.0.1.

Each case runs once per ``Kit`` (``conftest.py``): Nemesis' own HTTP/1.1
transport, the aiohttp one and the grpcio transport today. What the cases check is the
handler contract (``nemesis.delivery.contract``) as the runner sees it:
the ``DeliveryResult`` of a real request.
"""

from __future__ import annotations

import asyncio
import time
from email.utils import format_datetime, parsedate_to_datetime

import pytest

from nemesis.broker.port import Message
from nemesis.delivery.contract import ERROR_TEXT_CHARS, MAX_RETRY_AFTER_S
from nemesis.delivery.port import Event, Outcome
from nemesis.errors import ConfigError
from tests.transport.conftest import Kit, Reply

RECOVERY_S = 30.0  # a bound on the client's reconnect, not a timed assertion
PAYLOAD = b'{"order": {"id": 17, "city": "msk", "amount": 250.5}}'
OUTCOME_OF_CLASS = {
    "delivered": Outcome.DELIVERED,
    "dead": Outcome.DEAD,
    "come back later": Outcome.RETRY,
    "misconfigured": Outcome.RETRY,
    "failed": Outcome.RETRY,
    "unlisted": Outcome.RETRY,
}


def event(id_: str = "orders/3/41", payload: bytes = PAYLOAD) -> Event:
    message = Message("orders", 3, 41, payload, key="customer-9", created_at=1764480000.25)
    return Event(message=message, id=id_, type="order.created")


class FrozenWallClock:
    """Real monotonic time, a fixed wall clock (for Retry-After dates)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        raise AssertionError("a transport does not sleep")


# --- the outcome table ----------------------------------------------------------------


@pytest.mark.parametrize("status_class", list(OUTCOME_OF_CLASS))
async def test_each_status_of_a_class_maps_as_the_table_says(kit: Kit, status_class: str) -> None:
    transport = kit.transport()
    expected = OUTCOME_OF_CLASS[status_class]
    for status in kit.classes[status_class]:
        words = "" if expected is Outcome.DELIVERED else f"answered {status}"
        kit.reply(Reply(status, words=words))

        single = await transport.deliver(event())
        batch = await transport.deliver_batch([event("a"), event("b")])

        for result in (single, batch):
            assert (result.outcome, result.status, result.protocol) == (
                expected,
                status,
                kit.protocol,
            ), status
            if expected is Outcome.DELIVERED:
                assert result.error is None
            else:
                assert result.error == f"{kit.status_text(status)}: answered {status}"


async def test_a_batch_is_one_request_whose_answer_applies_to_every_event(kit: Kit) -> None:
    transport = kit.transport()
    kit.reply(Reply(kit.classes["dead"][0], words="event b is bad"))

    result = await transport.deliver_batch([event("a"), event("b"), event("c")])

    assert result.outcome is Outcome.DEAD
    [arrival] = kit.arrivals()
    assert (arrival.ids, arrival.batch) == (("a", "b", "c"), True)


async def test_a_batch_of_one_is_still_a_batch(kit: Kit) -> None:
    result = await kit.transport().deliver_batch([event("only")])

    assert result.outcome is Outcome.DELIVERED
    [arrival] = kit.arrivals()
    assert (arrival.ids, arrival.batch) == (("only",), True)


async def test_an_empty_batch_is_a_caller_error(kit: Kit) -> None:
    with pytest.raises(ValueError, match="at least one"):
        await kit.transport().deliver_batch([])


# --- verdicts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status_class", "verdict", "outcome"),
    [
        ("delivered", "drop", Outcome.DROPPED),
        ("failed", "drop", Outcome.DROPPED),
        ("delivered", "dead", Outcome.DEAD),
        ("failed", "dead", Outcome.DEAD),
        ("delivered", "retry", Outcome.RETRY),
        ("dead", "retry", Outcome.RETRY),
        ("delivered", " DROP ", Outcome.DROPPED),
        # An unknown verdict is ignored: the status decides.
        ("delivered", "nonsense", Outcome.DELIVERED),
        ("dead", "later", Outcome.DEAD),
    ],
)
async def test_the_verdict_overrides_the_status(
    kit: Kit, status_class: str, verdict: str, outcome: Outcome
) -> None:
    transport = kit.transport()
    status = kit.classes[status_class][0]
    kit.reply(Reply(status, verdict=verdict))

    single = await transport.deliver(event())
    batch = await transport.deliver_batch([event("a"), event("b")])

    for result in (single, batch):
        assert (result.outcome, result.status) == (outcome, status)
        if outcome is Outcome.DELIVERED:
            assert result.error is None
        elif verdict in ("nonsense", "later"):
            assert result.error == kit.status_text(status)
        else:
            named = verdict.strip().lower()
            assert result.error == f"{kit.status_text(status)} (nemesis-verdict: {named})"


# --- Retry-After ----------------------------------------------------------------------

NOW = parsedate_to_datetime("Wed, 21 Oct 2026 07:28:00 GMT").timestamp()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("120", 120.0),
        ("1.5", 1.5),
        (format_datetime(parsedate_to_datetime("Wed, 21 Oct 2026 07:29:30 GMT"), True), 90.0),
        ("Wed, 21 Oct 2026 07:00:00 GMT", 0.0),  # in the past: now
        ("999999999", MAX_RETRY_AFTER_S),  # bounded
        ("Wed, 21 Oct 2099 07:28:00 GMT", MAX_RETRY_AFTER_S),
        ("soon", None),
        ("-3", None),
    ],
)
async def test_retry_after(kit: Kit, value: str, seconds: float | None) -> None:
    transport = kit.transport(clock=FrozenWallClock(NOW))
    kit.reply(Reply(kit.classes["come back later"][0], retry_after=value))

    result = await transport.deliver(event())

    assert (result.outcome, result.retry_after_s) == (Outcome.RETRY, seconds)


# --- no answer -------------------------------------------------------------------------


async def test_timeout_is_a_retry(kit: Kit) -> None:
    transport = kit.transport(timeout_s=0.2)
    kit.reply(Reply(kit.classes["delivered"][0], hang=True))

    result = await transport.deliver(event())

    assert (result.outcome, result.error) == (Outcome.RETRY, "timeout after 0.2s")
    assert result.duration_s >= 0.2


async def test_connection_refused_is_a_retry(kit: Kit) -> None:
    result = await kit.transport(url=kit.refused_url()).deliver(event())

    assert (result.outcome, result.error) == (Outcome.RETRY, "connection refused")
    assert result.status == kit.no_answer_status


async def test_connection_reset_mid_answer_is_a_retry(kit: Kit) -> None:
    transport = kit.transport()
    kit.reset_mid_answer()

    result = await transport.deliver(event())

    assert result.outcome is Outcome.RETRY
    assert result.status == kit.no_answer_status
    assert result.error is not None
    assert kit.proxy.resets >= 1
    # The transport recovers once the handler does. A call that meets the reset connection
    # before the client has torn it down is a retry as well (grpc learns of a reset when it
    # next writes), so the next deliveries are retries until one is delivered.
    kit.reply(Reply(kit.classes["delivered"][0]))
    outcomes = []
    deadline = time.monotonic() + RECOVERY_S
    while time.monotonic() < deadline:
        outcomes.append((await transport.deliver(event("next"))).outcome)
        if outcomes[-1] is not Outcome.RETRY:
            break
        await asyncio.sleep(0.05)
    assert outcomes[-1] is Outcome.DELIVERED, outcomes


async def test_an_oversized_answer_is_not_read_whole(kit: Kit) -> None:
    transport = kit.transport()
    kit.reply_oversized()

    result = await transport.deliver(event())

    assert result.outcome is Outcome.RETRY
    assert result.error is not None
    assert len(result.error) <= len("HTTP 503: ") + ERROR_TEXT_CHARS
    kit.reply(Reply(kit.classes["delivered"][0]))
    assert (await transport.deliver(event("next"))).outcome is Outcome.DELIVERED


async def test_a_closed_transport_answers_retry(kit: Kit) -> None:
    transport = kit.transport()
    assert (await transport.deliver(event())).outcome is Outcome.DELIVERED
    await transport.close()

    single = await transport.deliver(event())
    batch = await transport.deliver_batch([event()])

    for result in (single, batch):
        assert (result.outcome, result.error) == (Outcome.RETRY, "transport closed")
    assert len(kit.arrivals()) == 1


# --- error text -----------------------------------------------------------------------


async def test_error_text_is_one_short_line(kit: Kit) -> None:
    transport = kit.transport()
    status = kit.classes["failed"][0]
    kit.reply(Reply(status, words="Traceback:\r\n  line\t1\n" * 100))

    result = await transport.deliver(event())

    assert result.error is not None
    prefix = f"{kit.status_text(status)}: "
    assert result.error.startswith(prefix + "Traceback: line 1 Traceback: line 1")
    assert len(result.error) <= len(prefix) + ERROR_TEXT_CHARS


async def test_error_text_never_echoes_the_payload(kit: Kit) -> None:
    transport = kit.transport()
    status = kit.classes["dead"][0]
    kit.reply(Reply(status, words="invalid order: " + PAYLOAD.decode() + " at line 1"))

    result = await transport.deliver(event())

    assert result.error == f"{kit.status_text(status)}: invalid order: <request payload>"


async def test_error_text_never_shows_credentials(kit: Kit) -> None:
    token = "s3cr3t-t0ken-4711"
    transport = kit.transport(
        headers={"authorization": f"Bearer {token}", "x-api-key": "k3y-0815-x"}
    )
    status = kit.classes["misconfigured"][0]
    kit.reply(
        Reply(
            status,
            words=(
                f"token {token} rejected; key k3y-0815-x unknown; see "
                "https://svc:pa55w0rd@auth.internal/help; Authorization: Basic dXNlcjpwdw=="
            ),
        )
    )

    result = await transport.deliver(event())

    assert result.error is not None
    for secret in (token, "k3y-0815-x", "pa55w0rd", "dXNlcjpwdw=="):
        assert secret not in result.error
    assert result.error == (
        f"{kit.status_text(status)}: token <redacted> rejected; key <redacted> unknown; see "
        "https://<redacted>@auth.internal/help; Authorization: Basic <redacted>"
    )


# --- signing --------------------------------------------------------------------------

SENT_AT = 1_764_480_000.75  # the injected clock's time: t is its whole seconds
SECRET, PREVIOUS, OTHER = b"k2-new-secret-0001", b"k1-old-secret-0001", b"k9-not-this-one"


@pytest.fixture
def secrets_in_env(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv("ORDERS_HOOK_SECRET", SECRET.decode())
    monkeypatch.setenv("ORDERS_HOOK_SECRET_PREVIOUS", PREVIOUS.decode())
    monkeypatch.setenv("ORDERS_HOOK_SECRET_EMPTY", "")
    return ["ORDERS_HOOK_SECRET", "ORDERS_HOOK_SECRET_PREVIOUS"]


async def test_signed_requests_verify_at_the_handler(kit: Kit, secrets_in_env: list[str]) -> None:
    url = await kit.check_signatures([SECRET], now=SENT_AT + 10)
    transport = kit.transport(
        url=url,
        clock=FrozenWallClock(SENT_AT),
        signing={"secrets_env": ["ORDERS_HOOK_SECRET"]},
    )

    single = await transport.deliver(event("orders/3/41"))
    # An id that must be percent-encoded in a header: the handler signs what it reads.
    odd = await transport.deliver(event("id with space/ü"))
    batch = await transport.deliver_batch([event("a"), event("b", payload=b"\x00binary")])
    one = await transport.deliver_batch([event("only")])

    assert [r.outcome for r in (single, odd, batch, one)] == [Outcome.DELIVERED] * 4
    assert [verified for _, verified in kit.checked] == [True] * 4
    for header, _ in kit.checked:
        assert header is not None
        assert header.startswith("v1,")
        assert header.count("v1,") == 1


async def test_rotation_signs_with_both_secrets(kit: Kit, secrets_in_env: list[str]) -> None:
    for handler_has in ([SECRET], [PREVIOUS]):
        kit.checked.clear()
        url = await kit.check_signatures(handler_has, now=SENT_AT)
        transport = kit.transport(
            url=url, clock=FrozenWallClock(SENT_AT), signing={"secrets_env": secrets_in_env}
        )

        single = await transport.deliver(event())
        batch = await transport.deliver_batch([event("a"), event("b")])

        assert (single.outcome, batch.outcome) == (Outcome.DELIVERED, Outcome.DELIVERED)
        assert [header.count("v1,") for header, _ in kit.checked if header] == [2, 2]


@pytest.mark.parametrize("case", ["other secret", "unsigned", "stale"])
async def test_a_refused_signature_is_retried_never_dead(
    kit: Kit, secrets_in_env: list[str], case: str
) -> None:
    handler_has = [OTHER] if case == "other secret" else [SECRET]
    now = SENT_AT + 301 if case == "stale" else SENT_AT
    url = await kit.check_signatures(handler_has, now=now)
    signing = None if case == "unsigned" else {"secrets_env": ["ORDERS_HOOK_SECRET"]}
    transport = kit.transport(url=url, clock=FrozenWallClock(SENT_AT), signing=signing)

    single = await transport.deliver(event())
    batch = await transport.deliver_batch([event("a"), event("b")])

    for result in (single, batch):
        assert (result.outcome, result.status) == (Outcome.RETRY, kit.unauthenticated_status)
        assert result.error is not None
        assert SECRET.decode() not in result.error
    assert [verified for _, verified in kit.checked] == [False, False]
    if case == "unsigned":
        assert [header for header, _ in kit.checked] == [None, None]


@pytest.mark.parametrize("name", ["ORDERS_HOOK_SECRET_UNSET", "ORDERS_HOOK_SECRET_EMPTY"])
def test_a_missing_secret_refuses_to_make_the_transport(
    kit: Kit, secrets_in_env: list[str], name: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        kit.transport(signing={"secrets_env": ["ORDERS_HOOK_SECRET", name]})
    [problem] = refused.value.problems
    assert problem.field == "target.signing.secrets_env.1"
    assert name in problem.message
    assert SECRET.decode() not in str(refused.value)


def test_the_signature_header_is_not_a_target_header(kit: Kit) -> None:
    for name in ("nemesis-signature", "webhook-signature", "webhook-id", "content-digest"):
        with pytest.raises(ConfigError, match=r"set by Nemesis when target\.signing is configured"):
            kit.transport(headers={name: "forged"})
