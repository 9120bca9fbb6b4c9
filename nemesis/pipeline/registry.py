"""Stage types by name: a config model and a factory each (benthos' Environment).

A registry is a plain object: ``default_registry()`` builds a fresh one with
the built-in stages every time it is called, tests copy it or start from
``StageRegistry()`` and register their own types, and nothing is global.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from nemesis.pipeline.stage import BuildContext, Stage, StageConfig

ConfigT = TypeVar("ConfigT", bound=StageConfig)


@dataclass(frozen=True, slots=True)
class StageType(Generic[ConfigT]):
    """One kind of stage: its YAML name, config model and factory."""

    name: str
    config: type[ConfigT]
    # Builds the stage from a validated config; raises StageConfigError for
    # problems the model cannot see (a pattern, a file to read).
    factory: Callable[[ConfigT, BuildContext], Stage]
    summary: str = ""


class StageRegistry:
    """Stage types by name; copy it to extend it without touching the original."""

    def __init__(self, types: Iterable[StageType[Any]] = ()) -> None:
        self._types: dict[str, StageType[Any]] = {}
        for stage_type in types:
            self.register(stage_type)

    def register(self, stage_type: StageType[Any]) -> None:
        """Adds a stage type; a name can be registered once."""
        if stage_type.name in self._types:
            raise ValueError(f"stage type {stage_type.name!r} is already registered")
        self._types[stage_type.name] = stage_type

    def get(self, name: str) -> StageType[Any] | None:
        return self._types.get(name)

    def names(self) -> list[str]:
        return sorted(self._types)

    def copy(self) -> StageRegistry:
        return StageRegistry(self._types.values())

    def __contains__(self, name: object) -> bool:
        return name in self._types


def default_registry() -> StageRegistry:
    """A new registry with the built-in stages."""
    # Imported here: the stage modules import this one for StageType.
    from nemesis.pipeline.stages import builtin_stage_types

    return StageRegistry(builtin_stage_types())
