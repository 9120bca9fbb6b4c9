"""Turning a read message into the event a handler receives (docs/design.md, section 6)."""

from __future__ import annotations

from nemesis import tracecontext
from nemesis.broker.port import Message
from nemesis.config.models import IntegrationConfig
from nemesis.delivery.cloudevents import CloudRecord, cloud_record, is_structured
from nemesis.delivery.port import Event
from nemesis.topology import META_EVENT_ID
from nemesis.tracecontext import TraceContext

DEFAULT_EVENT_TYPE = "nemesis.message"

_CONTENT_TYPES = {
    "json": "application/json",
    "protobuf": "application/protobuf",
    "bytes": "application/octet-stream",
}


def event_id(message: Message) -> str:
    """Stable across retries and redeliveries: the handler's idempotency key.

    A message moved to a retry tier or replayed from the DLQ carries the id of
    its first appearance, so the handler sees one id per source message.
    """
    carried = message.metadata.get(META_EVENT_ID)
    if carried:
        return carried
    return f"{message.topic}:{message.partition}:{message.offset}"


def _cloud_record(message: Message, media: str | None) -> CloudRecord | None:
    """The CloudEvent a record is (binary or structured mode); None for any other record."""
    metadata = message.metadata
    if "ce_specversion" in metadata or (media is not None and is_structured(media)):
        return cloud_record(metadata, message.value, message.tombstone)
    return None


class EventFactory:
    """Builds events for one integration."""

    __slots__ = ("_content_type", "_forward", "_forward_order", "_type_key")

    def __init__(self, config: IntegrationConfig) -> None:
        self._type_key = config.source.type_key
        self._content_type = _CONTENT_TYPES[config.target.format]
        # The trace context is the event's ``trace``, continued or started, never copied as is.
        own = (tracecontext.TRACEPARENT, tracecontext.TRACESTATE)
        self._forward_order = tuple(n for n in config.source.forward_headers if n not in own)
        self._forward = frozenset(self._forward_order)

    def message_type(self, message: Message) -> str:
        return message.metadata.get(self._type_key) or DEFAULT_EVENT_TYPE

    def __call__(
        self,
        message: Message,
        attempt: int,
        payload: bytes | None = None,
        content_type: str | None = None,
        trace: TraceContext | None = None,
    ) -> Event:
        """The event of ``message``'s attempt; ``trace``: the one its earlier attempts had."""
        metadata = message.metadata
        if not metadata and not message.headers and not message.tombstone:
            # Most messages carry no metadata: no lookups (this runs for every delivery).
            return Event(
                message,
                f"{message.topic}:{message.partition}:{message.offset}",
                DEFAULT_EVENT_TYPE,
                attempt,
                content_type or self._content_type,
                payload,
                None,
                (),
                trace or tracecontext.start(),
            )
        forwarded = self._forwarded(message) if self._forward else ()
        media = metadata.get("content-type")
        record = _cloud_record(message, media)
        if record is not None:
            # A CloudEvent already: its own attributes, and its data (a structured
            # event's, unpacked) unless a pipeline made a payload of its own.
            attributes = record.attributes
            if payload is None and record.data is not None:
                payload = record.data
            elif payload is None:
                payload, content_type = b"", ""
            return Event(
                message=message,
                id=attributes["id"],
                type=attributes["type"],
                attempt=attempt,
                content_type=(
                    content_type
                    if content_type is not None
                    else attributes.get("datacontenttype") or self._content_type
                ),
                payload=payload,
                attributes=attributes,
                forwarded=forwarded,
                trace=trace
                or tracecontext.record_context(metadata, message.headers, attributes)
                or tracecontext.start(),
            )
        if message.tombstone and payload is None:
            payload, content_type = b"", ""  # no data: no body, no content type
        return Event(
            message=message,
            id=event_id(message),
            type=metadata.get(self._type_key) or DEFAULT_EVENT_TYPE,
            attempt=attempt,
            content_type=content_type if content_type is not None else media or self._content_type,
            payload=payload,
            forwarded=forwarded,
            trace=trace
            or tracecontext.record_context(metadata, message.headers)
            or tracecontext.start(),
        )

    def trace_of(self, message: Message) -> TraceContext:
        """The trace the event of ``message`` continues: the record's own, or a new one."""
        metadata = message.metadata
        if not metadata and not message.headers:
            return tracecontext.start()
        media = metadata.get("content-type")
        record = _cloud_record(message, media)
        attributes = None if record is None else record.attributes
        return (
            tracecontext.record_context(metadata, message.headers, attributes)
            or tracecontext.start()
        )

    def _forwarded(self, message: Message) -> tuple[tuple[str, bytes], ...]:
        """The producer's headers a handler receives, in order (a null value never).

        A Kafka header's name matches whatever its case; a metadata key (YDB,
        the embedded log) as it is written, lowercase.
        """
        forward = self._forward
        if message.headers:
            return tuple(
                (lowered, value)
                for name, value in message.headers
                if value is not None and (lowered := name.lower()) in forward
            )
        metadata = message.metadata
        if forward.isdisjoint(metadata):
            return ()  # most messages: one set operation in C
        return tuple((n, metadata[n].encode()) for n in self._forward_order if n in metadata)
