"""The delivery port: a transport pushes events to a handler and reports an Outcome.

A delivery's result is a value, never an exception: each transport has one
table-like function from the handler's answer to an ``Outcome``
(``nemesis.delivery.contract`` holds them, one per protocol).
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
    """The handler's answer, reduced to what the outcome table needs (treat it as immutable)."""

    outcome: Outcome
    status: int | None = None  # HTTP status (gRPC code number for gRPC); None: no answer
    error: str | None = None  # short, for logs and the DLQ; never the payload
    retry_after_s: float | None = None  # the handler's Retry-After, if any
    duration_s: float = 0.0
    protocol: Literal["http", "grpc"] = "http"  # what ``status`` is: an HTTP status or a gRPC code


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
