"""Requeue and discard of dead letters: the one path the CLI, the API and the UI share.

A requeued message is written to its integration's replay topic
(``nemesis.replay.<integration>``), never to the shared source topic, so only
that integration receives it again, through its replay flow and at its
``rate_limits.replay``. It carries its event id, so if it fails again it comes
back as the same DLQ row, with the requeue count kept.

The order is: write to the replay topic, then mark the rows requeued. A crash
in between leaves rows marked dead whose messages are on their way already: a
second requeue would send them twice, which the handler's idempotency by
``ce-id`` absorbs. The reverse order could lose messages.

A dead letter of a queue (an ``sqs`` source) goes back to that queue
instead (``nemesis.broker.sqs.requeue``: SendMessage, with the event id as an
attribute), at the address the letter keeps in its metadata, with the AWS
credentials of the process that requeues. When a send fails, the letters sent
before it are marked requeued and the error is raised.

This needs the state store, a broker and the topic names of
``nemesis.topology``, nothing of the running proxy: a viewer on another host
requeues the same way. The replay topic is used as the broker describes it;
when it does not exist yet (the proxy has not run the integration), it is
created with as many partitions as the message's source topic has.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from nemesis.backends.sqs import META_QUEUE_URL
from nemesis.broker.port import Broker, OutgoingMessage
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.dlq.port import (
    MAX_SELECT_IDS,
    Action,
    DeadLetterFilter,
    DeadLetterRow,
    DeadLetterStore,
    Status,
)
from nemesis.errors import BrokerError, TopicNotFound
from nemesis.topology import register_internal, replay_message, replay_topic

_WRITE_BATCH = 500


@dataclass(frozen=True, slots=True)
class ActionResult:
    """How many rows an action touched, per integration."""

    action: Action
    count: int
    by_integration: dict[str, int]
    # Rows a requeue left dead because their stored payload is cut (``nemesis.dlq.core``:
    # MAX_STORED_PAYLOAD_BYTES): replaying the first 16 MiB would deliver a broken message.
    payload_cut: int = 0


async def requeue(
    store: DeadLetterStore,
    broker: Broker,
    ids: Collection[str],
    *,
    by: str,
    allowed: frozenset[str] | None = None,
    description: str = "",
    clock: Clock = SYSTEM_CLOCK,
) -> ActionResult:
    """Sends dead rows back to their own integration's replay flow; returns what moved.

    ``allowed`` limits the action to those integrations (a user's teams);
    rows of other integrations, and rows not in ``dead`` status, are skipped,
    and so are rows whose stored payload is cut (``ActionResult.payload_cut``).
    """
    rows = await _dead_rows(store, ids, allowed)
    cut = sum(1 for row in rows if row.payload_truncated)
    by_integration: dict[str, list[DeadLetterRow]] = defaultdict(list)
    for row in rows:
        if not row.payload_truncated:
            by_integration[row.integration].append(row)
    moved: dict[str, int] = {}
    now = clock.time()
    failed: BrokerError | None = None
    for integration, rows_of in sorted(by_integration.items()):
        queued = [row for row in rows_of if META_QUEUE_URL in row.metadata]
        if queued:
            sent, failed = await _to_queues(queued)
            if sent:
                moved[integration] = await store.mark_requeued(
                    sent, by=by, at=now, integrations=frozenset({integration})
                )
            if failed is not None:
                break
        letters = [row for row in rows_of if META_QUEUE_URL not in row.metadata]
        if not letters:
            continue
        topic = await _replay_topic_of(broker, integration, letters[0].source_topic)
        writer = await broker.writer(topic)
        try:
            for start in range(0, len(letters), _WRITE_BATCH):
                chunk = letters[start : start + _WRITE_BATCH]
                await writer.write([replay_of(row) for row in chunk])
        finally:
            await writer.close()
        moved[integration] = moved.get(integration, 0) + await store.mark_requeued(
            [row.id for row in letters], by=by, at=now, integrations=frozenset({integration})
        )
    result = await _audited(store, Action.REQUEUE, moved, by=by, description=description, at=now)
    if failed is not None:
        raise failed
    return dataclasses.replace(result, payload_cut=cut)


async def _to_queues(rows: list[DeadLetterRow]) -> tuple[list[str], BrokerError | None]:
    """Sends a queue's dead letters back to it: the ids sent, and the error that stopped it."""
    try:
        from nemesis.broker.sqs.requeue import send_back
    except ImportError:
        return [], BrokerError("requeue to a queue needs aiobotocore: pip install 'nemesis[sqs]'")
    return await send_back(rows)


def replay_of(row: DeadLetterRow) -> OutgoingMessage:
    """The message a requeue writes for a dead letter: the record as it was read."""
    return replay_message(
        row.payload,
        event=row.event_id,
        key=row.key,
        metadata=row.metadata,
        source_topic=row.source_topic,
        source_partition=row.source_partition,
        source_offset=row.source_offset,
        headers=row.headers,
        tombstone=row.tombstone,
    )


async def _replay_topic_of(broker: Broker, integration: str, source_topic: str) -> str:
    """The integration's replay topic, made ready to take messages its consumer reads."""
    topic = replay_topic(integration)
    try:
        await broker.admin.describe_topic(topic)
    except TopicNotFound:
        try:
            partitions = len((await broker.admin.describe_topic(source_topic)).partitions)
        except TopicNotFound:
            partitions = 1  # the source is gone too: one partition keeps the messages in order
        await broker.admin.create_topic(topic, partitions=max(1, partitions), exist_ok=True)
    await register_internal(broker.admin, topic, integration)
    return topic


async def discard(
    store: DeadLetterStore,
    ids: Collection[str],
    *,
    by: str,
    allowed: frozenset[str] | None = None,
    description: str = "",
    clock: Clock = SYSTEM_CLOCK,
) -> ActionResult:
    """Marks dead rows discarded (they stay for the audit until retention removes them)."""
    rows = await _dead_rows(store, ids, allowed)
    now = clock.time()
    moved: dict[str, int] = {}
    for integration in sorted({row.integration for row in rows}):
        moved[integration] = await store.mark_discarded(
            [row.id for row in rows if row.integration == integration],
            by=by,
            at=now,
            integrations=frozenset({integration}),
        )
    return await _audited(store, Action.DISCARD, moved, by=by, description=description, at=now)


async def _dead_rows(
    store: DeadLetterStore, ids: Collection[str], allowed: frozenset[str] | None
) -> list[DeadLetterRow]:
    """The rows an action may touch: dead ones, of the integrations the actor may act on."""
    return [
        row
        for row in await store.get_many(list(ids))
        if row.status is Status.DEAD and (allowed is None or row.integration in allowed)
    ]


async def _audited(
    store: DeadLetterStore,
    action: Action,
    moved: dict[str, int],
    *,
    by: str,
    description: str,
    at: float,
) -> ActionResult:
    """Writes the audit entry of an action that touched rows, and reports it."""
    total = sum(moved.values())
    if total:
        await store.record_action(
            who=by,
            action=action,
            integrations=sorted(moved),
            count=total,
            description=description or f"{total} selected",
            at=at,
            counts=moved,
        )
    return ActionResult(action, total, moved)


async def matching_ids(
    store: DeadLetterStore, where: DeadLetterFilter, limit: int = MAX_SELECT_IDS
) -> Sequence[str]:
    """The ids of the dead rows a filter (or a group) covers, for a bulk action."""
    dead_only = DeadLetterFilter(
        integrations=where.integrations,
        reason=where.reason,
        status=Status.DEAD,
        http_status=where.http_status,
        signature=where.signature,
        since=where.since,
        until=where.until,
        text=where.text,
    )
    return await store.select_ids(dead_only, limit)
