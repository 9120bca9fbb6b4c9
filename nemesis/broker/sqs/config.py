"""The configuration of one SQS-API queue read as a source (``nemesis.backends.sqs``)."""

from __future__ import annotations

from nemesis.backends.sqs import MAX_BATCH, MAX_VISIBILITY_S, MAX_WAIT_S
from nemesis.backends.sqs import SqsQueueConfig as SqsSourceConfig

__all__ = ["MAX_BATCH", "MAX_VISIBILITY_S", "MAX_WAIT_S", "SqsSourceConfig"]
