"""The h1 transport writes the event's headers as lines; they must be binary mode's, exactly."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nemesis.broker.port import Message
from nemesis.delivery.cloudevents import binary_header_lines, binary_headers_from
from nemesis.delivery.port import Event

anything = st.text(alphabet=st.characters(codec=None), max_size=40)


@given(
    event_id=anything,
    key=st.none() | anything,
    partition=st.integers(0, 2**31 - 1),
    offset=st.integers(0, 2**63 - 1),
    attempt=st.integers(1, 100),
    created_at=st.sampled_from([0.0, 1764480000.25, 1.5]),
    written_at=st.sampled_from([0.0, 1764480001.0]),
)
def test_lines_are_the_binary_mode_headers_and_cannot_be_split(
    event_id: str,
    key: str | None,
    partition: int,
    offset: int,
    attempt: int,
    created_at: float,
    written_at: float,
) -> None:
    message = Message(
        "orders", partition, offset, b"{}", key=key, created_at=created_at, written_at=written_at
    )
    event = Event(message=message, id=event_id, type="order.created", attempt=attempt)

    sent_id, lines = binary_header_lines(event)

    assert lines.endswith("\r\n")
    parsed = [line.split(": ", 1) for line in lines[:-2].split("\r\n")]
    expected = binary_headers_from({}, event)
    assert [(name, value) for name, value in parsed] == list(expected.items())
    assert sent_id == expected["ce-id"]
    # One header per line: no CR, LF or NUL inside a value.
    for _, value in parsed:
        assert not set(value) & {"\r", "\n", "\x00"}
