"""``nemesis check-handler`` against real handlers that follow the contract, and ones that do not.

HTTP handlers are ``nemesis.testing.HandlerServer`` scripted to misbehave;
gRPC ones are ``GrpcHandler`` (tests/test_grpc_delivery.py). The templates'
own handlers are checked for real in test_onboarding_templates.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import pytest

from nemesis.delivery import signing
from nemesis.onboarding.probe import HandlerReport, ProbeOptions, Verdict, check_handler
from nemesis.proto.nemesis.v1 import handler_pb2 as pb
from nemesis.testing import HandlerServer, LedgerEntry
from tests.test_grpc_delivery import Answer, GrpcHandler


def verdicts(report: HandlerReport) -> dict[str, Verdict]:
    return {result.name: result.verdict for result in report.results}


def is_malformed(entry: LedgerEntry) -> bool:
    try:
        json.loads(entry.body)
    except ValueError:
        return True
    return False


async def test_a_handler_that_follows_the_contract_passes() -> None:
    async with HandlerServer() as server:
        server.when(is_malformed, status=422)
        report = await check_handler(ProbeOptions(url=server.url, batch_size=3))
    assert report.passed
    assert set(verdicts(report).values()) == {Verdict.PASS}
    assert [r.name for r in report.results] == [
        "delivers one event",
        "answers a repeat of the same ce-id",
        "delivers a batch of 3 events",
        "delivers a batch of one event",
        "dead-letters a malformed event",
        "answers in time",
    ]
    assert report.results[0].answer == "HTTP 200"
    # Exactly what Nemesis would send: one id twice (attempts 1 and 2), a batch of 3 and
    # one of one (a batch integration sends the batch form for a single message too), a bad one.
    entries = server.ledger.entries
    first, repeat = entries[0], entries[1]
    assert first.id == repeat.id
    assert (first.attempt, repeat.attempt) == (1, 2)
    assert first.source == "nemesis/check-handler"
    assert [e.batch_size for e in entries if e.mode == "batch"] == [3, 3, 3, 1]
    assert "the handler follows the contract" in report.format()


async def test_rejecting_a_repeat_fails_idempotency() -> None:
    async with HandlerServer() as server:
        server.when(is_malformed, status=400)
        # "Already processed" answered as a conflict: Nemesis dead-letters redeliveries.
        server.when(lambda e: e.receipt >= 2, status=409)
        report = await check_handler(ProbeOptions(url=server.url))
    assert not report.passed
    assert verdicts(report)["answers a repeat of the same ce-id"] is Verdict.FAIL
    repeat = report.results[1]
    assert repeat.answer == "HTTP 409"
    assert "redelivery would be dead-lettered" in repeat.detail


async def test_failing_a_repeat_fails_idempotency() -> None:
    async with HandlerServer() as server:
        server.when(is_malformed, status=422)
        server.when(lambda e: e.receipt >= 2, status=500, body="duplicate key value")
        report = await check_handler(ProbeOptions(url=server.url))
    assert verdicts(report)["answers a repeat of the same ce-id"] is Verdict.FAIL
    assert "retried until it reaches the DLQ" in report.results[1].detail


async def test_crashing_on_a_malformed_payload_fails() -> None:
    async with HandlerServer() as server:
        server.when(is_malformed, status=500, body="JSONDecodeError")
        report = await check_handler(ProbeOptions(url=server.url))
    assert verdicts(report)["dead-letters a malformed event"] is Verdict.FAIL
    assert not report.passed


async def test_accepting_a_malformed_payload_is_a_warning() -> None:
    async with HandlerServer() as server:
        report = await check_handler(ProbeOptions(url=server.url))
    assert verdicts(report)["dead-letters a malformed event"] is Verdict.WARN
    assert report.passed
    assert "1 warning" in report.format()


async def test_slow_answers_warn_and_timeouts_fail() -> None:
    async with HandlerServer() as server:
        server.when(is_malformed, status=422)
        server.delay(0.12)
        slow = await check_handler(ProbeOptions(url=server.url, slow_ms=50))
        server.delay(1.0)
        timed_out = await check_handler(ProbeOptions(url=server.url, timeout_s=0.3))
    assert verdicts(slow)["answers in time"] is Verdict.WARN
    assert slow.passed
    assert verdicts(timed_out)["delivers one event"] is Verdict.FAIL
    assert "did not answer in time" in timed_out.results[0].detail
    assert not timed_out.passed


async def test_an_unreachable_handler_fails_once_and_skips_the_rest() -> None:
    async with HandlerServer() as gone:
        url = gone.url
    report = await check_handler(ProbeOptions(url=url, timeout_s=1, batch_size=2))
    assert [r.verdict for r in report.results] == [
        Verdict.FAIL,
        Verdict.SKIP,
        Verdict.SKIP,
        Verdict.SKIP,
        Verdict.SKIP,
        Verdict.PASS,
    ]
    assert "is the handler running at this address?" in report.results[0].detail


async def test_a_handler_that_cannot_take_batches_fails_the_batch_probe() -> None:
    async with HandlerServer() as server:
        server.when(is_malformed, status=422)
        server.when(lambda e: e.mode == "batch", status=415)
        report = await check_handler(ProbeOptions(url=server.url, batch_size=2))
    assert verdicts(report)["delivers a batch of 2 events"] is Verdict.FAIL
    assert "must accept batches" in report.results[2].detail


def grpc_script(events: Sequence[pb.Event]) -> Answer:
    if any(event.data == b'{"nemesis_probe": ' for event in events):
        return Answer(grpc.StatusCode.INVALID_ARGUMENT, "not JSON")
    return Answer()


async def test_a_grpc_handler_that_follows_the_contract_passes() -> None:
    async with GrpcHandler(grpc_script) as handler:
        report = await check_handler(ProbeOptions(url=handler.url, batch_size=4))
    assert report.passed, report.format()
    assert [r.answer for r in report.results[:5]] == ["OK", "OK", "OK", "OK", "INVALID_ARGUMENT"]
    assert [call.method for call in handler.calls] == [
        "Deliver",
        "Deliver",
        "DeliverBatch",
        "DeliverBatch",
        "Deliver",
    ]
    assert [len(call.events) for call in handler.calls[2:4]] == [4, 1]
    assert handler.calls[0].events[0].id == handler.calls[1].events[0].id


async def test_a_grpc_handler_answering_already_exists_to_a_repeat_fails() -> None:
    seen: set[str] = set()

    def script(events: Sequence[pb.Event]) -> Answer:
        [event] = events
        if event.id in seen:
            return Answer(grpc.StatusCode.ALREADY_EXISTS, "order exists")
        seen.add(event.id)
        return grpc_script(events)

    async with GrpcHandler(script) as handler:
        report = await check_handler(ProbeOptions(url=handler.url))
    assert verdicts(report)["answers a repeat of the same ce-id"] is Verdict.FAIL
    assert report.results[1].answer == "ALREADY_EXISTS"


async def test_a_grpc_handler_without_deliver_batch_fails_the_batch_probe() -> None:
    def script(events: Sequence[pb.Event]) -> Answer:
        if len(events) > 1:
            return Answer(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        return grpc_script(events)

    async with GrpcHandler(script) as handler:
        report = await check_handler(ProbeOptions(url=handler.url, batch_size=2))
    batch = report.results[2]
    assert (batch.verdict, batch.answer) == (Verdict.FAIL, "UNIMPLEMENTED")
    assert "does not implement nemesis.v1.HandlerService" in batch.detail


async def run_cli(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "nemesis",
        *args,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_cli_exits_1_on_a_broken_contract_and_0_on_a_good_one() -> None:
    async with HandlerServer() as server:
        retrying = server.when(is_malformed, status=503)
        code, out, _ = await run_cli("check-handler", server.url)
        assert code == 1
        assert "FAIL  dead-letters a malformed event" in out
        server.remove(retrying)
        server.when(is_malformed, status=422)
        code, out, _ = await run_cli("check-handler", server.url, "--json")
    assert code == 0
    assert json.loads(out)["passed"] is True


async def test_the_cli_takes_the_target_from_an_integration_file(tmp_path: Path) -> None:
    async with HandlerServer() as server:
        server.when(is_malformed, status=422)
        file = tmp_path / "orders-to-it.yaml"
        file.write_text(
            "name: orders-to-it\nowners: [team-it]\n"
            "source: {topic: orders, consumer: orders-to-it}\n"
            f"target: {{url: '{server.url}', timeout_s: 2,"
            " headers: {authorization: 'Bearer ${IT_TOKEN:-dev-token}'}}\n"
            "delivery: {batch: {size: 5, max_wait_ms: 10}}\n"
        )
        code, out, err = await run_cli("check-handler", "--integration", str(file))
        entries = server.ledger.entries
    assert code == 0, out + err
    assert "delivers a batch of 5 events" in out
    assert {e.headers["authorization"] for e in entries} == {"Bearer dev-token"}


async def test_the_cli_refuses_a_bad_url() -> None:
    code, _, err = await run_cli("check-handler", "ftp://example.com/x")
    assert code == 1
    assert "url" in err


# --- signatures (--signing-secret-env) ----------------------------------------------------

SECRET = b"probe-signing-secret"


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HANDLER_SECRET", SECRET.decode())
    return "HANDLER_SECRET"


def signed_well(entry: LedgerEntry) -> bool:
    """What a handler that checks signatures decides for one event sent alone."""
    try:
        signing.verify_http(entry.headers.items(), entry.body, [SECRET], now=time.time())
    except signing.SignatureError:
        return False
    return True


async def test_an_http_handler_that_checks_signatures_passes(secret_env: str) -> None:
    async with HandlerServer() as server:
        server.when(lambda entry: not signed_well(entry), status=401, body="bad signature")
        server.when(is_malformed, status=422)
        report = await check_handler(
            ProbeOptions(url=server.url, signing_secrets_env=(secret_env,))
        )
        entries = server.ledger.entries
    assert report.passed, report.format()
    result = report.results[-2]
    assert (result.name, result.verdict, result.answer) == (
        "checks signatures",
        Verdict.PASS,
        "HTTP 401, HTTP 401",
    )
    # The probes were signed; the two signature probes were not, or too long ago.
    assert [signed_well(e) for e in entries] == [True, True, True, False, False]
    assert "webhook-signature" not in entries[3].headers
    assert SECRET.decode() not in report.format()


async def test_a_handler_that_does_not_check_signatures_fails(secret_env: str) -> None:
    async with HandlerServer() as server:
        server.when(is_malformed, status=422)
        report = await check_handler(
            ProbeOptions(url=server.url, batch_size=2, signing_secrets_env=(secret_env,))
        )
    assert not report.passed
    result = report.results[-2]
    assert (result.name, result.verdict) == ("checks signatures", Verdict.FAIL)
    assert result.detail.startswith(
        "does NOT check signatures: it accepted an unsigned request and a request signed 1 hour ago"
    )
    assert "FAIL  checks signatures" in report.format()


async def test_refusing_a_bad_signature_with_403_fails(secret_env: str) -> None:
    async with HandlerServer() as server:
        server.when(lambda entry: not signed_well(entry), status=403)
        server.when(is_malformed, status=422)
        report = await check_handler(
            ProbeOptions(url=server.url, signing_secrets_env=(secret_env,))
        )
    result = report.results[-2]
    assert (result.verdict, result.answer) == (Verdict.FAIL, "HTTP 403, HTTP 403")
    assert "without 401" in result.detail


async def test_without_the_secret_a_checking_handler_fails_with_a_hint() -> None:
    async with HandlerServer() as server:
        server.when(lambda entry: not signed_well(entry), status=401)
        report = await check_handler(ProbeOptions(url=server.url))
    assert report.results[0].verdict is Verdict.FAIL
    assert "--signing-secret-env" in report.results[0].detail


def check_grpc_signature(
    method: str, events: Sequence[pb.Event], metadata: Mapping[str, str]
) -> Answer | None:
    batch = method == "DeliverBatch"
    try:
        signing.verify_grpc(metadata, events, [SECRET], batch=batch, now=time.time())
    except signing.SignatureError as refused:
        return Answer(grpc.StatusCode.UNAUTHENTICATED, str(refused))
    return None


async def test_a_grpc_handler_that_checks_signatures_passes(secret_env: str) -> None:
    async with GrpcHandler(grpc_script, check=check_grpc_signature) as handler:
        report = await check_handler(
            ProbeOptions(url=handler.url, batch_size=3, signing_secrets_env=(secret_env,))
        )
    assert report.passed, report.format()
    result = report.results[-2]
    assert (result.name, result.verdict, result.answer) == (
        "checks signatures",
        Verdict.PASS,
        "UNAUTHENTICATED, UNAUTHENTICATED",
    )
    assert [call.method for call in handler.calls].count("DeliverBatch") == 2


async def test_the_cli_signs_with_the_variable_and_refuses_an_unset_one() -> None:
    async with HandlerServer() as server:
        server.when(lambda entry: not signed_well(entry), status=401)
        server.when(is_malformed, status=422)
        env = {**os.environ, "HANDLER_SECRET": SECRET.decode()}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nemesis",
            "check-handler",
            server.url,
            "--signing-secret-env",
            "HANDLER_SECRET",
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(process.communicate(), timeout=60)
        code, _, err = await run_cli(
            "check-handler", server.url, "--signing-secret-env", "NEMESIS_TEST_UNSET_SECRET"
        )
    assert process.returncode == 0, out.decode()
    assert "PASS  checks signatures" in out.decode()
    assert code == 1
    assert "NEMESIS_TEST_UNSET_SECRET: the variable is unset or empty" in err


async def test_the_cli_takes_the_signing_variables_from_an_integration_file(
    tmp_path: Path,
) -> None:
    async with HandlerServer() as server:
        server.when(lambda entry: not signed_well(entry), status=401)
        server.when(is_malformed, status=422)
        file = tmp_path / "orders-to-it.yaml"
        file.write_text(
            "name: orders-to-it\nowners: [team-it]\n"
            "source: {topic: orders, consumer: orders-to-it}\n"
            f"target: {{url: '{server.url}', signing: {{secrets_env: [IT_HOOK_SECRET]}}}}\n"
        )
        env = {**os.environ, "IT_HOOK_SECRET": SECRET.decode()}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nemesis",
            "check-handler",
            "--integration",
            str(file),
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, out.decode()
    assert "PASS  checks signatures" in out.decode()
