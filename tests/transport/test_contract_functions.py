"""The handler contract's functions on their own: tables, Retry-After, wire errors, redaction."""

from __future__ import annotations

import json
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from multidict import CIMultiDict

from nemesis.delivery import signing
from nemesis.delivery.contract import (
    MAX_RETRY_AFTER_S,
    Contract,
    GrpcCode,
    Redactor,
    WireError,
    WireFailure,
    answer_for_grpc_status,
    answer_for_response,
    grpc_retry_after_s,
    parse_retry_after,
    timeout_after,
)
from nemesis.delivery.grpc import answer_for_status
from nemesis.delivery.port import FailureKind, Outcome

K = FailureKind


@pytest.mark.parametrize(
    ("status", "verdict", "expected"),
    [
        (None, None, K.NO_ANSWER),  # timeout or connection error
        (100, None, K.SERVER_ERROR),
        (199, None, K.SERVER_ERROR),
        (200, None, Outcome.DELIVERED),
        (200, "drop", Outcome.DROPPED),
        (200, "dead", K.VERDICT_DEAD),
        (200, "retry", K.VERDICT_RETRY),
        (200, "nonsense", Outcome.DELIVERED),
        (503, "drop", Outcome.DROPPED),
        (422, "retry", K.VERDICT_RETRY),
        (500, "dead", K.VERDICT_DEAD),
        (422, "nonsense", K.REJECTED),
        (400, None, K.REJECTED),
        (409, None, K.REJECTED),
        (401, None, K.SERVER_ERROR),  # a refused signature: retried, never dead-lettered
        (404, None, K.SERVER_ERROR),
        (408, None, K.SERVER_ERROR),
        (429, None, K.RATE_LIMITED),
        (503, None, K.SERVER_ERROR),
        (302, None, K.SERVER_ERROR),
        (None, "dead", K.VERDICT_DEAD),
    ],
)
def test_http_table(status: int | None, verdict: str | None, expected: Outcome | K) -> None:
    headers = CIMultiDict[str]() if verdict is None else CIMultiDict({"Nemesis-Verdict": verdict})
    outcome, failure = answer_for_response(status, headers)
    if isinstance(expected, Outcome):
        assert (outcome, failure) == (expected, None)
    else:
        # Each row names the kind; the outcome is the kind's (dead or retry).
        assert (outcome, failure) == (expected.outcome, expected)


GRPC_TABLE: dict[GrpcCode, K | None] = {  # None: delivered
    GrpcCode.OK: None,
    GrpcCode.INVALID_ARGUMENT: K.REJECTED,
    GrpcCode.FAILED_PRECONDITION: K.REJECTED,
    GrpcCode.OUT_OF_RANGE: K.REJECTED,
    GrpcCode.ALREADY_EXISTS: K.REJECTED,
    GrpcCode.UNAVAILABLE: K.SERVER_ERROR,
    GrpcCode.RESOURCE_EXHAUSTED: K.RATE_LIMITED,
    GrpcCode.DEADLINE_EXCEEDED: K.SERVER_ERROR,
    GrpcCode.ABORTED: K.SERVER_ERROR,
    GrpcCode.INTERNAL: K.SERVER_ERROR,
    GrpcCode.UNKNOWN: K.SERVER_ERROR,
    GrpcCode.CANCELLED: K.SERVER_ERROR,
    GrpcCode.NOT_FOUND: K.SERVER_ERROR,
    GrpcCode.PERMISSION_DENIED: K.SERVER_ERROR,
    GrpcCode.UNAUTHENTICATED: K.SERVER_ERROR,
    GrpcCode.UNIMPLEMENTED: K.SERVER_ERROR,
    GrpcCode.DATA_LOSS: K.SERVER_ERROR,
}


def test_grpc_table_covers_every_status_code() -> None:
    assert {(code.name, code.value[0]) for code in grpc.StatusCode} == {
        (code.name, code.value) for code in GrpcCode
    }
    assert set(GRPC_TABLE) == set(GrpcCode)
    for code, kind in GRPC_TABLE.items():
        outcome = Outcome.DELIVERED if kind is None else kind.outcome
        assert answer_for_grpc_status(code) == (outcome, kind), code
    for status in grpc.StatusCode:
        assert answer_for_status(status) == answer_for_grpc_status(status.value[0])
    assert answer_for_grpc_status(None) == (Outcome.RETRY, K.NO_ANSWER)
    assert answer_for_grpc_status(99) == (Outcome.RETRY, K.SERVER_ERROR)
    assert answer_for_grpc_status(GrpcCode.UNAVAILABLE, {"nemesis-verdict": "drop"}) == (
        Outcome.DROPPED,
        None,
    )
    assert answer_for_grpc_status(GrpcCode.OK, {"nemesis-verdict": "retry"}) == (
        Outcome.RETRY,
        K.VERDICT_RETRY,
    )
    assert answer_for_grpc_status(GrpcCode.OK, {"nemesis-verdict": "dead"}) == (
        Outcome.DEAD,
        K.VERDICT_DEAD,
    )


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("0", 0.0),
        (" 7 ", 7.0),
        ("1.5", 1.5),
        ("-3", None),
        ("soon", None),
        ("nan", None),
        ("inf", None),
        ("", None),
        ("1e12", MAX_RETRY_AFTER_S),
        ("Wed, 21 Oct 2026 07:28:30 GMT", 30.0),
        ("Wed, 21 Oct 2026 07:27:00 GMT", 0.0),  # in the past: now
        ("Wednesday, 21-Oct-26 07:28:30 GMT", 30.0),  # RFC 850, still allowed
        ("Wed, 21 Oct 2027 07:28:00 GMT", MAX_RETRY_AFTER_S),
        ("Wed, 21 Oct", None),
    ],
)
def test_parse_retry_after(value: str, seconds: float | None) -> None:
    now = parsedate_to_datetime("Wed, 21 Oct 2026 07:28:00 GMT").timestamp()
    assert parse_retry_after(value, now) == seconds


