"""``nemesis check-handler URL``: probes a handler and says whether it follows the contract.

The probes go through the real transports, so the handler sees exactly what
Nemesis sends, and their answers are judged by the handler contract's own
outcome tables (``nemesis.delivery.contract``):

1. a normal event must be delivered (2xx / OK);
2. the same event again, same ``ce-id``, as a retry would send it, must be
   answered done too: a handler that rejects a repeat dead-letters every
   redelivery, one that fails it retries forever;
3. with ``--batch N`` (N > 1), one batch of N events and one batch of one
   must be delivered: a batch integration always sends the batch form, also
   when only one message is waiting;
4. an event whose payload cannot be right (JSON that does not parse) should
   be dead-lettered (4xx / INVALID_ARGUMENT): retrying it only delays the
   DLQ, and acknowledging it hides a lost message (a warning: some handlers
   take any bytes on purpose);
5. with ``--signing-secret-env VAR`` every probe is signed with the secret
   in ``VAR`` (``nemesis.delivery.signing``), and the handler must check
   signatures: one unsigned request and one signed too long ago must both be
   refused with 401 (gRPC UNAUTHENTICATED);
6. every answer should come well inside the timeout.

Probe events are real events to the handler: run the check against a
development or staging instance. They carry ``ce-source:
nemesis/check-handler`` and ``ce-type`` from ``--type``.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from nemesis.broker.port import Message
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import SigningConfig, TargetConfig
from nemesis.delivery.cloudevents import is_json
from nemesis.delivery.contract import grpc_code_name
from nemesis.delivery.port import DeliveryResult, Event, Outcome, Transport
from nemesis.delivery.signing import DEFAULT_TOLERANCE_S
from nemesis.onboarding.choices import DEFAULT_DATA
from nemesis.transports import default_transports

PROBE_INTEGRATION: Final = "check-handler"
PROBE_TOPIC: Final = "nemesis.check-handler"
_MALFORMED_JSON: Final = b'{"nemesis_probe": '
_MALFORMED_BYTES: Final = b"\xff\xfe\x00 not a valid payload"
# How far in the past the stale probe is signed: well outside any sane tolerance.
_STALE_BY_S: Final = 12 * DEFAULT_TOLERANCE_S
_UNAUTHENTICATED: Final = {"http": 401, "grpc": 16}  # HTTP status, gRPC code number


class Verdict(enum.Enum):
    """How one probe went."""

    PASS = "PASS"
    WARN = "WARN"  # legal, but probably not what you want
    FAIL = "FAIL"  # breaks the contract: Nemesis would lose time, retry forever or dead-letter
    SKIP = "SKIP"  # not judged: an earlier probe failed in a way that decides this one


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """What to send and how patient to be."""

    url: str
    timeout_s: float = 5.0
    batch_size: int = 0  # 0 or 1: no batch probe
    data: bytes = DEFAULT_DATA
    content_type: str = "application/json"
    event_type: str = "nemesis.probe"
    headers: Mapping[str, str] = field(default_factory=dict)
    slow_ms: float = 1000.0  # a warning above this
    # Sign with the secrets in these variables (1, or 2 during a rotation), and check.
    signing_secrets_env: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe: what was checked, how it went, and the answer it got."""

    name: str
    verdict: Verdict
    detail: str
    answer: str = ""  # "HTTP 200", "OK", "INVALID_ARGUMENT"...
    duration_s: float | None = None


