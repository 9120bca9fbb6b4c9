"""Live overrides of an integration's settings, and their drift from the YAML.

An override is a value set while running (admin API) for one of the
``LIVE_FIELDS``, on top of the integration's YAML. The effective
configuration is the YAML with the overrides laid over it, validated as a
whole (so ``delivery.buffer`` must still hold a ``delivery.batch.size``). An
override is *drift*: the running value differs from the reviewed file. It
lasts until it is cleared, or until the YAML catches up (a reload finds the
file saying the same value). ``nemesis run`` keeps overrides in the fleet's
state store (``nemesis.fleet``): they hold on every replica and survive a
restart, which is why drift is reported loudly. A proxy built without a
fleet (tests, embedders) keeps them in memory only.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from pydantic import BaseModel

from nemesis.config.models import IntegrationConfig

# Dotted paths of the settings that change while running, without a restart.
LiveField = Literal[
    "delivery.workers",
    "delivery.buffer",
    "delivery.batch.size",
    "delivery.batch.max_wait_ms",
    "rate_limits.main",
    "rate_limits.retry",
    "rate_limits.replay",
    "flags.disabled_types",
    "paused",
]
LIVE_FIELDS: Final[tuple[str, ...]] = get_args(LiveField)

# Changes to these need no restart either: the runtime never reads owners
# (the DLQ viewer does, from the configuration it is handed); a fleet member
# places an integration again when its replicas change.
RESTART_FREE_FIELDS: Final = (*LIVE_FIELDS, "owners", "replicas")


class Source(enum.Enum):
    """Where a running value came from."""

    DEFAULT = "default"  # the YAML does not set it
    YAML = "yaml"
    OVERRIDE = "override"


@dataclass(frozen=True, slots=True)
class Setting:
    """One live field: its running value, where it came from, and what the YAML says."""

    field: str
    value: Any
    source: Source
    yaml: Any  # the file's value (the default when the file does not set it)

    @property
    def drift(self) -> bool:
        """Whether the running value differs from the YAML's."""
        return self.source is Source.OVERRIDE


def get_field(config: BaseModel, path: str) -> Any:
    """The value at a dotted path of a config model."""
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return _plain(value)


def is_set_in_file(config: BaseModel, path: str) -> bool:
    """Whether the file wrote the field (every section on the way included)."""
    model: Any = config
    for part in path.split("."):
        if not isinstance(model, BaseModel) or part not in model.model_fields_set:
            return False
        model = getattr(model, part)
    return True


def apply_overrides(config: IntegrationConfig, overrides: Mapping[str, Any]) -> IntegrationConfig:
    """``config`` with ``overrides`` laid over it, validated; raises pydantic's ValidationError."""
    if not overrides:
        return config
    unknown = set(overrides) - set(LIVE_FIELDS)
    if unknown:
        raise KeyError(f"not a live field: {', '.join(sorted(unknown))}")
    document = config.model_dump()
    for path, value in overrides.items():
        *sections, leaf = path.split(".")
        target = document
        for section in sections:
            target = target[section]
        target[leaf] = value
    return IntegrationConfig.model_validate(document)


def caught_up(file_config: IntegrationConfig, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The overrides the YAML does not say yet; the ones it says now are drift no more."""
    return {
        path: value for path, value in overrides.items() if get_field(file_config, path) != value
    }


def settings(file_config: IntegrationConfig, overrides: Mapping[str, Any]) -> Iterator[Setting]:
    """Every live field with its value and source."""
    for path in LIVE_FIELDS:
        yaml_value = get_field(file_config, path)
        if path in overrides:
            yield Setting(path, overrides[path], Source.OVERRIDE, yaml_value)
        elif is_set_in_file(file_config, path):
            yield Setting(path, yaml_value, Source.YAML, yaml_value)
        else:
            yield Setting(path, yaml_value, Source.DEFAULT, yaml_value)


def changed_fields(old: IntegrationConfig, new: IntegrationConfig) -> list[str]:
    """Dotted paths of the leaves that differ between two configurations."""
    return sorted(_diff(old.model_dump(), new.model_dump(), ""))


def needs_restart(old: IntegrationConfig, new: IntegrationConfig) -> list[str]:
    """The changed fields that cannot be applied while running (empty: apply live)."""
    return [
        path
        for path in changed_fields(old, new)
        if not any(_within(path, live) for live in RESTART_FREE_FIELDS)
    ]


def only(overrides: Mapping[str, Any], fields: Collection[str]) -> dict[str, Any]:
    """The overrides without ``fields``."""
    return {path: value for path, value in overrides.items() if path not in fields}


def _within(path: str, field: str) -> bool:
    return path == field or path.startswith(field + ".")


def _diff(old: Any, new: Any, prefix: str) -> Iterator[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in old.keys() | new.keys():
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                yield path
            else:
                yield from _diff(old[key], new[key], path)
    elif old != new:
        yield prefix


def _plain(value: Any) -> Any:
    # Lists are compared and reported by value; a model is never a leaf of LIVE_FIELDS.
    return list(value) if isinstance(value, list | tuple) else value
