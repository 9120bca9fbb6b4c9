"""JSON Schema for the YAML files teams write, generated from the models that validate them.

``nemesis schema integration`` (and ``pipeline``, ``pipeline-test``,
``process``) prints a JSON Schema (draft 2020-12) for editors: with it, VS
Code, JetBrains IDEs and anything speaking yaml-language-server complete
field names and flag mistakes while typing. The schema is derived from the
pydantic models ``nemesis validate`` uses, plus what the models cannot say
in JSON Schema terms:

- pipeline stages come from the stage registry: each list item is a mapping
  with one key, a stage type, holding that type's config model;
- durations (``retry.tiers``, retentions) accept ``90s``, ``5m``, ``1h`` as
  well as seconds;
- any value may be a ``${VAR}`` reference, expanded at load time, so every
  constrained scalar (a number, a pattern, a choice) also accepts one.

The schema is for editors: it may accept a file ``nemesis validate`` rejects
(cross-file rules, the file name), never the other way round for a file the
loader accepts.
"""

from __future__ import annotations

import copy
from typing import Any, Final, Literal

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from pydantic_core import core_schema

from nemesis import __version__
from nemesis.config.models import NAME_PATTERN, IntegrationConfig, NemesisConfig, parse_duration
from nemesis.onboarding.choices import SCHEMA_KINDS as SCHEMA_KINDS
from nemesis.onboarding.choices import SchemaKind as SchemaKind
from nemesis.pipeline.compiler import PipelineFile
from nemesis.pipeline.registry import StageRegistry, default_registry
from nemesis.pipeline.testing import PipelineTestFile

DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"

# What parse_duration accepts, as a pattern: "90", "1.5s", "250ms", "5m", "2h", "7d".
DURATION_PATTERN: Final = r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?\s*$"
# A value that is (or holds) a ${VAR} reference: expanded before validation.
VARIABLE_PATTERN: Final = r"\$\{"
# The shape TargetConfig's validator checks.
TARGET_URL_PATTERN: Final = r"^(https?|grpcs?)://[^/\s]+"

_TITLES: Final[dict[SchemaKind, str]] = {
    "integration": "Nemesis integration (integrations/<name>.yaml)",
    "pipeline": "Nemesis pipeline (pipelines/<name>.yaml)",
    "pipeline-test": "Nemesis pipeline tests (pipelines/<name>.test.yaml)",
    "process": "Nemesis process configuration (nemesis.yaml)",
}
_MODELS: Final[dict[SchemaKind, type[BaseModel]]] = {
    "integration": IntegrationConfig,
    "pipeline": PipelineFile,
    "pipeline-test": PipelineTestFile,
    "process": NemesisConfig,
}
_VARIABLE_DEF: Final = "Variable"
_STAGE_DEF: Final = "Stage"


class _NemesisSchema(GenerateJsonSchema):
    """pydantic's generator, taught the value forms the loader accepts before validation."""

    def function_before_schema(
        self, schema: core_schema.BeforeValidatorFunctionSchema
    ) -> JsonSchemaValue:
        if schema["function"]["function"] is parse_duration:
            return {
                "anyOf": [
                    {"type": "number", "minimum": 0},
                    {"type": "string", "pattern": DURATION_PATTERN},
                ],
                "description": "seconds, or a duration such as 250ms, 90s, 5m, 2h, 7d",
            }
        return super().function_before_schema(schema)


