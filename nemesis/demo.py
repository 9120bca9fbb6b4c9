"""``nemesis demo``: the whole path on a laptop in one minute.

Starts the embedded backend in a folder of its own (or uses a Kafka-protocol
broker, ``--kafka host:port``), a sample handler that
fails now and then (so retries show), a producer of sample orders, and the
proxy with one integration whose YAML it writes next to the data, so a
newcomer can read what configured it. Prints what happens every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import signal
import time
from pathlib import Path

import orjson

from nemesis.admin.server import plugin_services
from nemesis.backends import open_backend, open_dlq, open_state
from nemesis.broker.port import Broker, ConsumerSpec, OutgoingMessage
from nemesis.config.loader import load_integrations, load_process_config
from nemesis.config.passwords import hash_password
from nemesis.dlq import DeadLetterFilter, DeadLetterStore
from nemesis.runtime.app import Proxy
from nemesis.runtime.runner import RunnerOptions
from nemesis.testing import HandlerServer

log = logging.getLogger(__name__)

TOPIC = "orders"
CITIES = ("msk", "spb", "kzn", "nsk", "ekb", "sochi", "kgd", "vvo")

PROCESS_YAML = """\
# Written by `nemesis demo`. Run the same setup yourself with:
#   nemesis run -c {config}
backend: {backend}
{single_host}data_dir: .
integrations_dir: integrations
viewer: {{port: {viewer_port}}}
admin: {{enabled: false}}
auth:                      # the DLQ viewer's one user; its password is printed at start
  session_secret: {session_secret}
  secure_cookies: false
  users: [{{name: demo, password_hash: "{password_hash}", teams: [team-demo], admin: true}}]
"""

INTEGRATION_YAML = """\
# Written by `nemesis demo`: one integration = one YAML file in a pull request.
name: demo-orders
owners: [team-demo]
source: {{topic: {topic}, consumer: demo-orders}}
pipeline:                  # runs inside Nemesis: filtered orders never cost an HTTP request
  - filter:
      name: msk-spb-over-100
      match:
        city: [msk, spb]
        amount: {{gt: 100}}
  - transform:
      name: trim
      keep: [id, city, amount]
target:
  url: {url}events/order
  timeout_s: 2
delivery:
  workers: 16
  buffer: 500
  ordering: none
retry:
  tiers: [2s, 5s, 10s]
