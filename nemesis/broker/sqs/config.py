"""The configuration of one SQS-API queue read as a source.

Credentials are never in the file: the usual AWS chain finds them
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, a role).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from nemesis.config_base import Model

# SQS's own limits: a queue name, a batch, a long poll, a visibility timeout.
_QUEUE_NAME = r"^[A-Za-z0-9_-]{1,75}(\.fifo)?$"
MAX_BATCH = 10
MAX_WAIT_S = 20
MAX_VISIBILITY_S = 43_200


class SqsSourceConfig(Model):
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
    def _one_queue(self) -> SqsSourceConfig:
        if (self.queue is None) == (self.queue_url is None):
            raise ValueError("name the queue by `queue` (its name) or `queue_url`, one of them")
        return self

    @property
    def queue_label(self) -> str:
        """The queue's name, as messages carry it in ``topic``."""
        if self.queue is not None:
            return self.queue
        assert self.queue_url is not None
        return self.queue_url.rstrip("/").rsplit("/", 1)[-1]
