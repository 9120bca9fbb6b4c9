"""The fleet as ``nemesis fleet status`` and ``GET /fleet`` show it: members and assignments."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemesis.fleet.placement import Replicas, assign
from nemesis.fleet.plan import active_ids, live_ids, runners_of
from nemesis.fleet.port import FleetView


@dataclass(frozen=True, slots=True)
class MemberStatus:
    member_id: str
    host: str
    pid: int
    started_at: float
    heartbeat_age_s: float
    lease_left_s: float  # negative: expired, about to be forgotten
    draining: bool
    running: int  # integrations it runs now


@dataclass(frozen=True, slots=True)
class IntegrationPlacement:
    name: str
    replicas: Replicas
    assigned: tuple[str, ...]  # who should run it (rendezvous hashing over the active members)
    running: tuple[str, ...]  # who runs it now (the assignment rows of live members)

    @property
    def settled(self) -> bool:
        return set(self.assigned) == set(self.running)


@dataclass(frozen=True, slots=True)
class OverrideStatus:
    integration: str
    field: str
    value: Any
    version: int
    set_by: str
    set_at: float


@dataclass(frozen=True, slots=True)
class FleetStatus:
    location: str
    generation: int
    members: tuple[MemberStatus, ...]
    integrations: tuple[IntegrationPlacement, ...]
    overrides: tuple[OverrideStatus, ...]


def fleet_status(
    view: FleetView, integrations: Mapping[str, Replicas], *, now: float, location: str
) -> FleetStatus:
    """The fleet from a view of the store and the integrations' ``replicas``.

    The members counted are the planner's (``nemesis.fleet.plan``): owners
    over the live members that do not drain, runners among the live ones.
    """
    placed = assign(integrations, active_ids(view.members, now))
    running = runners_of(view.assignments, live_ids(view.members, now))
    counts: dict[str, int] = {}
    for assignment in view.assignments:
        counts[assignment.member_id] = counts.get(assignment.member_id, 0) + 1
    return FleetStatus(
        location=location,
        generation=view.generation,
        members=tuple(
            MemberStatus(
                member_id=m.member_id,
                host=m.host,
                pid=m.pid,
                started_at=m.started_at,
                heartbeat_age_s=max(0.0, now - m.heartbeat_at),
                lease_left_s=m.lease_until - now,
                draining=m.draining,
                running=counts.get(m.member_id, 0),
            )
            for m in view.members
        ),
        integrations=tuple(
            IntegrationPlacement(
                name=name,
                replicas=replicas,
                assigned=placed[name],
                running=tuple(sorted(running.get(name, frozenset()))),
            )
            for name, replicas in sorted(integrations.items())
        ),
        overrides=tuple(
            OverrideStatus(o.integration, o.field, o.value, o.version, o.set_by, o.set_at)
            for o in view.overrides
        ),
    )


def describe(status: FleetStatus) -> str:
    """The status as text for a terminal."""
    lines = [f"state store: {status.location} (generation {status.generation})", ""]
    lines.append(f"members ({len(status.members)}):")
    for m in status.members:
        flags = " draining" if m.draining else ""
        if m.lease_left_s < 0:
            flags += " EXPIRED"
        lines.append(
            f"  {m.member_id}  host {m.host} pid {m.pid}  runs {m.running}"
            f"  heartbeat {m.heartbeat_age_s:.1f}s ago  lease {m.lease_left_s:.1f}s{flags}"
        )
    unsettled = [i for i in status.integrations if not i.settled]
    lines.append("")
    lines.append(f"integrations ({len(status.integrations)}, {len(unsettled)} moving or unplaced):")
    for i in status.integrations:
        note = "" if i.settled else "  (moving)"
        running = ", ".join(i.running) or "-"
        lines.append(f"  {i.name}  replicas {i.replicas}  runs on {running}{note}")
    if status.overrides:
        lines.append("")
        lines.append(f"live overrides ({len(status.overrides)}):")
        lines.extend(
            f"  {o.integration}  {o.field} = {o.value!r}  (version {o.version}, set by {o.set_by})"
            for o in status.overrides
        )
    return "\n".join(lines)


def as_json(status: FleetStatus) -> dict[str, Any]:
    """The status as plain JSON-able data."""
    return dataclasses.asdict(status)