def json_schema(kind: SchemaKind, *, registry: StageRegistry | None = None) -> dict[str, Any]:
    """The JSON Schema of one kind of file, its stages taken from ``registry``."""
    registry = registry if registry is not None else default_registry()
    # Only the files that hold stages carry their schemas.
    names = registry.names() if kind != "process" else []
    stage_types = [t for t in map(registry.get, names) if t is not None]
    models: list[tuple[type[BaseModel], Literal["validation"]]] = [(_MODELS[kind], "validation")]
    models += [(t.config, "validation") for t in stage_types]
    keys, defs = models_json_schema(
        models,
        ref_template="#/$defs/{model}",
        schema_generator=_NemesisSchema,
    )
    definitions: dict[str, Any] = dict(defs.get("$defs", {}))
    root_ref = keys[(_MODELS[kind], "validation")]["$ref"].rsplit("/", 1)[-1]
    root = definitions.pop(root_ref)
    stage_refs = {t.name: keys[(t.config, "validation")]["$ref"] for t in stage_types}
    if kind != "process":
        definitions[_STAGE_DEF] = _stage_schema(registry, stage_refs)
        _use_stages(kind, root)
    if "TargetConfig" in definitions:
        url = definitions["TargetConfig"]["properties"]["url"]
        url["pattern"] = TARGET_URL_PATTERN
        url.setdefault("description", "http(s)://host/path or grpc(s)://host:port")
    schema: dict[str, Any] = {
        "$schema": DIALECT,
        "$id": f"urn:nemesis:schema:{kind}:{__version__}",
        **root,
        "title": _TITLES[kind],
    }
    schema["$defs"] = {name: _allow_variables(d) for name, d in sorted(definitions.items())}
    schema["properties"] = {
        name: _allow_variables(prop) for name, prop in schema.get("properties", {}).items()
    }
    schema["$defs"][_VARIABLE_DEF] = {
        "type": "string",
        "pattern": VARIABLE_PATTERN,
        "description": "${VAR} or ${VAR:-default}, read from the environment at load time",
    }
    return schema


def _stage_schema(registry: StageRegistry, refs: dict[str, str]) -> dict[str, Any]:
    """One pipeline stage: a mapping with one key, the stage type, holding its config."""
    choices = []
    for name in registry.names():
        stage_type = registry.get(name)
        if stage_type is None:
            continue
        choices.append(
            {
                "type": "object",
                "title": name,
                "description": stage_type.summary or f"the {name} stage",
                # `- route_by_type:` with nothing after it means default settings.
                "properties": {name: {"anyOf": [{"$ref": refs[name]}, {"type": "null"}]}},
                "required": [name],
                "additionalProperties": False,
            }
        )
    if not choices:
        return {"description": "no stage types are registered", "not": {}}
    return {"description": "a stage: `- <type>: {config}`", "anyOf": choices}


def _use_stages(kind: SchemaKind, root: dict[str, Any]) -> None:
    """Replace the models' loose ``list[dict]`` stage lists with the registry's stage schema."""
    stages = {"type": "array", "items": {"$ref": f"#/$defs/{_STAGE_DEF}"}}
    reference = {
        "anyOf": [
            {"type": "string", "pattern": NAME_PATTERN, "description": "a file in pipelines/"},
            {**stages, "description": "inline stages"},
            {"type": "null"},
        ],
        "default": None,
        "description": "a pipeline name from pipelines/, or an inline list of stages",
    }
    properties = root.get("properties", {})
    if kind == "pipeline":
        properties["stages"] = {**stages, "minItems": 1, "description": "run in order"}
    elif "pipeline" in properties:
        properties["pipeline"] = reference


def _is_constrained_scalar(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind in ("integer", "number", "boolean"):
        return True
    if "enum" in node or "const" in node:
        return True
    return kind == "string" and ("pattern" in node or "format" in node)


def _allow_variables(node: Any, *, wrap: bool = True) -> Any:
    """A copy of ``node`` where every constrained scalar also accepts a ``${VAR}`` reference."""
    if not isinstance(node, dict):
        return node
    node = copy.copy(node)
    for key in ("properties", "$defs", "patternProperties"):
        if isinstance(node.get(key), dict):
            node[key] = {name: _allow_variables(sub) for name, sub in node[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            node[key] = _allow_variables(node[key])
    if isinstance(node.get("prefixItems"), list):
        node["prefixItems"] = [_allow_variables(sub) for sub in node["prefixItems"]]
    variable = {"$ref": f"#/$defs/{_VARIABLE_DEF}"}
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            # One reference alternative for the whole choice, not one per member.
            members = [_allow_variables(sub, wrap=False) for sub in node[key]]
            if any(_is_constrained_scalar(m) for m in members):
                members.append(variable)
            node[key] = members
    if wrap and _is_constrained_scalar(node):
        # Annotations stay outside, so editors still show them on hover and complete defaults.
        outer = {k: node.pop(k) for k in ("title", "description", "default") if k in node}
        return {**outer, "anyOf": [node, variable]}
    return node
