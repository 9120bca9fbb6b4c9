"""The platform's caps (``limits:`` in ``nemesis.yaml``): what an integration and a team may take.

Replicas are shared by many teams' integrations: the caps bound what one
integration sets (``delivery.workers``, ``delivery.buffer``,
``delivery.batch.size``, each flow's ``rate_limits``) and what a team's
integrations take together (the sums of workers, buffers and rates over the
integrations that list the team in ``owners``; an integration owned by two
teams counts in full for each). Workers and buffers are per replica, so in a
team's total an integration counts with them times its ``replicas``
(``replicas: all`` as ``limits.team.all_replicas``); rates are the fleet's
already (its replicas share them). A capped rate must be set: no rate is an
unlimited one, over any cap.

The same check runs everywhere a value is decided:

- ``nemesis validate`` with the process file among its paths (the pull
  request's check), at the integration file's line, naming the cap and the
  line of ``nemesis.yaml`` that sets it;
- ``nemesis run``, at start and at every reload (``admit``): an integration
  over a cap is refused, with the same problem, and the others start; a
  changed file over a cap is refused like any invalid file, so the running
  version goes on. Team totals are filled in order: what runs already keeps
  its share, then the rest by name, so a new integration can never stop
  one that runs;
- the admin API's live changes (and so ``nemesis ctl set``): a change over a
  cap is refused with a 422 naming the field, the cap and where it is set;
- live values another replica stored for the fleet (``FleetMember``): those
  over a cap of this replica's are not applied, and the log says why.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from nemesis.config.document import DataPath
from nemesis.config.loader import ValidationContext, read_yaml
from nemesis.config.models import IntegrationConfig, LimitsConfig, NemesisConfig
from nemesis.config.overrides import get_field
from nemesis.errors import ConfigProblem

# (the cap's path under limits.integration, the integration field it bounds)
INTEGRATION_CAPS: Final = (
    ("workers", "delivery.workers"),
    ("buffer", "delivery.buffer"),
    ("batch_size", "delivery.batch.size"),
    ("rate_limits.main", "rate_limits.main"),
    ("rate_limits.retry", "rate_limits.retry"),
    ("rate_limits.replay", "rate_limits.replay"),
)
# (the cap's path under limits.team, the integration field summed over the team)
TEAM_CAPS: Final = (
    ("workers", "delivery.workers"),
    ("buffer", "delivery.buffer"),
    ("rate_limits.main", "rate_limits.main"),
    ("rate_limits.retry", "rate_limits.retry"),
    ("rate_limits.replay", "rate_limits.replay"),
)
# Team totals of these fields count an integration once per replica running it.
PER_REPLICA: Final = frozenset({"delivery.workers", "delivery.buffer"})
# A team total's message names this many of the integrations in it.
_NAMED_IN_TOTAL: Final = 5


@dataclass(frozen=True, slots=True)
class Breach:
    """An integration's setting over a cap: the field (``delivery.workers``) and why."""

    integration: str
    field: str
    message: str


