"""Helpers of the operability tests (admin API, metrics, reload): real parts, in one process.

The proxy runs on the embedded broker in a SQLite file under tmp_path and
delivers to a real ``HandlerServer`` on 127.0.0.1; the admin API is the real
FastAPI app, called through httpx's ASGI transport in the same event loop
(the proxy's state belongs to that loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemesis.admin import create_admin_app
from nemesis.broker.embedded import EmbeddedBroker
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.config.models import IntegrationConfig
from nemesis.runtime.app import Proxy
from nemesis.runtime.reload import ConfigReloader
from nemesis.runtime.runner import RunnerOptions

TOKEN = "test-admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=5)
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def integration(name: str, url: str, **sections: Any) -> IntegrationConfig:
    """An integration reading ``orders`` as consumer ``name``; sections replace the defaults."""
    document: dict[str, Any] = {
        "name": name,
        "owners": [f"team-{name}"],
        "source": {"topic": "orders", "consumer": name},
        "target": {"url": url, "timeout_s": 5},
        "delivery": {"workers": 8, "buffer": 500},
        "retry": {"tiers": ["200ms", "400ms"]},
    }
    document.update(sections)
    return IntegrationConfig.model_validate(document)


def integration_yaml(name: str, url: str, *, extra: str = "", workers: int = 8) -> str:
    """The YAML of ``integration(name, url)``, for files in an integrations directory."""
    return (
        f"name: {name}\n"
        f"owners: [team-{name}]\n"
        f"source: {{topic: orders, consumer: {name}}}\n"
        f"target: {{url: '{url}', timeout_s: 5}}\n"
        f"delivery: {{workers: {workers}, buffer: 500}}\n"
        "retry: {tiers: [200ms, 400ms]}\n" + extra
    )


async def publish(
    broker: EmbeddedBroker,
    count: int,
    *,
    consumers: Sequence[str] = (),
    partitions: int = 4,
    types: Sequence[str] = ("order.created",),
    start: int = 0,
) -> None:
    """``count`` messages ``{"n": n}`` to ``orders``, typed round-robin from ``types``."""
    await broker.admin.create_topic(
        "orders",
        partitions=partitions,
        consumers=[ConsumerSpec(c) for c in consumers],
        exist_ok=True,
    )
    writer = await broker.writer("orders")
    try:
        for first in range(start, start + count, 1000):
            await writer.write(
                [
                    OutgoingMessage(
                        value=orjson.dumps({"n": n}),
                        metadata={"type": types[n % len(types)]},
                        partition=n % partitions,
                    )
                    for n in range(first, min(start + count, first + 1000))
                ]
            )
    finally:
        await writer.close()


async def committed(broker: EmbeddedBroker, consumer: str, topic: str = "orders") -> int:
    """Messages of ``topic`` committed by ``consumer``, over every partition."""
    description = await broker.admin.describe_topic(topic)
    return sum(p.committed.get(consumer, p.start_offset) for p in description.partitions)


async def end_offsets(broker: EmbeddedBroker, topic: str = "orders") -> int:
    description = await broker.admin.describe_topic(topic)
    return sum(p.end_offset for p in description.partitions)


@contextlib.asynccontextmanager
async def running(proxy: Proxy) -> AsyncIterator[Proxy]:
    """Runs the proxy for the block; stops it and waits for the drain on the way out."""
    task = asyncio.create_task(proxy.run(), name="proxy under test")
    try:
        await wait_until_true(lambda: proxy.running)
        yield proxy
    finally:
        proxy.stop()
        await task


async def watch_sees(reloader: ConfigReloader, folder: Path) -> None:
    """Returns once the running reloader's watcher sees a change in ``folder`` (a probe file)."""
    probe = folder / ".watch-probe"
    for attempt in range(100):
        seen = reloader.last
        probe.write_text(str(attempt))
        for _ in range(10):
            await asyncio.sleep(0.02)
            last = reloader.last
            if last is not seen and last is not None and last.trigger == "watch":
                return
    pytest.fail(f"the reloader's watcher never saw a change in {folder}")


@contextlib.asynccontextmanager
async def reloading(
    reloader: ConfigReloader, watched: Path | None = None
) -> AsyncIterator[ConfigReloader]:
    """Runs the reloader; with ``watched``, returns once its watcher sees changes there.

    The watcher starts in a task of its own: an edit made before it is up is
    never seen as a change, so a test that edits files first proves it is up.
    """
    task = asyncio.create_task(reloader.run(), name="reloader under test")
    try:
        if watched is not None:
            await watch_sees(reloader, watched)
        yield reloader
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def admin_client(
    proxy: Proxy, *, token: str | None = TOKEN, reloader: ConfigReloader | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the admin API over the proxy, in this event loop."""
    app = create_admin_app(proxy, token=token, reloader=reloader)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
        yield client


async def wait_until_true(check: Any, timeout_s: float = 10.0, step_s: float = 0.02) -> None:
    """Polls ``check()`` until it is true; fails the test after ``timeout_s``."""
    # Polling on purpose: the conditions are any state of the proxy, with no event to wait on.
    for _ in range(max(1, round(timeout_s / step_s))):
        if check():
            return
        await asyncio.sleep(step_s)
    if not check():
        pytest.fail(f"condition not met within {timeout_s}s")


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A Prometheus text scrape: sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def value_of(
    scrape: Mapping[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    matches = [
        value
        for sample_labels, value in scrape.get(name, [])
        if all(sample_labels.get(key) == wanted for key, wanted in labels.items())
    ]
    assert len(matches) == 1, f"{name}{labels}: {matches}"
    return matches[0]


def promtool() -> str:
    """The promtool binary (Debian's ``prometheus`` package ships it)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (see .ci/run)")
    return path


def run_promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Runs promtool and returns its result (the caller asserts on it)."""
    return subprocess.run(
        [promtool(), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def metric_names(text: str) -> set[str]:
    """Every family and sample name in a scrape (``x``, ``x_total``, ``x_bucket``, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def first_time(times: Iterable[float], condition: Any) -> float | None:
    """The first of ``times`` where ``condition(t)`` holds."""
    for moment in times:
        if condition(moment):
            return moment
    return None


class SkewClock:
    """The system clock, moved forward at will: ``skip(60)`` makes a minute pass at once.

    For tests that need minutes to pass (a consumer stuck for ten minutes)
    while the proxy keeps running on real I/O: sleeps stay real.
    """

    def __init__(self) -> None:
        self.offset = 0.0

    def skip(self, seconds: float) -> None:
        self.offset += seconds

    def time(self) -> float:
        return time.time() + self.offset

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def humanize_duration(seconds: float) -> str:
    """Prometheus' ``humanizeDuration`` template function, for durations of a second or more."""
    whole = int(seconds)
    days, hours, minutes, secs = whole // 86400, whole // 3600 % 24, whole // 60 % 60, whole % 60
    if days:
        return f"{days}d {hours}h {minutes}m {secs}s"
    if hours:
        return f"{hours}h {minutes}m {secs}s"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{seconds:.4g}s"