@dataclass(frozen=True, slots=True)
class HandlerReport:
    """Every probe's result."""

    url: str
    results: tuple[ProbeResult, ...]

    @property
    def passed(self) -> bool:
        """No probe failed (warnings allowed)."""
        return all(result.verdict is not Verdict.FAIL for result in self.results)

    def format(self) -> str:
        """A report for a terminal, one line per probe."""
        width = max(len(result.name) for result in self.results)
        lines = [f"checking {self.url}"]
        for result in self.results:
            timing = "" if result.duration_s is None else f" in {_ms(result.duration_s)}"
            answer = f"{result.answer}{timing}".strip()
            lines.append(f"  {result.verdict.value}  {result.name:<{width}}  {answer}".rstrip())
            if result.detail:
                lines.append(f"        {result.detail}")
        failed = sum(result.verdict is Verdict.FAIL for result in self.results)
        warned = sum(result.verdict is Verdict.WARN for result in self.results)
        if failed:
            lines.append(f"{failed} check(s) failed: the handler does not follow the contract")
        elif warned:
            lines.append(f"the handler follows the contract ({warned} warning(s))")
        else:
            lines.append("the handler follows the contract")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``--json``)."""
        return {
            "url": self.url,
            "passed": self.passed,
            "results": [
                {
                    "name": r.name,
                    "verdict": r.verdict.value,
                    "detail": r.detail,
                    "answer": r.answer,
                    "duration_ms": None if r.duration_s is None else round(r.duration_s * 1000, 1),
                }
                for r in self.results
            ],
        }


TransportFactory = Callable[[TargetConfig, Clock], Transport]
Describe = Callable[[DeliveryResult], str]


async def check_handler(options: ProbeOptions, *, clock: Clock = SYSTEM_CLOCK) -> HandlerReport:
    """Sends the probes to ``options.url`` and judges every answer.

    Raises ``ConfigError`` when ``options.signing_secret_env`` names an unset
    or empty variable.
    """
    signing = None
    if options.signing_secrets_env:
        signing = SigningConfig(secrets_env=list(options.signing_secrets_env))
    target = TargetConfig(
        url=options.url,
        timeout_s=options.timeout_s,
        headers=dict(options.headers),
        signing=signing,
    )
    factory, describe, protocol = _transport_for(target.scheme)
    transport = factory(target, clock)
    probes = _Probes(options, transport, describe)
    try:
        first = await probes.single()
        if first.verdict is Verdict.FAIL:
            # Unreachable, misrouted or rejecting a normal event: the other probes
            # would fail for the same reason and bury it.
            later = ["answers a repeat of the same ce-id", "dead-letters a malformed event"]
            if options.batch_size > 1:
                later[1:1] = [_batch_name(options.batch_size), _batch_name(1)]
            if signing is not None:
                later.append(_SIGNATURES)
            skipped = "not run: the first delivery failed, fix that first"
            results = [first, *(ProbeResult(name, Verdict.SKIP, skipped) for name in later)]
        else:
            results = [first, await probes.repeat()]
            if options.batch_size > 1:
                results.append(await probes.batch(options.batch_size))
                results.append(await probes.batch(1))
            results.append(await probes.malformed())
            if signing is not None:
                unsigned = factory(target.model_copy(update={"signing": None}), clock)
                stale = factory(target, _Behind(clock, _STALE_BY_S))
                try:
                    results.append(await probes.signatures(unsigned, stale, protocol))
                finally:
                    await unsigned.close()
                    await stale.close()
    finally:
        await transport.close()
    results.append(_latency(results, options))
    return HandlerReport(options.url, tuple(results))


_SIGNATURES: Final = "checks signatures"


def _batch_name(size: int) -> str:
    return f"delivers a batch of {size} events" if size > 1 else "delivers a batch of one event"


class _Behind:
    """``clock``, ``behind_s`` in the past: what a replayed, captured request would carry."""

    def __init__(self, clock: Clock, behind_s: float) -> None:
        self._clock = clock
        self._behind_s = behind_s

    def time(self) -> float:
        return self._clock.time() - self._behind_s

    def monotonic(self) -> float:
        return self._clock.monotonic()

    async def sleep(self, seconds: float) -> None:
        await self._clock.sleep(seconds)


class _Probes:
    def __init__(self, options: ProbeOptions, transport: Transport, describe: Describe) -> None:
        self.options = options
        self.transport = transport
        self.describe = describe
        self.run_id = uuid.uuid4().hex[:12]
        self.offset = 0
        self.first: Event | None = None

    def event(self, data: bytes | None = None, *, attempt: int = 1) -> Event:
        self.offset += 1
        message = Message(
            topic=PROBE_TOPIC,
            partition=0,
            offset=self.offset,
            value=self.options.data if data is None else data,
            key="nemesis-probe",
            created_at=time.time(),
        )
        return Event(
            message=message,
            id=f"nemesis-probe-{self.run_id}-{self.offset}",
            type=self.options.event_type,
            attempt=attempt,
            content_type=self.options.content_type,
        )

    async def single(self) -> ProbeResult:
        name = "delivers one event"
        self.first = self.event()
        result = await self.transport.deliver(self.first)
        if result.outcome is Outcome.DELIVERED:
            return self.passed(name, result)
        if result.outcome is Outcome.DROPPED:
            return self.judged(
                name,
                result,
                Verdict.WARN,
                "dropped on purpose (nemesis-verdict: drop): fine if it skips this type;"
                " give a realistic --type and --data to probe the real path",
            )
        if result.outcome is Outcome.DEAD:
            return self.judged(
                name,
                result,
                Verdict.FAIL,
                "rejected a normal event; if the probe payload is not what it expects,"
                " give a realistic one with --data or --data-file",
            )
        return self.judged(name, result, Verdict.FAIL, _retry_detail(result))

    async def repeat(self) -> ProbeResult:
        name = "answers a repeat of the same ce-id"
        if self.first is None:
            raise RuntimeError("the repeat probe runs after the single one")
        again = Event(
            message=self.first.message,
            id=self.first.id,
            type=self.first.type,
            attempt=2,
            content_type=self.first.content_type,
        )
        result = await self.transport.deliver(again)
        if result.outcome.done:
            return self.passed(name, result)
        if result.outcome is Outcome.DEAD:
            detail = (
                "a redelivery would be dead-lettered: an id you already handled must be"
                " answered as done (2xx / OK), without doing the work twice"
            )
        else:
            detail = (
                "a redelivery would be retried until it reaches the DLQ: answer an id you"
                " already handled as done. " + _retry_detail(result)
            )
        return self.judged(name, result, Verdict.FAIL, detail)

    async def batch(self, size: int) -> ProbeResult:
        name = _batch_name(size)
        result = await self.transport.deliver_batch([self.event() for _ in range(size)])
        if result.outcome.done:
            return self.passed(name, result)
        detail = (
            "the batch was rejected"
            if result.outcome is Outcome.DEAD
            else "the batch was not accepted. " + _retry_detail(result)
        )
        return self.judged(
            name,
            result,
            Verdict.FAIL,
            detail + " (with delivery.batch.size > 1 the handler must accept batches,"
            " of one event too)",
        )

    async def signatures(self, unsigned: Transport, stale: Transport, protocol: str) -> ProbeResult:
        refusal = _UNAUTHENTICATED[protocol]
        answers = {
            "an unsigned request": await unsigned.deliver(self.event()),
            "a request signed 1 hour ago": await stale.deliver(self.event()),
        }
        shown = ", ".join(self.describe(result) for result in answers.values())
        slowest = max(result.duration_s for result in answers.values())
        accepted = [what for what, result in answers.items() if result.outcome.done]
        if accepted:
            detail = (
                f"does NOT check signatures: it accepted {' and '.join(accepted)}; set"
                " NEMESIS_SIGNING_SECRET (or your handler's equivalent) so that only Nemesis"
                " can deliver to it"
            )
            return ProbeResult(_SIGNATURES, Verdict.FAIL, detail, shown, slowest)
        wrong = [what for what, result in answers.items() if result.status != refusal]
        if wrong:
            refusal_name = "401" if protocol == "http" else "UNAUTHENTICATED"
            detail = (
                f"refused {' and '.join(wrong)} without {refusal_name}: answer a missing,"
                f" wrong or stale signature with {refusal_name}, which Nemesis retries"
                " (other refusals may dead-letter every message while secrets differ)"
            )
            return ProbeResult(_SIGNATURES, Verdict.FAIL, detail, shown, slowest)
        return ProbeResult(_SIGNATURES, Verdict.PASS, "", shown, slowest)

    async def malformed(self) -> ProbeResult:
        name = "dead-letters a malformed event"
        json_payload = is_json(self.options.content_type)
        result = await self.transport.deliver(
            self.event(_MALFORMED_JSON if json_payload else _MALFORMED_BYTES)
        )
        if result.outcome is Outcome.DEAD:
            return self.passed(name, result)
        what = "truncated JSON" if json_payload else "bytes that cannot be a valid payload"
        if result.outcome.done:
            return self.judged(
                name,
                result,
                Verdict.WARN,
                f"accepted {what}: a message the handler cannot use should be answered"
                " 400/422 (gRPC INVALID_ARGUMENT) so it reaches the DLQ instead of vanishing",
            )
        return self.judged(
            name,
            result,
            Verdict.FAIL,
            f"{what} would be retried through every tier before reaching the DLQ: answer"
            " 400/422 (gRPC INVALID_ARGUMENT) for messages that can never succeed",
        )

    def passed(self, name: str, result: DeliveryResult) -> ProbeResult:
        return self.judged(name, result, Verdict.PASS, "")

    def judged(
        self, name: str, result: DeliveryResult, verdict: Verdict, detail: str
    ) -> ProbeResult:
        return ProbeResult(name, verdict, detail, self.describe(result), result.duration_s)


def _retry_detail(result: DeliveryResult) -> str:
    why = result.error or "no answer"
    detail = f"Nemesis would retry it ({why})"
    hint = _hint(result)
    return f"{detail}; {hint}" if hint else detail


# Answers that mean the check itself points at the wrong place, not a contract breach.
_HINTS: Final = (
    ("connection refused", "is the handler running at this address?"),
    ("cannot resolve", "check the host name"),
    ("HTTP 404", "check the URL's path"),
    ("HTTP 405", "the handler must accept POST at this URL"),
    (
        "HTTP 401",
        "check the credentials (--header authorization=...); a handler that checks"
        " signatures wants --signing-secret-env with its secret",
    ),
    ("HTTP 403", "check the credentials (--header authorization=...)"),
    ("gRPC UNIMPLEMENTED", "the server does not implement nemesis.v1.HandlerService"),
    ("gRPC UNAVAILABLE", "is the handler running at this address (and plaintext vs TLS)?"),
    (
        "gRPC UNAUTHENTICATED",
        "check the credentials (--header authorization=...); a handler that checks"
        " signatures wants --signing-secret-env with its secret",
    ),
    ("timeout after", "the handler did not answer in time (--timeout-s)"),
)


def _hint(result: DeliveryResult) -> str | None:
    error = result.error or ""
    return next((hint for prefix, hint in _HINTS if error.startswith(prefix)), None)


def _latency(results: list[ProbeResult], options: ProbeOptions) -> ProbeResult:
    durations = [r.duration_s for r in results if r.duration_s is not None]
    slowest = max(durations, default=0.0)
    answer = f"slowest {_ms(slowest)} (timeout {options.timeout_s:g} s)"
    if slowest >= options.timeout_s:
        return ProbeResult(
            "answers in time", Verdict.FAIL, "an answer took the whole timeout", answer
        )
    if slowest * 1000 > options.slow_ms:
        return ProbeResult(
            "answers in time",
            Verdict.WARN,
            f"slower than {options.slow_ms:g} ms: every worker waits that long per message"
            " (delivery.workers = RPS x latency)",
            answer,
        )
    return ProbeResult("answers in time", Verdict.PASS, "", answer)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def _transport_for(scheme: str) -> tuple[TransportFactory, Describe, str]:
    transports = default_transports()
    kind = transports.kind_for(scheme)
    protocol = kind.name if kind is not None else scheme

    def factory(target: TargetConfig, clock: Clock) -> Transport:
        return transports.open(
            target, integration=PROBE_INTEGRATION, max_connections=2, clock=clock
        )

    return factory, _answer, protocol


def _answer(result: DeliveryResult) -> str:
    if result.status is None:
        return "no answer"
    if result.protocol == "grpc":
        return grpc_code_name(result.status)
    return f"HTTP {result.status}"
