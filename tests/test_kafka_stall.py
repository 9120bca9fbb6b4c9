"""Kafka records that cannot be decoded: the partition stalls alone, in plain sight.

Brokers check a batch when it is written, not when it is read, so the tests
break one where it rests: a batch written whole is rewritten in the
broker's log segment, in place and at the same length, the ways a consumer
meets them: a codec id Kafka does not define, lz4 or gzip bytes that do not
decompress (where the lz4 library is missing, the codec alone stops the
client), a CRC that does not match. The reader hands out every other
partition's records and the bad partition's records ahead of the batch,
names the partition and the reason, and commits nothing past it; the lag
counts what waits behind it. End to end through ``nemesis run``: the admin
status, ``nemesis_stalled_partitions`` and the commit lag show it, no flow
restarts, and ``nemesis offsets skip`` passes over the batch.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.record.util import calc_crc32c

from nemesis.broker.kafka.broker import KafkaBroker, open_kafka
from nemesis.broker.port import ConsumerSpec, Message
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import KafkaNode, Namespace, free_port, kafka_backend_config
from tests.operability import samples, value_of, wait_until_true

pytestmark = pytest.mark.timeout(240)

# The v2 batch header: the batch length (of what follows it) at byte 8, the CRC (of
# everything after it) at 17, the attributes (the codec in their low 3 bits) at 21.
_LENGTH, _CRC, _ATTRIBUTES, _RECORDS = 8, 17, 21, 61
CODECS = {"unknown codec": 7, "lz4 garbage": 3, "gzip garbage": 1, "bad crc": 0}


def break_batch(
    node: KafkaNode, topic: str, partition: int, offsets: tuple[int, int], kind: str
) -> None:
    """Rewrites the batch of ``offsets`` (first, last) in its log segment, ``kind``'s way."""
    base_offset = offsets[0]
    segment = node.data_dir / f"{topic}-{partition}" / "00000000000000000000.log"
    with segment.open("r+b") as log:
        data = log.read()
        position = 0
        while position + _RECORDS <= len(data):
            (offset,) = struct.unpack_from(">q", data, position)
            (length,) = struct.unpack_from(">i", data, position + _LENGTH)
            if offset == base_offset:
                break
            position += 12 + length
        else:
            raise AssertionError(f"no batch at offset {base_offset} in {segment}")
        batch = bytearray(data[position : position + 12 + length])
        (last_delta,) = struct.unpack_from(">i", batch, _ATTRIBUTES + 2)
        assert base_offset + last_delta == offsets[1], "the records are not one batch"
        (attributes,) = struct.unpack_from(">h", batch, _ATTRIBUTES)
        struct.pack_into(">h", batch, _ATTRIBUTES, (attributes & ~0x07) | CODECS[kind])
        crc = calc_crc32c(bytes(batch[_ATTRIBUTES:]))
        struct.pack_into(">I", batch, _CRC, crc ^ 1 if kind == "bad crc" else crc)
        log.seek(position)
        log.write(batch)


async def write(
    node: KafkaNode, topic: str, plan: list[tuple[int, bytes | list[bytes]]], kind: str
) -> None:
    """Writes ``plan`` in order: a value as one record, a list of values as one batch, broken."""
    producer = AIOKafkaProducer(bootstrap_servers=node.bootstrap, linger_ms=50)
    await producer.start()
    try:
        for partition, value in plan:
            if isinstance(value, bytes):
                await producer.send_and_wait(topic, value, partition=partition)
                continue
            sent = [await producer.send(topic, v, partition=partition) for v in value]
            offsets = [(await future).offset for future in sent]
            assert offsets == list(range(offsets[0], offsets[0] + len(value))), offsets
            break_batch(node, topic, partition, (offsets[0], offsets[-1]), kind)
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
async def broker(kafka: KafkaNode) -> AsyncIterator[KafkaBroker]:
    opened = await open_kafka(kafka_backend_config(kafka.bootstrap))
    yield opened
    await opened.close()


# --- the reader --------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CODECS))
async def test_a_batch_that_cannot_be_decoded_stalls_its_partition_alone(
    broker: KafkaBroker, kafka: KafkaNode, kind: str
) -> None:
    name = Namespace()
    topic = name("orders")
    await broker.admin.create_topic(topic, partitions=2, consumers=[ConsumerSpec(name("c"))])
    await write(kafka, topic, plan_of(3, 2, 3), kind)
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
        "  session_timeout_s: 6\n"
        "  heartbeat_interval_s: 1\n"
        "  connect_timeout_s: 5\n"
        "  request_timeout_s: 8\n"
        "single_host: true\n"  # one process: its state and DLQ files are enough
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


@pytest.mark.slow
async def test_a_stalled_partition_shows_and_the_others_flow_through_the_proxy(
    workspace: Workspace, kafka: KafkaNode
) -> None:
    admin = kafka_workspace(workspace, kafka.bootstrap)
    name = Namespace()
    topic, integration = name("orders"), name("loyalty")
    created = workspace.cli("topics", "create", topic, "--partitions", "2")
    assert created.returncode == 0, created.stderr
    await write(kafka, topic, plan_of(4, 3, 5), "gzip garbage")
    async with HandlerServer() as handler:
        yaml = integration_yaml(integration, handler.url, topic=topic, workers=4)
        workspace.write_integration(integration, yaml)
        done = workspace.cli("init")
        assert done.returncode == 0, done.stdout + done.stderr
        proxy = await workspace.start("run")
        before = {(0, n) for n in range(9)} | {(1, n) for n in range(4)}
        await wait_until_true(lambda: delivered(handler) == before, timeout_s=90, step_s=0.2)

        def stalled() -> list[dict[str, object]]:
            response = httpx.get(f"{admin}/integrations/{integration}", timeout=5)
            flows = response.json().get("flows", [])
            assert isinstance(flows, list)
            return [
                s for flow in flows if flow["flow"] == "main" for s in flow["stalled_partitions"]
            ]

        await wait_until_true(lambda: bool(stalled()), timeout_s=30, step_s=0.2)
        (stall,) = stalled()
        assert (stall["topic"], stall["partition"]) == (topic, 1)
        assert "offset 4: a record batch (offsets 4-6)" in str(stall["reason"]), stall
        # The bad batch and the five records behind it are unread: the lag says so.
        await wait_until_true(lambda: lag_of(admin, 1) == 8, timeout_s=30, step_s=0.2)
        metrics = scrape(admin)
        where = {"integration": integration, "flow": "main"}
        assert value_of(metrics, "nemesis_stalled_partitions", **where) == 1
        assert lag_of(admin, 0) == 0
        # It stalled; it did not crash: the main flow never restarted.
        assert value_of(metrics, "nemesis_flow_restarts_total", **where) == 0
        assert delivered(handler) == before
        assert await stop_gracefully(proxy) == 0, workspace.logs()

        # The operator passes over the three records of the batch; the rest flows.
        skipped = workspace.cli(
            "offsets", "skip", integration, "--count", "3", "--partition", "1", "--force"
        )
        assert skipped.returncode == 0, skipped.stdout + skipped.stderr
        proxy = await workspace.start("run")
        every = before | {(1, n) for n in range(4, 9)}
        await wait_until_true(lambda: delivered(handler) == every, timeout_s=90, step_s=0.2)
        await wait_until_true(lambda: lag_of(admin, 1) == 0, timeout_s=30, step_s=0.2)
        assert await stop_gracefully(proxy) == 0, workspace.logs()
