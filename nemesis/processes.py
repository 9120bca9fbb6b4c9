"""Processes beside this one: where a process runs, and whether a neighbour is gone.

A restarted ``nemesis run`` finds rows its predecessor wrote (fleet members,
partition leases). When that predecessor was killed (``kill -9``) its rows
stay until their lease runs out; a process can skip the wait only when it is
sure the writer is gone. It is sure when the row names this host, this
**node** (this boot of the machine and this pid namespace) and a pid that no
longer runs. The node matters because a container may carry the host's name
while its pids are not ours to look up: a pid "gone" here can be alive there.

Anything uncertain (another host, another node, a live pid, even a reused
one) is taken for alive, and the row waits for its lease.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import socket
from pathlib import Path


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


@functools.cache
def node() -> str:
    """This boot of this machine and this pid namespace, as 8 hex digits.

    Two processes with one node digest see each other's pids; a container has
    its own pid namespace (so its own digest) even where it has the host's name.
    """
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    if not boot or not namespace:
        # Nothing to tell this boot and pid namespace from another: a random digest,
        # so no other process can take this one for its neighbour (leases then expire).
        return secrets.token_hex(4)
    return hashlib.sha256(f"{boot}/{namespace}".encode()).hexdigest()[:8]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs in this pid namespace (a zombie does not: it only holds its pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    # Killed but not yet reaped by its parent: a zombie holds its pid and nothing else.
    stat = _read(f"/proc/{pid}/stat")
    state = stat.rpartition(")")[2].split()[:1]
    return state != ["Z"]


def is_dead_neighbour(host: str, pid: int, node_digest: str) -> bool:
    """True when (host, pid, node) names a process of this host and node that is gone.

    This process itself is never a dead neighbour; nor is a pid of another
    host or node, whatever it is here.
    """
    if host != socket.gethostname() or node_digest != node():
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    return not alive(pid)
