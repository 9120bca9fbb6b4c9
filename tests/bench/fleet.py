"""A fleet of real ``nemesis run`` processes: spread, handover, a shared rate, PATCH propagation.

Every replica is a ``nemesis run`` subprocess on one embedded broker and one
state file, with its own admin port; the handler is ``HandlerServer``. Rows:

  spread             60 integrations over 3 replicas: how many each runs (target 20 +- 4)
  handover           kill -9 of one replica -> every integration runs on the other two
                     (target: within the lease; the broker's partition leases expire alike)
  shared rate        one integration on 2 replicas (replicas: all), rate_limits.main: 200:
                     the busiest 5 s at the handler (target: at most 210/s)
  PATCH propagation  PATCH on replica 0 -> in effect on replica 1 (target: 3 s), and on
                     replica 1 restarted (from its start to its first answer showing it)
  idle cost          with --idle: CPU and RSS of one process running 100 and 500 integrations
                     that receive nothing (measured only; the target is 5% of a core, 400 MB)

Usage: ``python tests/bench/fleet.py [--lease-s 10] [--poll-s 1] [--idle]``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from nemesis.testing import HandlerServer

TOKEN = "fleet-bench-token-0123456789"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Fleet:
    """Replicas of one configuration in one directory."""

    def __init__(self, root: Path, *, lease_s: float, poll_s: float) -> None:
        self.root = root
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.ports: dict[int, int] = {}
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        (root / "integrations").mkdir(parents=True, exist_ok=True)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "nemesis", *args, "-c", self.config(0)],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"nemesis {' '.join(args)}: {done.stderr}")
        return done

    def config(self, n: int) -> str:
        port = self.ports.setdefault(n, free_port())
        path = self.root / f"replica-{n}.yaml"
        path.write_text(
            f"backend: {{kind: embedded, path: nemesis.db, lease_s: {self.lease_s}}}\n"
            f"state: {{kind: sqlite, path: state.db, lease_s: {self.lease_s},"
            f" poll_s: {self.poll_s}}}\n"
            "data_dir: .\n"
            "integrations_dir: integrations\n"
            "shutdown_grace_s: 5\n"
            f"admin: {{port: {port}, token: {TOKEN}}}\n"
            "viewer: {enabled: false}\n"
            "reload: {watch: false}\n"
        )
        return path.name

    def integration(self, name: str, url: str, extra: str = "") -> None:
        (self.root / "integrations" / f"{name}.yaml").write_text(
            f"name: {name}\nowners: [bench]\nsource: {{topic: orders, consumer: {name}}}\n"
            f"target: {{url: '{url}'}}\ndelivery: {{workers: 16, buffer: 200}}\n"
            "retry: {tiers: []}\n" + extra
        )

    async def start(self, n: int) -> None:
        log = (self.root / f"stderr-{n}.log").open("ab")
        self.processes[n] = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nemesis",
            "run",
            "-c",
            self.config(n),
            cwd=self.root,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log,
        )
        log.close()

    async def stop(self, n: int, sig: int = signal.SIGTERM) -> None:
        process = self.processes.pop(n)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        await process.wait()

    async def stop_all(self) -> None:
        for n in list(self.processes):
            await self.stop(n)

    async def get(self, n: int, path: str) -> Any:
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                response = await client.get(f"http://127.0.0.1:{self.ports[n]}{path}")
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    async def settled(self, n: int, members: int) -> dict[str, Any] | None:
        fleet = await self.get(n, "/fleet")
        if fleet is None or len(fleet["members"]) != members:
            return None
        live = {m["member_id"] for m in fleet["members"]}
        for placed in fleet["integrations"]:
            running = set(placed["running"])
            if not running or running != set(placed["assigned"]) or running - live:
                return None
        found: dict[str, Any] = fleet
        return found


async def until(check: Callable[[], Awaitable[Any]], timeout_s: float, step_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := await check():
            return found
        await asyncio.sleep(step_s)
    raise TimeoutError(f"not within {timeout_s}s")


async def spread_and_handover(root: Path, args: argparse.Namespace) -> dict[str, str]:
    fleet = Fleet(root, lease_s=args.lease_s, poll_s=args.poll_s)
    try:
        async with HandlerServer() as handler:
            for n in range(60):
                fleet.integration(f"team-{n:02d}", f"{handler.url}team-{n:02d}")
            fleet.cli("topics", "create", "orders", "--partitions", "4")
            for n in range(3):
                await fleet.start(n)
            placed = await until(lambda: fleet.settled(0, 3), 180)
            counts = sorted(m["running"] for m in placed["members"])
            victim = fleet.processes[2].pid
            killed = time.monotonic()
            await fleet.stop(2, signal.SIGKILL)
            await until(lambda: fleet.settled(0, 2), 120)
            handover_s = time.monotonic() - killed
            await fleet.stop_all()
        return {
            "spread (60 over 3)": f"{' / '.join(map(str, counts))} integrations   (target 20 +- 4)",
            "handover after kill -9": f"{handover_s:.1f} s with {args.lease_s:g} s leases"
            f" (pid {victim})   (target: within the lease)",
        }
    finally:
        await fleet.stop_all()


def busiest(times: list[float], window_s: float) -> int:
    ordered = sorted(times)
    return max(bisect.bisect_left(ordered, start + window_s) - i for i, start in enumerate(ordered))


async def shared_rate(root: Path, args: argparse.Namespace) -> dict[str, str]:
    fleet = Fleet(root, lease_s=args.lease_s, poll_s=args.poll_s)
    try:
        async with HandlerServer() as handler:
            fleet.integration("heavy", handler.url, "replicas: all\nrate_limits: {main: 200}\n")
            fleet.cli("topics", "create", "orders", "--partitions", "4")
            for n in range(2):
                await fleet.start(n)

            async def both() -> bool:
                placed = await fleet.settled(0, 2)
                status = await fleet.get(1, "/integrations/heavy")
                if placed is None or status is None:
                    return False
                main = next(f for f in status["flows"] if f["flow"] == "main")
                return bool(main["assigned_partitions"])

            await until(both, 120)
            count = 3000
            lines = root / "orders.jsonl"
            lines.write_text("".join(json.dumps({"id": n}) + "\n" for n in range(count)))
            fleet.cli("publish", "orders", "--file", lines.name, "--lines")

            async def arrived() -> bool:
                return len({e.id for e in handler.ledger if e.done}) >= count

            await until(arrived, 120, step_s=0.2)
            times = [e.received_monotonic for e in handler.ledger]
            await fleet.stop_all()
        peak = busiest(times, 5.0) / 5
        mean = len(times) / (max(times) - min(times))
        return {
            "two replicas, rate 200/s": f"busiest 5 s: {peak:.0f}/s, mean {mean:.0f}/s"
            "   (target: at most 210/s)",
        }
    finally:
        await fleet.stop_all()


async def patch_propagation(root: Path, args: argparse.Namespace) -> dict[str, str]:
    fleet = Fleet(root, lease_s=args.lease_s, poll_s=args.poll_s)
    try:
        async with HandlerServer() as handler:
            fleet.integration("loyalty", handler.url, "replicas: all\n")
            fleet.cli("topics", "create", "orders", "--partitions", "2")
            for n in range(2):
                await fleet.start(n)
            await until(lambda: fleet.settled(0, 2), 120)

            async def workers_on_1() -> bool:
                status = await fleet.get(1, "/integrations/loyalty")
                drift = {} if status is None else {s["field"]: s["value"] for s in status["drift"]}
                return drift.get("delivery.workers") == 9

            async with httpx.AsyncClient(timeout=10) as client:
                sent = time.monotonic()
                response = await client.patch(
                    f"http://127.0.0.1:{fleet.ports[0]}/integrations/loyalty",
                    json={"delivery": {"workers": 9}},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
                response.raise_for_status()
            await until(workers_on_1, 30, step_s=0.02)
            propagated_s = time.monotonic() - sent
            await fleet.stop(1)
            restarted = time.monotonic()
            await fleet.start(1)
            await until(lambda: fleet.get(1, "/healthz"), 60, step_s=0.02)
            answering_s = time.monotonic() - restarted
            shown = await workers_on_1()
            await fleet.stop_all()
        return {
            "PATCH on the other replica": f"{propagated_s:.2f} s with poll_s {args.poll_s:g}"
            "   (target 3 s)",
            "PATCH after a restart": f"{'in effect' if shown else 'NOT in effect'} at the first"
            f" answer, {answering_s:.1f} s after the start",
        }
    finally:
        await fleet.stop_all()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def idle_cost(root: Path, args: argparse.Namespace, count: int) -> dict[str, str]:
    fleet = Fleet(root, lease_s=args.lease_s, poll_s=args.poll_s)
    try:
        for n in range(count):
            fleet.integration(f"idle-{n:03d}", "http://127.0.0.1:9/")
        fleet.cli("topics", "create", "orders", "--partitions", "4")
        await fleet.start(0)
        await until(lambda: fleet.settled(0, 1), 300, step_s=0.5)
        await asyncio.sleep(10)  # past the start
        pid = fleet.processes[0].pid
        cpu, wall = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(args.idle_s)
        share = (cpu_seconds(pid) - cpu) / (time.monotonic() - wall)
        memory = rss_mb(pid)
        await fleet.stop_all()
        return {
            f"idle, {count} integrations": f"{share * 100:.1f}% of a core, {memory:.0f} MB RSS"
            "   (target 5%, 400 MB at 500)"
        }
    finally:
        await fleet.stop_all()


async def main(args: argparse.Namespace) -> None:
    rows: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="nemesis-fleet-bench-") as tmp:
        rows |= await spread_and_handover(Path(tmp, "spread"), args)
        rows |= await shared_rate(Path(tmp, "rate"), args)
        rows |= await patch_propagation(Path(tmp, "patch"), args)
        if args.idle:
            for count in (100, 500):
                rows |= await idle_cost(Path(tmp, f"idle-{count}"), args, count)
    width = max(map(len, rows))
    for name, figure in rows.items():
        print(f"{name:<{width}}  {figure}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lease-s", type=float, default=10.0, help="state and broker leases")
    parser.add_argument("--poll-s", type=float, default=1.0, help="state.poll_s")
    parser.add_argument("--idle", action="store_true", help="also the idle cost of 100/500")
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle measuring time")
    asyncio.run(main(parser.parse_args()))
