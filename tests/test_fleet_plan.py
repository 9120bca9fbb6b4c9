"""The fleet's planner as a table: what one member sees, what it then does.

Each row is a ``Situation`` of member "a" (at time 100, lease rows running
until 110 unless said) and the parts of the ``Plan`` it must get. With
members "a" and "b" the placement gives ``payments`` to "a" and ``orders``
to "b" (checked first, so the table reads plainly).
"""

from __future__ import annotations

from typing import Any

import pytest

from nemesis.fleet.placement import assign
from nemesis.fleet.plan import Plan, Situation, active_ids, plan, runners_of, share
from nemesis.fleet.port import Assignment, FleetView, Member
from nemesis.fleet.status import fleet_status

NOW = 100.0
WAIT_S = 30.0


def member(member_id: str, *, lease_until: float = NOW + 10, draining: bool = False) -> Member:
    return Member(member_id, "host", 1, 0.0, NOW - 1, lease_until, draining)


def rows(*pairs: tuple[str, str]) -> tuple[Assignment, ...]:
    return tuple(Assignment(integration, member_id, 0.0) for integration, member_id in pairs)


A, B, C = member("a"), member("b"), member("c")
BOTH = {"payments": 1, "orders": 1}


def situation(**given: Any) -> Situation:
    fields: dict[str, Any] = {
        "me": "a",
        "now": NOW,
        "members": (A,),
        "assignments": (),
        "integrations": {"payments": 1},
        "handover_wait_s": WAIT_S,
    }
    fields.update(given)
    return Situation(**fields)


def test_the_table_reads_the_placement_it_assumes() -> None:
    assert assign(BOTH, ["a", "b"]) == {"payments": ("a",), "orders": ("b",)}


CASES: list[tuple[str, Situation, dict[str, Any]]] = [
    (
        "alone: starts what nobody ran, no handover, alone in its limits",
        situation(integrations=BOTH),
        {
            "active": ("a",),
            "start": ("payments", "orders"),
            "decided": {"orders": NOW, "payments": NOW},
            "takeovers": frozenset(),
            "shares": {"orders": 1, "payments": 1},
        },
    ),
    (
        "a live old owner still runs it: the new owner waits (a takeover)",
        situation(members=(A, B), assignments=rows(("payments", "b"))),
        {"start": (), "decided": {"payments": NOW}, "takeovers": {"payments"}, "shares": {}},
    ),
    (
        "still waiting, just short of handover_wait_s: it keeps its decision time",
        situation(
            members=(A, B),
            assignments=rows(("payments", "b")),
            decided={"payments": NOW - WAIT_S + 1},
            taking_over=frozenset({"payments"}),
        ),
        {"start": (), "decided": {"payments": NOW - WAIT_S + 1}, "takeovers": {"payments"}},
    ),
    (
        "handover_wait_s after the decision: it starts anyway, sharing with the old owner",
        situation(
            members=(A, B),
            assignments=rows(("payments", "b")),
            decided={"payments": NOW - WAIT_S},
            taking_over=frozenset({"payments"}),
        ),
        {"start": ("payments",), "takeovers": {"payments"}, "shares": {"payments": 2}},
    ),
    (
        "the old owner let go: it starts at once",
        situation(
            members=(A, B), decided={"payments": NOW - 1}, taking_over=frozenset({"payments"})
        ),
        {"start": ("payments",), "takeovers": {"payments"}, "shares": {"payments": 1}},
    ),
    (
        "owned by another member before: a takeover even though nobody runs it",
        situation(owned_before={"payments": ("b",)}),
        {"start": ("payments",), "takeovers": {"payments"}},
    ),
    (
        "its own stale row blocks nothing and makes no handover",
        situation(assignments=rows(("payments", "a"))),
        {"start": ("payments",), "takeovers": frozenset(), "reassert": ()},
    ),
    (
        "an expired member's row blocks nothing; it is neither live nor active",
        situation(members=(A, member("b", lease_until=NOW)), assignments=rows(("orders", "b"))),
        {
            "active": ("a",),
            "live": {"a"},
            "runners": {"payments": frozenset()},
            "start": ("payments",),
        },
    ),
    (
        "settling after an outage: every row counts as live, nothing starts",
        situation(
            members=(A, member("b", lease_until=NOW), member("c", lease_until=NOW - 50)),
            integrations=BOTH,
            settling=True,
        ),
        {"active": ("a", "b", "c"), "start": (), "decided": {"payments": NOW}},
    ),
    (
        "runs one the store forgot: the row is written again",
        situation(running=frozenset({"payments"})),
        {"reassert": ("payments",), "release": (), "start": (), "shares": {"payments": 1}},
    ),
    (
        "owned elsewhere now: released; a live row means no reassert",
        situation(
            members=(A, B),
            integrations=BOTH,
            running=frozenset({"orders", "payments"}),
            assignments=rows(("orders", "a"), ("payments", "a")),
        ),
        {"release": ("orders",), "reassert": (), "shares": {"orders": 1, "payments": 1}},
    ),
    (
        "already releasing: not released twice",
        situation(
            members=(A, B),
            integrations=BOTH,
            running=frozenset({"orders"}),
            releasing=frozenset({"orders"}),
            assignments=rows(("orders", "a")),
        ),
        {"release": (), "decided": {"payments": NOW}, "start": ("payments",)},
    ),
    (
        "draining: owns nothing, releases what it runs, no longer active",
        situation(
            members=(A, B),
            integrations=BOTH,
            draining=True,
            running=frozenset({"payments"}),
            assignments=rows(("payments", "a")),
        ),
        {"active": ("b",), "release": ("payments",), "decided": {}, "start": ()},
    ),
    (
        "a draining peer takes nothing: this member owns everything",
        situation(members=(A, member("b", draining=True)), integrations=BOTH),
        {"active": ("a",), "start": ("payments", "orders")},
    ),
    (
        "removed by a reload: unassigned at once, no longer shared",
        situation(running=frozenset({"gone"}), assignments=rows(("gone", "a"))),
        {"unassign": ("gone",), "release": (), "shares": {"payments": 1}},
    ),
    (
        "replicas all: every runner and owner counts in the share",
        situation(
            members=(A, B, C),
            integrations={"payments": "all"},
            running=frozenset({"payments"}),
            assignments=rows(("payments", "a"), ("payments", "b")),
        ),
        {"owners": {"payments": ("a", "b", "c")}, "shares": {"payments": 3}},
    ),
    (
        "a wait left behind by a removed integration is dropped",
        situation(decided={"gone": NOW - 5}, taking_over=frozenset({"gone"})),
        {"decided": {"payments": NOW}, "takeovers": frozenset()},
    ),
]


