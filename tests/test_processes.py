"""The dead-neighbour check both the fleet and the embedded broker's leases use."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from nemesis import processes


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0]


def test_a_zombie_is_dead_and_a_running_process_is_alive() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert processes.alive(child.pid)
        assert child.stdin is not None
        child.stdin.close()  # it exits; unreaped, it stays a zombie until wait()
        deadline = time.monotonic() + 60
        while _state(child.pid) != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        assert not processes.alive(child.pid)
        assert processes.is_dead_neighbour(socket.gethostname(), child.pid, processes.node())
    finally:
        child.wait()
    assert not processes.alive(child.pid)  # reaped: gone


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (the other tests' too)."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(child.stdout)


def test_only_a_gone_pid_of_this_host_and_node_is_a_dead_neighbour() -> None:
    gone = dead_pid()
    host, node = socket.gethostname(), processes.node()
    assert len(node) == 8
    assert processes.is_dead_neighbour(host, gone, node)
    assert not processes.is_dead_neighbour(host, gone, "0badc0de")  # another container
    assert not processes.is_dead_neighbour(f"not-{host}", gone, node)  # another host
    assert not processes.is_dead_neighbour(host, os.getpid(), node)  # itself
    assert not processes.is_dead_neighbour(host, os.getppid(), node)  # alive
    assert not processes.is_dead_neighbour(host, 0, node)
