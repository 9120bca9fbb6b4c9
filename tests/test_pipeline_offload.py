"""Costly pipelines run off the event loop, with the same result as cheap ones.

A real proxy on the embedded broker delivers to a real handler on loopback:
a payload above ``OFFLOAD_PIPELINE_BYTES`` (its pipeline runs in a worker
process) and small ones (inline) are transformed alike, and the filter drops
the same. ``PipelineProcesses`` runs a pipeline in a real worker process and
counts its stages as if inline; ``PipelineCost`` offloads by measured cost.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.pipeline import build_integration_pipeline
from nemesis.pipeline.compiled import StageMark
from nemesis.pipeline.offload import (
    OFFLOAD_PIPELINE_BYTES,
    WORKER_NICENESS,
    PipelineCost,
    PipelineProcesses,
)
from nemesis.processes import alive
from nemesis.runtime.app import Proxy
from nemesis.testing import HandlerServer
from tests.operability import FAST, integration, running

PIPELINE = [
    {"filter": {"match": {"keep": True}}},
    {"transform": {"set": {"seen": True}}},
]


async def test_large_and_small_payloads_go_through_the_pipeline_alike(tmp_path: Path) -> None:
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    try:
        await broker.admin.create_topic("orders", partitions=1, consumers=[ConsumerSpec("it")])
        padding = "x" * OFFLOAD_PIPELINE_BYTES
        documents = [
            {"n": 0, "keep": True, "pad": padding},  # large: off the loop
            {"n": 1, "keep": False, "pad": padding},  # large, filtered out
            {"n": 2, "keep": True},
            {"n": 3, "keep": False},
        ]
        writer = await broker.writer("orders")
        await writer.write([OutgoingMessage(value=orjson.dumps(d)) for d in documents])
        await writer.close()
        async with HandlerServer() as handler:
            proxy = Proxy(
                broker,
                {"it": integration("it", handler.url, pipeline=PIPELINE)},
                runner_options=FAST,
            )
            async with running(proxy):
                await handler.ledger.wait_for(2, timeout_s=30)
            bodies = [json.loads(entry.body) for entry in handler.ledger if entry.done]
        assert sorted(b["n"] for b in bodies) == [0, 2]
        assert all(b["seen"] is True for b in bodies)
        assert len(next(b for b in bodies if b["n"] == 0)["pad"]) == OFFLOAD_PIPELINE_BYTES
    finally:
        await broker.close()


async def test_a_worker_process_gives_the_inline_result_and_counts_the_stages(
    tmp_path: Path,
) -> None:
    config = integration("it", "http://127.0.0.1:9/", pipeline=PIPELINE)
    offloaded = build_integration_pipeline(config, pipelines_dir=tmp_path)
    inline = build_integration_pipeline(config, pipelines_dir=tmp_path)
    assert offloaded.recipe is not None
    messages = [
        Message("orders", 0, n, orjson.dumps({"n": n, "keep": n % 2 == 0})) for n in range(4)
    ]
    processes = PipelineProcesses(workers=1)
    try:
        for message in messages:
            result, seconds = await processes.process(offloaded, message, ())
            assert result == inline.process(message)
            assert seconds > 0
    finally:
        processes.close()
    assert processes.offloaded == len(messages)
    # The worker's stage counts were added to the pipeline of this process.
    counted = [(s.passed, s.filtered, s.failed) for s in offloaded.statistics().stages]
    assert counted == [(s.passed, s.filtered, s.failed) for s in inline.statistics().stages]
    assert counted == [(4, 0, 0), (2, 2, 0), (2, 0, 0)]  # decode, filter, transform


async def test_the_worker_runs_in_another_process_at_a_lower_priority(tmp_path: Path) -> None:
    processes = PipelineProcesses(workers=1)
    try:
        pool = processes._executor()
        pid, niceness = await asyncio.wrap_future(pool.submit(_whoami))
    finally:
        processes.close()
    assert pid != os.getpid()
    assert niceness == min(os.nice(0) + WORKER_NICENESS, 19)


def _whoami() -> tuple[int, int]:
    return os.getpid(), os.nice(0)


def test_the_cost_decides_once_measured() -> None:
    cost = PipelineCost(threshold_s=0.001)
    # Nothing measured yet: by size.
    assert not cost.costly(OFFLOAD_PIPELINE_BYTES - 1)
    assert cost.costly(OFFLOAD_PIPELINE_BYTES)
    # Cheap per byte (a filter on a large payload): large ones stay inline.
    cost.record(1_000_000, 0.0001)
    assert not cost.costly(OFFLOAD_PIPELINE_BYTES * 4)
    # Costly per byte (a heavy transform): small payloads go too, once the average says so.
    for _ in range(30):
        cost.record(10_000, 0.005)
    assert cost.costly(4_000)
    assert not cost.costly(100)


async def test_the_stages_marks_come_back_from_the_worker(tmp_path: Path) -> None:
    config = integration("it", "http://127.0.0.1:9/", pipeline=PIPELINE)
    offloaded = build_integration_pipeline(config, pipelines_dir=tmp_path)
    inline = build_integration_pipeline(config, pipelines_dir=tmp_path)
    processes = PipelineProcesses(workers=1)
    try:
        for keep in (True, False):
            message = Message("orders", 0, 1, orjson.dumps({"keep": keep}))
            there: list[StageMark] = []
            here: list[StageMark] = []
            await processes.process(offloaded, message, (), there)
            inline.process(message, here)
            assert [(m.stage, m.outcome) for m in there] == [(m.stage, m.outcome) for m in here]
            assert all(m.started <= m.ended for m in there)
    finally:
        processes.close()
    assert processes.offloaded == 2


async def test_a_killed_worker_is_replaced_and_its_message_runs_here(tmp_path: Path) -> None:
    config = integration("it", "http://127.0.0.1:9/", pipeline=PIPELINE)
    offloaded = build_integration_pipeline(config, pipelines_dir=tmp_path)
    inline = build_integration_pipeline(config, pipelines_dir=tmp_path)
    messages = [Message("orders", 0, n, orjson.dumps({"n": n, "keep": True})) for n in range(3)]
    processes = PipelineProcesses(workers=1)
    try:
        result, _ = await processes.process(offloaded, messages[0], ())
        assert result == inline.process(messages[0])
        pid, _ = await asyncio.wrap_future(processes._executor().submit(_whoami))
        os.kill(pid, signal.SIGKILL)
        # The message that meets the dead worker runs in this process; the next ones in a
        # new worker.
        for message in messages[1:]:
            result, _ = await processes.process(offloaded, message, ())
            assert result == inline.process(message)
        pid_after, _ = await asyncio.wrap_future(processes._executor().submit(_whoami))
    finally:
        processes.close()
    assert pid_after != pid
    assert processes.offloaded >= 2


WORKER_OF_A_DOOMED_PARENT = """
import asyncio, os, time
from nemesis.pipeline.offload import PipelineProcesses

async def main():
    processes = PipelineProcesses(workers=1)
    print(await asyncio.wrap_future(processes._executor().submit(os.getpid)), flush=True)
    time.sleep(600)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_workers_end_when_their_proxy_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "doomed.py"
    script.write_text(WORKER_OF_A_DOOMED_PARENT)
    with subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    ) as parent:
        try:
            assert parent.stdout is not None
            worker = int(parent.stdout.readline())
            assert alive(worker)
        finally:
            parent.kill()
    deadline = time.monotonic() + 60  # a bound on the watch's second, not a timed assertion
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker)
