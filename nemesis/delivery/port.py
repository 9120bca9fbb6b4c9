"""The delivery port: a transport pushes events to a handler and reports an Outcome.

A delivery's result is a value, never an exception: each transport has one
table-like function from the handler's answer to an ``Outcome`` and, for an
answer that did not finish the message, its ``FailureKind``
(``nemesis.delivery.contract`` holds them, one per protocol). Nothing
downstream reads the status again: the circuit breaker and the failure
policy read the kind.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from nemesis.broker.port import Message, is_text_key
from nemesis.errors import ConfigProblem
from nemesis.tracecontext import TraceContext


class Outcome(enum.Enum):
    """What happened to one message (or one batch) at the handler."""

    DELIVERED = "delivered"  # 2xx: done, may be committed
    DROPPED = "dropped"  # the handler said `nemesis-verdict: drop`: done, counted apart
    RETRY = "retry"  # try again later; counts against the circuit breaker
    DEAD = "dead"  # message-level contract violation: dead-letter at once

    # Members are singletons: identity hashing (C) instead of Enum's hash of the name (Python).
    __hash__ = object.__hash__

    @property
    def done(self) -> bool:
        """Whether the message is finished and its offset may be committed."""
        # Identity tests: enum hashing and equality run Python code (hot path).
        return self is Outcome.DELIVERED or self is Outcome.DROPPED


class FailureKind(enum.Enum):
    """Why a message did not finish: the one vocabulary of failures.

    The handler contract names the kind of an answer; a pipeline stage names
    its own (``PIPELINE_ERROR``, ``DECODE_ERROR``). ``dead`` and ``unwell``
    are what the rest of Nemesis asks of a kind.
    """

    REJECTED = "rejected"  # 400, 409, 410, 413, 415, 422, or a gRPC contract violation
    VERDICT_DEAD = "verdict_dead"  # nemesis-verdict: dead
    PIPELINE_ERROR = "pipeline_error"  # a pipeline stage failed on this message
    DECODE_ERROR = "decode_error"  # the payload does not decode (JSON, Protobuf)
    SERVER_ERROR = "server_error"  # 5xx, 408, 425, the misconfigured 401/403/404/405, gRPC codes
    NO_ANSWER = "no_answer"  # timeout, refused or broken connection, an answer too large
    RATE_LIMITED = "rate_limited"  # 429 (gRPC RESOURCE_EXHAUSTED)
    VERDICT_RETRY = "verdict_retry"  # nemesis-verdict: retry

    __hash__ = object.__hash__  # as Outcome's: identity hashing

    @property
    def dead(self) -> bool:
        """Whether the message itself is at fault: dead-lettered at once."""
        return self in _DEAD_KINDS

    @property
    def unwell(self) -> bool:
        """Whether it says the handler may be unwell: every kind that is not ``dead``.

        The one definition: the circuit breaker counts exactly these answers
        against the handler, and the failure policy never dead-letters one of
        them while the handler may be down. A retry verdict is one: the handler
        asks to be called again later, as a 503 or a 429 does (the handler
        contract: "counts against the breaker").
        """
        return self not in _DEAD_KINDS

    @property
    def outcome(self) -> Outcome:
        """``DEAD`` for a dead kind, ``RETRY`` for any other."""
        return Outcome.DEAD if self in _DEAD_KINDS else Outcome.RETRY


_DEAD_KINDS = frozenset(
    {
        FailureKind.REJECTED,
        FailureKind.VERDICT_DEAD,
        FailureKind.PIPELINE_ERROR,
        FailureKind.DECODE_ERROR,
    }
)


@dataclass(slots=True)
class Event:
    """One message on its way to a handler, with what the handler contract adds.

    ``attributes``: a record that is a CloudEvent already keeps its own
    (id, source, type, time, subject, datacontenttype, extensions...;
    ``nemesis.delivery.cloudevents.cloud_record``); None for any other.
    ``forwarded``: the producer's headers on the integration's
    ``source.forward_headers``, in order, duplicates kept (never the trace
    context: ``trace`` is sent instead). ``trace``: the W3C trace context the
    handler receives (``nemesis.tracecontext``), the record's own or
    one Nemesis started; None only for events made outside a runner.
    """

    message: Message
    id: str  # stable across retries: the handler's idempotency key (ce-id)
    type: str  # ce-type
    attempt: int = 1
    content_type: str = "application/json"  # "": none (an event without data)
    payload: bytes | None = None  # the pipeline's output; the message value when None
    attributes: dict[str, str] | None = None
    forwarded: tuple[tuple[str, bytes], ...] = ()
    trace: TraceContext | None = None

    @property
    def body(self) -> bytes:
        return self.message.value if self.payload is None else self.payload

    @property
    def plain(self) -> bool:
        """Whether the transports' fast path encodes it: Nemesis' attributes and a text key only."""
        message = self.message
        key = message.key
        return (
            self.attributes is None
            and not self.forwarded
            and not message.tombstone
            and (key is None or is_text_key(key))
        )


@dataclass(slots=True)  # not frozen: one is made per request, and frozen ones cost 3x to make
class DeliveryResult:
    """The handler's answer, as the contract reads it (treat it as immutable).

    ``failure`` is set exactly when ``outcome`` is ``RETRY`` or ``DEAD``.
    """

    outcome: Outcome
    status: int | None = None  # HTTP status (gRPC code number for gRPC); None: no answer
    error: str | None = None  # short, for logs and the DLQ; never the payload
    retry_after_s: float | None = None  # the handler's Retry-After, if any
    duration_s: float = 0.0
    protocol: Literal["http", "grpc"] = "http"  # what ``status`` is: an HTTP status or a gRPC code
    failure: FailureKind | None = None  # why it did not finish; None: delivered or dropped


class Transport(Protocol):
    """Delivers events to one integration's target."""

    async def deliver(self, event: Event) -> DeliveryResult: ...

    async def deliver_batch(self, events: Sequence[Event]) -> DeliveryResult:
        """One request for several events; the result applies to every one of them."""
        ...

    async def close(self) -> None: ...


def config_problem(integration: str, field: str, message: str) -> ConfigProblem:
    """A problem with an integration's target, found when its transport is made."""
    return ConfigProblem(file=f"integration {integration}", line=None, field=field, message=message)
