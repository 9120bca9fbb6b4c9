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

The integration schema also carries ``validate``'s own rules wherever JSON
Schema can say them: the pull-request rules (owners, the topic naming
convention, Nemesis's ``nemesis.*`` topics, header names per transport),
``start_from``'s forms, ``halt`` needing an ordering, TLS settings only on a
TLS URL, a client certificate with its key. What it cannot say it leaves to
``validate``: rules across files (the file name, unique names and consumers,
a named pipeline that exists) and comparisons of two values (``buffer`` at
least ``batch.size``, ``close_below`` below ``open_above``, retry tiers that
never shorten), since JSON Schema compares a value with constants only.
``tests/test_schema_corpus.py`` runs both on one corpus and keeps that list.

The schema is for editors: it may accept a file ``nemesis validate`` rejects
(what it cannot say), never the other way round for a file the loader accepts.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Final, Literal

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from pydantic_core import core_schema

from nemesis import __version__
from nemesis.backends import default_backends
from nemesis.config.models import (
    DNS_NAME_PATTERN,
    NAME_PATTERN,
    TRANSPORTS,
    IntegrationConfig,
    NemesisConfig,
    parse_duration,
    parse_start_from,
)
from nemesis.delivery.http_common import HEADER_NAME_PATTERN
from nemesis.onboarding.choices import SCHEMA_KINDS as SCHEMA_KINDS
from nemesis.onboarding.choices import SchemaKind as SchemaKind
from nemesis.onboarding.rules import INTERNAL_PREFIX, OWNER_PATTERN, TOPIC_CONVENTION
from nemesis.pipeline.compiler import PipelineFile
from nemesis.pipeline.registry import StageRegistry, default_registry
from nemesis.pipeline.testing import PipelineTestFile

DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"

# What parse_duration accepts, as a pattern: "90", "1.5s", "250ms", "5m", "2h", "7d".
DURATION_PATTERN: Final = r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?\s*$"
# A value that is (or holds) a ${VAR} reference: expanded before validation.
VARIABLE_PATTERN: Final = r"\$\{"
# The shape TargetConfig's validator checks: a registered scheme (nemesis.transports).
_SCHEMES: Final = TRANSPORTS.scheme_pattern()
TARGET_URL_PATTERN: Final = rf"^{_SCHEMES}://[^/\s]+"
# TARGET_URL_PATTERN, and a port (when written) from 1 to 65535, as urlsplit reads it.
_PORT: Final = r"0*([1-9]\d{0,3}|[1-5]\d{4}|6[0-4]\d{3}|65[0-4]\d{2}|655[0-2]\d|6553[0-5])"
_AUTHORITY: Final = rf"([^/\s?#@]*@)?(\[[^\]/\s]*\]|[^/\s?#:\[\]@]+)(:({_PORT})?)?"
TARGET_URL_WITH_PORT_PATTERN: Final = rf"^{_SCHEMES}://{_AUTHORITY}([/?#]|$)"
# A duration of zero, which no retry tier may have.
_ZERO_DURATION: Final = r"^\s*0+(\.0+)?\s*(ms|s|m|h|d)?\s*$"
# What parse_start_from accepts: earliest, latest, -<duration>, or a time with its zone.
START_FROM_PATTERN: Final = (
    r"^\s*(earliest|latest|-\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?"
    r"|\d{4}-?(\d{2}-?\d{2}|W\d{2}-?\d?|\d{3}).\d{2}\S*([Zz]|[+-]\d{2}(:?\d{2}(:?\d{2}(\.\d+)?)?)?))\s*$"
)
# Source topics and consumers: the naming convention, at most 200 characters (the
# model's own limit), never Nemesis's own topics (the pull-request rules).
_INTERNAL: Final = INTERNAL_PREFIX.rstrip(".").replace(".", "\\.")
SOURCE_NAME_PATTERN: Final = (
    rf"^(?!{_INTERNAL}(\.|$))(?=.{{1,200}}$){TOPIC_CONVENTION.removeprefix('^')}"
)

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
        if schema["function"]["function"] is parse_start_from:
            return {
                "type": "string",
                "pattern": START_FROM_PATTERN,
                "description": "earliest, latest, a time with its zone"
                " (2026-12-01T09:00:00Z) or a duration back from now (-1h, -30m, -2d)",
            }
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
        url["pattern"] = TARGET_URL_WITH_PORT_PATTERN
        forms = [kind.url_form for kind in TRANSPORTS.kinds.values() if kind.url_form]
        url.setdefault("description", " or ".join(forms))
    if kind == "integration":
        _integration_rules(root, definitions)
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


def _on_scheme(pattern: str, then: dict[str, Any]) -> dict[str, Any]:
    """``then`` applies to a target whose URL matches ``pattern`` and holds no ${VAR}.

    As in ``validate``: a URL or header value that is still a reference (a secret
    absent in CI) leaves the transport's checks to the host that has it.
    """
    unexpanded = {"pattern": VARIABLE_PATTERN}
    condition = {
        "properties": {
            "url": {"pattern": pattern, "not": unexpanded},
            "headers": {"additionalProperties": {"not": unexpanded}},
        },
        "required": ["url"],
    }
    return {"if": condition, "then": then}


def _integration_rules(root: dict[str, Any], definitions: dict[str, Any]) -> None:
    """``validate``'s rules beyond the models' fields, where JSON Schema can say them."""
    owners = root["properties"]["owners"]
    owners["items"] = {
        "type": "string",
        "pattern": OWNER_PATTERN,
        "description": "a team slug (team-loyalty), org/team or an e-mail address",
    }
    owners["uniqueItems"] = True
    # halt holds a key (or partition) back: only an ordered integration can.
    root["allOf"] = [
        {
            "if": {
                "properties": {
                    "retry": {
                        "properties": {"on_exhausted": {"const": "halt"}},
                        "required": ["on_exhausted"],
                    }
                },
                "required": ["retry"],
            },
            "then": {
                "properties": {
                    "delivery": {
                        "properties": {"ordering": {"not": {"const": "none"}}},
                        "required": ["ordering"],
                    }
                },
                "required": ["delivery"],
            },
        }
    ]
    sources = default_backends().sources
    default_source = next(iter(sources))  # the kind a source without `kind` is
    for name, kind in sources.items():  # every source kind's source:
        definition = definitions[kind.config.__name__]
        if name != default_source:  # any other kind is named, or the two would both match
            definition["required"] = sorted({*definition.get("required", ()), "kind"})
        source = definition["properties"]
        for field in ("topic", "consumer"):
            source[field]["pattern"] = SOURCE_NAME_PATTERN
            source[field]["description"] = (
                f"lowercase words joined by '.', '-', '_' or '/'; not {INTERNAL_PREFIX}*"
            )
    target = definitions["TargetConfig"]
    target["properties"]["headers"]["propertyNames"] = {"pattern": f"^{HEADER_NAME_PATTERN}$"}
    # Each transport's own checks, on a target of its schemes.
    target["allOf"] = [
        _on_scheme(f"^({'|'.join(map(re.escape, kind.schemes))})://", {"properties": kind.schema()})
        for kind in TRANSPORTS.kinds.values()
        if kind.schema is not None and kind.schemes
    ]
    # TLS settings belong to the TLS schemes (https://, grpcs://).
    plain = "|".join(map(re.escape, TRANSPORTS.plain_schemes()))
    target["allOf"].append(
        {
            "if": {"properties": {"url": {"pattern": f"^({plain})://"}}, "required": ["url"]},
            "then": {"properties": {"tls": {"type": "null"}}},
        }
    )
    signing = definitions["SigningConfig"]["properties"]["secrets_env"]
    signing["uniqueItems"] = True
    tls = definitions["TlsConfig"]
    tls["dependentRequired"] = {"cert_file": ["key_file"], "key_file": ["cert_file"]}
    for member in tls["properties"]["server_name"].get("anyOf", []):
        if member.get("type") == "string":
            member["pattern"] = f"^{DNS_NAME_PATTERN}$"
    tiers = definitions["RetryConfig"]["properties"]["tiers"]["items"]
    for member in tiers["anyOf"]:
        if member.get("type") == "number":
            member.pop("minimum", None)
            member["exclusiveMinimum"] = 0
        else:
            member["not"] = {"pattern": _ZERO_DURATION}


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
