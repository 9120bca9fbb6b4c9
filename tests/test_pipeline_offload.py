"""Pipelines of large payloads run off the event loop, with the same result as small ones.

A real proxy on the embedded broker delivers to a real handler on loopback:
a payload above ``OFFLOAD_PIPELINE_BYTES`` (its pipeline runs in a thread)
and small ones (inline) are transformed alike, and the filter drops the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.runtime.app import Proxy
from nemesis.runtime.runner import OFFLOAD_PIPELINE_BYTES
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
