"""SQS-API queues as sources: Amazon SQS, Yandex Message Queue, YDB's SQS endpoint (docs/sqs.md).

``SqsSource`` implements ``broker.source.Source`` (``AckOrder.ANY``) and
``Releases``. The client is aiobotocore (the ``sqs`` extra): async on the
aiohttp the proxy already runs, so a 20 s long poll holds a socket, not a
thread. aiobotocore is imported only when a source is opened.
"""

from nemesis.broker.sqs.config import SqsSourceConfig
from nemesis.broker.sqs.describe import QueueDescription, describe_queue, format_description
from nemesis.broker.sqs.source import (
    META_MESSAGE_ID,
    META_RECEIVE_COUNT,
    META_SENT_AT,
    QueueStats,
    SqsSource,
    open_sqs_source,
)

__all__ = [
    "META_MESSAGE_ID",
    "META_RECEIVE_COUNT",
    "META_SENT_AT",
    "QueueDescription",
    "QueueStats",
    "SqsSource",
    "SqsSourceConfig",
    "describe_queue",
    "format_description",
    "open_sqs_source",
]
