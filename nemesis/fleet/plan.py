"""What a fleet member should do, decided from what it sees: a pure function.

``plan(situation)`` takes what one member knows after a look at the store
(the member rows, the assignment rows, the integrations and their
``replicas``, what runs and waits here) and returns a ``Plan``; the member
(``nemesis.fleet.member``) only carries the plan out, and ``nemesis fleet
status`` and ``GET /fleet`` count members with the same helpers
(``live_ids``, ``active_ids``, ``runners_of``). Nothing here reads a clock or
the store.

The rules, in the order the planner applies them:

- **Live** members are those whose lease runs at ``now``; while the member
  *settles* after an outage of the store every stored member counts as live
  (their heartbeats come in before it acts on the membership). This member
  is live to itself even before its row is read back.
- **Active** members are the live ones that are not draining; the owners of
  every integration are ``placement.assign`` over them.
- The **runners** of an integration are the live members with its
  assignment row, plus this member where it runs the integration.
- An integration this member owns but does not run is **decided** at the
  first plan that says so (``decided`` keeps that time while it waits). It
  is a **takeover** (a handover, counted and timed) when another member runs
  it or owned it at that moment; the first start of an integration nobody
  ran is none.
- A decided integration **starts** once no runner outside its owners is left
  (the old owner drained and let go) or ``handover_wait_s`` after the
  decision; never while settling.
- An integration that runs here is **reasserted** (its row written again)
  when the store lost the row (forgotten while this member could not renew
  its lease), and **released** (drained, then unassigned) once this member is
  no longer among its owners. One removed from the integrations (a reload) is
  **unassigned** at once.
- **Shares**: every integration running here after the plan takes its
  ``1 / runners`` of each rate limit, counting ``max(owners, runners)``
  members: the owners even before they start, and every runner while one
  hands over.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from nemesis.fleet.placement import Replicas, assign
from nemesis.fleet.port import Assignment, Member


@dataclass(frozen=True, slots=True)
class Situation:
    """What one member knows after a look at the store."""

    me: str
    now: float
    members: tuple[Member, ...]  # the rows as read (expired ones included)
    assignments: tuple[Assignment, ...]
    integrations: Mapping[str, Replicas]  # this member's, by name
    draining: bool = False  # this member shuts down
    settling: bool = False  # after an outage: every stored member counts as live
    running: frozenset[str] = frozenset()  # runs here now
    releasing: frozenset[str] = frozenset()  # drains here now, before another member takes it
    decided: Mapping[str, float] = field(default_factory=dict)  # waits here, since when
    taking_over: frozenset[str] = frozenset()  # the waits that are handovers
    owned_before: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # the last plan's
    handover_wait_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Plan:
    """What the member does now (the empty plan: before the first look)."""

    active: tuple[str, ...] = ()  # the members that take integrations, sorted
    live: frozenset[str] = frozenset()  # the live members, this one included
    owners: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # best first
    runners: Mapping[str, frozenset[str]] = field(default_factory=dict)  # see runners_of
    decided: Mapping[str, float] = field(default_factory=dict)  # owned, not run here: since when
    takeovers: frozenset[str] = frozenset()  # the decided ones that are handovers
    start: tuple[str, ...] = ()  # decided ones to start now (a subset of ``decided``)
    reassert: tuple[str, ...] = ()  # running here, the store lost the row: write it again
    release: tuple[str, ...] = ()  # running here, owned elsewhere now: drain, then unassign
    unassign: tuple[str, ...] = ()  # running here, removed from the integrations: unassign now
    shares: Mapping[str, int] = field(default_factory=dict)  # members sharing its rate limits

    @property
    def waiting(self) -> tuple[str, ...]:
        """The decided integrations that do not start now."""
        return tuple(name for name in self.decided if name not in self.start)


def live_ids(members: Iterable[Member], now: float, *, settling: bool = False) -> frozenset[str]:
    """The members whose lease runs at ``now`` (every one while settling)."""
    return frozenset(m.member_id for m in members if settling or m.live(now))


def active_ids(
    members: Iterable[Member],
    now: float,
    *,
    me: str | None = None,
    draining: bool = False,
    settling: bool = False,
) -> tuple[str, ...]:
    """The live members that are not draining, sorted: those that take integrations.

    ``me`` (with its own ``draining``) overrides its row: a member knows its
    state before the store shows it.
    """
    active = {
        m.member_id
        for m in members
        if m.member_id != me and (settling or m.live(now)) and not m.draining
    }
    if me is not None and not draining:
        active.add(me)
    return tuple(sorted(active))


def runners_of(
    assignments: Iterable[Assignment], live: Collection[str]
) -> dict[str, frozenset[str]]:
    """Every integration's runners: the live members with its assignment row."""
    runners: dict[str, set[str]] = {}
    for assignment in assignments:
        if assignment.member_id in live:
            runners.setdefault(assignment.integration, set()).add(assignment.member_id)
    return {name: frozenset(members) for name, members in runners.items()}


def share(owners: Collection[str], runners: Collection[str]) -> int:
    """How many members hold an integration's rate limits together (see the docstring)."""
    return max(1, len(owners), len(runners))


def plan(situation: Situation) -> Plan:
    """What the member should do in ``situation`` (see the module docstring)."""
    s = situation
    me, now = s.me, s.now
    live = live_ids(s.members, now, settling=s.settling) | {me}
    active = active_ids(s.members, now, me=me, draining=s.draining, settling=s.settling)
    owners = assign(s.integrations, active)
    stored = runners_of(s.assignments, live)
    runners = {
        name: stored.get(name, frozenset()) | ({me} if name in s.running else frozenset())
        for name in s.integrations
    }
    decided: dict[str, float] = {}
    takeovers: set[str] = set()
    start: list[str] = []
    reassert: list[str] = []
    release: list[str] = []
    for name in s.integrations:
        wanted = owners[name]
        if me in wanted and name not in s.running:
            since = s.decided.get(name)
            if since is None:  # decided now
                since = now
                if runners[name] - {me} or set(s.owned_before.get(name, ())) - {me}:
                    takeovers.add(name)  # a handover, not a first start
            elif name in s.taking_over:
                takeovers.add(name)
            decided[name] = since
            if s.settling:
                continue  # the membership may be stale: the others' heartbeats first
            blockers = runners[name] - set(wanted)
            if blockers and now - since < s.handover_wait_s:
                continue  # the old owner drains first
            start.append(name)
            continue
        if name not in s.running:
            continue
        if me not in stored.get(name, ()):
            reassert.append(name)
        if me not in wanted and name not in s.releasing:
            release.append(name)
    shares = {
        name: share(owners[name], runners[name] | {me})
        for name in s.integrations
        if name in s.running or name in start
    }
    return Plan(
        active=active,
        live=live,
        owners=owners,
        runners=runners,
        decided=decided,
        takeovers=frozenset(takeovers),
        start=tuple(start),
        reassert=tuple(reassert),
        release=tuple(release),
        unassign=tuple(sorted(s.running - s.integrations.keys())),
        shares=shares,
    )
