"""One queue described without reading it: ``nemesis queues describe`` and ``validate --online``.

GetQueueUrl and GetQueueAttributes only: nothing is received, so nothing is
hidden from the readers, and read-only credentials are enough.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nemesis.broker.sqs.config import SqsSourceConfig
from nemesis.broker.sqs.errors import sqs_call

if TYPE_CHECKING:
    from types_aiobotocore_sqs import SQSClient


@dataclass(frozen=True, slots=True)
class QueueDescription:
    """What a queue says about itself (SQS's counts are approximate)."""

    name: str
    url: str
    fifo: bool
    visible: int
    in_flight: int
    delayed: int
    visibility_timeout_s: int
    retention_s: int | None
    max_message_bytes: int | None
    delay_s: int
    receive_wait_s: int
    redrive_policy: Mapping[str, Any] | None  # the queue's own DLQ: it races Nemesis' DLQ

    def as_dict(self) -> dict[str, Any]:
        """The description as JSON-ready values."""
        return {
            "name": self.name,
            "url": self.url,
            "fifo": self.fifo,
            "visible": self.visible,
            "in_flight": self.in_flight,
            "delayed": self.delayed,
            "visibility_timeout_s": self.visibility_timeout_s,
            "retention_s": self.retention_s,
            "max_message_bytes": self.max_message_bytes,
            "delay_s": self.delay_s,
            "receive_wait_s": self.receive_wait_s,
            "redrive_policy": None if self.redrive_policy is None else dict(self.redrive_policy),
        }


def _int(attributes: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = attributes.get(name)
    try:
        return default if value is None else int(value)
    except ValueError:
        return default


def description_of(name: str, url: str, attributes: Mapping[str, str]) -> QueueDescription:
    """The description of a queue from its GetQueueAttributes answer."""
    text = attributes.get("RedrivePolicy")
    policy: Mapping[str, Any] | None = None
    if text:
        try:
            loaded = json.loads(text)
        except ValueError:
            loaded = None
        policy = loaded if isinstance(loaded, dict) else {"raw": text}
    return QueueDescription(
        name=name,
        url=url,
        fifo=attributes.get("FifoQueue") == "true" or name.endswith(".fifo"),
        visible=_int(attributes, "ApproximateNumberOfMessages", 0) or 0,
        in_flight=_int(attributes, "ApproximateNumberOfMessagesNotVisible", 0) or 0,
        delayed=_int(attributes, "ApproximateNumberOfMessagesDelayed", 0) or 0,
        visibility_timeout_s=_int(attributes, "VisibilityTimeout", 30) or 0,
        retention_s=_int(attributes, "MessageRetentionPeriod", None),
        max_message_bytes=_int(attributes, "MaximumMessageSize", None),
        delay_s=_int(attributes, "DelaySeconds", 0) or 0,
        receive_wait_s=_int(attributes, "ReceiveMessageWaitTimeSeconds", 0) or 0,
        redrive_policy=policy,
    )


async def describe_queue(config: SqsSourceConfig) -> QueueDescription:
    """The queue's URL, kind, counts and settings; BrokerErrors say what is wrong."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    name = config.queue_label
    where = f"queue {name} at {config.endpoint_url or config.region}"
    timeout_s = config.request_timeout_s
    async with AsyncExitStack() as exits:
        client: SQSClient = await exits.enter_async_context(
            get_session().create_client(
                "sqs",
                region_name=config.region,
                endpoint_url=config.endpoint_url,
                config=AioConfig(
                    connect_timeout=min(timeout_s, 10),
                    read_timeout=timeout_s,
                    retries={"max_attempts": 2, "mode": "standard"},
                ),
            )
        )
        url = config.queue_url
        if url is None:
            answer = await sqs_call(where, client.get_queue_url(QueueName=name), timeout_s)
            url = answer["QueueUrl"]
        found = await sqs_call(
            f"{where}: GetQueueAttributes",
            client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"]),
            timeout_s,
        )
    attributes = {str(k): str(v) for k, v in found.get("Attributes", {}).items()}
    return description_of(name, url, attributes)


def format_description(description: QueueDescription, integration: str | None = None) -> str:
    """The description as ``nemesis topics describe`` prints a topic: a few aligned lines."""
    policy = description.redrive_policy
    if policy is None:
        redrive = "none"
    else:
        target = policy.get("deadLetterTargetArn", policy.get("raw", "?"))
        redrive = (
            f"to {target} after {policy.get('maxReceiveCount', '?')} receives"
            " (races Nemesis' retries and DLQ: remove it)"
        )
    retention = "?" if description.retention_s is None else f"{description.retention_s}s"
    size = "?" if description.max_message_bytes is None else f"{description.max_message_bytes}"
    rows = [
        ("queue", f"{description.name}  {'FIFO' if description.fifo else 'standard'}"),
        ("url", description.url),
        ("visible", str(description.visible)),
        ("in flight", str(description.in_flight)),
        ("delayed", str(description.delayed)),
        ("visibility timeout", f"{description.visibility_timeout_s}s"),
        ("retention", retention),
        ("max message bytes", size),
        ("delay", f"{description.delay_s}s"),
        ("receive wait", f"{description.receive_wait_s}s"),
        ("redrive policy", redrive),
    ]
    if integration is not None:
        rows.insert(0, ("integration", integration))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows) + "\n"
