"""One SQS-API queue as a source: receive, delete each finished message, release the rest.

The acknowledgement contract of a queue (``AckOrder.ANY``): a received
message is hidden for ``visibility_timeout_s``; deleting it by its receipt
handle acknowledges it, in whatever order messages finish. While a message
is in flight the source extends its visibility on a timer (a slow handler
does not see it delivered twice); a message the source stops extending (the
process died) becomes visible again when its timeout runs out, and another
reader receives it with its receive count grown by one. ``release`` hands a
message back now (delay 0) or after a delay: a retry without tier topics.

Messages (``broker.port.Message``): ``topic`` is the queue's name,
``partition`` 0, ``offset`` a counter of this source (never a position),
``key`` the FIFO message group, ``written_at`` the queue's SentTimestamp.
``metadata`` holds the message attributes (String and Number as they are,
Binary as base64) and the source's own, under these names:

* ``sqs-message-id``: the queue's message id, the same on every redelivery;
  it is also the event id (``nemesis-event-id``, so ``ce-id``) unless the
  message carries one of Nemesis' own (a message requeued from the DLQ).
* ``sqs-receive-count``: ApproximateReceiveCount, 1 on the first receive.
* ``sqs-sent-at``: SentTimestamp, Unix milliseconds.
* ``sqs-message-group-id``, ``sqs-sequence-number``: a FIFO queue's.

A dead letter of the queue keeps where it came from (``return_address``):
``sqs-queue-url``, ``sqs-region`` and, where set, ``sqs-endpoint-url``, so
that a requeue (``nemesis.broker.sqs.requeue``) sends it back to the queue.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nemesis.backends.sqs import META_ENDPOINT_URL, META_QUEUE_URL, META_REGION
from nemesis.broker.port import Message, PartitionSession, build_message
from nemesis.broker.source import AckOrder
from nemesis.broker.sqs.config import MAX_BATCH, MAX_VISIBILITY_S, SqsSourceConfig
from nemesis.broker.sqs.errors import sqs_call, sqs_error
from nemesis.errors import BrokerError

if TYPE_CHECKING:
    from types_aiobotocore_sqs import SQSClient

log = logging.getLogger(__name__)

META_MESSAGE_ID = "sqs-message-id"
META_RECEIVE_COUNT = "sqs-receive-count"
META_SENT_AT = "sqs-sent-at"
META_GROUP_ID = "sqs-message-group-id"
META_SEQUENCE_NUMBER = "sqs-sequence-number"
META_EVENT_ID = "nemesis-event-id"  # nemesis.topology's name, which sits a layer above
# What the source sets itself: never sent back to a queue as a message attribute.
OWN_METADATA = frozenset(
    {
        META_MESSAGE_ID,
        META_RECEIVE_COUNT,
        META_SENT_AT,
        META_GROUP_ID,
        META_SEQUENCE_NUMBER,
        META_QUEUE_URL,
        META_REGION,
        META_ENDPOINT_URL,
    }
)

# SQS's limits on one message: body and attributes together, and attributes.
MAX_MESSAGE_BYTES = 262_144
MAX_ATTRIBUTES = 10


@dataclass(frozen=True, slots=True)
class QueueSession:
    """The source's one session: alive from open to close."""

    topic: str
    partition: int
    id: int
    source: SqsSource

    @property
    def alive(self) -> bool:
        return not self.source.closed


@dataclass(frozen=True, slots=True)
class QueueStats:
    """A queue's counts as SQS reports them (approximate), and what this source knows itself."""

    queue: str
    visible: int
    in_flight: int
    delayed: int
    fifo: bool
    redrive_policy: Mapping[str, Any] | None  # the queue's own DLQ: it races Nemesis' DLQ
    visibility_timeout_s: int
    held_here: int  # received by this source and not finished
    oldest_held_age_s: float | None  # since the oldest of those was sent
    since_last_receive_s: float | None


@dataclass(slots=True)
class _Held:
    receipt: str
    sent_at: float
    visible_until: float  # monotonic


