"""Kafka client libraries for the kafka backend: aiokafka against confluent-kafka (librdkafka).

Against an Apache Kafka broker (tests/kafka_broker.py) on 127.0.0.1, in one run, prints per
client: produce rate (batches of 1,000 awaited as the backend's writer does,
acks=all) and consume rate (one group member reading everything), each with
the client process's CPU per message. The broker is pinned to core 1, the
client to core 0, when there are two. confluent-kafka is not a dependency:
`pip install confluent-kafka` to include it.

Usage: `python tests/bench/kafka_clients.py [--messages N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PAYLOAD = b'{"id": "order-000000", "city": "msk", "amount": 123.45, "note": "' + b"x" * 200 + b'"}'
BATCH = 1000


def cpu_s() -> float:
    times = os.times()
    return times.user + times.system


async def aiokafka_run(bootstrap: str, topic: str, count: int) -> dict[str, float]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_batch_size=256 * 1024
    )
    await producer.start()
    started, cpu = time.perf_counter(), cpu_s()
    for start in range(0, count, BATCH):
        futures = [
            await producer.send(topic, PAYLOAD, key=b"k%d" % n)
            for n in range(start, min(count, start + BATCH))
        ]
        await asyncio.gather(*futures)
    produce_s, produce_cpu = time.perf_counter() - started, cpu_s() - cpu
    await producer.stop()

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"{topic}-reader",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    seen = 0
    while seen == 0:  # the group's join is not the rate
        batches = await consumer.getmany(timeout_ms=200, max_records=500)
        seen += sum(len(r) for r in batches.values())
    started, cpu = time.perf_counter(), cpu_s()
    first = seen
    while seen < count:
        batches = await consumer.getmany(timeout_ms=200, max_records=500)
        seen += sum(len(r) for r in batches.values())
    consume_s, consume_cpu = time.perf_counter() - started, cpu_s() - cpu
    await consumer.stop()
    return _rates(count, produce_s, produce_cpu, count - first, consume_s, consume_cpu)


async def confluent_run(bootstrap: str, topic: str, count: int) -> dict[str, float]:
    from confluent_kafka.aio import AIOConsumer, AIOProducer

    # Its own buffer flushes at batch_size messages or after buffer_timeout: as linger_ms.
    producer = AIOProducer(
        {"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5},
        batch_size=BATCH,
        buffer_timeout=0.005,
    )
    started, cpu = time.perf_counter(), cpu_s()
    for start in range(0, count, BATCH):
        futures = [
            await producer.produce(topic, value=PAYLOAD, key=b"k%d" % n)
            for n in range(start, min(count, start + BATCH))
        ]
        await asyncio.gather(*futures)
    produce_s, produce_cpu = time.perf_counter() - started, cpu_s() - cpu
    await producer.flush()
    await producer.close()

    consumer = AIOConsumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{topic}-reader",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    await consumer.subscribe([topic])
    seen = 0
    while seen == 0:
        seen += len(await consumer.consume(num_messages=500, timeout=0.2))
    started, cpu = time.perf_counter(), cpu_s()
    first = seen
    while seen < count:
        seen += len(await consumer.consume(num_messages=500, timeout=0.2))
    consume_s, consume_cpu = time.perf_counter() - started, cpu_s() - cpu
    await consumer.close()
    return _rates(count, produce_s, produce_cpu, count - first, consume_s, consume_cpu)


def _rates(
    produced: int, produce_s: float, produce_cpu: float, read: int, read_s: float, read_cpu: float
) -> dict[str, float]:
    return {
        "produce": produced / produce_s,
        "produce_cpu_us": produce_cpu / produced * 1e6,
        "consume": read / read_s,
        "consume_cpu_us": read_cpu / max(read, 1) * 1e6,
    }


def child(client: str, bootstrap: str, topic: str, count: int) -> None:
    """One client's run, in a process of its own (its CPU is the client's alone)."""
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    run = aiokafka_run if client == "aiokafka" else confluent_run
    print(json.dumps(asyncio.run(run(bootstrap, topic, count))))


def create_topic(bootstrap: str, topic: str) -> None:
    async def create() -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 4, 1)])
        finally:
            await admin.close()

    asyncio.run(create())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=100_000)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.kafka_broker import start_kafka

    clients = ["aiokafka"]
    if importlib.util.find_spec("confluent_kafka") is not None:
        clients.append("confluent-kafka")
    with tempfile.TemporaryDirectory(prefix="nemesis-kafka-bench-") as tmp:
        kafka_broker = start_kafka(Path(tmp))
        try:
            if (os.cpu_count() or 1) >= 2:
                assert kafka_broker.process is not None
                os.sched_setaffinity(kafka_broker.process.pid, {1})
            print(
                f"\nKafka clients against Apache Kafka (one broker), {args.messages:,} messages each"
            )
            for client in clients:
                topic = f"bench-{client}"
                create_topic(kafka_broker.bootstrap, topic)
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        client,
                        kafka_broker.bootstrap,
                        topic,
                        str(args.messages),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rates: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
                print(
                    f"  {client:<16} produce {rates['produce']:>9,.0f} msg/s"
                    f" ({rates['produce_cpu_us']:.1f} us CPU each)"
                    f"   consume {rates['consume']:>9,.0f} msg/s"
                    f" ({rates['consume_cpu_us']:.1f} us CPU each)"
                )
        finally:
            kafka_broker.stop()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        sys.exit(0)
    main()
