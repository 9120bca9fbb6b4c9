"""The kafka backend beyond the contract suite: its configuration, and the group's fencing.

Against Apache Kafka (``tests/kafka_broker.py``): the session's broker, each case
with topics and groups of its own (``Namespace``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from nemesis.broker.kafka.broker import KafkaBroker, open_kafka
from nemesis.broker.kafka.config import KafkaBackendConfig
from nemesis.broker.kafka.connection import client_settings, security_protocol
from nemesis.broker.kafka.mapping import KafkaSession
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage, TopicReader
from nemesis.config.interpolation import expand
from nemesis.config.models import NemesisConfig
from nemesis.errors import BrokerError, TopicNotFound
from tests.kafka_broker import KafkaNode, Namespace, kafka_backend_config

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ns() -> Namespace:
    return Namespace()


@pytest.fixture
async def broker(kafka: KafkaNode) -> AsyncIterator[KafkaBroker]:
    opened = await open_kafka(kafka_backend_config(kafka.bootstrap))
    yield opened
    await opened.close()


async def receive(reader: TopicReader, count: int, timeout_s: float = 30) -> list[Message]:
    received: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(received) < count:
        assert time.monotonic() < deadline, f"received {len(received)} of {count}"
        received.extend(await reader.receive(100, 0.5))
    return received


# --- configuration -----------------------------------------------------------------


def kafka_errors(document: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as info:
        NemesisConfig.model_validate(
            {"backend": {"kind": "kafka", **document}, "single_host": True}
        )
    # The union member's tag (kind=kafka) shown as the kind's name.
    return [
        (".".join(str(p).removeprefix("kind=") for p in e["loc"]), e["msg"])
        for e in info.value.errors()
    ]


def test_bad_settings_are_refused_naming_the_field() -> None:
    errors = kafka_errors(
        {
            "bootstrap_servers": ["kafka-1:9092", "no-port"],
            "sasl": {"mechanism": "GSSAPI", "username": "u", "password": "p"},
            "tls": {"cert_file": "client.pem"},
            "compression": "brotli",
            "bootstrap": "typo",
        }
    )
    fields = [field for field, _ in errors]
    assert fields == [
        "backend.kafka.bootstrap_servers.1",
        "backend.kafka.sasl.mechanism",
        "backend.kafka.tls",
        "backend.kafka.compression",
        "backend.kafka.bootstrap",
    ]
    assert "cert_file and key_file go together" in dict(errors)["backend.kafka.tls"]


def test_servers_are_required_and_heartbeats_must_fit_the_session() -> None:
    assert [f for f, _ in kafka_errors({})] == ["backend.kafka.bootstrap_servers"]
    ((field, message),) = kafka_errors(
        {"bootstrap_servers": ["k:9092"], "session_timeout_s": 6, "heartbeat_interval_s": 3}
    )
    assert field == "backend.kafka"
    assert "heartbeat_interval_s must be at most a third of session_timeout_s" in message


def test_security_settings_map_to_the_client() -> None:
    base = {"bootstrap_servers": ["k:9093"]}
    plain = KafkaBackendConfig.model_validate(base)
    sasl = {"mechanism": "SCRAM-SHA-512", "username": "nemesis", "password": "s3cret"}
    scram = KafkaBackendConfig.model_validate({**base, "sasl": sasl})
    tls = KafkaBackendConfig.model_validate({**base, "tls": {}, "sasl": sasl})
    assert [security_protocol(c) for c in (plain, scram, tls)] == [
        "PLAINTEXT",
        "SASL_PLAINTEXT",
        "SASL_SSL",
    ]
    settings = client_settings(tls)
    assert settings["sasl_mechanism"] == "SCRAM-SHA-512"
    assert settings["sasl_plain_password"] == "s3cret"
    assert settings["ssl_context"].check_hostname
    # The secret is not in the model's text form (logs, errors).
    assert "s3cret" not in repr(tls)


def test_the_example_kafka_block_validates_when_uncommented() -> None:
    lines = (ROOT / "nemesis.example.yaml").read_text().splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("#   kind: kafka")) - 1
    block = ["backend:"]
    for line in lines[start + 1 :]:
        if not line.startswith("#  "):
            break
        block.append(line[2:])
    expanded = expand("\n".join(block), env={"KAFKA_PASSWORD": "from-the-environment"})
    config = NemesisConfig.model_validate({**yaml.safe_load(expanded.text), "single_host": True})
    assert isinstance(config.backend, KafkaBackendConfig)
    assert config.backend.sasl is not None
    assert config.backend.sasl.password.get_secret_value() == "from-the-environment"


# --- against the broker ------------------------------------------------------------


async def test_an_unreachable_broker_is_a_broker_error_in_time(tmp_path: Path) -> None:
    config = kafka_backend_config("127.0.0.1:9", connect_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(BrokerError, match=r"connect to 127\.0\.0\.1:9"):
        await open_kafka(config)
    assert time.monotonic() - started < 30


async def test_a_reader_needs_a_registered_consumer(broker: KafkaBroker, ns: Namespace) -> None:
    await broker.admin.create_topic(ns("t"), partitions=1)
    with pytest.raises(TopicNotFound, match="nemesis init"):
        await broker.reader(ns("t"), ns("stranger"))
    with pytest.raises(TopicNotFound):
        await broker.reader(ns("missing"), ns("stranger"))
    # Asking about a missing topic does not create it (brokers may auto-create on metadata).
    assert ns("missing") not in await broker.admin.list_topics()


async def test_revocation_ends_a_session_at_once_and_its_commit_is_ignored(
    broker: KafkaBroker, ns: Namespace
) -> None:
    await broker.admin.create_topic(ns("t"), partitions=2, consumers=[ConsumerSpec(ns("c"))])
    writer = await broker.writer(ns("t"))
    await writer.write([OutgoingMessage(value=b"%d" % i, partition=i % 2) for i in range(10)])
    first = await broker.reader(ns("t"), ns("c"))
    taken = await receive(first, 10)
    sessions = {m.session for m in taken}
    assert all(isinstance(s, KafkaSession) and s.alive for s in sessions)

    second = await broker.reader(ns("t"), ns("c"))
    # The first member learns of the rebalance from its heartbeat: its sessions end then.
    deadline = time.monotonic() + 30
    while any(s is not None and s.alive for s in sessions):
        assert time.monotonic() < deadline, "the first reader's sessions never ended"
        await second.receive(100, 0.2)
    assert not any(m.alive for m in taken)
    await first.commit([m for m in taken if m.partition == 0])  # stale: ignored

    description = await broker.admin.describe_topic(ns("t"))
    assert [p.committed[ns("c")] for p in description.partitions] == [0, 0]
    await first.close()
    again = await receive(second, 10)
    assert sorted(m.value for m in again) == sorted(m.value for m in taken)


async def test_a_commit_after_the_group_moved_on_is_refused_by_the_generation(
    broker: KafkaBroker, kafka: KafkaNode, ns: Namespace
) -> None:
    """A member that stalled past its session still thinks it holds its partition; the
    coordinator, a generation further, refuses its commit."""
    await broker.admin.create_topic(ns("t"), partitions=1, consumers=[ConsumerSpec(ns("c"))])
    await (await broker.writer(ns("t"))).write([OutgoingMessage(value=b"%d" % i) for i in range(5)])
    first = await broker.reader(ns("t"), ns("c"))
    taken = await receive(first, 5)
    (session,) = {m.session for m in taken}
    assert session is not None

    # The second member runs on a loop of its own, in a thread: it joins, takes the
    # partition once the first has been expired, reads, and holds on until told.
    joined, release = threading.Event(), threading.Event()
    seen: list[bytes] = []

    async def second_member() -> None:
        other = await open_kafka(kafka_backend_config(kafka.bootstrap))
        try:
            reader = await other.reader(ns("t"), ns("c"))
            joined.set()
            seen.extend(m.value for m in await receive(reader, 5, timeout_s=60))
            await asyncio.to_thread(release.wait, 60)
        finally:
            await other.close()

    thread = threading.Thread(target=asyncio.run, args=(second_member(),))
    thread.start()
    try:
        await asyncio.to_thread(joined.wait, 30)
        # Stall this loop, as a process stuck in a long GC or a swap storm: no heartbeats.
        deadline = time.monotonic() + 60
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)  # noqa: ASYNC251  blocking on purpose
        assert seen == [m.value for m in taken]  # the group gave the partition to the second
        # The first, stalled, has not heard of it yet; its commit carries the old
        # generation, the coordinator refuses it, and that ends the session.
        alive_before = session.alive
        await first.commit(taken[:3])
        assert (alive_before, session.alive) == (True, False)
        description = await broker.admin.describe_topic(ns("t"))
        assert description.partitions[0].committed[ns("c")] == 0
    finally:
        release.set()
        await asyncio.to_thread(thread.join, 30)


async def test_pausing_a_partition_holds_back_only_that_partition(
    broker: KafkaBroker, ns: Namespace
) -> None:
    await broker.admin.create_topic(ns("t"), partitions=2, consumers=[ConsumerSpec(ns("c"))])
    writer = await broker.writer(ns("t"))
    reader = await broker.reader(ns("t"), ns("c"))
    await writer.write([OutgoingMessage(value=b"a", partition=0)])
    first = await receive(reader, 1)
    reader.pause(first[0].session)  # type: ignore[arg-type]
    await writer.write([OutgoingMessage(value=b"%d" % i, partition=i % 2) for i in range(2, 12)])
    flowing = await receive(reader, 5)
    assert {m.partition for m in flowing} == {1}
    assert list(await reader.receive(100, 1.0)) == []
    reader.resume(first[0].session)  # type: ignore[arg-type]
    held = await receive(reader, 5)
    assert [m.value for m in held] == [b"%d" % i for i in range(2, 12, 2)]


async def test_a_retried_write_with_the_same_seqnos_writes_only_what_is_missing(
    broker: KafkaBroker, ns: Namespace
) -> None:
    await broker.admin.create_topic(ns("t"), partitions=3)
    writer = await broker.writer(ns("t"), producer_id=ns("orders-importer"))
    first = await writer.write([OutgoingMessage(value=b"%d" % s, seqno=s) for s in (1, 2, 3)])
    home = {r.partition for r in first}
    assert len(home) == 1  # unkeyed seqno writes go to the producer's home partition
    # A new writer of the same producer (a restart) finds its last seqno in the partition.
    again = await (await broker.writer(ns("t"), producer_id=ns("orders-importer"))).write(
        [OutgoingMessage(value=b"%d" % s, seqno=s) for s in (2, 3, 4)]
    )
    assert [r.status.value for r in again] == ["duplicate", "duplicate", "written"]
    description = await broker.admin.describe_topic(ns("t"))
    (partition,) = home
    assert description.partitions[partition].end_offset == 4
