"""The topics Nemesis owns and the metadata it writes on them: names both sides agree on.

Each integration has its own retry tier topics (``nemesis.retry.<integration>.<n>``)
and replay topic (``nemesis.replay.<integration>``), which its flows read as the
consumer ``nemesis.internal.<integration>``: a name of their own, never the main
flow's (on Kafka a consumer is a group across topics, and a group with members
reading one topic cannot be registered on another from outside it; names
starting with ``nemesis.`` are refused as a source's consumer). A message Nemesis writes
to one of them carries the original bytes and metadata plus the ``nemesis-*``
keys below. The proxy's flows read these topics; the DLQ's requeue path (the
CLI, the viewer) writes to the replay topics. Both take the names from here,
so a viewer that runs apart from the proxy needs nothing of the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping

from nemesis.broker.port import ConsumerSpec, Headers, OutgoingMessage, TopicAdmin

# Metadata keys Nemesis itself writes (retry tiers, replays); producers should not use them.
META_PREFIX = "nemesis-"
META_EVENT_ID = "nemesis-event-id"
META_SOURCE_TOPIC = "nemesis-source-topic"
META_SOURCE_PARTITION = "nemesis-source-partition"
META_SOURCE_OFFSET = "nemesis-source-offset"
META_ATTEMPTS = "nemesis-attempts"  # deliveries tried so far
META_DUE_AT = "nemesis-due-at"  # Unix seconds: not before
META_FIRST_FAILURE_AT = "nemesis-first-failure-at"
META_LAST_ERROR = "nemesis-last-error"
META_LAST_STATUS = "nemesis-last-status"
META_STAGE = "nemesis-stage"
META_TIER = "nemesis-tier"
META_REPLAY = "nemesis-replay"  # set on messages requeued from the DLQ
# A trace context Nemesis started (the record carried none): nemesis.tracecontext.
META_TRACEPARENT = "nemesis-traceparent"
META_TRACESTATE = "nemesis-tracestate"
# The span of the attempt that dead-lettered a message (a traceparent; recorded spans
# only): a requeued message's attempt spans link to it (nemesis.runtime.tracing).
META_LAST_SPAN = "nemesis-last-span"
# Bookkeeping a requeue keeps: the started trace goes on through the replay, linked to
# the attempt that gave up.
_KEPT_BY_REPLAY = (META_TRACEPARENT, META_TRACESTATE, META_LAST_SPAN)


def tier_topic(integration: str, tier: int) -> str:
    """The topic of retry tier ``tier`` (1-based) of an integration."""
    return f"nemesis.retry.{integration}.{tier}"


def replay_topic(integration: str) -> str:
    """The topic requeued dead letters of an integration go through."""
    return f"nemesis.replay.{integration}"


def internal_consumer(integration: str) -> str:
    """The consumer an integration's retry tier and replay flows read their topics as."""
    return f"nemesis.internal.{integration}"


async def register_internal(admin: TopicAdmin, topic: str, integration: str) -> bool:
    """Registers the internal consumer on one of the integration's own topics; True if new.

    Where the topic was read before as the consumer named like the integration
    (the internal flows' consumer of Nemesis up to 0.x, the main flow's on
    Kafka), the new consumer starts at that consumer's committed offsets, so an
    upgrade neither reads a retry tier again from its start nor skips it.
    """
    consumer = internal_consumer(integration)
    described = await admin.describe_topic(topic)
    if consumer in described.consumers:
        return False
    await admin.add_consumer(topic, ConsumerSpec(consumer))
    if integration in described.consumers:
        for partition in described.partitions:
            offset = partition.committed.get(integration, partition.start_offset)
            if offset > partition.start_offset:
                await admin.seek(topic, consumer, partition.partition, offset)
    return True


def is_internal(topic: str) -> bool:
    """Whether ``topic`` is one of Nemesis' own: a retry tier or a replay topic."""
    return topic.startswith(("nemesis.retry.", "nemesis.replay."))


def replay_message(
    payload: bytes,
    *,
    event: str,
    key: str | None,
    metadata: Mapping[str, str],
    source_topic: str,
    source_partition: int,
    source_offset: int,
    headers: Headers = (),
    tombstone: bool = False,
) -> OutgoingMessage:
    """A dead letter on its way back to its integration's replay topic, as it was read."""
    meta = {
        k: v for k, v in metadata.items() if not k.startswith(META_PREFIX) or k in _KEPT_BY_REPLAY
    }
    meta[META_EVENT_ID] = event
    meta[META_SOURCE_TOPIC] = source_topic
    meta[META_SOURCE_PARTITION] = str(source_partition)
    meta[META_SOURCE_OFFSET] = str(source_offset)
    meta[META_REPLAY] = "1"
    return OutgoingMessage(
        value=payload, key=key, metadata=meta, headers=headers, tombstone=tombstone
    )
