"""Records from third-party producers, kept as they were (docs/handler-contract.md).

The Java client (kafka-clients from Maven Central, ``tests/kafka/RecordsProducer.java``)
and librdkafka (confluent-kafka) write records with each codec: keys and values
that are not UTF-8, null keys, tombstones, empty values, duplicate and null
headers, and CloudEvents in both Kafka binding modes. The real proxy (``nemesis
run`` in a subprocess, on Apache Kafka) delivers each to a real HTTP handler on
127.0.0.1 three times: once from the topic (answered 503), once from the retry
tier (answered 422: the DLQ), once from the replay topic after a requeue
(answered 200). Every arrival is checked against the contract, the CloudEvents
ones parsed by the ``cloudevents`` SDK; a second client (confluent-kafka) reads
the retry tier and replay records back byte for byte, and the committed offsets.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import shutil
import subprocess
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote_to_bytes

import confluent_kafka
import confluent_kafka.admin
import orjson
import pytest
import yaml
from aiohttp import web
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

from nemesis.config.models import IntegrationConfig
from nemesis.dlq import DeadLetterFilter, DeadLetterRow, PageRequest, open_sqlite_dlq
from nemesis.runtime.retries import flows_of
from nemesis.tracecontext import parse_traceparent
from tests.conftest import Workspace, stop_gracefully
from tests.kafka_broker import KafkaBroker, free_port, kafka_classpath
from tests.maven import cache_dir
from tests.operability import wait_until_true
from tests.test_kafka_e2e import init, kafka_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CODECS = ("gzip", "snappy", "lz4", "zstd")
PRODUCERS = ("java", "librdkafka")
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = b"rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
FORWARDED = ("traceparent", "tracestate", "x-dup")
JAVA_PROGRAM = Path(__file__).resolve().parent / "kafka" / "RecordsProducer.java"

Headers = tuple[tuple[str, bytes | None], ...]


@dataclass(frozen=True)
class Record:
    """A record as its producer writes it, and what kind of event it is."""

    kind: str  # plain | empty | tombstone | ce-binary | ce-structured
    key: bytes | None
    value: bytes | None
    headers: Headers = ()
    ce_id: str = ""


def records_of(producer: str, codec: str) -> list[Record]:
    """The records one producer writes with one codec."""
    tag = f"{producer}-{codec}"
    ce_json = b'{"order": "%b",  "price": 1.50, "tags": ["a", "\\u00e9"]}' % tag.encode()
    structured = {
        "specversion": "1.0",
        "id": f"s-{tag}",
        "source": "/shop/orders",
        "type": "com.example.order.created",
        "subject": f"order/{tag}",
        "time": "2026-12-02T10:00:00.123Z",
        "dataschema": "https://example.com/order.json",
        "datacontenttype": "application/json",
        "shopregion": "eu west",
        "priority": 7,
    }
    envelope = orjson.dumps(structured)[:-1] + b',"data":' + ce_json + b"}"
    return [
        Record(
            "plain",
            key=b"\xff\xfe" + tag.encode(),
            value=b"\x00\xff\x80 " + tag.encode(),
            headers=(
                ("traceparent", TRACEPARENT),
                ("tracestate", TRACESTATE),
                ("x-dup", b"one"),
                ("x-null", None),
                ("x-dup", b"\xff two "),
                ("type", b"\xc3\x28"),  # not UTF-8: no type of its own
            ),
        ),
        Record("empty", key=None, value=b"", headers=(("x-dup", b""),)),
        Record("tombstone", key=f"gone-{tag}".encode(), value=None),
        Record(
            "ce-binary",
            key=f"клиент-{tag}".encode(),
            value=ce_json,
            headers=(
                ("ce_specversion", b"1.0"),
                ("ce_id", f"b-{tag}".encode()),
                ("ce_source", b"/shop/orders"),
                ("ce_type", b"com.example.order.created"),
                ("ce_subject", f"order/{tag}".encode()),
                ("ce_time", b"2026-12-02T10:00:00.123Z"),
                ("ce_dataschema", b"https://example.com/order.json"),
                ("ce_shopregion", "eu wést".encode()),
                ("content-type", b"application/json"),
                ("traceparent", TRACEPARENT),
            ),
            ce_id=f"b-{tag}",
        ),
        Record(
            "ce-structured",
            key=None,
            value=envelope,
            headers=(("content-type", b"application/cloudevents+json; charset=UTF-8"),),
            ce_id=f"s-{tag}",
        ),
    ]


def all_records() -> list[Record]:
    """Every record, in the order (and so at the offsets) they are written."""
    return [r for producer in PRODUCERS for codec in CODECS for r in records_of(producer, codec)]


def token(data: bytes | None) -> str:
    return "null" if data is None else "x" + data.hex()


def java_producer_classes() -> Path:
    """``RecordsProducer.java`` compiled by javac once, cached by the source's hash."""
    digest = hashlib.sha256(JAVA_PROGRAM.read_bytes()).hexdigest()[:16]
    classes = cache_dir() / f"records-producer-{digest}"
    if (classes / "RecordsProducer.class").is_file():
        return classes
    partial = classes.with_name(f"{classes.name}.{os.getpid()}.part")
    shutil.rmtree(partial, ignore_errors=True)
    compiled = subprocess.run(
        ["javac", "-cp", kafka_classpath(), "-d", str(partial), str(JAVA_PROGRAM)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    try:
        os.replace(partial, classes)
    except OSError:  # another worker compiled it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    return classes


def write_with_java(bootstrap: str, topic: str, records: Sequence[tuple[str, Record]]) -> None:
    lines = [
        "\t".join([codec, token(r.key), token(r.value), *(f"{n}={token(v)}" for n, v in r.headers)])
        for codec, r in records
    ]
    classpath = os.pathsep.join([str(java_producer_classes()), kafka_classpath()])
    done = subprocess.run(
        ["java", "-Xmx256m", "-cp", classpath, "RecordsProducer", bootstrap, topic],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"written {len(records)}" in done.stdout, done.stdout + done.stderr


def write_with_librdkafka(
    bootstrap: str, topic: str, codec: str, records: Sequence[Record]
) -> None:
    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "compression.type": codec,
            "enable.idempotence": True,
            "linger.ms": 50,
        }
    )
    failures: list[Any] = []

    def delivered(error: Any, _message: Any) -> None:
        if error is not None:
            failures.append(error)

    for r in records:
        producer.produce(
            topic,
            value=r.value,
            key=r.key,
            headers=list(r.headers),
            partition=0,
            on_delivery=delivered,
        )
    assert producer.flush(60) == 0
    assert failures == []


@dataclass
class Arrival:
    headers: list[tuple[str, str]]  # as sent, in order, names lowercased
    body: bytes

    def one(self, name: str) -> str | None:
        found = [v for n, v in self.headers if n == name]
        assert len(found) <= 1, (name, found)
        return found[0] if found else None


class Handler:
    """A handler on 127.0.0.1 that keeps every request's headers as they came.

    Answers a record's first arrival 503 (a retry tier), its second 422 (the
    DLQ), later ones 200.
    """

    def __init__(self) -> None:
        self.arrivals: dict[int, list[Arrival]] = defaultdict(list)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/events"

    async def handle(self, request: web.Request) -> web.Response:
        headers = [
            (n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in request.raw_headers
        ]
        arrival = Arrival(headers, await request.read())
        offset = int(arrival.one("ce-offset") or "-1")
        self.arrivals[offset].append(arrival)
        seen = len(self.arrivals[offset])
        return web.Response(status=503 if seen == 1 else 422 if seen == 2 else 200)

    def count(self, least: int) -> int:
        return sum(1 for arrivals in self.arrivals.values() if len(arrivals) >= least)


@pytest.fixture
async def handler() -> AsyncIterator[Handler]:
    server = Handler()
    app = web.Application()
    app.router.add_post("/events", server.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", server.port).start()
    try:
        yield server
    finally:
        await runner.cleanup()


def pct(data: bytes) -> str:
    """The percent-encoding of a forwarded value (docs/handler-contract.md)."""
    return "".join(
        chr(b)
        if (0x21 <= b <= 0x7E and b != 0x25) or (b == 0x20 and 0 < i < len(data) - 1)
        else f"%{b:02X}"
        for i, b in enumerate(data)
    )


def check_arrival(
    arrival: Arrival, record: Record, *, topic: str, offset: int, integration: str
) -> None:
    """One delivery of ``record`` is exactly what the handler contract says."""
    assert arrival.one("ce-specversion") == "1.0"
    assert arrival.one("ce-topic") == topic
    assert arrival.one("ce-partition") == "0"
    assert arrival.one("ce-offset") == str(offset)
    # One event per request: never a structured envelope beside ce-* headers.
    assert "cloudevents" not in (arrival.one("content-type") or "")
    key = record.key
    try:
        text_key = None if key is None else key.decode("utf-8")
    except UnicodeDecodeError:
        text_key = None
    if key is None:
        assert arrival.one("ce-partitionkey") is None
        assert arrival.one("ce-partitionkeybase64") is None
    elif text_key is not None:
        assert arrival.one("ce-partitionkey") == quote(
            text_key, safe="!#$&'()*+,-./:;<=>?@[\\]^_`{|}~"
        )
        assert arrival.one("ce-partitionkeybase64") is None
    else:
        assert arrival.one("ce-partitionkey") is None
        assert base64.b64decode(arrival.one("ce-partitionkeybase64") or "") == key
    forwarded = [(n, v) for n, v in record.headers if n == "x-dup" and v is not None]
    assert [(n, v) for n, v in arrival.headers if n == "x-dup"] == [
        (n, pct(v)) for n, v in forwarded
    ]
    for name, value in arrival.headers:
        if name == "x-dup":
            assert unquote_to_bytes(value) in [v for n, v in forwarded if n == name]
    # The trace context: the producer's as written, else one Nemesis started.
    own = dict((n, v) for n, v in record.headers if n in ("traceparent", "tracestate"))
    if "traceparent" in own:
        assert arrival.one("traceparent") == own["traceparent"].decode()  # type: ignore[union-attr]
        assert arrival.one("tracestate") == (
            None if own.get("tracestate") is None else own["tracestate"].decode()  # type: ignore[union-attr]
        )
    else:
        assert parse_traceparent(arrival.one("traceparent")) is not None
    if record.kind in ("plain", "empty", "tombstone"):
        assert arrival.one("ce-id") == f"{topic}:0:{offset}"
        assert arrival.one("ce-source") == f"nemesis/{integration}"
        assert arrival.one("ce-type") == "nemesis.message"
        assert arrival.one("ce-subject") is None
    if record.kind == "tombstone":
        assert arrival.body == b""
        assert arrival.one("ce-tombstone") == "true"
        assert arrival.one("content-type") is None
        return
    assert arrival.one("ce-tombstone") is None
    if record.kind in ("plain", "empty"):
        assert arrival.body == record.value
        assert arrival.one("content-type") == "application/octet-stream"
        return
    # A CloudEvent of its own: parsed by the SDK, its attributes as the producer set them.
    message = ce_http.HTTPMessage(headers=dict(arrival.headers), body=arrival.body)
    event = ce_http.from_http(message, JSONFormat(), CloudEvent)
    tag = record.ce_id[2:]
    assert event.get_id() == record.ce_id
    assert event.get_source() == "/shop/orders"
    assert event.get_type() == "com.example.order.created"
    assert event.get_subject() == f"order/{tag}"
    assert event.get_dataschema() == "https://example.com/order.json"
    time = event.get_time()
    assert time is not None
    assert time.isoformat() == "2026-12-02T10:00:00.123000+00:00"
    assert event.get_datacontenttype() == "application/json"
    assert event.get_extension("topic") == topic
    assert event.get_extension("offset") == str(offset)
    # The data, byte for byte as the producer wrote it (spaces, 1.50, the \u00e9 escape).
    expected_data = b'{"order": "%b",  "price": 1.50, "tags": ["a", "\\u00e9"]}' % tag.encode()
    assert arrival.body == expected_data
    if record.kind == "ce-binary":
        assert event.get_extension("shopregion") == "eu wést"
        assert event.get_extension("partitionkey") == f"клиент-{tag}"
    else:
        assert event.get_extension("shopregion") == "eu west"
        assert event.get_extension("priority") == "7"


def read_topic(bootstrap: str, topic: str) -> list[Any]:
    """Every record of a topic, read by confluent-kafka from the start of each partition."""
    metadata_client = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap})
    partitions = metadata_client.list_topics(topic, timeout=30).topics[topic].partitions
    consumer = confluent_kafka.Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "readback", "enable.auto.commit": False}
    )
    try:
        found = []
        for partition in partitions:
            low, high = consumer.get_watermark_offsets(
                confluent_kafka.TopicPartition(topic, partition), timeout=30
            )
            if high <= low:
                continue
            consumer.assign([confluent_kafka.TopicPartition(topic, partition, low)])
            got = 0
            while got < high - low:
                message = consumer.poll(10)
                assert message is not None, f"{topic}[{partition}] ended early"
                assert message.error() is None, message.error()
                found.append(message)
                got += 1
        return found
    finally:
        consumer.close()