@pytest.mark.parametrize(
    ("given", "expected"), [(s, e) for _, s, e in CASES], ids=[c[0] for c in CASES]
)
def test_plan(given: Situation, expected: dict[str, Any]) -> None:
    planned = plan(given)
    got = {name: getattr(planned, name) for name in expected}
    wanted = {
        name: frozenset(value) if isinstance(value, set) else value
        for name, value in expected.items()
    }
    if "runners" in wanted:
        got["runners"] = dict(planned.runners)
    assert got == wanted


def test_the_plan_is_pure() -> None:
    given = situation(members=(A, B), assignments=rows(("payments", "b")), integrations=BOTH)
    assert plan(given) == plan(given)
    assert given.decided == {}


def test_the_empty_plan_owns_nothing() -> None:
    empty = Plan()
    assert (empty.active, empty.start, dict(empty.owners)) == ((), (), {})


def test_one_share_rule_counts_owners_before_they_start_and_every_runner_while_moving() -> None:
    assert share(("a", "b"), ("a",)) == 2
    assert share(("a",), ("a", "b")) == 2
    assert share((), ()) == 1  # nobody counted yet: this one alone


def test_status_counts_the_members_the_planner_counts() -> None:
    expired = member("b", lease_until=NOW)
    draining = member("c", draining=True)
    view = FleetView(
        3, (A, expired, draining), rows(("payments", "b"), ("orders", "c"), ("payments", "a")), ()
    )
    status = fleet_status(view, BOTH, now=NOW, location="here")
    placed = {i.name: (i.assigned, i.running) for i in status.integrations}
    active = active_ids(view.members, NOW)
    assert active == ("a",)
    live = runners_of(view.assignments, {"a", "c"})
    assert placed == {
        "orders": (("a",), tuple(sorted(live["orders"]))),
        "payments": (("a",), ("a",)),  # the expired member's row runs nothing
    }
