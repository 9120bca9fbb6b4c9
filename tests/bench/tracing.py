"""Tracing benchmark: CPU per delivery with OpenTelemetry off, on at 1% and on at 100%.

`nemesis run` (a subprocess) delivers pre-published messages (no trace
context of their own: Nemesis starts one for each, and ``sample_ratio``
decides which are recorded) to the fast local handler
(tests/bench/fast_handler.py); spans go over OTLP/HTTP to a receiver in a
process of its own (tests/bench/otlp_receiver.py), as to a collector. The
modes take turns, round after round, and the figure of each is the median of
its rounds; each is printed as CPU microseconds per message of the proxy
process and as a ratio to tracing off, measured in the same run.

With `--baseline-tree PATH` (a checkout of another commit, its protos
generated), that tree's proxy runs as one more mode, tracing off: today's
code against tracing off here, in the same run. With `--pipeline city-filter`
the integration runs pipelines/city-filter.yaml (a decode and a filter that
drops 3 messages in 4): a recorded attempt then carries its stages as span
events, and a filtered message has a span of its own; CPU is per message
read.

Usage: `python tests/bench/tracing.py [--messages N] [--rounds R] [--baseline-tree PATH]
[--pipeline city-filter]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

# The delivery benchmark's workspace, handler and timing.
from tests.bench import delivery  # noqa: E402

# With --baseline-tree: tracing off in a checkout of other code (today's main, say).
BASELINE = "baseline"
MODES = {
    "off": "",
    "on, 1%": "tracing: {enabled: true, sample_ratio: 0.01, otlp_endpoint: '%s'}\n",
    "on, 100%": "tracing: {enabled: true, sample_ratio: 1.0, otlp_endpoint: '%s'}\n",
}


class Receiver:
    """tests/bench/otlp_receiver.py in its own process."""

    def __init__(self) -> None:
        self.port = delivery.free_port()
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "otlp_receiver.py"), "--port", str(self.port)]
        )
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.spans()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("OTLP receiver did not start")

    def spans(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/count", timeout=2) as answer:
            count: int = json.load(answer)["spans"]
            return count

    def close(self) -> None:
        self.process.terminate()
        self.process.wait()


async def main(args: argparse.Namespace) -> None:
    with_pipeline = f", pipeline {args.pipeline}" if args.pipeline else ""
    print(
        f"\nNemesis tracing benchmark ({os.cpu_count()} cores,"
        f" {args.messages:,} messages a run{with_pipeline})"
    )
    receiver = Receiver()
    handler = delivery.Handler()
    modes = dict(MODES)
    if args.baseline_tree is not None:
        modes[BASELINE] = ""
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    spans: dict[str, list[int]] = {mode: [] for mode in modes}
    try:
        with tempfile.TemporaryDirectory(prefix="nemesis-bench-") as tmp:
            space = delivery.Workspace(Path(tmp))
            base = (space.root / "nemesis.yaml").read_text()
            for round_ in range(args.rounds):
                for number, (mode, section) in enumerate(modes.items()):
                    text = section % receiver.url if "%s" in section else section
                    (space.root / "nemesis.yaml").write_text(base + text)
                    before = receiver.spans()
                    if mode == BASELINE:
                        # The proxy subprocess imports the other tree's nemesis.
                        os.environ["PYTHONPATH"] = str(args.baseline_tree)
                    try:
                        run = await delivery.through_proxy(
                            space,
                            handler,
                            f"t{round_}m{number}",
                            args.messages,
                            args.workers,
                            1,
                            pipeline=args.pipeline,
                        )
                    finally:
                        os.environ.pop("PYTHONPATH", None)
                    cpu[mode].append(run.cpu_us)
                    # The proxy exported what it buffered when it stopped.
                    spans[mode].append(receiver.spans() - before)
    finally:
        handler.close()
        receiver.close()
    baseline = statistics.median(cpu["off"])
    for mode in modes:
        median = statistics.median(cpu[mode])
        print(
            f"  tracing {mode:<9} {median:>7.1f} us CPU per message   x{median / baseline:.2f} of off"
            f"   spans exported per run: {statistics.median(spans[mode]):,.0f}"
            f"   (rounds: {', '.join(f'{c:.1f}' for c in cpu[mode])})"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="a source tree (with generated protos) whose proxy runs as one more mode",
    )
    parser.add_argument(
        "--pipeline",
        default="",
        choices=["", "city-filter"],
        help="run the integration through this pipeline of pipelines/ (its messages fit it)",
    )
    asyncio.run(main(parser.parse_args()))
