"""Flow control's one record of paused sessions per reader, and its one threshold rule.

The rule is a table; the record is driven over a recording reader, then over
the embedded log's real multi-topic reader shared by internal flows, where the
runner of a flow and the flows' queues pause the same sessions through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.broker.embedded.reader import EmbeddedSession
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage, PartitionSession
from nemesis.broker.source import Source
from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig
from nemesis.runtime.internal import SharedReader
from nemesis.runtime.pauses import Pauses, Why, key_of, over_buffer
from nemesis.runtime.runner import IntegrationRunner, RunnerOptions
from nemesis.testing import FakeRequest, FakeTransport, Reply
from tests.operability import wait_until_true

FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=5)


@pytest.mark.parametrize(
    ("count", "buffer", "paused", "over"),
    [
        # Not paused: a buffer's worth pauses, one less does not.
        (0, 100, False, False),
        (99, 100, False, False),
        (100, 100, False, True),
        (250, 100, False, True),
        # Paused: it stays paused above half a buffer and reads again at half or less.
        (100, 100, True, True),
        (51, 100, True, True),
        (50, 100, True, False),
        (0, 100, True, False),
        # Odd buffers: half rounds down.
        (50, 101, True, False),
        (51, 101, True, True),
        # A buffer of one: one message pauses, none resumes.
        (1, 1, False, True),
        (1, 1, True, True),
        (0, 1, True, False),
    ],
)
def test_the_threshold_rule(count: int, buffer: int, paused: bool, over: bool) -> None:
    assert over_buffer(count, buffer, paused=paused) is over


@dataclass
class _Session:
    topic: str
    partition: int
    id: int = 1
    alive: bool = True


class _Recorder:
    """A reader that records what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def pause(self, session: PartitionSession) -> None:
        self.calls.append(("pause", session.topic, session.partition))

    def resume(self, session: PartitionSession) -> None:
        self.calls.append(("resume", session.topic, session.partition))


def test_a_session_pauses_at_its_first_reason_and_resumes_at_its_last() -> None:
    reader = _Recorder()
    pauses = Pauses(reader)
    session = _Session("a", 0)
    pauses.pause(session, Why.QUEUED)
    pauses.pause(session, Why.UNCOMMITTED)
    pauses.pause(session, Why.QUEUED)  # again: nothing new
    assert reader.calls == [("pause", "a", 0)]
    assert pauses.reasons(key_of(session)) == {Why.QUEUED, Why.UNCOMMITTED}
    assert pauses.counted_apart(key_of(session))
    pauses.resume(session, Why.QUEUED)
    pauses.resume(session, Why.BLOCKED)  # not a reason it has: nothing
    assert reader.calls == [("pause", "a", 0)]  # still paused for its uncommitted messages
    pauses.resume(session, Why.UNCOMMITTED)
    assert reader.calls == [("pause", "a", 0), ("resume", "a", 0)]
    assert len(pauses) == 0
    assert pauses.reasons(key_of(session)) == frozenset()


def test_a_queued_pause_does_not_count_apart() -> None:
    pauses = Pauses(_Recorder())
    session = _Session("a", 0)
    pauses.pause(session, Why.QUEUED)
    assert not pauses.counted_apart(key_of(session))
    pauses.pause(session, Why.BLOCKED)
    assert pauses.counted_apart(key_of(session))


def test_weigh_follows_the_rule_with_its_gap() -> None:
    reader = _Recorder()
    pauses = Pauses(reader)
    session = _Session("a", 0)
    for count in (10, 99, 100, 80, 51, 50, 99):
        pauses.weigh(session, Why.UNCOMMITTED, count, 100)
    # Paused at 100, held through 80 and 51, resumed at 50, not paused again at 99.
    assert reader.calls == [("pause", "a", 0), ("resume", "a", 0)]


def test_resume_all_is_by_reason_and_topic_and_ended_sessions_are_forgotten() -> None:
    reader = _Recorder()
    pauses = Pauses(reader)
    a0, a1, b0 = _Session("a", 0), _Session("a", 1), _Session("b", 0)
    for session in (a0, a1, b0):
        pauses.pause(session, Why.QUEUED)
    pauses.pause(a1, Why.UNCOMMITTED)
    pauses.resume_all(Why.QUEUED, "a")
    assert reader.calls[3:] == [("resume", "a", 0)]  # a1 waits for its commit, b0 for b's queue
    assert {(s.topic, s.partition) for s in pauses.sessions(Why.QUEUED)} == {("b", 0)}
    b0.alive = False
    pauses.forget_ended()
    assert len(pauses) == 1
    assert reader.calls[3:] == [("resume", "a", 0)]  # an ended session is not resumed


# --- through the embedded log's shared reader --------------------------------------------


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db"), lease_s=1.0))
    yield opened
    await opened.close()


