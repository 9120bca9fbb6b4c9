"""A reader that goes away (`nemesis schema | head -1`) ends the command quietly."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_closed_stdout_ends_the_command_without_a_traceback() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "nemesis", "schema"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 141, done.stderr