class SqsSource:
    """An SQS-API queue read as a source (``Source``, ``AckOrder.ANY``) that ``Releases``."""

    max_release_delay_s: float = float(MAX_VISIBILITY_S)

    def __init__(
        self,
        config: SqsSourceConfig,
        client: SQSClient,
        queue_url: str,
        attributes: Mapping[str, str],
        exits: AsyncExitStack,
    ) -> None:
        self.config = config
        self.queue_url = queue_url
        self.name = config.queue_label
        self.fifo = attributes.get("FifoQueue") == "true" or self.name.endswith(".fifo")
        self.redrive_policy = _redrive(attributes)
        self._client = client
        self._exits = exits
        self._session = QueueSession(self.name, 0, 1, self)
        self._offsets = itertools.count()
        self._held: dict[int, _Held] = {}
        self._poll: asyncio.Task[list[Message]] | None = None
        self._interrupted = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._extender: asyncio.Task[None] | None = None
        self._last_receive: float | None = None
        self.closed = False
        if self.redrive_policy is not None:
            log.warning(
                "queue %s has its own redrive policy %s: it moves messages to its dead-letter"
                " queue after maxReceiveCount receives, racing Nemesis' retries and DLQ",
                self.name,
                json.dumps(dict(self.redrive_policy)),
            )

    @property
    def ack_order(self) -> AckOrder:
        return AckOrder.ANY

    def _timeout(self, extra_s: float = 0.0) -> float:
        return self.config.request_timeout_s + extra_s

    # -- receiving ---------------------------------------------------------------

    async def receive(self, max_messages: int, timeout_s: float) -> Sequence[Message]:
        """Up to ``max_messages`` (one long poll, then quick ones while batches come full)."""
        if self.closed:
            raise BrokerError(f"queue {self.name}: the source is closed")
        self._interrupted.clear()
        if self._extender is None:
            self._extender = asyncio.create_task(self._extend_forever())
        deadline = asyncio.get_running_loop().time() + timeout_s
        if not self._resumed.is_set():
            await self._wait_any(self._resumed.wait(), timeout_s)
            if not self._resumed.is_set():
                return []
        if self._poll is None:
            wait_s = min(self.config.wait_time_s, max(0, math.ceil(timeout_s)))
            self._poll = asyncio.create_task(
                self._receive_batch(min(max_messages, MAX_BATCH), wait_s)
            )
        remaining = deadline - asyncio.get_running_loop().time()
        await self._wait_any(asyncio.shield(self._poll), max(0.0, remaining))
        if not self._poll.done():
            return []  # the poll goes on; what it receives is the next receive's
        poll, self._poll = self._poll, None
        messages = poll.result()  # raises the poll's BrokerError
        while len(messages) < max_messages and len(messages) % MAX_BATCH == 0 and messages:
            more = await self._receive_batch(min(max_messages - len(messages), MAX_BATCH), 0)
            messages.extend(more)
            if not more:
                break
        return messages

    async def _wait_any(self, awaitable: Any, timeout_s: float) -> None:
        waiter = asyncio.ensure_future(awaitable)
        interrupted = asyncio.ensure_future(self._interrupted.wait())
        try:
            await asyncio.wait({waiter, interrupted}, timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            for task in (waiter, interrupted):
                task.cancel()

    async def _receive_batch(self, count: int, wait_s: int) -> list[Message]:
        answer = await sqs_call(
            f"queue {self.name}: ReceiveMessage",
            self._client.receive_message(
                QueueUrl=self.queue_url,
                MaxNumberOfMessages=max(1, count),
                WaitTimeSeconds=wait_s,
                VisibilityTimeout=self.config.visibility_timeout_s,
                MessageSystemAttributeNames=["All"],
                MessageAttributeNames=["All"],
            ),
            self._timeout(wait_s),
        )
        now = time.monotonic()
        self._last_receive = now
        messages = []
        for raw in answer.get("Messages", []):
            offset = next(self._offsets)
            message = self._message(raw, offset)
            self._held[offset] = _Held(
                raw["ReceiptHandle"], message.written_at, now + self.config.visibility_timeout_s
            )
            messages.append(message)
        return messages

    def _message(self, raw: Any, offset: int) -> Message:
        system = raw.get("Attributes", {})
        metadata: dict[str, str] = {}
        for name, attribute in raw.get("MessageAttributes", {}).items():
            if "StringValue" in attribute:
                metadata[name] = attribute["StringValue"]
            elif "BinaryValue" in attribute:
                metadata[name] = base64.b64encode(attribute["BinaryValue"]).decode()
        message_id = raw["MessageId"]
        metadata.setdefault(META_EVENT_ID, message_id)
        metadata[META_MESSAGE_ID] = message_id
        metadata[META_RECEIVE_COUNT] = system.get("ApproximateReceiveCount", "1")
        sent_ms = system.get("SentTimestamp")
        if sent_ms is not None:
            metadata[META_SENT_AT] = sent_ms
        group = system.get("MessageGroupId")
        if group is not None:
            metadata[META_GROUP_ID] = group
        if "SequenceNumber" in system:
            metadata[META_SEQUENCE_NUMBER] = system["SequenceNumber"]
        return build_message(
            self.name,
            0,
            offset,
            raw.get("Body", "").encode("utf-8"),
            group,
            metadata,
            None,
            None,
            0.0,
            int(sent_ms) / 1000 if sent_ms is not None else 0.0,
            self._session,
        )

    # -- finishing ---------------------------------------------------------------

    def _receipts(self, messages: Sequence[Message]) -> list[tuple[int, str]]:
        """The held messages of ``messages``, taken out of the table (a dead delivery's left)."""
        taken = []
        for message in messages:
            if message.session is not self._session:
                continue
            held = self._held.pop(message.offset, None)
            if held is not None:
                taken.append((message.offset, held.receipt))
        return taken

    async def commit(self, messages: Sequence[Message]) -> None:
        """Deletes finished messages, ten to a call; a stale receipt is a redelivery, no error."""
        receipts = self._receipts(messages)
        await asyncio.gather(
            *(self._delete(receipts[i : i + MAX_BATCH]) for i in range(0, len(receipts), MAX_BATCH))
        )

    async def _delete(self, chunk: list[tuple[int, str]]) -> None:
        answer = await sqs_call(
            f"queue {self.name}: DeleteMessageBatch",
            self._client.delete_message_batch(
                QueueUrl=self.queue_url,
                Entries=[{"Id": str(o), "ReceiptHandle": r} for o, r in chunk],
            ),
            self._timeout(),
        )
        self._failed("DeleteMessageBatch", answer)

    async def release(self, messages: Sequence[Message], delay_s: float) -> None:
        """Makes ``messages`` visible again after ``delay_s`` (0: now), unacknowledged."""
        visibility = min(MAX_VISIBILITY_S, max(0, math.ceil(delay_s)))
        held = {m.offset: self._held[m.offset] for m in messages if m.offset in self._held}
        receipts = self._receipts(messages)
        try:
            await asyncio.gather(
                *(
                    self._change_visibility(receipts[i : i + MAX_BATCH], visibility)
                    for i in range(0, len(receipts), MAX_BATCH)
                )
            )
        except BrokerError:
            # Not released: still held, and extended until it finishes another way.
            if not self.closed:
                self._held.update(held)
            raise

    def attempt(self, message: Message) -> int:
        """The message's receive count: 1 on its first receive, grown by each release."""
        try:
            return max(1, int(message.metadata.get(META_RECEIVE_COUNT, "1")))
        except ValueError:
            return 1

    def return_address(self) -> Mapping[str, str]:
        """Where a dead letter of this queue is sent back to (``nemesis.broker.sqs.requeue``)."""
        address = {META_QUEUE_URL: self.queue_url, META_REGION: self.config.region}
        if self.config.endpoint_url is not None:
            address[META_ENDPOINT_URL] = self.config.endpoint_url
        return address

    async def _change_visibility(self, chunk: list[tuple[int, str]], visibility_s: int) -> None:
        answer = await sqs_call(
            f"queue {self.name}: ChangeMessageVisibilityBatch",
            self._client.change_message_visibility_batch(
                QueueUrl=self.queue_url,
                Entries=[
                    {"Id": str(o), "ReceiptHandle": r, "VisibilityTimeout": visibility_s}
                    for o, r in chunk
                ],
            ),
            self._timeout(),
        )
        self._failed("ChangeMessageVisibilityBatch", answer)

    def _failed(self, call: str, answer: Any) -> None:
        for failure in answer.get("Failed", []):
            # A receipt that expired: the message went back to the queue and comes again.
            log.warning(
                "queue %s: %s refused message %s: %s: %s",
                self.name,
                call,
                failure.get("Id"),
                failure.get("Code"),
                failure.get("Message"),
            )

    async def _extend_forever(self) -> None:
        """Extends the visibility of held messages before it runs out (every third of it)."""
        timeout_s = self.config.visibility_timeout_s
        period_s = max(0.5, timeout_s / 3)
        while not self.closed:
            await asyncio.sleep(period_s)
            soon = time.monotonic() + 2 * period_s
            due = [(o, h.receipt) for o, h in self._held.items() if h.visible_until <= soon]
            for i in range(0, len(due), MAX_BATCH):
                chunk = due[i : i + MAX_BATCH]
                try:
                    await self._change_visibility(chunk, timeout_s)
                except BrokerError as exc:
                    log.warning("queue %s: visibility not extended: %s", self.name, exc)
                    continue
                until = time.monotonic() + timeout_s
                for offset, _ in chunk:
                    if (held := self._held.get(offset)) is not None:
                        held.visible_until = until

    # -- flow control and state --------------------------------------------------

    def pause(self, session: PartitionSession) -> None:
        self._resumed.clear()
        self._interrupted.set()

    def resume(self, session: PartitionSession) -> None:
        self._resumed.set()

    def interrupt(self) -> None:
        self._interrupted.set()

    def sessions(self) -> Sequence[PartitionSession]:
        return [] if self.closed else [self._session]

    def stalled(self) -> Mapping[tuple[str, int], str]:
        return {}

    @property
    def last_receive_at(self) -> float | None:
        """When a receive last came back (``time.monotonic``), empty long polls included."""
        return self._last_receive

    async def stats(self) -> QueueStats:
        """The queue's visible, in-flight and delayed counts (GetQueueAttributes)."""
        attributes = await queue_attributes(
            self._client, self.name, self.queue_url, self._timeout()
        )
        now = time.monotonic()
        oldest = min((h.sent_at for h in self._held.values() if h.sent_at > 0), default=None)
        return QueueStats(
            queue=self.name,
            visible=int(attributes.get("ApproximateNumberOfMessages", 0)),
            in_flight=int(attributes.get("ApproximateNumberOfMessagesNotVisible", 0)),
            delayed=int(attributes.get("ApproximateNumberOfMessagesDelayed", 0)),
            fifo=attributes.get("FifoQueue") == "true" or self.fifo,
            redrive_policy=_redrive(attributes),
            visibility_timeout_s=int(attributes.get("VisibilityTimeout", 30)),
            held_here=len(self._held),
            oldest_held_age_s=None if oldest is None else max(0.0, time.time() - oldest),
            since_last_receive_s=None if self._last_receive is None else now - self._last_receive,
        )

    async def send(
        self,
        body: bytes,
        attributes: Mapping[str, str] | None = None,
        *,
        group_id: str | None = None,
        deduplication_id: str | None = None,
    ) -> str:
        """Writes one message to the queue (a requeue); its message id."""
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise BrokerError(
                f"queue {self.name}: an SQS message body is text, and this one is not UTF-8"
            ) from None
        attributes = dict(attributes or {})
        if len(attributes) > MAX_ATTRIBUTES:
            raise BrokerError(
                f"queue {self.name}: a message with {len(attributes)} attributes is over"
                f" SQS's limit of {MAX_ATTRIBUTES}"
            )
        size = len(body) + sum(len(k.encode()) + len(v.encode()) for k, v in attributes.items())
        if size > MAX_MESSAGE_BYTES:
            raise BrokerError(
                f"queue {self.name}: a message of {size} bytes (body and attributes) is over"
                f" SQS's limit of {MAX_MESSAGE_BYTES}"
            )
        request: dict[str, Any] = {"QueueUrl": self.queue_url, "MessageBody": text}
        if attributes:
            request["MessageAttributes"] = {
                k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()
            }
        if self.fifo:
            request["MessageGroupId"] = group_id or "nemesis"
            if deduplication_id is not None:
                request["MessageDeduplicationId"] = deduplication_id
        answer = await sqs_call(
            f"queue {self.name}: SendMessage",
            self._client.send_message(**request),
            self._timeout(),
        )
        return answer["MessageId"]

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stops reading; what is held and unfinished goes back to the queue at once."""
        if self.closed:
            return
        self.closed = True
        self._interrupted.set()
        for task in (self._poll, self._extender):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, BrokerError):
                    await task
        held = [(o, h.receipt) for o, h in self._held.items()]
        self._held.clear()
        try:
            async with asyncio.timeout(timeout_s):
                for i in range(0, len(held), MAX_BATCH):
                    await self._change_visibility(held[i : i + MAX_BATCH], 0)
        except (BrokerError, TimeoutError) as exc:
            log.warning(
                "queue %s: %d held messages not released (they come back when their"
                " visibility runs out): %s",
                self.name,
                len(held),
                exc,
            )
        await self._exits.aclose()


def _redrive(attributes: Mapping[str, str]) -> Mapping[str, Any] | None:
    text = attributes.get("RedrivePolicy")
    if not text:
        return None
    try:
        policy = json.loads(text)
    except ValueError:
        return {"raw": text}
    return policy if isinstance(policy, dict) else {"raw": text}


async def queue_attributes(
    client: SQSClient, name: str, queue_url: str, timeout_s: float
) -> Mapping[str, str]:
    answer = await sqs_call(
        f"queue {name}: GetQueueAttributes",
        client.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["All"]),
        timeout_s,
    )
    return {str(name): value for name, value in answer.get("Attributes", {}).items()}


async def open_sqs_source(config: SqsSourceConfig) -> SqsSource:
    """Connects to the queue: finds its URL and attributes; errors say what is wrong."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session
    from botocore.exceptions import BotoCoreError, ClientError

    exits = AsyncExitStack()
    name = config.queue_label
    try:
        client: SQSClient = await exits.enter_async_context(
            get_session().create_client(
                "sqs",
                region_name=config.region,
                endpoint_url=config.endpoint_url,
                config=AioConfig(
                    connect_timeout=min(config.request_timeout_s, 10),
                    read_timeout=config.request_timeout_s + config.wait_time_s,
                    retries={"max_attempts": 3, "mode": "standard"},
                    max_pool_connections=32,
                ),
            )
        )
        if config.queue_url is not None:
            queue_url = config.queue_url
        else:
            try:
                answer = await client.get_queue_url(QueueName=name)
            except ClientError as exc:
                where = f"queue {name} at {config.endpoint_url or config.region}"
                raise sqs_error(exc, where) from exc
            queue_url = answer["QueueUrl"]
        attributes = await queue_attributes(client, name, queue_url, config.request_timeout_s)
    except BrokerError:
        await exits.aclose()
        raise
    except (ClientError, BotoCoreError, OSError, TimeoutError) as exc:
        await exits.aclose()
        raise sqs_error(exc, f"queue {name}: GetQueueUrl") from exc
    return SqsSource(config, client, queue_url, attributes, exits)