@dataclass(frozen=True)
class Caps:
    """The caps, and the file and lines that set them (for messages)."""

    limits: LimitsConfig = field(default_factory=LimitsConfig)
    file: str | None = None
    lines: Mapping[DataPath, int] = field(default_factory=dict)

    @classmethod
    def of(cls, config: NemesisConfig, file: Path | None) -> Caps:
        """The caps of a process configuration read from ``file`` (its lines are read again)."""
        lines: dict[DataPath, int] = {}
        if file is not None and config.limits != LimitsConfig():
            lines = dict(read_yaml(file, require_env=False).lines)
        return cls(config.limits, None if file is None else str(file), lines)

    @property
    def any(self) -> bool:
        """Whether any cap is set."""
        return self.limits != LimitsConfig()

    def where(self, scope: str, cap: str) -> str:
        """``limits.team.workers in nemesis.yaml:14``: the cap, and where it is set."""
        dotted = f"limits.{scope}.{cap}"
        if self.file is None:
            return f"{dotted} of the process configuration"
        line = self.lines.get(("limits", scope, *cap.split(".")))
        return f"{dotted} in {self.file}" + (f":{line}" if line is not None else "")

    def check(
        self, config: IntegrationConfig, others: Mapping[str, IntegrationConfig]
    ) -> list[Breach]:
        """What ``config`` sets over a cap, its team totals with ``others`` included."""
        return [*self._own(config), *self._team(config, others)]

    def admit(
        self,
        candidates: Mapping[str, IntegrationConfig],
        running: Mapping[str, IntegrationConfig] | None = None,
    ) -> tuple[dict[str, IntegrationConfig], dict[str, list[Breach]]]:
        """The candidates within the caps, and the breaches of those refused.

        ``running`` (what runs now, by name) keeps its share of the team
        totals: a candidate the same as what runs is taken first, then the
        others by name, each counted with what was taken before it. A
        refused candidate's running version, if any, still counts.
        """
        running = dict(running or {})
        if not self.any:
            return dict(candidates), {}
        taken = dict(running)
        admitted: dict[str, IntegrationConfig] = {}
        refused: dict[str, list[Breach]] = {}
        for name in sorted(candidates, key=lambda n: (candidates[n] != running.get(n), n)):
            config = candidates[name]
            breaches = self.check(config, {n: c for n, c in taken.items() if n != name})
            if breaches:
                refused[name] = breaches
            else:
                admitted[name] = config
                taken[name] = config
        return admitted, refused

    def _own(self, config: IntegrationConfig) -> Iterator[Breach]:
        caps = self.limits.integration
        for cap_path, integration_field in INTEGRATION_CAPS:
            cap = get_field(caps, cap_path)
            if cap is None:
                continue
            value = get_field(config, integration_field)
            where = self.where("integration", cap_path)
            if value is None:
                yield Breach(
                    config.name,
                    integration_field,
                    f"no rate (unlimited), but the platform caps it at {_number(cap)}/s"
                    f" ({where}): set {integration_field} to at most {_number(cap)}",
                )
            elif value > cap:
                unit = "/s" if integration_field.startswith("rate_limits.") else ""
                yield Breach(
                    config.name,
                    integration_field,
                    f"{_number(value)}{unit} is over the platform's cap of {_number(cap)}{unit}"
                    f" ({where})",
                )

    def _team(
        self, config: IntegrationConfig, others: Mapping[str, IntegrationConfig]
    ) -> Iterator[Breach]:
        caps = self.limits.team
        for cap_path, integration_field in TEAM_CAPS:
            cap = get_field(caps, cap_path)
            if cap is None:
                continue
            rate = integration_field.startswith("rate_limits.")
            unit = "/s" if rate else ""
            where = self.where("team", cap_path)
            per_replica = integration_field in PER_REPLICA
            own = get_field(config, integration_field)
            replicas = self._replicas(config) if per_replica else 1
            if own is not None and replicas is None:
                yield Breach(
                    config.name,
                    integration_field,
                    f"replicas: all runs it on every replica, each with its own"
                    f" {integration_field}, and the platform caps a team's total at"
                    f" {_number(cap)} ({where}): set replicas to a number, or"
                    f" limits.team.all_replicas to the fleet's size",
                )
                continue
            for team in dict.fromkeys(config.owners):
                if own is None:
                    yield Breach(
                        config.name,
                        integration_field,
                        f"no rate (unlimited), but {team}'s integrations may take at most"
                        f" {_number(cap)}/s together ({where}): set {integration_field}",
                    )
                    break  # one message for the unset rate, whatever the teams
                # An unlimited one of the others, or one of replicas it cannot count, is
                # reported at its own file.
                shares = {
                    name: (value, count)
                    for name, other in sorted(others.items())
                    if team in other.owners
                    and (value := get_field(other, integration_field)) is not None
                    and (count := self._replicas(other) if per_replica else 1) is not None
                }
                assert replicas is not None
                total = own * replicas + sum(v * n for v, n in shares.values())
                if total <= cap or math.isclose(total, cap):
                    continue
                parts = [_share(config.name, own, replicas)] + [
                    _share(name, value, count)
                    for name, (value, count) in sorted(
                        shares.items(), key=lambda item: -item[1][0] * item[1][1]
                    )
                ]
                named = ", ".join(parts[:_NAMED_IN_TOTAL])
                if len(parts) > _NAMED_IN_TOTAL:
                    named += f" and {len(parts) - _NAMED_IN_TOTAL} more"
                yield Breach(
                    config.name,
                    integration_field,
                    f"{team}'s integrations would take {_number(total)}{unit} together"
                    f" ({named}), over the team cap of {_number(cap)}{unit} ({where})",
                )

    def _replicas(self, config: IntegrationConfig) -> int | None:
        """How many replicas run ``config``; None: every one, and the fleet's size is not set."""
        if config.replicas == "all":
            return self.limits.team.all_replicas
        return config.replicas


