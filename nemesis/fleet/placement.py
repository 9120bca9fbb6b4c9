"""Who runs which integration: rendezvous hashing with bounded loads, and rate shares.

Every member computes the same answer from the same inputs (the active
members' ids, the integrations' names and their ``replicas``), so the fleet
agrees without a leader. Rendezvous (highest-random-weight) hashing scores
each (member, integration) pair with a stable hash; an integration goes to
its ``replicas`` highest-scoring members. Plain rendezvous hashing spreads
60 integrations over 3 members anywhere from about 13 to 27 each; so each
member takes at most ``ceil(slots / members * (1 + LOAD_SLACK))``
integrations, the integrations taking their members in name order, each
its highest-scoring member with room (bounded loads). 60 over 3 is then
18 to 21 each. Movement stays close to the minimum: a member that joins 3
takes about 17 of 60 (15 at best), one that leaves hands over about 21 (20
at best), because every integration still prefers the same members.
``replicas: all`` runs on every active member and counts against no cap.

A rate limit is the integration's as a whole: each runner takes
``budget / runners``, the runners counted by ``nemesis.fleet.plan.share``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Final, Literal

Replicas = int | Literal["all"]

# How far above the even share a member may be loaded (see the module docstring).
LOAD_SLACK: Final = 0.05


def score(member_id: str, integration: str) -> int:
    """The pair's weight: a stable 64-bit hash (the same in every process and release)."""
    digest = hashlib.blake2b(
        f"{integration}\x00{member_id}".encode(), digest_size=8, person=b"nemesis-hrw"
    ).digest()
    return int.from_bytes(digest, "big")


def ranked(integration: str, members: Iterable[str]) -> list[str]:
    """The members by their preference for ``integration``, best first."""
    return sorted(members, key=lambda member: (score(member, integration), member), reverse=True)


def assign(
    integrations: Mapping[str, Replicas], members: Iterable[str], *, slack: float = LOAD_SLACK
) -> dict[str, tuple[str, ...]]:
    """Every integration's owners among ``members``, best first."""
    active = sorted(set(members))
    if not active:
        return dict.fromkeys(integrations, ())
    slots = sum(min(r, len(active)) for r in integrations.values() if r != "all")
    cap = max(1, math.ceil(slots / len(active) * (1 + slack)))
    load = dict.fromkeys(active, 0)
    placed: dict[str, tuple[str, ...]] = {}
    for name in sorted(integrations):
        replicas = integrations[name]
        preferred = ranked(name, active)
        if replicas == "all":
            placed[name] = tuple(preferred)
            continue
        wanted = min(replicas, len(active))
        chosen = [member for member in preferred if load[member] < cap][:wanted]
        if len(chosen) < wanted:  # only when replicas outgrow the cap: take the best ones left
            chosen += [member for member in preferred if member not in chosen][
                : wanted - len(chosen)
            ]
        for member in chosen:
            load[member] += 1
        placed[name] = tuple(chosen)
    return placed


def spread(assignment: Mapping[str, Iterable[str]], members: Iterable[str]) -> dict[str, int]:
    """How many integrations each member runs."""
    counts = dict.fromkeys(members, 0)
    for runners in assignment.values():
        for member in runners:
            counts[member] = counts.get(member, 0) + 1
    return counts
