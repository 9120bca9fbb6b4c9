"""What every configuration model is built on: the ``Model`` base and durations.

Outside ``nemesis.config`` so that a backend's module
(``nemesis.backends.*``) can define its model without importing the whole
configuration, which itself lists the registered backends.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterator
from typing import Annotated, Any, ClassVar, TypeVar, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """``90`` -> 90.0 s; ``"1.5s"``, ``"5m"``, ``"2h"``, ``"7d"``, ``"250ms"`` -> seconds."""
    if isinstance(value, bool):
        # pydantic turns only ValueError into a validation error; a TypeError would escape.
        raise ValueError("expected a duration such as 30s, 5m or 1h")  # noqa: TRY004
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise ValueError(f"expected a duration such as 30s, 5m or 1h, got {value!r}")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


DurationS = Annotated[float, BeforeValidator(parse_duration)]


CROSS_FIELD_ERROR = "cross_field"
# A rule across fields: given a model's input (raw data, or the validated model),
# the problems it finds, each at a location relative to the model.
CrossRule = Callable[[Any], Iterator[tuple[tuple[Hashable, ...], str]]]


def get_path(data: Any, *path: str, default: Any = None) -> Any:
    """``data[a][b]`` whether ``data`` is raw input or a model; ``default`` where it is absent."""
    for key in path:
        if isinstance(data, dict):
            data = data.get(key, default)
        elif isinstance(data, BaseModel):
            data = getattr(data, key, default)
        else:
            return default
    return data


class Model(BaseModel):
    # .inf and .nan are never a setting: a breaker with cooldown_s: .inf never recovers.
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False, defer_build=True
    )

    # Rules across fields run on the input even when some other field is invalid,
    # so that one run of ``nemesis validate`` reports every problem in a file.
    # A rule judges only values it can read and says nothing about the rest.
    cross_rules: ClassVar[tuple[CrossRule, ...]] = ()

    @model_validator(mode="wrap")
    @classmethod
    def _check_across_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if not cls.cross_rules:
            return handler(data)
        try:
            value = handler(data)
        except ValidationError as exc:
            found = _cross_errors(cls.cross_rules, data)
            if not found:
                raise
            known = [_init_details(details) for details in exc.errors()]
            raise ValidationError.from_exception_data(exc.title, [*known, *found]) from None
        found = _cross_errors(cls.cross_rules, value)
        if found:
            raise ValidationError.from_exception_data(cls.__name__, found)
        return value


ModelT = TypeVar("ModelT", bound=Model)


def defaults(model: type[ModelT]) -> ModelT:
    """``model`` with every field at its default: a field's default that is itself a model.

    Written as ``BatchConfig()``, the default would build the model's validator
    when the module loads; made this way the models build on first use, so
    ``nemesis validate`` of integration files never builds the process file's.
    Defaults are valid as written (tests/test_config_defaults.py compares each
    with the validated model).
    """
    return cast("ModelT", model.model_construct())  # mypy reads Self on type[ModelT] as Model


def _cross_errors(rules: tuple[CrossRule, ...], data: Any) -> list[InitErrorDetails]:
    return [
        InitErrorDetails(
            type=PydanticCustomError(CROSS_FIELD_ERROR, "{message}", {"message": message}),
            loc=tuple(str(part) if not isinstance(part, int) else part for part in loc),
            input=get_path(data, *(str(part) for part in loc)),
        )
        for rule in rules
        for loc, message in rule(data)
    ]


def _init_details(details: Any) -> InitErrorDetails:
    kind = details["type"]
    if kind == CROSS_FIELD_ERROR:  # a nested model's rule: pydantic does not know the type
        kind = PydanticCustomError(kind, "{message}", details["ctx"])
    init = InitErrorDetails(type=kind, loc=details["loc"], input=details["input"])
    if "ctx" in details and not isinstance(kind, PydanticCustomError):
        init["ctx"] = details["ctx"]
    return init
