"""Idle-cost benchmark: what N integrations cost one `nemesis run` process when nothing flows.

For each N (default 100, 500, 1000) it writes N integrations (each with its own
4-partition source topic, three retry tiers and a replay topic, the DLQ on), starts
`nemesis run` on the embedded backend and measures:

  ready_s    start until the admin API's /readyz answers 200,
  running_s  start until every flow of every integration is running (/integrations),
  cpu        CPU seconds the process consumed (all threads, /proc/<pid>/stat) over
             --window seconds of idling, after --settle seconds; shown as % of one core,
  rss_mb     resident memory at the end of the window.

CPU is counted as CPU seconds consumed, not read off wall-clock rates, so other load on
the machine stretches the run but barely moves the figure; each N is run --repeat times
and the spread (min..max) is printed.

``--baseline PATH`` runs the same measurements against another checkout (its own .venv,
made with ``make install`` there) and prints both side by side. Usage:

    python tests/bench/idle.py [--counts 100 500 1000] [--baseline ../main-checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PARTITIONS = 4
TIERS = 3
# Flows per integration: main, one per retry tier, replay.
FLOWS = 1 + TIERS + 1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class Run:
    count: int
    ready_s: float
    running_s: float
    cpu_s: float
    window_s: float
    rss_mb: float

    @property
    def core_pct(self) -> float:
        return 100 * self.cpu_s / self.window_s


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of the process (fields 14 and 15 of /proc/pid/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def get_json(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, None


def make_workspace(root: Path, python: str, count: int) -> None:
    """nemesis.yaml, N integration files, and their source topics in the broker's file."""
    (root / "integrations").mkdir(parents=True)
    (root / "nemesis.yaml").write_text(
        "backend: {kind: embedded, path: idle.db}\n"
        "dlq: {kind: sqlite, path: dlq.db}\n"
        "data_dir: .\nintegrations_dir: integrations\n"
        f"pipelines_dir: {REPO / 'pipelines'}\n"
        f"admin: {{host: 127.0.0.1, port: {free_port()}}}\n"
        f"viewer: {{host: 127.0.0.1, port: {free_port()}}}\n"
        f"auth: {{session_secret: '{secrets.token_urlsafe(48)}'}}\n"
    )
    # Nobody listens there: nothing is delivered while idle.
    target = f"http://127.0.0.1:{free_port()}/events"
    for n in range(count):
        name = f"idle-{n:04d}"
        (root / "integrations" / f"{name}.yaml").write_text(
            f"name: {name}\nowners: [bench]\n"
            f"source: {{topic: {name}, consumer: {name}}}\n"
            f"target: {{url: '{target}', timeout_s: 5}}\n"
            "delivery: {workers: 8, buffer: 1000}\n"
            "retry: {tiers: [1m, 5m, 15m]}\n"
        )
    script = (
        "import asyncio, sys\n"
        "from nemesis.broker.embedded import open_embedded\n"
        "async def main():\n"
        "    broker = await open_embedded('idle.db', data_dir=sys.argv[1])\n"
        "    try:\n"
        "        for n in range(int(sys.argv[2])):\n"
        f"            await broker.admin.create_topic(f'idle-{{n:04d}}', partitions={PARTITIONS})\n"
        "    finally:\n"
        "        await broker.close()\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([python, "-c", script, str(root), str(count)], check=True)


def admin_url(root: Path) -> str:
    for line in (root / "nemesis.yaml").read_text().splitlines():
        if line.startswith("admin:"):
            port = line.split("port:")[1].strip(" }")
            return f"http://127.0.0.1:{port}"
    raise RuntimeError("no admin port in nemesis.yaml")


def all_running(url: str, count: int) -> bool:
    status, body = get_json(f"{url}/integrations")
    if status != 200 or not isinstance(body, dict):
        return False
    integrations = body["integrations"]
    if len(integrations) != count:
        return False
    return all(
        len(item["flows"]) == FLOWS and all(flow["state"] == "running" for flow in item["flows"])
        for item in integrations
    )


def measure(python: str, count: int, settle_s: float, window_s: float) -> Run:
    with tempfile.TemporaryDirectory(prefix="nemesis-idle-") as folder:
        root = Path(folder)
        make_workspace(root, python, count)
        url = admin_url(root)
        started = time.monotonic()
        process = subprocess.Popen(
            [python, "-m", "nemesis", "--log-level", "warning", "run"],
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=open(root / "proxy.log", "wb"),  # noqa: SIM115 - closed with the process
        )
        try:
            ready_s = running_s = float("nan")
            deadline = started + 600
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise RuntimeError((root / "proxy.log").read_text()[-3000:])
                if ready_s != ready_s and get_json(f"{url}/readyz")[0] == 200:
                    ready_s = time.monotonic() - started
                if ready_s == ready_s and all_running(url, count):
                    running_s = time.monotonic() - started
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError(f"{count} integrations not running after 600 s")
            time.sleep(settle_s)
            cpu_before, at = cpu_seconds(process.pid), time.monotonic()
            time.sleep(window_s)
            cpu_after, elapsed = cpu_seconds(process.pid), time.monotonic() - at
            memory = rss_mb(process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return Run(count, ready_s, running_s, cpu_after - cpu_before, elapsed, memory)


def spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return (
        f"{format(statistics.median(values), fmt)}"
        f" ({format(min(values), fmt)}..{format(max(values), fmt)})"
    )


def summary(runs: list[Run]) -> dict[str, str]:
    return {
        "ready s": spread([r.ready_s for r in runs], ".1f"),
        "running s": spread([r.running_s for r in runs], ".1f"),
        "idle cpu s": spread([r.cpu_s for r in runs], ".2f"),
        "% core": spread([r.core_pct for r in runs], ".1f"),
        "rss MB": spread([r.rss_mb for r in runs], ".0f"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before the window")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of idle measured")
    parser.add_argument("--baseline", type=Path, help="another checkout to measure as 'before'")
    args = parser.parse_args()
    trees: list[tuple[str, str]] = []
    if args.baseline is not None:
        trees.append(("before", str(args.baseline.resolve() / ".venv" / "bin" / "python")))
    trees.append(("after" if args.baseline else "this", sys.executable))
    results: dict[tuple[str, int], list[Run]] = {}
    for count in args.counts:
        for _ in range(args.repeat):
            for label, python in trees:
                run = measure(python, count, args.settle, args.window)
                results.setdefault((label, count), []).append(run)
                print(
                    f"  {label:6} N={count:5}: ready {run.ready_s:.1f}s, running"
                    f" {run.running_s:.1f}s, {run.cpu_s:.2f} cpu-s in {run.window_s:.1f}s"
                    f" ({run.core_pct:.1f}% of a core), rss {run.rss_mb:.0f} MB",
                    flush=True,
                )
    print()
    columns = ["ready s", "running s", "idle cpu s", "% core", "rss MB"]
    print(f"{'N':>5} {'tree':6} " + " ".join(f"{c:>20}" for c in columns))
    for count in args.counts:
        for label, _ in trees:
            row = summary(results[(label, count)])
            print(f"{count:>5} {label:6} " + " ".join(f"{row[c]:>20}" for c in columns))


if __name__ == "__main__":
    main()
