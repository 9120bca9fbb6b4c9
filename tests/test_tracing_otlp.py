"""``nemesis run`` with ``tracing.enabled``: spans reach an OTLP/HTTP receiver in another process.

The real CLI in a subprocess on the embedded log, exporting with the SDK's
OTLP exporter to ``tests/bench/otlp_receiver.py`` (an OTLP/HTTP endpoint that
decodes each export with the OTLP protobuf schema); a record with a
producer's ``traceparent`` and one without. Every attempt's span arrives,
each in its message's trace, the producer's one as its parent's child, by the
time the process has stopped (the buffered spans are exported on the way out).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from nemesis.testing import HandlerServer
from tests.conftest import REPO, Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import free_port

pytestmark = pytest.mark.timeout(120)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[int]:
    """The OTLP receiver's port, in a process of its own."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "bench" / "otlp_receiver.py"), "--port", str(port)]
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                spans_at(port)
                break
            except OSError:
                assert time.monotonic() < deadline, "the OTLP receiver did not start"
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def spans_at(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/count", timeout=2) as answer:
        count: int = json.load(answer)["spans"]
        return count


def exported(port: int) -> list[dict[str, str]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/spans", timeout=2) as answer:
        spans: list[dict[str, str]] = json.load(answer)
        return spans


async def test_run_exports_each_attempts_span_over_otlp(
    workspace: Workspace, receiver: int
) -> None:
    workspace.write_config(
        f"tracing: {{enabled: true, otlp_endpoint: 'http://127.0.0.1:{receiver}/v1/traces'}}\n"
    )
    topic = "orders"
    created = workspace.cli("topics", "create", topic, "--partitions", "1")
    assert created.returncode == 0, created.stderr
    for data, headers in (
        ('{"n": 0}', ["--header", f"traceparent=00-{TRACE_ID}-{PARENT}-01"]),
        ('{"n": 1}', []),
    ):
        published = workspace.cli("publish", topic, data, *headers)
        assert published.returncode == 0, published.stderr
    async with HandlerServer() as handler:
        handler.fail_first(1, status=503)  # each message: one retry, then taken
        workspace.write_integration("it", integration_yaml("it", handler.url, topic=topic))
        proxy = await workspace.start("run")
        await handler.ledger.wait_until(
            lambda ledger: sum(e.done for e in ledger) >= 2, timeout_s=60
        )
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    spans = exported(receiver)
    assert len(spans) == 4, spans
    assert {s["name"] for s in spans} == {f"process {topic}"}
    by_trace: dict[str, list[dict[str, str]]] = {}
    for span in spans:
        by_trace.setdefault(span["trace_id"], []).append(span)
    assert len(by_trace) == 2
    producers = by_trace.pop(TRACE_ID)
    assert {s["parent_span_id"] for s in producers} == {PARENT}
    [started] = by_trace.values()
    assert len(started) == 2
    assert len({s["parent_span_id"] for s in started}) == 1  # one origin, two attempts
    # The handler heard each attempt's span as its parent.
    heard = {e.headers["traceparent"].split("-")[2] for e in handler.ledger}
    assert heard == {s["span_id"] for s in spans}
