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
    grpc_retry_after_s,
    outcome_for_grpc_status,
    outcome_for_response,
    parse_retry_after,
    timeout_after,
)
from nemesis.delivery.grpc import outcome_for_status
from nemesis.delivery.port import Outcome


@pytest.mark.parametrize(
    ("status", "verdict", "outcome"),
    [
        (None, None, Outcome.RETRY),  # timeout or connection error
        (100, None, Outcome.RETRY),
        (199, None, Outcome.RETRY),
        (200, None, Outcome.DELIVERED),
        (200, "drop", Outcome.DROPPED),
        (200, "dead", Outcome.DEAD),
        (200, "retry", Outcome.RETRY),
        (200, "nonsense", Outcome.DELIVERED),
        (503, "drop", Outcome.DROPPED),
        (422, "retry", Outcome.RETRY),
        (500, "dead", Outcome.DEAD),
        (422, "nonsense", Outcome.DEAD),
        (401, None, Outcome.RETRY),  # a refused signature: retried, never dead-lettered
        (None, "dead", Outcome.DEAD),
    ],
)
def test_http_table(status: int | None, verdict: str | None, outcome: Outcome) -> None:
    headers = CIMultiDict[str]() if verdict is None else CIMultiDict({"Nemesis-Verdict": verdict})
    assert outcome_for_response(status, headers) is outcome


GRPC_TABLE = {
    GrpcCode.OK: Outcome.DELIVERED,
    GrpcCode.INVALID_ARGUMENT: Outcome.DEAD,
    GrpcCode.FAILED_PRECONDITION: Outcome.DEAD,
    GrpcCode.OUT_OF_RANGE: Outcome.DEAD,
    GrpcCode.ALREADY_EXISTS: Outcome.DEAD,
    GrpcCode.UNAVAILABLE: Outcome.RETRY,
    GrpcCode.RESOURCE_EXHAUSTED: Outcome.RETRY,
    GrpcCode.DEADLINE_EXCEEDED: Outcome.RETRY,
    GrpcCode.ABORTED: Outcome.RETRY,
    GrpcCode.INTERNAL: Outcome.RETRY,
    GrpcCode.UNKNOWN: Outcome.RETRY,
    GrpcCode.CANCELLED: Outcome.RETRY,
    GrpcCode.NOT_FOUND: Outcome.RETRY,
    GrpcCode.PERMISSION_DENIED: Outcome.RETRY,
    GrpcCode.UNAUTHENTICATED: Outcome.RETRY,
    GrpcCode.UNIMPLEMENTED: Outcome.RETRY,
    GrpcCode.DATA_LOSS: Outcome.RETRY,
}


def test_grpc_table_covers_every_status_code() -> None:
    assert {(code.name, code.value[0]) for code in grpc.StatusCode} == {
        (code.name, code.value) for code in GrpcCode
    }
    assert set(GRPC_TABLE) == set(GrpcCode)
    for code, outcome in GRPC_TABLE.items():
        assert outcome_for_grpc_status(code) is outcome, code
    for status in grpc.StatusCode:
        assert outcome_for_status(status) is GRPC_TABLE[GrpcCode(status.value[0])]
    assert outcome_for_grpc_status(None) is Outcome.RETRY
    assert outcome_for_grpc_status(99) is Outcome.RETRY
    assert outcome_for_grpc_status(GrpcCode.UNAVAILABLE, {"nemesis-verdict": "drop"}) is (
        Outcome.DROPPED
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
