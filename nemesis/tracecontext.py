"""W3C Trace Context (https://www.w3.org/TR/trace-context/): ``traceparent`` and ``tracestate``.

Every event reaches its handler with a trace context (docs/tracing.md). It is
the record's own when the record carries one that parses, looked up in this
order:

1. the record's ``traceparent`` header (a Kafka header, whatever its case;
   YDB and embedded message metadata) with its ``tracestate``;
2. the CloudEvents distributed-tracing extension of a record that is a
   CloudEvent (``ce_traceparent`` in binary mode, ``traceparent`` in a
   structured event);
3. the context Nemesis started for the message at its first attempt, kept
   in the ``nemesis-traceparent`` bookkeeping of a retry tier's copy, a dead
   letter and a requeue (``META_TRACEPARENT``).

Otherwise Nemesis starts one: a new random trace id and parent id, sampled.
Parsing is strict, as the specification's processing model asks: a version
of two lowercase hex digits other than ``ff``; for version ``00`` exactly 55
characters, for a later version at least 55 whose 56th is ``-``; a 32-digit
trace id and a 16-digit parent id in lowercase hex, neither all zeros; two
hex digits of flags. A ``traceparent`` that fails any of these is ignored as
if absent (and its ``tracestate`` with it); a ``tracestate`` that breaks its
grammar (keys, values, at most 32 members, no key twice) is dropped while the
``traceparent`` is kept.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping
from typing import Final

from nemesis.broker.port import Headers
from nemesis.topology import META_TRACEPARENT, META_TRACESTATE

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"

SAMPLED: Final = 0x01
# Flags this version of the specification defines (sampled; level 2's random-trace-id):
# unknown bits are not passed on, as level 1 asks of a participant that does not know them.
_KNOWN_FLAGS: Final = 0x03
_MAX_MEMBERS: Final = 32

_HEX = "[0-9a-f]"
_VERSION_00 = re.compile(rf"00-({_HEX}{{32}})-({_HEX}{{16}})-({_HEX}{{2}})")
_LATER_VERSION = re.compile(rf"({_HEX}{{2}})-({_HEX}{{32}})-({_HEX}{{16}})-({_HEX}{{2}})(?:-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_KEY = re.compile(
    r"[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13}"
)
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


class TraceContext:
    """A message's trace: its trace id, the span the next hop is a child of, flags, state.

    ``started``: Nemesis started it (the record carried none that parses).
    ``traceparent``: the version 00 value, made once (it is sent with every
    attempt). Treat it as immutable; it is a plain slotted class rather than
    a frozen dataclass because one is made for nearly every message, and a
    frozen one costs several times as much to make.
    """

    __slots__ = ("flags", "span_id", "started", "state", "trace_id", "traceparent")

    def __init__(
        self,
        trace_id: str,
        span_id: str,
        flags: int = SAMPLED,
        state: str = "",
        started: bool = False,
    ) -> None:
        self.trace_id = trace_id  # 32 lowercase hex digits, not all zeros
        self.span_id = span_id  # 16 lowercase hex digits, not all zeros: the next span's parent
        self.flags = flags
        self.state = state  # a valid tracestate, "" when none
        self.started = started
        self.traceparent = "00-%s-%s-%02x" % (trace_id, span_id, flags)  # noqa: UP031

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TraceContext):
            return NotImplemented
        return (self.traceparent, self.state, self.started) == (
            other.traceparent,
            other.state,
            other.started,
        )

    def __hash__(self) -> int:
        return hash((self.traceparent, self.state, self.started))

    def __repr__(self) -> str:
        return f"TraceContext({self.traceparent!r}, state={self.state!r}, started={self.started})"

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def child(self, span_id: str) -> TraceContext:
        """The same trace with ``span_id`` as the parent of the next hop."""
        return TraceContext(self.trace_id, span_id, self.flags, self.state, self.started)


def parse_traceparent(value: str | bytes | None) -> tuple[str, str, int] | None:
    """(trace id, parent id, flags) of a ``traceparent`` value; None when it is not valid."""
    if value is None:
        return None
    if isinstance(value, bytes):
        if not value.isascii():
            return None
        value = value.decode("ascii")
    # Surrounding whitespace is the header field's (RFC 9110 OWS), not the value's.
    value = value.strip(" \t")
    if value.startswith("00"):
        match = _VERSION_00.fullmatch(value)
        if match is None:
            return None
        trace_id, span_id, flags = match.groups()
    else:
        later = _LATER_VERSION.fullmatch(value)
        if later is None or later.group(1) == "ff":
            return None
        _, trace_id, span_id, flags = later.groups()
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return trace_id, span_id, int(flags, 16) & _KNOWN_FLAGS


def parse_tracestate(values: Iterable[str | bytes]) -> str:
    """The ``tracestate`` of one or more header values (joined by commas); "" when invalid."""
    texts: list[str] = []
    for value in values:
        if isinstance(value, bytes):
            if not value.isascii():
                return ""
            value = value.decode("ascii")
        texts.append(value)
    members: list[str] = []
    keys: set[str] = set()
    for member in ",".join(texts).split(","):
        member = member.strip(" \t")
        if not member:
            continue  # empty list members are allowed and dropped
        key, equals, text = member.partition("=")
        if not equals or not _KEY.fullmatch(key) or not _VALUE.fullmatch(text) or key in keys:
            return ""
        keys.add(key)
        members.append(member)
    if len(members) > _MAX_MEMBERS:
        return ""
    return ",".join(members)


def context_of(
    traceparent: str | bytes | None, tracestate: Iterable[str | bytes] = ()
) -> TraceContext | None:
    """The trace context of a ``traceparent`` and its ``tracestate``; None when invalid."""
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return None
    trace_id, span_id, flags = parsed
    return TraceContext(trace_id, span_id, flags, parse_tracestate(tracestate))


def record_context(
    metadata: Mapping[str, str],
    headers: Headers,
    attributes: Mapping[str, str] | None = None,
) -> TraceContext | None:
    """The trace context a record carries (steps 1 to 3 above); None when it carries none."""
    if headers:
        found = _from_headers(headers)
    elif TRACEPARENT in metadata:
        found = context_of(metadata[TRACEPARENT], _present(metadata.get(TRACESTATE)))
    else:
        found = None
    if found is None and attributes is not None and TRACEPARENT in attributes:
        found = context_of(attributes[TRACEPARENT], _present(attributes.get(TRACESTATE)))
    if found is None and META_TRACEPARENT in metadata:
        carried = context_of(metadata[META_TRACEPARENT], _present(metadata.get(META_TRACESTATE)))
        if carried is not None:
            found = TraceContext(
                carried.trace_id, carried.span_id, carried.flags, carried.state, started=True
            )
    return found


def _present(value: str | None) -> tuple[str, ...]:
    return () if value is None else (value,)


def _from_headers(headers: Headers) -> TraceContext | None:
    """A Kafka record's context: its one ``traceparent`` header (names match in any case).

    Two different ``traceparent`` headers are as invalid as HTTP's combined
    field would be; several ``tracestate`` headers are one list, in order.
    """
    parents: set[bytes] = set()
    states: list[bytes] = []
    for name, value in headers:
        if value is None or len(name) not in (10, 11):
            continue
        lowered = name.lower()
        if lowered == TRACEPARENT:
            parents.add(value)
        elif lowered == TRACESTATE:
            states.append(value)
    if len(parents) != 1:
        return None
    return context_of(parents.pop(), states)


def new_trace_id() -> str:
    """32 random lowercase hex digits, never all zeros."""
    while True:
        bits = random.getrandbits(128)
        if bits:
            return "%032x" % bits  # noqa: UP031


def new_span_id() -> str:
    """16 random lowercase hex digits, never all zeros."""
    while True:
        bits = random.getrandbits(64)
        if bits:
            return "%016x" % bits  # noqa: UP031


_new = object.__new__
_getrandbits = random.getrandbits


def start() -> TraceContext:
    """A new trace for a record that carries none: random ids, sampled.

    Made for nearly every message, so without ``__init__``'s formatting: one
    draw of 192 random bits is both ids.
    """
    digits = "%048x" % _getrandbits(192)  # noqa: UP031
    trace_id, span_id = digits[:32], digits[32:]
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return start()  # one draw in 2**64
    trace: TraceContext = _new(TraceContext)
    trace.trace_id = trace_id
    trace.span_id = span_id
    trace.flags = SAMPLED
    trace.state = ""
    trace.started = True
    trace.traceparent = "00-" + trace_id + "-" + span_id + "-01"
    return trace


def carried(trace: TraceContext) -> dict[str, str]:
    """The bookkeeping that keeps a started context with a message (empty for a record's own)."""
    if not trace.started:
        return {}
    kept = {META_TRACEPARENT: trace.traceparent}
    if trace.state:
        kept[META_TRACESTATE] = trace.state
    return kept
