"""A field's default that is itself a model equals what validating nothing gives.

Such defaults are made with ``nemesis.config_base.defaults`` (``model_construct``,
no validation), so that a model's validator is built on first use and not when
``nemesis.config.models`` loads. That is only right while every such default is
already valid as written: a validator that changes a value, or refuses the
default, would make the constructed default differ from a validated one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

import nemesis.config.models  # noqa: F401  (every configuration model is defined)
from nemesis.config_base import Model


def _subclasses(cls: type[Model]) -> Iterator[type[Model]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _model_defaults() -> list[tuple[str, BaseModel]]:
    found = []
    for model in sorted(set(_subclasses(Model)), key=lambda m: f"{m.__module__}.{m.__name__}"):
        for name, info in model.model_fields.items():
            if isinstance(info.default, BaseModel):
                found.append((f"{model.__name__}.{name}", info.default))
    return found


DEFAULTS = _model_defaults()


def test_the_process_and_integration_models_have_model_defaults() -> None:
    names = {name for name, _ in DEFAULTS}
    assert {"IntegrationConfig.delivery", "NemesisConfig.admin", "NemesisConfig.limits"} <= names


@pytest.mark.parametrize(("field", "default"), DEFAULTS, ids=[name for name, _ in DEFAULTS])
def test_a_model_default_is_the_validated_model(field: str, default: BaseModel) -> None:
    validated = type(default).model_validate({})
    assert default == validated
    assert repr(default) == repr(validated)  # 1 and 1.0 are equal, but not the same setting
    assert default.model_fields_set == validated.model_fields_set == set()
