"""Kafka takeover bench: how long a survivor takes to read a killed member's partitions.

Starts Apache Kafka on 127.0.0.1 (tests/kafka_broker.py), a topic of four
partitions and two `nemesis run` processes in one consumer group, each in a
workspace of its own, delivering to one handler server (10 ms per message).
Once both deliver, one is killed with SIGKILL: it sends no LeaveGroup, so the
coordinator waits for its session to expire. Printed, for each setting of
`session_timeout_s` / `heartbeat_interval_s`:

  - the delay from the kill to the survivor's first delivery of each of the
    dead member's partitions, and that delay over the session timeout
    (a ratio near 1 says the takeover is bound by the session timeout);
  - how many of the four partitions the survivor delivered from in each
    second of the five after the takeover (4 = it reads them all at once).

Usage: `python tests/bench/kafka_takeover.py [--messages N] [--setting 10/3 ...]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the test helpers and broker starter live in tests/

from nemesis.testing import HandlerServer  # noqa: E402
from tests.conftest import Workspace, integration_yaml, kill_hard, stop_gracefully  # noqa: E402
from tests.kafka_broker import KafkaBroker, free_port, start_kafka  # noqa: E402

PARTITIONS = 4
AFTER_S = 5  # seconds watched after the takeover


def configure(space: Workspace, bootstrap: str, session_s: float, heartbeat_s: float) -> None:
    space.root.mkdir(parents=True)
    (space.root / "nemesis.yaml").write_text(
        "backend:\n"
        "  kind: kafka\n"
        f"  bootstrap_servers: ['{bootstrap}']\n"
        f"  session_timeout_s: {session_s}\n"
        f"  heartbeat_interval_s: {heartbeat_s}\n"
        "single_host: true\n"
        "data_dir: .\n"
        "integrations_dir: integrations\n"
        f"admin: {{port: {free_port()}}}\n"
        "viewer: {port: 0, enabled: false}\n"
    )
    (space.root / "integrations").mkdir()


def cli(space: Workspace, *args: str) -> None:
    done = space.cli(*args, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"nemesis {' '.join(args)}: {done.stdout}{done.stderr}")


async def one_round(
    root: Path, kafka: KafkaBroker, topic: str, messages: int, session_s: float, heartbeat_s: float
) -> tuple[list[float], list[int]]:
    """(delays of the dead member's partitions in s, partitions read per second after)."""
    a, b = Workspace(root / "a"), Workspace(root / "b")
    for space in (a, b):
        configure(space, kafka.bootstrap, session_s, heartbeat_s)
    cli(a, "topics", "create", topic, "--partitions", str(PARTITIONS))
    with (a.root / "orders.jsonl").open("wb") as out:
        for n in range(messages):
            out.write(orjson.dumps({"id": f"order-{n}"}) + b"\n")
    cli(a, "publish", topic, "--file", "orders.jsonl", "--lines", "--key-field", "id")
    try:
        async with HandlerServer() as handler:
            handler.delay(0.01)
            for name, space in (("a", a), ("b", b)):
                text = integration_yaml(
                    "shared", handler.url, topic=topic, workers=2, buffer=20, headers={"x-by": name}
                )
                space.write_integration("shared", text)
            cli(a, "init")
            proxy_a = await a.start("run")
            await b.start("run")

            def partitions_of(name: str, since: float = 0.0) -> set[int]:
                return {
                    e.partition
                    for e in handler.ledger
                    if e.headers.get("x-by") == name
                    and e.partition is not None
                    and e.received_monotonic >= since
                }

            deadline = time.monotonic() + 120
            while not (partitions_of("a") and partitions_of("b")):
                if time.monotonic() > deadline:
                    raise SystemExit("the two members never both delivered")
                await asyncio.sleep(0.1)
            await asyncio.sleep(1)  # both steady
            owned_by_a = partitions_of("a", time.monotonic() - 1)
            killed_at = time.monotonic()
            kill_hard(proxy_a)
            await proxy_a.wait()
            first: dict[int, float] = {}
            deadline = killed_at + 120
            while first.keys() < owned_by_a:
                for e in handler.ledger:
                    if (
                        e.headers.get("x-by") == "b"
                        and e.partition in owned_by_a
                        and e.received_monotonic > killed_at
                    ):
                        first.setdefault(e.partition, e.received_monotonic - killed_at)
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"no takeover within 120 s: {first}; {len(handler.ledger)} delivered"
                        f" of {messages}; the survivor's log:\n{b.logs()[-3000:]}"
                    )
                await asyncio.sleep(0.05)
            took_over = killed_at + max(first.values())
            await asyncio.sleep(AFTER_S + 0.5)
            per_second = [
                len(
                    {
                        e.partition
                        for e in handler.ledger
                        if e.headers.get("x-by") == "b"
                        and took_over + n <= e.received_monotonic < took_over + n + 1
                    }
                )
                for n in range(AFTER_S)
            ]
    finally:
        for space in (a, b):
            for process in space.processes:
                if process.returncode is None:
                    await stop_gracefully(process)
            for log_file in space.log_files:
                log_file.close()
    return sorted(first.values()), per_second


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="nemesis-takeover-") as tmp:
        root = Path(tmp)
        kafka = start_kafka(root / "kafka")
        try:
            for n, setting in enumerate(args.setting):
                session_s, heartbeat_s = (float(x) for x in setting.split("/"))
                for r in range(args.repeat):
                    delays, per_second = await one_round(
                        root / f"round-{n}-{r}",
                        kafka,
                        f"takeover-{n}-{r}",
                        args.messages,
                        session_s,
                        heartbeat_s,
                    )
                    print(
                        f"session_timeout_s={session_s:g} heartbeat_interval_s={heartbeat_s:g}:"
                        f" partitions taken over after {[round(d, 2) for d in delays]} s"
                        f" (slowest / session timeout = {max(delays) / session_s:.2f});"
                        f" partitions read per second after: {per_second}"
                        f" (mean {statistics.mean(per_second):.1f} of {PARTITIONS})",
                        flush=True,
                    )
        finally:
            kafka.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--setting",
        action="append",
        help="session_timeout_s/heartbeat_interval_s (repeatable; default 10/3 and 6/2; Apache Kafka refuses a session below group.min.session.timeout.ms, 6 s by default)",
    )
    parsed = parser.parse_args()
    parsed.setting = parsed.setting or ["10/3", "6/2"]
    sys.exit(asyncio.run(main(parsed)))