def _share(name: str, value: float, replicas: int) -> str:
    """``fair 60``, or ``fair 60x3`` for an integration on three replicas."""
    return f"{name} {_number(value)}" + (f"x{replicas}" if replicas != 1 else "")


def breach_problems(
    breaches: Mapping[str, list[Breach]],
    files: Mapping[str, Path | None],
    lines_of: Mapping[str, Mapping[DataPath, int]] | None = None,
) -> list[ConfigProblem]:
    """Breaches as problems of the integrations' files, at the field's line when it is known."""
    problems: list[ConfigProblem] = []
    for name, found in sorted(breaches.items()):
        file = files.get(name)
        where = str(file) if file is not None else f"integration {name}"
        lines = (lines_of or {}).get(name, {})
        problems.extend(
            ConfigProblem(where, _line(lines, tuple(b.field.split("."))), b.field, b.message)
            for b in found
        )
    return problems


def _line(lines: Mapping[DataPath, int], path: DataPath) -> int | None:
    """The line of ``path``, or of its nearest ancestor that the file writes."""
    for end in range(len(path), -1, -1):
        line = lines.get(path[:end])
        if line is not None:
            return line
    return None


def _number(value: float) -> str:
    return f"{value:g}"


class CapsChecker:
    """``nemesis validate``: the integrations against the caps of each process file validated."""

    def claims(self, path: Path) -> bool:
        """Claims nothing: it checks what the core loaded."""
        return False

    def check(self, paths: Sequence[Path], context: ValidationContext) -> list[ConfigProblem]:
        """Every integration over a cap of a process file among the paths, at its line."""
        integrations = context.integrations.integrations
        problems: list[ConfigProblem] = []
        lines: dict[str, Mapping[DataPath, int]] = {}
        for process_file, config in sorted(context.process_configs.items()):
            caps = Caps.of(config, process_file)
            if not caps.any:
                continue
            breaches = {
                name: found
                for name, integration in integrations.items()
                if (found := caps.check(integration, _without(integrations, name)))
            }
            for name in breaches:
                file = context.integration_files.get(name)
                if name not in lines and file is not None:
                    lines[name] = read_yaml(file, env=context.env, require_env=False).lines
            problems.extend(breach_problems(breaches, context.integration_files, lines))
        return problems


def _without(configs: Mapping[str, IntegrationConfig], name: str) -> dict[str, IntegrationConfig]:
    return {n: c for n, c in configs.items() if n != name}


def within_caps(
    caps: Caps,
    integrations: Mapping[str, IntegrationConfig],
    files: Mapping[str, Path | None],
    running: Mapping[str, IntegrationConfig] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[dict[str, IntegrationConfig], list[ConfigProblem]]:
    """``Caps.admit`` for ``nemesis run``: the integrations taken, and problems for the rest."""
    admitted, refused = caps.admit(integrations, running)
    lines: dict[str, Mapping[DataPath, int]] = {}
    for name in refused:
        file = files.get(name)
        if file is not None:
            lines[name] = read_yaml(file, env=env, require_env=False).lines
    return admitted, breach_problems(refused, files, lines)


def live_change_breaches(
    caps: Caps,
    running: IntegrationConfig,
    changed: IntegrationConfig,
    changes: Mapping[str, object],
    others: Mapping[str, IntegrationConfig],
) -> list[Breach]:
    """What a live change (``running`` -> ``changed``) would set over a cap.

    Only the fields it changes count, and only when it raises them: a team
    over its total (the caps were lowered since) may still turn its
    integrations down, or tune what is not capped.
    """
    if not caps.any:
        return []
    return [
        breach
        for breach in caps.check(changed, {n: c for n, c in others.items() if n != changed.name})
        if breach.field in changes
        and not _lowers(get_field(changed, breach.field), get_field(running, breach.field))
    ]


def _lowers(new: float | None, old: float | None) -> bool:
    """Whether ``new`` is below ``old``, where None is unlimited."""
    if new is None:
        return False
    return old is None or new < old
