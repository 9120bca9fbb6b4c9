"""The Kafka backend: admin, readers and writers over aiokafka clients of one configuration."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor

from nemesis.broker.kafka.admin import KafkaAdmin, Peeker
from nemesis.broker.kafka.config import KafkaBackendConfig
from nemesis.broker.kafka.connection import (
    client_settings,
    close_leftover_connections,
    connection_failure,
)
from nemesis.broker.kafka.errors import broker_error, kafka_call
from nemesis.broker.kafka.reader import KafkaReader
from nemesis.broker.kafka.writer import KafkaWriter, default_producer_id
from nemesis.broker.port import EARLIEST, StartFrom
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.errors import BrokerError, TopicNotFound
from nemesis.topology import is_internal

logger = logging.getLogger(__name__)

# Bytes a produce batch of one partition may reach before it is sent (linger_ms bounds the wait).
_BATCH_BYTES = 256 * 1024
_SETTLE_S = 0.05


class KafkaBroker:
    """Any Kafka-protocol broker through aiokafka (see ``docs/kafka.md``).

    One admin client and one group-less consumer (offsets, look-backs) per
    broker, one producer shared by every writer (opened on the first), and a
    consumer-group member per reader.
    """

    def __init__(
        self, config: KafkaBackendConfig, admin: AIOKafkaAdminClient, *, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.config = config
        self._clock = clock
        self._admin_client = admin
        self._peeker = Peeker(config)
        self._admin = KafkaAdmin(admin, self._peeker, config)
        self._producer: AIOKafkaProducer | None = None
        self._producer_lock = asyncio.Lock()
        self._readers: list[KafkaReader] = []
        self._writers: list[KafkaWriter] = []
        self._closed = False

    @property
    def admin(self) -> KafkaAdmin:
        return self._admin

    async def reader(
        self, topic: str | Sequence[str], consumer: str, *, start_from: StartFrom = EARLIEST
    ) -> KafkaReader:
        """A member of group ``consumer`` reading ``topic``; the group assigns its partitions.

        ``start_from`` applies to the partitions the group never read: Nemesis'
        registration commit (see ``KafkaAdmin.add_consumer``) does not count.
        A reader of several topics is not offered yet (``NotImplementedError``):
        the runtime then opens one per topic.
        """
        if not isinstance(topic, str):
            names = list(dict.fromkeys(topic))
            if len(names) != 1:
                raise NotImplementedError("a Kafka reader reads one topic")
            topic = names[0]
        self._check_open()
        # Nemesis' own topics need no registration: the group reads them from their
        # start, which is all of them. (Registering is a commit from outside the group,
        # which a broker refuses once the integration's source reader has joined it.)
        if not is_internal(topic) and not await self._admin.is_registered(topic, consumer):
            raise TopicNotFound(
                f"topic {topic} has no consumer {consumer}: `nemesis init` registers it"
            )
        config = self.config
        client = AIOKafkaConsumer(
            **client_settings(config),
            group_id=consumer,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # Round-robin: the one assignor every Kafka-protocol broker takes (YDB's too).
            partition_assignment_strategy=(RoundRobinPartitionAssignor,),
            session_timeout_ms=int(config.session_timeout_s * 1000),
            heartbeat_interval_ms=int(config.heartbeat_interval_s * 1000),
            max_poll_interval_ms=int(config.max_poll_interval_s * 1000),
            rebalance_timeout_ms=int(config.session_timeout_s * 1000),
            fetch_max_bytes=config.fetch_max_bytes,
            max_partition_fetch_bytes=config.max_partition_fetch_bytes,
            isolation_level="read_committed",
            check_crcs=config.check_crcs,
        )
        reader = KafkaReader(
            client,
            topic=topic,
            group=consumer,
            commit_timeout_s=config.request_timeout_s,
            leave_timeout_s=config.session_timeout_s + 2,
            start_positions=(
                None
                if start_from.kind == "earliest"
                else partial(self._admin.start_positions, consumer, start_from=start_from)
            ),
        )
        # Subscribed after the start, which would otherwise wait for the first assignment.
        await kafka_call(f"read {topic} as {consumer}", client.start(), config.connect_timeout_s)
        client.subscribe([topic], listener=reader.listener)
        self._readers = [r for r in self._readers if not r.closed]
        self._readers.append(reader)
        return reader

    async def writer(self, topic: str, producer_id: str | None = None) -> KafkaWriter:
        """A writer for ``topic``; give a stable ``producer_id`` where de-duplication matters."""
        self._check_open()
        partitions = await self._admin.partitions(topic)
        writer = KafkaWriter(
            await self._shared_producer(),
            topic=topic,
            producer_id=producer_id or default_producer_id(),
            partitions=partitions,
            last_seqno=self._peeker.last_seqno,
        )
        self._writers = [w for w in self._writers if not w.closed]
        self._writers.append(writer)
        return writer

    async def _shared_producer(self) -> AIOKafkaProducer:
        async with self._producer_lock:
            if self._producer is None:
                config = self.config
                settings: dict[str, Any] = {
                    **client_settings(config),
                    "acks": "all",
                    "enable_idempotence": config.idempotent_producer,
                    "linger_ms": config.linger_ms,
                    "max_batch_size": _BATCH_BYTES,
                }
                if config.compression != "none":
                    settings["compression_type"] = config.compression
                producer = AIOKafkaProducer(**settings)
                await kafka_call("open a producer", producer.start(), config.connect_timeout_s)
                self._producer = producer
            return self._producer

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the broker is closed")

    async def close(self, timeout_s: float = 5.0) -> None:
        """Closes readers (they leave their groups), flushes the producer, closes the clients."""
        if self._closed:
            return
        self._closed = True
        for reader in self._readers:
            await reader.close(timeout_s)
        self._readers.clear()
        self._writers.clear()
        clients: list[tuple[str, Any, Any]] = [
            ("consumer", self._peeker.consumer, self._peeker.close()),
            ("admin client", self._admin_client, self._admin_client.close()),
        ]
        if self._producer is not None:
            clients.insert(0, ("producer", self._producer, self._producer.stop()))
        for name, _client, stopping in clients:
            try:
                async with asyncio.timeout(timeout_s):
                    await stopping
            except TimeoutError:
                logger.warning("the Kafka %s did not close in %.1fs", name, timeout_s)
        self._producer = None
        # Connections the clients were opening as they closed: closed here, after the
        # event loop has had a moment to finish opening them.
        await asyncio.sleep(_SETTLE_S)
        for _, client, _ in clients:
            close_leftover_connections(client)


async def open_kafka(config: KafkaBackendConfig, *, clock: Clock = SYSTEM_CLOCK) -> KafkaBroker:
    """Connects to the brokers; a BrokerError naming the reason if none answers in time."""
    admin = AIOKafkaAdminClient(**client_settings(config))
    what = f"connect to {', '.join(config.bootstrap_servers)}"
    try:
        await kafka_call(what, admin.start(), config.connect_timeout_s)
    except BrokerError as exc:
        await admin.close()
        cause = await connection_failure(config)
        if cause is None:
            raise
        raise broker_error(cause, what) from exc
    except BaseException:
        await admin.close()
        raise
    return KafkaBroker(config, admin, clock=clock)