"""


EMBEDDED_BACKEND = "{kind: embedded, path: nemesis.db, default_partitions: 4}"
# The demo's topics on a Kafka broker; its idempotent producer stays on unless the broker lacks it.
KAFKA_BACKEND = "{{kind: kafka, bootstrap_servers: [{servers}], idempotent_producer: {idempotent}}}"


async def run_demo(
    directory: Path,
    *,
    duration_s: float | None,
    rate: float,
    viewer_port: int = 8080,
    kafka: str | None = None,
    idempotent_producer: bool = True,
) -> int:
    """Runs until Ctrl-C (or ``duration_s``); returns the exit code.

    With ``kafka`` (``host:port``, comma-separated for several) the demo's topics
    live on that Kafka-protocol broker instead of the embedded log.
    """
    backend = (
        EMBEDDED_BACKEND
        if kafka is None
        else KAFKA_BACKEND.format(
            servers=", ".join(f"'{s.strip()}'" for s in kafka.split(",")),
            idempotent=str(idempotent_producer).lower(),
        )
    )
    directory.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before anything runs
    async with HandlerServer(seed=7) as handler:
        # Every 20th order fails its first attempt with a 503: the retry path at work.
        handler.when(
            lambda entry: (
                entry.offset is not None and entry.offset % 20 == 0 and entry.receipt == 1
            ),
            status=503,
        )
        # Orders above 480 break the handler's contract: they go to the DLQ at once.
        handler.when(
            lambda entry: _amount(entry.body) > 480,
            status=422,
            body='{"error": "amount above the loyalty limit"}',
        )
        config_path = directory / "nemesis.yaml"
        password = secrets.token_urlsafe(9)
        config_path.write_text(
            PROCESS_YAML.format(
                backend=backend,
                # On Kafka, state and DLQ files are for replicas of one host: the demo is one.
                single_host="" if kafka is None else "single_host: true\n",
                config=config_path,
                viewer_port=viewer_port,
                password_hash=hash_password(password),
                session_secret=secrets.token_urlsafe(48),
            )
        )
        integrations_dir = directory / "integrations"
        integrations_dir.mkdir(exist_ok=True)
        (integrations_dir / "demo-orders.yaml").write_text(
            INTEGRATION_YAML.format(topic=TOPIC, url=handler.url)
        )
        config = load_process_config(config_path)
        integrations, problems = load_integrations(Path(config.integrations_dir))
        if problems:
            for problem in problems:
                log.error("%s", problem)
            return 1
        broker = await open_backend(config)
        dlq = await open_dlq(config, broker=broker)
        state = await open_state(config)  # where the viewer keeps its sign-outs
        try:
            await broker.admin.create_topic(
                TOPIC, partitions=4, consumers=[ConsumerSpec("demo-orders")], exist_ok=True
            )
            proxy = Proxy(
                broker,
                integrations,
                dlq=dlq,
                pipelines_dir=config.pipelines_dir,
                runner_options=RunnerOptions(shutdown_grace_s=3),
            )
            services = []
            viewer_lines = []
            for service in plugin_services(config, proxy, dlq, broker, state):
                try:
                    service.bind()
                except OSError as exc:
                    log.warning("%s not started: %s", service.name, exc)
                    continue
                services.append(service)
                viewer_lines.append(f"  {service.name + ':':<17}{service.url}/ (demo / {password})")
            _print_banner(directory, handler.url, viewer_lines, config.backend.kind)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            try:
                async with asyncio.TaskGroup() as tasks:
                    proxy_task = tasks.create_task(proxy.run())
                    serving = [tasks.create_task(service.serve()) for service in services]
                    producer = tasks.create_task(_produce(broker, rate))
                    reporter = tasks.create_task(_report(broker, handler, proxy, dlq))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(duration_s):
                            await stop.wait()
                    producer.cancel()
                    proxy.stop()
                    await proxy_task
                    reporter.cancel()
                    for service in services:
                        service.stop()
                    await asyncio.gather(*serving)
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
            delivered = len(handler.ledger.done_ids())
            dead = await dlq.count(DeadLetterFilter())
            print(
                f"\nstopped: {delivered} orders delivered to the sample handler, {dead} in the DLQ"
                f"\n  look at them: nemesis dlq list -c {config_path}",
                flush=True,
            )
        finally:
            await state.close()
            await dlq.close()
            await broker.close()
    return 0


def _print_banner(directory: Path, handler_url: str, extra: list[str], kind: str) -> None:
    print(
        "\n".join(
            [
                f"Nemesis demo ({kind} backend)",
                f"  data and YAML:   {directory}/ (the integration: integrations/demo-orders.yaml)",
                f"  sample handler:  {handler_url}events/order",
                "                   every 20th order fails once (503: retried through a tier),",
                "                   orders above 480 are rejected (422: dead-lettered)",
                f"  producer:        sample orders into topic '{TOPIC}' (4 partitions)",
                "  pipeline:        only msk/spb orders over 100 reach the handler (~20%)",
                *extra,
                "  stop with Ctrl-C",
                "",
            ]
        ),
        flush=True,
    )


async def _produce(broker: Broker, rate: float) -> None:
    writer = await broker.writer(TOPIC, producer_id="nemesis-demo")
    rng = random.Random(1)
    started = time.monotonic()
    sequence = 0
    try:
        while True:
            # The orders due by now, in one write: the rate holds whatever a write's
            # round trip costs (a networked broker's is milliseconds).
            due = int((time.monotonic() - started) * rate) + 1
            batch = []
            while sequence < due:
                sequence += 1
                order = {
                    "id": f"order-{sequence}",
                    "city": rng.choice(CITIES),
                    "amount": round(rng.uniform(5, 500), 2),
                    "ts": time.time(),
                }
                batch.append(
                    OutgoingMessage(
                        value=orjson.dumps(order),
                        key=str(order["id"]),
                        metadata={"type": "order.created"},
                    )
                )
            if batch:
                await writer.write(batch)
            await asyncio.sleep(min(1.0 / rate, 0.05))
    finally:
        await writer.close()


def _amount(body: bytes) -> float:
    try:
        amount = orjson.loads(body).get("amount", 0)
    except (orjson.JSONDecodeError, AttributeError):
        return 0.0
    return float(amount) if isinstance(amount, int | float) else 0.0


async def _report(
    broker: Broker, handler: HandlerServer, proxy: Proxy, dlq: DeadLetterStore
) -> None:
    while True:
        await asyncio.sleep(5)
        description = await broker.admin.describe_topic(TOPIC)
        produced = sum(p.end_offset - p.start_offset for p in description.partitions)
        lag = sum(
            p.end_offset - p.committed.get("demo-orders", p.start_offset)
            for p in description.partitions
        )
        retried = sum(1 for entry in handler.ledger if not entry.done)
        filtered = proxy.metrics.registry.get_sample_value(
            "nemesis_stage_messages_total",
            {"integration": "demo-orders", "stage": "msk-spb-over-100", "outcome": "filtered"},
        )
        dead = await dlq.count(DeadLetterFilter())
        print(
            f"produced {produced:>6}  filtered {int(filtered or 0):>6}  "
            f"delivered {len(handler.ledger.done_ids()):>6}  "
            f"failed attempts {retried:>4}  dead-lettered {dead:>3}  commit lag {lag:>4}",
            flush=True,
        )
