"""Turning a read message into the event a handler receives (DESIGN.md section 6)."""

from __future__ import annotations

from nemesis.broker.port import Message
from nemesis.config.models import IntegrationConfig
from nemesis.delivery.port import Event
from nemesis.topology import META_EVENT_ID

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


class EventFactory:
    """Builds events for one integration."""

    __slots__ = ("_content_type", "_type_key")

    def __init__(self, config: IntegrationConfig) -> None:
        self._type_key = config.source.type_key
        self._content_type = _CONTENT_TYPES[config.target.format]

    def message_type(self, message: Message) -> str:
        return message.metadata.get(self._type_key) or DEFAULT_EVENT_TYPE

    def __call__(
        self,
        message: Message,
        attempt: int,
        payload: bytes | None = None,
        content_type: str | None = None,
    ) -> Event:
        metadata = message.metadata
        if not metadata:
            # Most messages carry no metadata: no lookups (this runs for every delivery).
            return Event(
                message,
                f"{message.topic}:{message.partition}:{message.offset}",
                DEFAULT_EVENT_TYPE,
                attempt,
                content_type or self._content_type,
                payload,
            )
        return Event(
            message=message,
            id=event_id(message),
            type=metadata.get(self._type_key) or DEFAULT_EVENT_TYPE,
            attempt=attempt,
            content_type=content_type or metadata.get("content-type") or self._content_type,
            payload=payload,
        )
