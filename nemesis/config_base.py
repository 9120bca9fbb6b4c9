"""What every configuration model is built on: the ``Model`` base and durations.

Outside ``nemesis.config`` so that a backend's module
(``nemesis.backends.*``) can define its model without importing the whole
configuration, which itself lists the registered backends.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

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


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
