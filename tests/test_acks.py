"""The commit rule: the committed offset never passes an unfinished message."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemesis.broker.port import Message
from nemesis.runtime.acks import AckTracker, PartitionAcks


@dataclass
class FakeSession:
    topic: str = "t"
    partition: int = 0
    id: int = 1
    alive: bool = True


def message(offset: int, partition: int = 0, session: FakeSession | None = None) -> Message:
    return Message(
        topic="t", partition=partition, offset=offset, value=b"", session=session or FakeSession()
    )


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(min_value=1, max_value=200),
    data=st.data(),
)
def test_committed_offset_never_passes_an_unfinished_message(
    count: int, data: st.DataObject
) -> None:
    session = FakeSession()
    acks = PartitionAcks(session)
    # Offsets may have gaps (retention, YDB transactions); read order is still offset order.
    gaps = data.draw(st.lists(st.integers(1, 3), min_size=count, max_size=count))
    offsets = []
    offset = data.draw(st.integers(0, 1000))
    for gap in gaps:
        offsets.append(offset)
        offset += gap
    for o in offsets:
        acks.add(message(o, session=session))
    order = data.draw(st.permutations(offsets))
    # Complete only some of them, in random order, committing after each completion.
    finished_count = data.draw(st.integers(0, count))
    finished: set[int] = set()
    committed: list[int] = []
    for o in order[:finished_count]:
        assert acks.ack(message(o, session=session))
        finished.add(o)
        run = acks.take_committable()
        committed.extend(m.offset for m in run)
        if committed:
            high = committed[-1]
            assert all(x in finished for x in offsets if x <= high), (
                "committed past an unfinished message"
            )
    # Committed offsets form exactly the done prefix, in order, with no repeats.
    prefix = []
    for o in offsets:
        if o not in finished:
            break
        prefix.append(o)
    assert committed == prefix
    assert acks.outstanding == count - len(prefix)
    assert acks.unfinished == count - len(finished)


def test_offsets_must_arrive_in_increasing_order() -> None:
    acks = PartitionAcks(FakeSession())
    acks.add(message(5))
    with pytest.raises(ValueError, match="offset 5 read after 5"):
        acks.add(message(5))


def test_ack_of_unknown_or_repeated_message_is_ignored() -> None:
    tracker = AckTracker()
    m = message(1)
    assert not tracker.ack(m)
    tracker.add(m)
    assert tracker.ack(m)
    assert not tracker.ack(m)
    assert tracker.unfinished == 0


def test_dead_session_is_forgotten_not_committed() -> None:
    tracker = AckTracker()
    old = FakeSession(id=1)
    for o in range(5):
        tracker.add(message(o, session=old))
    tracker.ack(message(0, session=old))
    tracker.ack(message(1, session=old))
    old.alive = False
    assert tracker.take_committable() == []
    assert tracker.unfinished == 0
    assert tracker.outstanding == 0
    # A late ack from a worker that was still delivering is a no-op.
    assert not tracker.ack(message(3, session=old))
    # The new owner starts over from the committed offset.
    new = FakeSession(id=2)
    tracker.add(message(0, session=new))
    tracker.ack(message(0, session=new))
    assert [[m.offset for m in run] for run in tracker.take_committable()] == [[0]]


def test_partitions_commit_independently() -> None:
    tracker = AckTracker()
    a, b = FakeSession(partition=0), FakeSession(partition=1)
    tracker.add(message(0, 0, a))
    tracker.add(message(1, 0, a))
    tracker.add(message(0, 1, b))
    tracker.ack(message(1, 0, a))  # partition 0 waits for offset 0
    tracker.ack(message(0, 1, b))
    runs = tracker.take_committable()
    assert [(r[0].partition, [m.offset for m in r]) for r in runs] == [(1, [0])]
    stats = {s.partition: s for s in tracker.statistics()}
    assert stats[0].oldest_unfinished_offset == 0
    assert stats[0].outstanding == 2


def test_ack_after_commit_is_ignored_and_counts_stay_right() -> None:
    tracker = AckTracker()
    session = FakeSession()
    tracker.extend([message(o, session=session) for o in (3, 4, 7)])
    assert tracker.unfinished == 3
    assert tracker.ack(message(3, session=session))
    assert [[m.offset for m in run] for run in tracker.take_committable()] == [[3]]
    # Committed already: a repeated ack must not count a second finish.
    assert not tracker.ack(message(3, session=session))
    # Outside what is tracked, on either side.
    assert not tracker.ack(message(2, session=session))
    assert not tracker.ack(message(8, session=session))
    assert tracker.unfinished == 2
    assert tracker.ack(message(7, session=session))
    assert tracker.take_committable() == []  # 4 is still unfinished
    assert tracker.ack(message(4, session=session))
    assert [[m.offset for m in run] for run in tracker.take_committable()] == [[4, 7]]
    assert (tracker.unfinished, tracker.outstanding) == (0, 0)


def test_a_run_that_goes_backwards_is_refused_whole() -> None:
    acks = PartitionAcks(FakeSession())
    acks.extend([message(1), message(2)])
    with pytest.raises(ValueError, match="offset 3 read after 4"):
        acks.extend([message(4), message(3)])
    assert acks.outstanding == 2  # nothing of the refused run was taken


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_ack_all_is_ack_of_each(data: st.DataObject) -> None:
    session = FakeSession()
    offsets = sorted(data.draw(st.sets(st.integers(0, 60), min_size=1, max_size=30)))
    one_by_one, at_once = PartitionAcks(session), PartitionAcks(session)
    for acks in (one_by_one, at_once):
        acks.extend([message(o, session=session) for o in offsets])
    # Tracked and untracked offsets, repeats included, in rounds with commits between.
    for _ in range(data.draw(st.integers(1, 3))):
        chosen = data.draw(st.lists(st.integers(-2, 63), max_size=40))
        batch = [message(o, session=session) for o in chosen]
        expected = sum(one_by_one.ack(m) for m in batch)
        assert at_once.ack_all(batch) == expected
        assert at_once.unfinished == one_by_one.unfinished
        assert [m.offset for m in at_once.take_committable()] == [
            m.offset for m in one_by_one.take_committable()
        ]