def committed(bootstrap: str, group: str, topic: str) -> dict[int, tuple[int, int]]:
    """(committed, end) per partition of ``group`` on ``topic``, as confluent-kafka reads them."""
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap})
    partitions = admin.list_topics(topic, timeout=30).topics[topic].partitions
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        asked = [confluent_kafka.TopicPartition(topic, p) for p in partitions]
        found = consumer.committed(asked, timeout=30)
        return {
            tp.partition: (tp.offset, consumer.get_watermark_offsets(tp, timeout=30)[1])
            for tp in found
        }
    finally:
        consumer.close()


def check_copy(message: Any, record: Record) -> None:
    """A retry tier or replay record: the producer's key, value and headers, then Nemesis'."""
    assert message.key() == record.key
    assert message.value() == record.value  # None for a tombstone
    headers = message.headers() or []
    own = len(record.headers)
    assert tuple(headers[:own]) == record.headers
    assert all(n.startswith(("nemesis-", "__")) for n, _ in headers[own:]), headers[own:]


def source_offset(message: Any) -> int:
    return int(dict(message.headers())["nemesis-source-offset"])


async def test_records_of_the_java_client_and_librdkafka_reach_the_handler_as_written(
    workspace: Workspace, kafka: KafkaBroker, handler: Handler
) -> None:
    bootstrap = kafka.bootstrap
    name = f"rec{workspace.root.name[-6:].lower().replace('_', '')}"
    name = "".join(c for c in name if c.isalnum()) + "x"
    topic = f"{name}-orders"
    kafka_config(workspace, bootstrap)
    created = workspace.cli("topics", "create", topic, "--partitions", "1")
    assert created.returncode == 0, created.stderr
    records = all_records()
    java = [(codec, r) for codec in CODECS for r in records_of("java", codec)]
    await asyncio.to_thread(write_with_java, bootstrap, topic, java)
    for codec in CODECS:
        await asyncio.to_thread(
            write_with_librdkafka, bootstrap, topic, codec, records_of("librdkafka", codec)
        )
    # Each codec's batch is on the broker as written: the topic holds every record once.
    assert [
        (m.key(), m.value()) for m in await asyncio.to_thread(read_topic, bootstrap, topic)
    ] == [(r.key, r.value) for r in records]

    integration = workspace.write_integration(
        name,
        f"name: {name}\n"
        "owners: [team-test]\n"
        f"source: {{topic: {topic}, consumer: {name}, forward_headers: [{', '.join(FORWARDED)}]}}\n"
        f"target: {{url: '{handler.url}', timeout_s: 5, format: bytes}}\n"
        "delivery: {workers: 4, buffer: 100}\n"
        "retry: {tiers: [300ms]}\n"
        "breaker: {min_requests: 100000}\n",
    )
    init(workspace)
    proxy = await workspace.start("run")
    try:
        await wait_until_true(lambda: handler.count(2) == len(records), timeout_s=180, step_s=0.2)
        store = await open_sqlite_dlq(workspace.root / "dlq.db")
        try:

            async def dead_rows() -> list[DeadLetterRow]:
                page = await store.query(DeadLetterFilter(), PageRequest(limit=500))
                return [await store.get(row.id) for row in page.rows]  # type: ignore[misc]

            for _ in range(600):
                if await store.count(DeadLetterFilter()) == len(records):
                    break
                await asyncio.sleep(0.1)
            rows = await dead_rows()
        finally:
            await store.close()
        requeued = workspace.cli("dlq", "requeue", "--all-matching", "--yes", "--by", "ops")
        assert requeued.returncode == 0, requeued.stderr
        await wait_until_true(lambda: handler.count(3) == len(records), timeout_s=180, step_s=0.2)
        for _ in range(120):  # the last commit follows the last answer
            offsets = await asyncio.to_thread(committed, bootstrap, name, topic)
            if all(c == end for c, end in offsets.values()):
                break
            await asyncio.sleep(0.5)
    finally:
        assert await stop_gracefully(proxy) == 0, workspace.logs()

    for offset, record in enumerate(records):
        arrivals = handler.arrivals[offset]
        assert len(arrivals) == 3, (offset, record.kind)
        for arrival in arrivals:
            check_arrival(arrival, record, topic=topic, offset=offset, integration=name)
        # One event, one idempotency key, wherever it came from.
        assert len({a.one("ce-id") for a in arrivals}) == 1
        assert [a.one("ce-attempt") for a in arrivals[:2]] == ["1", "2"]

    # The DLQ kept each record's bytes: key, value (a tombstone as one), headers.
    assert len(rows) == len(records)
    by_offset = {row.source_offset: row for row in rows}
    for offset, record in enumerate(records):
        row = by_offset[offset]
        assert row.payload == (record.value or b"")
        assert row.tombstone is (record.value is None)
        assert row.headers == record.headers
        raw_key = None if row.key is None else row.key.encode("utf-8", "surrogateescape")
        assert raw_key == record.key
    # An operator sees them too: `nemesis dlq show --json` of the first record.
    shown = workspace.cli("dlq", "show", by_offset[0].id, "--json")
    assert shown.returncode == 0, shown.stderr
    document = orjson.loads(shown.stdout)
    assert base64.b64decode(document["key_base64"]) == records[0].key
    assert [
        (n, None if v is None else base64.b64decode(v)) for n, v in document["headers"]
    ] == list(records[0].headers)

    # A second client reads the retry tier and the replay topic back, byte for byte.
    for internal in (f"nemesis.retry.{name}.1", f"nemesis.replay.{name}"):
        copies = await asyncio.to_thread(read_topic, bootstrap, internal)
        assert sorted(source_offset(m) for m in copies) == list(range(len(records))), internal
        for message in copies:
            check_copy(message, records[source_offset(message)])

    # Every flow committed everything it read: the source, the tier, the replay topic.
    config = IntegrationConfig.model_validate(yaml.safe_load(integration.read_text()))
    flows = flows_of(config)
    assert len(flows) == 3
    for flow in flows:
        offsets = await asyncio.to_thread(committed, bootstrap, flow.consumer, flow.topic)
        assert offsets, flow
        assert all(c == end for c, end in offsets.values()), (flow, offsets)
    source = await asyncio.to_thread(committed, bootstrap, config.source.consumer, topic)
    assert sum(end for _, end in source.values()) == len(records)
