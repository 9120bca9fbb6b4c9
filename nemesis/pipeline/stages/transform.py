"""``transform``: reshape the payload so a handler receives only what it needs.

::

    - transform:
        keep: [id, order.city, order.amount]    # only these fields (structure kept)
        drop: [order.customer.phone]
        rename: {order.amount: amount_rub}       # from: to
        set_from: {customer_id: customer.id, type: $metadata.type}   # to: any path
        set: {schema: 2}                         # to: a literal value

The operations run in that order; ``set_from`` reads the message as it came
into the stage, so it can pick a field that ``keep`` leaves out. Writes go
into objects (created on the way); a path through a list or a scalar is not
written: the message is
dead-lettered (type_error), or dropped with ``on_error: drop``. A payload that
is not a JSON object cannot be transformed the same way.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Hashable
from typing import Any, Literal

from pydantic import Field

from nemesis.pipeline.paths import (
    MISSING,
    FieldPath,
    PathError,
    getter,
    json_kind,
    parse_path,
    pop,
    put,
)
from nemesis.pipeline.stage import (
    TYPE_ERROR,
    BuildContext,
    ConfigIssue,
    Envelope,
    Stage,
    StageConfig,
    StageConfigError,
    StageFailure,
    dropping_failures,
)

_MAX_INT = 2**63  # orjson encodes 64-bit integers only


class TransformConfig(StageConfig):
    """Keep / drop / rename / set payload fields, in that order."""

    keep: list[str] | None = None
    drop: list[str] = Field(default_factory=list)
    rename: dict[str, str] = Field(default_factory=dict)
    set_from: dict[str, str] = Field(default_factory=dict)
    set: dict[str, Any] = Field(default_factory=dict)
    on_error: Literal["dead_letter", "drop"] = "dead_letter"


def build_transform(config: TransformConfig, context: BuildContext) -> Stage:
    """Parses every path once; the stage applies them to each message's document."""
    issues: list[ConfigIssue] = []

    def target(text: str, where: tuple[Hashable, ...]) -> FieldPath | None:
        try:
            path = parse_path(text, payload_only=True)
        except PathError as exc:
            issues.append(ConfigIssue(where, f"bad path: {exc}"))
            return None
        if not path.segments:
            issues.append(ConfigIssue(where, "name a payload field, not the whole payload"))
            return None
        return path

    keep = [target(text, ("keep", i)) for i, text in enumerate(config.keep or [])]
    drop = [target(text, ("drop", i)) for i, text in enumerate(config.drop)]
    rename = [
        (target(source, ("rename", source)), target(destination, ("rename", source)))
        for source, destination in config.rename.items()
    ]
    set_from: list[tuple[FieldPath | None, Callable[[Envelope], Any] | None]] = []
    for destination, source in config.set_from.items():
        try:
            read = getter(parse_path(source))
        except PathError as exc:
            issues.append(ConfigIssue(("set_from", destination), f"bad path: {exc}"))
            read = None
        set_from.append((target(destination, ("set_from", destination)), read))
    literals = []
    for destination, value in config.set.items():
        problem = _json_problem(value)
        if problem:
            issues.append(ConfigIssue(("set", destination), problem))
        literals.append((target(destination, ("set", destination)), value))
    if issues:
        raise StageConfigError(issues)
    plan = _Plan(
        keep=None if config.keep is None else [p for p in keep if p is not None],
        drop=[p.segments for p in drop if p is not None],
        rename=[(s, d) for s, d in rename if s is not None and d is not None],
        set_from=[(d, r) for d, r in set_from if d is not None and r is not None],
        literals=[(d, v) for d, v in literals if d is not None],
    )
    process = plan.apply if config.on_error == "dead_letter" else dropping_failures(plan.apply)
    return Stage(process, reads_payload=True)


class _Plan:
    __slots__ = ("drop", "keep", "literals", "rename", "set_from")

    def __init__(
        self,
        keep: list[FieldPath] | None,
        drop: list[tuple[str, ...]],
        rename: list[tuple[FieldPath, FieldPath]],
        set_from: list[tuple[FieldPath, Callable[[Envelope], Any]]],
        literals: list[tuple[FieldPath, Any]],
    ) -> None:
        self.keep = keep
        self.drop = drop
        self.rename = rename
        self.set_from = set_from
        self.literals = literals

    def apply(self, env: Envelope) -> bool:
        document = env.document
        if type(document) is not dict:
            raise StageFailure(
                TYPE_ERROR, f"transform: the payload is {json_kind(document)}, not an object"
            )
        # Read before anything moves: set_from copies from the message as it came in.
        copied = [(destination, read(env)) for destination, read in self.set_from]
        changed = False
        if self.keep is not None:
            kept: dict[str, Any] = {}
            for path in self.keep:
                value = _in_objects(document, path.segments)
                if value is not MISSING:
                    put(kept, path, value)
            document = env.document = kept
            changed = True
        for segments in self.drop:
            changed = pop(document, segments) is not MISSING or changed
        for source, destination in self.rename:
            value = pop(document, source.segments)
            if value is not MISSING:
                put(document, destination, value)
                changed = True
        for destination, value in copied:
            if value is not MISSING:
                # A copy: two places in one document must not share a mutable value.
                put(document, destination, _copied(value))
                changed = True
        for destination, value in self.literals:
            put(document, destination, _copied(value))
            changed = True
        env.changed = env.changed or changed
        return True


def _in_objects(document: dict[str, Any], segments: tuple[str, ...]) -> Any:
    node: Any = document
    for segment in segments:
        if type(node) is not dict:
            return MISSING
        node = node.get(segment, MISSING)
    return node


def _copied(value: Any) -> Any:
    return copy.deepcopy(value) if isinstance(value, dict | list) else value


def _json_problem(value: Any) -> str | None:
    """Why ``value`` cannot be written as JSON, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return "JSON has no NaN or infinity"
    if isinstance(value, int) and not isinstance(value, bool) and not -_MAX_INT <= value < _MAX_INT:
        return "integers beyond 64 bits cannot be encoded"
    if isinstance(value, list):
        return next(filter(None, map(_json_problem, value)), None)
    if isinstance(value, dict):
        if any(not isinstance(key, str) for key in value):
            return "JSON object keys are strings"
        return next(filter(None, map(_json_problem, value.values())), None)
    return None
