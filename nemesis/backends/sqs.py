"""The ``sqs`` source kind: one SQS-API queue (Amazon SQS, Yandex Message Queue) (docs/sqs.md).

The queue's fields are ``SqsQueueConfig``; ``SqsSourceConfig`` is them in an
integration's ``source:`` block, where ``topic`` (the name messages, metrics,
retries and dead letters carry) is the queue's name unless given. The queue
is not on the process's backend: retry tiers and replay live there under
``consumer``. The factory imports ``nemesis.broker.sqs`` (aiobotocore, the
``sqs`` extra) only when it opens a queue. Credentials are never in the file:
the usual AWS chain finds them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
a profile, a role).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from nemesis.backends.base import SourceContext, SourceKind, SourceModel
from nemesis.config_base import Model

if TYPE_CHECKING:
    from nemesis.broker.source import Source

# SQS's own limits: a queue name, a batch, a long poll, a visibility timeout.
_QUEUE_NAME = r"^[A-Za-z0-9_-]{1,75}(\.fifo)?$"
MAX_BATCH = 10
MAX_WAIT_S = 20
MAX_VISIBILITY_S = 43_200
ONE_QUEUE = "name the queue by `queue` (its name) or `queue_url`, one of them"
# Where a dead letter of a queue came from, kept in its metadata for the requeue
# (``nemesis.broker.sqs.requeue``) that sends it back there.
META_QUEUE_URL = "sqs-queue-url"
META_REGION = "sqs-region"
META_ENDPOINT_URL = "sqs-endpoint-url"


class SqsQueueConfig(Model):
    """Where the queue is and how it is read (docs/sqs.md)."""

    queue: Annotated[str, Field(pattern=_QUEUE_NAME)] | None = None
    queue_url: Annotated[str, Field(pattern=r"^https?://\S+$")] | None = None
    # None: the SDK's endpoint for the region (Amazon SQS); Yandex Message Queue:
    # https://message-queue.api.cloud.yandex.net, region ru-central1.
    endpoint_url: Annotated[str, Field(pattern=r"^https?://\S+$")] | None = None
    region: Annotated[str, Field(pattern=r"^[a-z0-9-]{1,40}$")] = "us-east-1"
    # How long a received message stays hidden; extended while it is in flight.
    visibility_timeout_s: Annotated[int, Field(ge=2, le=MAX_VISIBILITY_S)] = 30
    # The longest wait of one receive (a long poll; 0 polls without waiting).
    wait_time_s: Annotated[int, Field(ge=0, le=MAX_WAIT_S)] = MAX_WAIT_S
    request_timeout_s: Annotated[float, Field(gt=0, le=300)] = 30.0

    @model_validator(mode="after")
    def _one_queue(self) -> SqsQueueConfig:
        if (self.queue is None) == (self.queue_url is None):
            raise ValueError(ONE_QUEUE)
        return self

    @property
    def queue_label(self) -> str:
        """The queue's name, as messages carry it in ``topic``."""
        if self.queue is not None:
            return self.queue
        assert self.queue_url is not None
        return _name_in_url(self.queue_url)


def _name_in_url(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


class SqsSourceConfig(SourceModel, SqsQueueConfig):
    """``source:`` of the ``sqs`` kind: a queue; ``topic`` defaults to the queue's name."""

    kind: Literal["sqs"] = "sqs"

    on_backend: ClassVar[bool] = False
    # Released by its visibility timeout, which SQS caps at 12 hours.
    max_release_delay_s: ClassVar[float | None] = float(MAX_VISIBILITY_S)

    @model_validator(mode="before")
    @classmethod
    def _topic_is_the_queue(cls, data: Any) -> Any:
        if isinstance(data, dict) and "topic" not in data:
            queue, url = data.get("queue"), data.get("queue_url")
            if isinstance(queue, str):
                return {**data, "topic": queue}
            if isinstance(url, str):
                return {**data, "topic": _name_in_url(url)}
            if queue is None and url is None:
                raise ValueError(ONE_QUEUE)
        return data


async def open_sqs(config: SourceModel, context: SourceContext) -> Source:
    try:
        from nemesis.broker.sqs import open_sqs_source
    except ImportError as exc:
        raise RuntimeError(
            f"integration {context.integration}: an sqs source needs aiobotocore:"
            " pip install 'nemesis[sqs]'"
        ) from exc

    assert isinstance(config, SqsSourceConfig)  # chosen by kind
    return await open_sqs_source(config)


SQS = SourceKind("sqs", SqsSourceConfig, open_sqs)
