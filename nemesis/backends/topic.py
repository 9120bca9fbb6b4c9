"""The ``topic`` source kind, the default: a topic of the process's log backend (``backend:``).

An integration whose ``source:`` has no ``kind`` reads this way: its
consumer's reader of ``source.topic`` on the process's broker, seen as a
source with the log's commit rule (``nemesis.broker.logsource``).
``start_from`` says where a consumer that never committed starts.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator

from nemesis.backends.base import SourceContext, SourceKind, SourceModel
from nemesis.broker.port import StartFrom
from nemesis.config_base import parse_duration

if TYPE_CHECKING:
    from nemesis.broker.source import Source

START_FROM_HELP = (
    "earliest, latest, a time with its zone (2026-12-01T09:00:00Z) or a duration back"
    " from now (-1h, -30m, -2d)"
)


def parse_start_from(value: Any) -> str:
    """Checks a ``start_from`` value (see ``START_FROM_HELP``); returns it as written."""
    if not isinstance(value, str):
        # pydantic turns only ValueError into a validation error.
        raise ValueError(f"expected {START_FROM_HELP}, got {value!r}")  # noqa: TRY004
    text = value.strip()
    if text in ("earliest", "latest"):
        return text
    if text.startswith("-"):
        try:
            parse_duration(text[1:])
        except ValueError:
            raise ValueError(f"expected {START_FROM_HELP}, got {value!r}") from None
        return text
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"expected {START_FROM_HELP}, got {value!r}") from None
    if moment.tzinfo is None:
        raise ValueError(f"{value!r} has no zone: add Z or +03:00, so it means one moment")
    return text


def start_from_at(text: str, now: float) -> StartFrom:
    """The position a checked ``start_from`` names; a duration is counted back from ``now``."""
    text = parse_start_from(text)
    if text in ("earliest", "latest"):
        return StartFrom(text)  # type: ignore[arg-type]  # one of the two literals
    if text.startswith("-"):
        return StartFrom("time", now - parse_duration(text[1:]))
    return StartFrom("time", datetime.datetime.fromisoformat(text).timestamp())


class TopicSourceConfig(SourceModel):
    """``source:`` of the ``topic`` kind: ``topic`` is read on the process's backend."""

    kind: Literal["topic"] = "topic"
    # Where the consumer starts on partitions it never committed (the retry tier and
    # replay flows always start at earliest): see ``START_FROM_HELP``. A duration
    # counts back from when the integration starts reading.
    start_from: Annotated[str, BeforeValidator(parse_start_from)] = "earliest"

    on_backend: ClassVar[bool] = True

    def start_position(self, now: float) -> StartFrom:
        """``start_from`` as the broker port takes it."""
        return start_from_at(self.start_from, now)


async def open_topic_source(config: SourceModel, context: SourceContext) -> Source:
    from nemesis.broker.logsource import log_source

    assert isinstance(config, TopicSourceConfig)  # chosen by kind
    clock = context.clock
    opener = log_source(
        context.broker,
        config.topic,
        config.consumer,
        start_from=lambda: config.start_position(clock.time()),
    )
    return await opener()


TOPIC = SourceKind("topic", TopicSourceConfig, open_topic_source)
