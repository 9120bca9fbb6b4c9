"""W3C Trace Context parsing and where a record's context is found (docs/tracing.md).

The refused values follow the processing model of the W3C Trace Context
recommendation (section 3.2 ``traceparent``, 3.3 ``tracestate``, 4.3
versioning) and the cases of its test suite (github.com/w3c/trace-context,
``test/test.py``).
"""

from __future__ import annotations

import pytest

from nemesis import tracecontext
from nemesis.broker.port import Message
from nemesis.topology import META_TRACEPARENT
from nemesis.tracecontext import (
    context_of,
    parse_traceparent,
    parse_tracestate,
    record_context,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"


def test_a_valid_traceparent_parses_into_its_parts() -> None:
    assert parse_traceparent(VALID) == (TRACE, SPAN, 1)
    assert parse_traceparent(VALID.encode()) == (TRACE, SPAN, 1)
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-00") == (TRACE, SPAN, 0)
    # Surrounding whitespace belongs to the header field (RFC 9110 OWS).
    assert parse_traceparent(f" {VALID}\t") == (TRACE, SPAN, 1)


@pytest.mark.parametrize(
    "value",
    [
        "",
        f"00-{TRACE.upper()}-{SPAN}-01",  # hex must be lowercase
        f"00-{TRACE}-{SPAN.upper()}-01",
        f"00-{TRACE}-{SPAN}-0A",
        f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
        f"0g-{TRACE}-{SPAN}-01",
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE[:-1]}-{SPAN}-01",  # short trace id
        f"00-{TRACE}0-{SPAN}-01",  # long trace id
        f"00-{TRACE}-{SPAN[:-1]}-01",
        f"00-{TRACE}-{SPAN}-1",
        f"00-{TRACE}-{SPAN}-01-",  # version 00 is exactly 55 characters
        f"00-{TRACE}-{SPAN}-01-what-the-future-will-be-like",
        f"00_{TRACE}_{SPAN}_01",
        f"00-{TRACE}-{SPAN}-01,00-{TRACE}-{SPAN}-01",  # two headers combined
        f"cc-{TRACE}-{SPAN}-01.",  # a later version: the 56th character must be "-"
        f"cc-{TRACE}-{SPAN}",  # shorter than 55
        f"00-{TRACE}-{SPAN}-é1",
    ],
)
def test_an_invalid_traceparent_is_refused(value: str) -> None:
    assert parse_traceparent(value) is None
    assert context_of(value, ["shop=1"]) is None


def test_a_later_version_is_read_by_its_first_four_fields() -> None:
    assert parse_traceparent(f"cc-{TRACE}-{SPAN}-01") == (TRACE, SPAN, 1)
    assert parse_traceparent(f"cc-{TRACE}-{SPAN}-01-what-the-future-will-be-like") == (
        TRACE,
        SPAN,
        1,
    )


def test_unknown_flags_are_not_passed_on() -> None:
    parsed = context_of(f"00-{TRACE}-{SPAN}-ff")
    assert parsed is not None
    assert parsed.traceparent == f"00-{TRACE}-{SPAN}-03"


@pytest.mark.parametrize(
    ("values", "state"),
    [
        (["rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"], "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
        (["rojo=1", "congo=2"], "rojo=1,congo=2"),  # several headers are one list
        ([" rojo=1 ,, congo=2 "], "rojo=1,congo=2"),  # OWS and empty members
        (["tenant@vendor=x"], "tenant@vendor=x"),
        (["1tenant@vendor=x"], "1tenant@vendor=x"),
        ([], ""),
    ],
)
def test_a_valid_tracestate_is_kept(values: list[str], state: str) -> None:
    assert parse_tracestate(values) == state


@pytest.mark.parametrize(
    "value",
    [
        "Rojo=1",  # keys are lowercase
        "rojo=1,rojo=2",  # a key twice
        "rojo",  # no value
        "rojo=",  # an empty value
        "rojo=a,b",  # a member without "="
        "rojo=a=b",  # "=" inside a value
        "1rojo=1",  # a simple key starts with a letter
        "t@V=1",  # the system id starts with a lowercase letter
        "rojo=é",
        ",".join(f"k{i}=v" for i in range(33)),  # more than 32 members
        "a" * 257 + "=1",  # a key of more than 256 characters
        "rojo=" + "x" * 257,  # a value of more than 256 characters
    ],
)
def test_an_invalid_tracestate_is_dropped_and_the_traceparent_kept(value: str) -> None:
    assert parse_tracestate([value]) == ""
    found = context_of(VALID, [value])
    assert found is not None
    assert (found.traceparent, found.state) == (VALID, "")


def message(**metadata: str) -> Message:
    return Message("orders", 0, 1, b"{}", metadata=metadata)


def test_a_records_context_comes_from_its_headers_first_then_its_cloudevent_then_nemesis() -> None:
    other = f"00-{'1' * 32}-{'2' * 16}-01"
    carried = f"00-{'3' * 32}-{'4' * 16}-01"
    # Kafka: the header, whatever the case of its name.
    kafka = record_context({}, (("TraceParent", VALID.encode()), ("tracestate", b"a=1")))
    assert kafka is not None
    assert (kafka.traceparent, kafka.state, kafka.started) == (VALID, "a=1", False)
    # YDB and embedded metadata.
    found = record_context({"traceparent": VALID, "tracestate": "a=1"}, ())
    assert found is not None
    assert (found.traceparent, found.state) == (VALID, "a=1")
    # The CloudEvents distributed-tracing extension when the record has no header.
    from_event = record_context({}, (), {"traceparent": other, "tracestate": "b=2"})
    assert from_event is not None
    assert (from_event.traceparent, from_event.state) == (other, "b=2")
    # An invalid header gives way to the extension.
    after_invalid = record_context({"traceparent": VALID.upper()}, (), {"traceparent": other})
    assert after_invalid is not None
    assert after_invalid.traceparent == other
    # A context Nemesis started, kept by a retry tier or a requeue.
    kept = record_context({META_TRACEPARENT: carried}, ())
    assert kept is not None
    assert (kept.traceparent, kept.started) == (carried, True)
    assert record_context({}, ()) is None


def test_two_different_traceparent_headers_are_refused_and_tracestates_joined() -> None:
    other = f"00-{'1' * 32}-{'2' * 16}-01"
    two = (("traceparent", VALID.encode()), ("traceparent", other.encode()))
    assert record_context({}, two) is None
    same = record_context(
        {},
        (
            ("traceparent", VALID.encode()),
            ("tracestate", b"a=1"),
            ("traceparent", VALID.encode()),
            ("tracestate", b"b=2"),
        ),
    )
    assert same is not None
    assert same.state == "a=1,b=2"


def test_a_started_context_is_new_random_sampled_and_kept_as_bookkeeping() -> None:
    first, second = tracecontext.start(), tracecontext.start()
    assert first.trace_id != second.trace_id
    assert parse_traceparent(first.traceparent) == (first.trace_id, first.span_id, 1)
    assert first.started
    assert tracecontext.carried(first) == {META_TRACEPARENT: first.traceparent}
    found = context_of(VALID)
    assert found is not None
    assert tracecontext.carried(found) == {}  # a record's own travels in the record
