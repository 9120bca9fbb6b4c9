"""Who runs which integration: rendezvous hashing over the live members, and rate shares.

Every member computes the same answer from the same inputs (the active
members' ids, an integration's name and its ``replicas``), so the fleet
agrees without a leader. Rendezvous (highest-random-weight) hashing scores
each (member, integration) pair with a hash and gives the integration to
its ``replicas`` highest-scoring members. A member that leaves moves only
its own integrations (each to its next-highest member); a member that joins
takes from each of the others only the integrations it now scores highest
for: about 1/n of them, never a shuffle.

A rate limit is the integration's as a whole: each runner takes
``budget / runners`` (``share_of``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

Replicas = int | Literal["all"]


def score(member_id: str, integration: str) -> int:
    """The pair's weight: a stable 64-bit hash (the same in every process and release)."""
    digest = hashlib.blake2b(
        f"{integration}\x00{member_id}".encode(), digest_size=8, person=b"nemesis-hrw"
    ).digest()
    return int.from_bytes(digest, "big")


def owners(integration: str, members: Sequence[str], replicas: Replicas) -> tuple[str, ...]:
    """The members that should run ``integration``, best first (all of them for ``all``)."""
    ranked = sorted(members, key=lambda member: (score(member, integration), member), reverse=True)
    if replicas == "all":
        return tuple(ranked)
    return tuple(ranked[:replicas])


def assign(
    integrations: Mapping[str, Replicas], members: Sequence[str]
) -> dict[str, tuple[str, ...]]:
    """Every integration's owners among ``members``."""
    return {name: owners(name, members, replicas) for name, replicas in integrations.items()}


def spread(assignment: Mapping[str, Iterable[str]], members: Iterable[str]) -> dict[str, int]:
    """How many integrations each member runs."""
    counts = dict.fromkeys(members, 0)
    for runners in assignment.values():
        for member in runners:
            counts[member] = counts.get(member, 0) + 1
    return counts


def share_of(budget: float | None, runners: int) -> float | None:
    """One runner's part of a rate limit held by ``runners`` members (None: unlimited)."""
    if budget is None:
        return None
    return budget / max(1, runners)
