"""Start-up of ``nemesis --help`` and ``nemesis validate FILE`` against ``python -c pass``.

Each command runs in a fresh interpreter (``python -m nemesis``, as the
installed script does), several rounds interleaved. Printed per command: the
median wall time and the median CPU time (user + system of the child, what a
busy host disturbs least), each with its ratio to the bare interpreter
measured in the same run. Target: both commands start within 0.3 s.
``--compare DIR`` times the same commands from another checkout too (say
``git worktree add /tmp/nemesis-main main``), interleaved with this one's, with
this virtualenv's interpreter: a change's before and after under one load.

    .venv/bin/python tests/bench/cli_startup.py [--rounds 15] [--compare DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET_S = 0.3


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--file", default="integrations/orders-to-loyalty.yaml", help="what validate checks"
    )
    parser.add_argument(
        "--compare", type=Path, help="another checkout whose commands are timed in the same run"
    )
    args = parser.parse_args()
    nemesis = {
        "nemesis --help": ["--help"],
        f"nemesis validate {args.file}": ["validate", args.file],
    }
    # name -> (folder it runs in, which decides the nemesis it imports; argv)
    commands = {"python -c pass": (REPO, [sys.executable, "-c", "pass"])}
    for tree, suffix in ((args.compare, " (--compare)"), (REPO, "")):
        if tree is not None:
            for name, argv in nemesis.items():
                commands[name + suffix] = (tree, [sys.executable, "-m", "nemesis", *argv])
    wall: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    # An installed package loads compiled .pyc files (pip writes them); a shell with
    # PYTHONDONTWRITEBYTECODE would time the compiler instead. The cache goes to a
    # temporary folder, not into the repository.
    cache = tempfile.mkdtemp(prefix="nemesis-pyc-")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = cache
    for cwd, argv in commands.values():  # warm the page cache and the .pyc files
        subprocess.run(argv, cwd=cwd, capture_output=True, check=True, env=env)
    for _ in range(args.rounds):
        for name, (cwd, argv) in commands.items():
            cpu_before, started = children_cpu_s(), time.perf_counter()
            subprocess.run(argv, cwd=cwd, capture_output=True, check=True, env=env)
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(children_cpu_s() - cpu_before)
    base_wall = statistics.median(wall["python -c pass"])
    base_cpu = statistics.median(cpu["python -c pass"])
    print(f"{args.rounds} rounds; medians: wall time, CPU time (user + system)")
    for name in commands:
        median_wall, median_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
        verdict = ""
        if name != "python -c pass":
            verdict = "  within" if median_wall <= TARGET_S else "  above"
            verdict += f" the {TARGET_S} s target"
        print(
            f"  {name:<64} wall {median_wall * 1000:7.1f} ms x{median_wall / base_wall:5.1f}"
            f"   cpu {median_cpu * 1000:7.1f} ms x{median_cpu / base_cpu:5.1f}{verdict}"
        )


if __name__ == "__main__":
    main()
