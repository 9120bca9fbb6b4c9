"""Kafka records that cannot be decoded: the partition stalls alone, in plain sight.

A batch is written at the protocol level (a raw produce request), as a
broken or exotic producer would: lz4 bytes that are no lz4 frame (where the
lz4 library is missing, the codec alone stops the client), gzip bytes cut
short, a CRC that does not match. (A codec id Kafka does not define is
refused by the brokers on produce.) The reader hands out every
other partition's records and the bad partition's records ahead of the
batch, names the partition and the reason, and commits nothing past it; the
lag counts what waits behind it. End to end through ``nemesis run``: the
admin status, ``nemesis_stalled_partitions`` and the commit lag show it, and
no flow restarts.
"""

from __future__ import annotations

import gzip
import json
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.util import calc_crc32c

from nemesis.broker.kafka.broker import KafkaBroker, open_kafka
from nemesis.broker.port import ConsumerSpec, Message
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import Namespace, TansuBroker, free_port, kafka_backend_config, start_tansu
from tests.operability import samples, value_of, wait_until_true

pytestmark = pytest.mark.timeout(240)

# The v2 batch header: attributes at byte 21, the CRC (of everything after it) at 17,
# the batch length (of everything after it) at 8; the records start at byte 61.
_ATTRIBUTES, _CRC, _LENGTH, _RECORDS = 21, 17, 8, 61
GZIP, LZ4 = 1, 3


def undecodable_batch(values: list[bytes], kind: str) -> bytes:
    """A record batch of ``values`` that no client can decode, broken the ``kind`` way."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 20,
    )
    for delta, value in enumerate(values):
        builder.append(delta, timestamp=None, key=None, value=value, headers=[])
    raw = bytearray(builder.build())
    codec = {"lz4 garbage": LZ4, "gzip cut short": GZIP, "bad crc": 0}[kind]
    if kind == "gzip cut short":
        raw = raw[:_RECORDS] + bytearray(gzip.compress(bytes(raw[_RECORDS:]))[:-12])
        struct.pack_into(">i", raw, _LENGTH, len(raw) - 12)
    (attributes,) = struct.unpack_from(">h", raw, _ATTRIBUTES)
    struct.pack_into(">h", raw, _ATTRIBUTES, (attributes & ~0x07) | codec)
    crc = calc_crc32c(bytes(raw[_ATTRIBUTES:]))
    struct.pack_into(">I", raw, _CRC, crc ^ 1 if kind == "bad crc" else crc)
    return bytes(raw)


async def write(
    bootstrap: str, topic: str, plan: list[tuple[int, bytes | list[bytes]]], kind: str
) -> None:
    """Writes ``plan`` in order: a value as one record, a list of values as one bad batch."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        for partition, value in plan:
            if isinstance(value, bytes):
                await producer.send_and_wait(topic, value, partition=partition)
                continue
            leader = producer.client.cluster.leader_for_partition(TopicPartition(topic, partition))
            request = ProduceRequest(
                None, -1, 10_000, [(topic, [(partition, undecodable_batch(value, kind))])]
            )
            await producer.client.send(leader, request)
    finally:
        await producer.stop()


def body(partition: int, n: int) -> bytes:
    return json.dumps({"p": partition, "n": n}).encode()


def plan_of(good_before: int, bad: int, good_after: int) -> list[tuple[int, bytes | list[bytes]]]:
    """Partition 0 flows; partition 1 has ``bad`` records in one bad batch amid good ones."""
    plan: list[tuple[int, bytes | list[bytes]]] = []
    for n in range(good_before):
        plan += [(0, body(0, n)), (1, body(1, n))]
    plan.append((1, [b"bad-%d" % n for n in range(bad)]))
    for n in range(good_before, good_before + good_after):
        plan += [(0, body(0, n)), (1, body(1, n))]
    return plan


@pytest.fixture
def tansu(tmp_path: Path) -> Iterator[TansuBroker]:
    broker = start_tansu(tmp_path)
    yield broker
    broker.stop()


@pytest.fixture
async def broker(tansu: TansuBroker) -> AsyncIterator[KafkaBroker]:
    opened = await open_kafka(kafka_backend_config(tansu.bootstrap))
    yield opened
    await opened.close()