def test_grpc_retry_after_and_pushback() -> None:
    assert grpc_retry_after_s({}, 0.0) is None
    assert grpc_retry_after_s({"retry-after": "2.5"}, 0.0) == 2.5
    assert grpc_retry_after_s({"retry-after": "Thu, 01 Jan 1970 00:01:40 GMT"}, 40.0) == 60.0
    assert grpc_retry_after_s({"grpc-retry-pushback-ms": "250"}, 0.0) == 0.25
    # gRFC A6: negative pushback means "do not retry" for gRPC's own retries; no hint here.
    assert grpc_retry_after_s({"grpc-retry-pushback-ms": "-1"}, 0.0) is None
    assert grpc_retry_after_s({"grpc-retry-pushback-ms": "soon"}, 0.0) is None
    assert grpc_retry_after_s({"grpc-retry-pushback-ms": "99999999999"}, 0.0) == MAX_RETRY_AFTER_S
    assert grpc_retry_after_s({"retry-after": "3", "grpc-retry-pushback-ms": "9000"}, 0.0) == 3.0


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (timeout_after(0.2), "timeout after 0.2s"),
        (WireError(WireFailure.REFUSED), "connection refused"),
        (WireError(WireFailure.RESET), "server disconnected"),
        (
            WireError(WireFailure.RESET, "connection reset"),
            "server disconnected (connection reset)",
        ),
        (WireError(WireFailure.DNS, "loyalty.svc"), "cannot resolve loyalty.svc"),
        (WireError(WireFailure.TLS, "certificate\nexpired"), "TLS error: certificate expired"),
        (WireError(WireFailure.CONNECT, "No route to host"), "cannot connect: No route to host"),
        (WireError(WireFailure.PROTOCOL, "HTTP: bad status"), "invalid response: HTTP: bad status"),
        (WireError(WireFailure.TOO_LARGE), "answer too large"),
        (WireError(WireFailure.CLOSED), "transport closed"),
    ],
)
def test_wire_error_text(error: WireError, text: str) -> None:
    assert error.text() == text


def test_every_wire_failure_has_a_text() -> None:
    for failure in WireFailure:
        assert WireError(failure, "x").text()


def test_redactor() -> None:
    # A header value "<scheme> <credential>": the credential alone is redacted too.
    redact = Redactor(["Bearer tok-123456789", "short"])

    assert redact(b"got Bearer tok-123456789 and tok-123456789") == (
        b"got <redacted> and <redacted>"
    )
    # Values shorter than 8 bytes would be found by coincidence: kept.
    assert redact(b"a short word") == b"a short word"
    assert redact(b"see http://user:pw@host/x and ftp://a@b") == (
        b"see http://<redacted>@host/x and ftp://<redacted>@b"
    )
    assert redact(b"Authorization: bearer abc.def.ghi, next") == (
        b"Authorization: bearer <redacted>, next"
    )
    assert redact(b"an invalid token format") == b"an invalid token format"
    assert redact(b"echo: " + b"p" * 100, [b"p" * 100]) == b"echo: <request payload>"


VECTORS: list[dict[str, Any]] = json.loads(
    Path(signing.__file__).with_name("signing-vectors.json").read_text()
)["signed"]


def test_the_grpc_batch_body_frames_what_could_be_confused() -> None:
    # The legacy scheme's gRPC batch: without the lengths these two would sign the same bytes.
    assert signing.grpc_batch_body([("a", b"1,2:b")]) != signing.grpc_batch_body(
        [("a", b"1"), ("b", b"")]
    )
    assert signing.grpc_batch_body([("é", b"")]) == "2:é,0:,".encode()


def test_the_contract_signs_with_the_clock_it_was_given() -> None:
    class At:
        def time(self) -> float:
            return 1733060000.9  # the vector's timestamp, in whole seconds

        def monotonic(self) -> float:
            return 0.0

        async def sleep(self, seconds: float) -> None:
            raise AssertionError

    vector = VECTORS[0]
    contract = Contract(clock=At(), signer=signing.Signer(vector["secrets"]))
    body = bytes.fromhex(vector["body_hex"])
    headers = [(name, value) for name, value in vector["request_headers"]]
    assert contract.signs
    assert dict(contract.sign_http(headers, body)) == vector["signed_headers"]
    assert not Contract().signs