async def _publish(broker: EmbeddedBroker, topic: str, count: int, partitions: int = 2) -> None:
    await broker.admin.create_topic(
        topic, partitions=partitions, consumers=[ConsumerSpec("c")], exist_ok=True
    )
    writer = await broker.writer(topic)
    await writer.write(
        [OutgoingMessage(orjson.dumps({"n": n}), partition=n % partitions) for n in range(count)]
    )
    await writer.close()


def _paused_at_reader(sessions: Sequence[PartitionSession]) -> set[tuple[str, int]]:
    paused = set()
    for session in sessions:
        assert isinstance(session, EmbeddedSession)
        if session.paused:
            paused.add((session.topic, session.partition))
    return paused


async def test_a_flow_queue_over_its_buffer_pauses_and_resumes_through_the_shared_record(
    broker: EmbeddedBroker,
) -> None:
    buffer = 20
    await _publish(broker, "a", 200)
    await _publish(broker, "b", 200)
    shared = SharedReader(await broker.reader(["a", "b"], "c"), ["a", "b"], lambda: buffer)
    slow, busy = shared.view("a"), shared.view("b")
    try:
        # Flow b reads (it pumps the shared reader); flow a takes nothing, its queue grows.
        while len(slow.queue) < buffer:
            await busy.receive(10, 5.0)
        sessions = shared.reader.sessions()
        a_sessions = [s for s in sessions if s.topic == "a"]
        queued = {message.session for message in slow.queue}
        assert _paused_at_reader(sessions) == {(s.topic, s.partition) for s in queued if s}
        assert all(shared.pauses.reasons(key_of(s)) == {Why.QUEUED} for s in queued if s)
        # The runner of flow a pauses one of them for its uncommitted messages, through
        # the same record (its view's).
        stuck = a_sessions[0]
        assert slow.pauses is shared.pauses
        slow.pauses.pause(stuck, Why.UNCOMMITTED)
        # Flow a takes its queue down to half a buffer: the queue's pauses go; the
        # runner's stays.
        while len(slow.queue) > buffer // 2:
            assert await slow.receive(1, 5.0)
        assert _paused_at_reader(sessions) == {("a", stuck.partition)}
        assert shared.pauses.reasons(key_of(stuck)) == {Why.UNCOMMITTED}
        slow.pauses.resume(stuck, Why.UNCOMMITTED)
        assert _paused_at_reader(sessions) == set()
        assert len(shared.pauses) == 0
    finally:
        await shared.close()


def _config(buffer: int) -> IntegrationConfig:
    return IntegrationConfig.model_validate(
        {
            "name": "it",
            "owners": ["team"],
            "source": {"topic": "a", "consumer": "c"},
            "target": {"url": "http://127.0.0.1:9/"},
            "delivery": {"workers": 4, "buffer": buffer},
        }
    )


async def test_a_runner_over_its_buffer_pauses_and_resumes_through_its_readers_record(
    broker: EmbeddedBroker,
) -> None:
    buffer = 20
    await _publish(broker, "a", 400, partitions=2)
    await _publish(broker, "b", 10, partitions=2)
    shared = SharedReader(await broker.reader(["a", "b"], "c"), ["a", "b"], lambda: buffer)
    view = shared.view("a")
    released = asyncio.Event()

    async def answer(request: FakeRequest) -> Reply:
        message: Message = request.events[0].message
        if message.partition == 0 and message.offset == 3:
            await released.wait()  # partition 0 waits behind its fourth message
        return Reply(200)

    async def open_view() -> Source:
        return view

    transport = FakeTransport(answer)
    runner = IntegrationRunner(_config(buffer), open_view, transport, options=FAST)
    task = asyncio.create_task(runner.run())
    try:
        # Partition 1 is delivered in full while partition 0 is held at the broker,
        # paused for its uncommitted messages behind the one that does not finish.
        await wait_until_true(
            lambda: sum(1 for r in transport.requests if r.events[0].message.partition == 1) >= 200,
            timeout_s=30,
        )
        sessions = shared.reader.sessions()
        stuck = next(s for s in sessions if s.topic == "a" and s.partition == 0)
        await wait_until_true(lambda: _paused_at_reader(sessions) == {("a", 0)}, timeout_s=30)
        assert shared.pauses.counted_apart(key_of(stuck))
        assert runner.statistics().paused_partitions == 1
        # It finishes: the partition reads again and is delivered in full.
        released.set()
        await wait_until_true(lambda: len(transport.done_ids()) == 400, timeout_s=30)
        await wait_until_true(lambda: len(shared.pauses) == 0, timeout_s=30)
        assert _paused_at_reader(sessions) == set()
        assert runner.statistics().paused_partitions == 0
    finally:
        released.set()
        runner.stop()
        await task
        await shared.close()
