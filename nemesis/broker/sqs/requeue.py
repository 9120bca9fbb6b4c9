"""Requeue of a queue's dead letters: back to the queue they came from (SendMessage).

A dead letter of an SQS source keeps the queue's address in its metadata
(``SqsSource.return_address``); ``send_back`` sends each letter there with
the credentials of the AWS chain of the process that requeues. The message
carries its event id as the ``nemesis-event-id`` attribute, so that it is the
same event to the handler and, if it fails again, the same DLQ row. Its
attributes are the producer's as they were read (the source's own, the
``sqs-*`` names, are not sent), then the trace context while SQS's ten
attributes leave room. On a FIFO queue it goes to its message group again,
with a deduplication id of its own: a requeue is a new send, never taken for
a duplicate of the first.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Sequence

from nemesis.backends.sqs import META_ENDPOINT_URL, META_QUEUE_URL, META_REGION
from nemesis.broker.sqs.config import SqsSourceConfig
from nemesis.broker.sqs.source import MAX_ATTRIBUTES, META_EVENT_ID, OWN_METADATA, open_sqs_source
from nemesis.dlq.port import DeadLetterRow
from nemesis.errors import BrokerError

_TRACE = ("traceparent", "tracestate")  # sent while there is room, the parent first


def attributes_of(row: DeadLetterRow) -> dict[str, str]:
    """The message attributes a requeued letter carries (at most SQS's ten while it can)."""
    attributes = {META_EVENT_ID: row.event_id} | {
        name: value
        for name, value in row.metadata.items()
        if name not in OWN_METADATA and name not in _TRACE and name != META_EVENT_ID
    }
    for name in _TRACE:
        if name in row.metadata and len(attributes) < MAX_ATTRIBUTES:
            attributes[name] = row.metadata[name]
    return attributes


async def send_back(rows: Sequence[DeadLetterRow]) -> tuple[list[str], BrokerError | None]:
    """Sends each row to its queue: the ids of the rows sent, and the error that stopped it.

    A row that cannot be sent (its queue is gone, a body that is not text)
    stops the requeue there; the rows sent before it are returned, for the
    caller to mark.
    """
    by_queue: dict[tuple[str, str, str | None], list[DeadLetterRow]] = defaultdict(list)
    for row in rows:
        meta = row.metadata
        address = (meta[META_QUEUE_URL], meta.get(META_REGION, "us-east-1"))
        by_queue[(*address, meta.get(META_ENDPOINT_URL))].append(row)
    sent: list[str] = []
    for (url, region, endpoint), letters in by_queue.items():
        config = SqsSourceConfig(queue_url=url, region=region, endpoint_url=endpoint)
        try:
            queue = await open_sqs_source(config)
        except BrokerError as exc:
            return sent, exc
        try:
            for row in letters:
                try:
                    await queue.send(
                        row.payload,
                        attributes_of(row),
                        group_id=row.key,
                        deduplication_id=secrets.token_hex(16),
                    )
                except BrokerError as exc:
                    return sent, BrokerError(f"dead letter {row.id}: {exc}")
                sent.append(row.id)
        finally:
            await queue.close()
    return sent, None
