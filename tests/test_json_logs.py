"""``log_format: json``: every stderr line of a real run is one JSON object (deploy/README.md).

The real CLI in subprocesses, on the embedded log and on Apache Kafka: topic
admin, publish, init, run (a dead letter, a retry), ``dlq list``. Every line
each command writes to stderr must parse as JSON, other libraries' records
(aiokafka's) included, and none of theirs below WARNING by default; the
dead-letter and retry lines carry their coordinates as fields.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import KafkaBroker, Namespace, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def json_lines(text: str, where: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object; a line that is not one fails the case."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"{where}, line {number} is not JSON: {line!r}")
        assert isinstance(record, dict), line
        assert {"ts", "level", "logger", "msg"} <= record.keys(), line
        records.append(record)
    return records


def configure(space: Workspace, backend: str, bootstrap: str | None) -> None:
    """nemesis.yaml for the backend, with JSON logs."""
    if backend == "kafka":
        assert bootstrap is not None
        (space.root / "nemesis.yaml").write_text(
            "backend:\n"
            "  kind: kafka\n"
            f"  bootstrap_servers: ['{bootstrap}']\n"
            "  heartbeat_interval_s: 1\n"
            "single_host: true\n"
            "data_dir: .\n"
            "integrations_dir: integrations\n"
            f"admin: {{port: {free_port()}}}\n"
            "viewer: {port: 0, enabled: false}\n"
            "log_format: json\n"
        )
        (space.root / "integrations").mkdir(exist_ok=True)
    else:
        space.write_config("log_format: json\n")


@pytest.mark.parametrize("backend", ["embedded", "kafka"])
async def test_every_stderr_line_of_a_run_is_json_with_the_coordinates_as_fields(
    workspace: Workspace, backend: str, request: pytest.FixtureRequest
) -> None:
    bootstrap = None
    if backend == "kafka":
        kafka: KafkaBroker = request.getfixturevalue("kafka")
        bootstrap = kafka.bootstrap
    configure(workspace, backend, bootstrap)
    ns = Namespace()
    topic, name = ns("orders"), ns("loyalty")
    stderr: dict[str, str] = {}

    def cli(*args: str) -> str:
        done = workspace.cli(*args, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        stderr[" ".join(args[:2])] = done.stderr
        return done.stdout

    cli("topics", "create", topic, "--partitions", "1")
    # Dead-lettered at once (422), in the producer's trace.
    cli("publish", topic, '{"n": 0}', "--header", f"traceparent={TRACEPARENT}")
    cli("publish", topic, '{"n": 1}')  # retried once (503), then taken
    async with HandlerServer() as handler:
        handler.when(lambda e: b'"n": 0' in e.body, status=422)
        handler.when(lambda e: b'"n": 1' in e.body and e.receipt == 1, status=503)
        workspace.write_integration(name, integration_yaml(name, handler.url, topic=topic))
        cli("init")
        proxy = await workspace.start("run")
        await workspace.wait_for_log(proxy, "dead-lettered", timeout_s=120)
        await handler.ledger.wait_until(
            lambda ledger: any(e.done and b'"n": 1' in e.body for e in ledger), timeout_s=120
        )
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    cli("dlq", "list")
    cli("topics", "describe", topic)

    for command, text in stderr.items():
        json_lines(text, f"nemesis {command}")
    run = json_lines(workspace.logs(), "nemesis run")
    everything = run + [r for text in stderr.values() for r in json_lines(text, "cli")]
    # Other libraries speak at WARNING and above unless told otherwise.
    chatty = [
        r
        for r in everything
        if not r["logger"].startswith("nemesis") and r["level"] in ("debug", "info")
    ]
    assert chatty == [], chatty[:5]

    [dead] = [r for r in run if "dead-lettered" in r["msg"]]
    assert dead["level"] == "warning"
    assert {k: dead.get(k) for k in ("integration", "topic", "partition", "offset")} == {
        "integration": name,
        "topic": topic,
        "partition": 0,
        "offset": 0,
    }
    assert dead["event_id"] == f"{topic}:0:0"
    assert dead["attempt"] == 1
    assert dead["trace_id"] == TRACE_ID
    assert dead["reason"] == "http_4xx"
    retried = [r for r in run if "retries since the last report" in r["msg"]]
    assert retried, [r["msg"] for r in run]
    first = retried[0]
    assert first["integration"] == name
    assert first["event_id"] == f"{topic}:0:1"
    assert (first["topic"], first["partition"], first["offset"], first["attempt"]) == (
        topic,
        0,
        1,
        1,
    )
    assert len(first["trace_id"]) == 32  # the trace Nemesis started for it