# --- the reader --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lz4 garbage", "gzip cut short", "bad crc"])
async def test_a_batch_that_cannot_be_decoded_stalls_its_partition_alone(
    broker: KafkaBroker, tansu: TansuBroker, kind: str
) -> None:
    name = Namespace()
    topic = name("orders")
    await broker.admin.create_topic(topic, partitions=2, consumers=[ConsumerSpec(name("c"))])
    await write(tansu.bootstrap, topic, plan_of(3, 2, 3), kind)
    reader = await broker.reader(topic, name("c"))
    received: list[Message] = []
    deadline = time.monotonic() + 60
    # Every record of partition 0 and the three of partition 1 ahead of the bad batch.
    while len(received) < 9 or not reader.stalled():
        assert time.monotonic() < deadline, (len(received), reader.stalled())
        received.extend(await reader.receive(100, 0.5))
    assert sorted((m.partition, m.offset) for m in received) == [
        *((0, n) for n in range(6)),
        *((1, n) for n in range(3)),
    ]
    (stall,) = reader.stalled().items()
    assert stall[0] == (topic, 1)
    assert "offset 3:" in stall[1], stall[1]
    assert "offsets 3-4" in stall[1], stall[1]
    # Nothing more of partition 1 comes, and the reader goes on without failing.
    assert [m for m in await reader.receive(100, 1.0) if m.partition == 1] == []
    for partition in (0, 1):
        await reader.commit([m for m in received if m.partition == partition])
    described = await broker.admin.describe_topic(topic)
    by_partition = {p.partition: p for p in described.partitions}
    # The end counts the bad batch and what follows it; the commit stops before it.
    assert by_partition[1].end_offset == 8
    assert by_partition[1].committed[name("c")] == 3
    assert by_partition[0].committed[name("c")] == 6
    await reader.close()


# --- end to end ----------------------------------------------------------------------


def kafka_workspace(space: Workspace, bootstrap: str) -> str:
    """Points the workspace at the broker; returns the admin API's address."""
    port = free_port()
    (space.root / "nemesis.yaml").write_text(
        "backend:\n"
        "  kind: kafka\n"
        f"  bootstrap_servers: ['{bootstrap}']\n"
        "  idempotent_producer: false   # Tansu has no InitProducerId\n"
        "  session_timeout_s: 6\n"
        "  heartbeat_interval_s: 1\n"
        "  connect_timeout_s: 5\n"
        "  request_timeout_s: 8\n"
        "data_dir: .\n"
        "integrations_dir: integrations\n"
        f"admin: {{port: {port}}}\n"
        "viewer: {port: 0, enabled: false}\n"
        "metrics: {lag_refresh_s: 1}\n"
    )
    (space.root / "integrations").mkdir(exist_ok=True)
    return f"http://127.0.0.1:{port}"


def delivered(handler: HandlerServer) -> set[tuple[int, int]]:
    found = set()
    for entry in handler.ledger:
        if entry.done:
            document = json.loads(entry.body)
            found.add((document["p"], document["n"]))
    return found


def scrape(admin: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    try:
        return samples(httpx.get(f"{admin}/metrics", timeout=5).text)
    except httpx.HTTPError:
        return {}


def lag_of(admin: str, partition: int) -> float | None:
    found = [
        value
        for labels, value in scrape(admin).get("nemesis_commit_lag_messages", [])
        if labels.get("flow") == "main" and labels.get("partition") == str(partition)
    ]
    return found[0] if found else None


async def test_a_stalled_partition_shows_and_the_others_flow_through_the_proxy(
    workspace: Workspace, tansu: TansuBroker
) -> None:
    admin = kafka_workspace(workspace, tansu.bootstrap)
    created = workspace.cli("topics", "create", "orders", "--partitions", "2")
    assert created.returncode == 0, created.stderr
    await write(tansu.bootstrap, "orders", plan_of(4, 3, 5), "gzip cut short")
    async with HandlerServer() as handler:
        workspace.write_integration("loyalty", integration_yaml("loyalty", handler.url, workers=4))
        done = workspace.cli("init")
        assert done.returncode == 0, done.stdout + done.stderr
        proxy = await workspace.start("run")
        before = {(0, n) for n in range(9)} | {(1, n) for n in range(4)}
        await wait_until_true(lambda: delivered(handler) == before, timeout_s=90, step_s=0.2)

        def status() -> dict[str, object]:
            response = httpx.get(f"{admin}/integrations/loyalty", timeout=5)
            return dict(response.json())

        def stalled() -> list[dict[str, object]]:
            flows = status().get("flows", [])
            assert isinstance(flows, list)
            return [
                s for flow in flows if flow["flow"] == "main" for s in flow["stalled_partitions"]
            ]

        await wait_until_true(lambda: bool(stalled()), timeout_s=30, step_s=0.2)
        (stall,) = stalled()
        assert (stall["topic"], stall["partition"]) == ("orders", 1)
        assert "offset 4" in str(stall["reason"]), stall
        assert "EOFError" in str(stall["reason"]), stall
        # The bad batch and the five records behind it are unread: the lag says so.
        await wait_until_true(lambda: lag_of(admin, 1) == 8, timeout_s=30, step_s=0.2)
        metrics = scrape(admin)
        assert (
            value_of(metrics, "nemesis_stalled_partitions", integration="loyalty", flow="main") == 1
        )
        assert lag_of(admin, 0) == 0
        # It stalled; it did not crash: the main flow never restarted.
        assert (
            value_of(metrics, "nemesis_flow_restarts_total", integration="loyalty", flow="main")
            == 0
        )
        assert delivered(handler) == before
        assert await stop_gracefully(proxy) == 0, workspace.logs()
