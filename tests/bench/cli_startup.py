"""Start-up of ``nemesis --help`` and ``nemesis validate FILE`` against ``python -c pass``.

Each command runs in a fresh interpreter (``python -m nemesis``, as the
installed script does), several rounds interleaved; the median wall time of
each is printed with its ratio to the bare interpreter measured in the same
run, and the time above it. Target: both commands within 0.3 s.

    .venv/bin/python tests/bench/cli_startup.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET_S = 0.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--file", default="integrations/orders-to-loyalty.yaml", help="what validate checks"
    )
    args = parser.parse_args()
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "nemesis --help": [sys.executable, "-m", "nemesis", "--help"],
        f"nemesis validate {args.file}": [sys.executable, "-m", "nemesis", "validate", args.file],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for argv in commands.values():  # warm the page cache and the .pyc files
        subprocess.run(argv, cwd=REPO, capture_output=True, check=True)
    for _ in range(args.rounds):
        for name, argv in commands.items():
            started = time.perf_counter()
            subprocess.run(argv, cwd=REPO, capture_output=True, check=True)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["python -c pass"])
    print(f"{args.rounds} rounds, median wall time per command")
    for name, samples in times.items():
        median = statistics.median(samples)
        verdict = (
            ""
            if name.startswith("python")
            else ("  within target" if median <= TARGET_S else f"  above the {TARGET_S} s target")
        )
        print(
            f"  {name:<52} {median * 1000:7.1f} ms  x{median / base:5.1f}"
            f"  (+{(median - base) * 1000:6.1f} ms){verdict}"
        )


if __name__ == "__main__":
    main()
