"""JSON Schema for the YAML files (``nemesis schema``), checked with the ``jsonschema`` package.

The schema must accept every shipped example and reject the broken ones,
and agree with ``nemesis validate`` on each: a file the loader accepts is
never flagged in an editor, a broken one is flagged at its field.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from jsonschema import Draft202012Validator

from nemesis.config.document import parse_yaml
from nemesis.config.loader import validate_paths
from nemesis.onboarding.schema import SCHEMA_KINDS, SchemaKind, json_schema
from nemesis.pipeline import PipelineChecker
from nemesis.pipeline.registry import StageRegistry, StageType, default_registry
from nemesis.pipeline.stage import Stage, StageConfig
from tests.conftest import REPO


def validator(kind: SchemaKind) -> Draft202012Validator:
    return Draft202012Validator(json_schema(kind))


def data_of(text: str) -> Any:
    """The YAML as the loader reads it (its own parser, not PyYAML's constructors)."""
    document = parse_yaml(text, "test.yaml")
    assert document.problems == []
    return document.data


def shipped() -> list[tuple[SchemaKind, Path]]:
    files: list[tuple[SchemaKind, Path]] = [
        ("integration", path) for path in sorted((REPO / "integrations").glob("*.yaml"))
    ]
    files += [
        ("pipeline-test" if path.name.endswith(".test.yaml") else "pipeline", path)
        for path in sorted((REPO / "pipelines").glob("*.yaml"))
    ]
    files.append(("process", REPO / "nemesis.example.yaml"))
    return files


@pytest.mark.parametrize("kind", SCHEMA_KINDS)
def test_each_schema_is_a_valid_draft_2020_12_schema(kind: SchemaKind) -> None:
    schema = json_schema(kind)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is False  # unknown keys are flagged while typing


@pytest.mark.parametrize(
    ("kind", "path"), shipped(), ids=lambda value: getattr(value, "name", value)
)
def test_every_shipped_example_validates(kind: SchemaKind, path: Path) -> None:
    errors = list(validator(kind).iter_errors(data_of(path.read_text())))
    assert errors == [], [e.message for e in errors]


def test_shipped_examples_cover_every_kind() -> None:
    assert {kind for kind, _ in shipped()} == set(SCHEMA_KINDS)


INTEGRATION = """\
name: {name}
owners: [team-x]
source: {{topic: orders, consumer: {name}}}
target: {{url: 'http://x.svc/events'}}
"""

# (name, extra YAML, the path of the field the schema must flag)
BROKEN_INTEGRATIONS: list[tuple[str, str, list[str | int] | None]] = [
    ("unknown-key", "workers: 3\n", []),
    ("no-owners", "owners: []\n", ["owners"]),
    ("bad-timeout", "target: {url: 'http://x', timeout_s: 0}\n", ["target", "timeout_s"]),
    ("bad-scheme", "target: {url: 'ftp://x/y'}\n", ["target", "url"]),
    ("bad-format", "target: {url: 'http://x', format: xml}\n", ["target", "format"]),
    ("no-workers", "delivery: {workers: 0}\n", ["delivery", "workers"]),
    ("bad-ordering", "delivery: {ordering: random}\n", ["delivery", "ordering"]),
    ("bad-batch", "delivery: {batch: {size: 0}}\n", ["delivery", "batch", "size"]),
    ("bad-tier", "retry: {tiers: [5 minutes]}\n", ["retry", "tiers", 0]),
    ("bad-breaker", "breaker: {open_above: 2}\n", ["breaker", "open_above"]),
    ("bad-limit", "rate_limits: {main: -1}\n", ["rate_limits", "main"]),
    ("bad-flags", "flags: {disabled_types: order.test}\n", ["flags", "disabled_types"]),
    ("bad-paused", "paused: sometimes\n", ["paused"]),
    ("bad-pipeline-name", "pipeline: City_Filter\n", ["pipeline"]),
    ("two-key-stage", "pipeline: [{filter: {match: {a: 1}}, transform: {keep: [a]}}]\n", None),
    ("unknown-stage", "pipeline: [{fliter: {match: {a: 1}}}]\n", None),
    ("stage-unknown-option", "pipeline: [{filter: {match: {a: 1}, bogus: 1}}]\n", None),
    ("stage-missing-option", "pipeline: [{filter: {}}]\n", None),
    ("stage-bad-choice", "pipeline: [{decode: {format: avro}}]\n", None),
]


def broken_integration(name: str, extra: str) -> str:
    lines = INTEGRATION.format(name=name).splitlines(keepends=True)
    # A later key of the same name replaces the base one (no duplicate keys).
    keys = {line.split(":", 1)[0] for line in extra.splitlines()}
    kept = [line for line in lines if line.split(":", 1)[0] not in keys]
    return "".join(kept) + extra


@pytest.mark.parametrize(
    ("name", "extra", "where"), BROKEN_INTEGRATIONS, ids=[b[0] for b in BROKEN_INTEGRATIONS]
)
def test_broken_integrations_are_rejected_by_the_schema_and_the_loader(
    tmp_path: Path, name: str, extra: str, where: list[str | int] | None
) -> None:
    text = broken_integration(name, extra)
    errors = list(validator("integration").iter_errors(data_of(text)))
    assert errors, text
    if where is not None:
        best = jsonschema.exceptions.best_match(errors)
        assert list(best.absolute_path)[: len(where)] == where, best.message
    else:
        # A stage: the error is inside the pipeline list.
        assert all(list(e.absolute_path)[:1] == ["pipeline"] for e in errors)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    problems = validate_paths([path], checkers=[PipelineChecker()])
    assert problems, f"the loader accepts what the schema rejects:\n{text}"


# Legal spellings an editor must not flag.
VALID_INTEGRATIONS: list[tuple[str, str]] = [
    ("durations", "retry: {tiers: [250ms, 30, 1.5m, 2h, '7d']}\n"),
    ("variables", "delivery: {workers: '${WORKERS:-8}', ordering: '${ORDERING:-key}'}\n"),
    ("grpc", "target: {url: 'grpcs://x.svc:443', headers: {authorization: 'Bearer ${T}'}}\n"),
    ("unlimited", "rate_limits: {main: null, retry: 10, replay: null}\n"),
    (
        "inline-stages",
        "pipeline:\n"
        "  - route_by_type:\n"
        "  - filter: {name: big, match: {order.amount: {gt: 1000}}}\n"
        "  - transform: {keep: [order_id], set: {source: nemesis}}\n",
    ),
    ("named-pipeline", "pipeline: city-filter\n"),
    ("owners", "owners: [team-loyalty, payments/loyalty, loyalty@example.com]\n"),
    (
        "start-zoned",
        "source: {topic: crm/leads-v2, consumer: z, start_from: '2026-12-01T09:00+03:00'}\n",
    ),
    ("start-back", "source: {topic: billing.invoices, consumer: start-back, start_from: -2h}\n"),
    ("start-latest", "source: {topic: orders, consumer: start-latest, start_from: latest}\n"),
    (
        "grpc-metadata",
        "target: {url: 'grpcs://loyalty.svc:443',"
        " headers: {x-trace: a, authorization: 'Bearer ${T}'},"
        " tls: {cert_file: c.pem, key_file: k.pem, server_name: loyalty.internal}}\n",
    ),
    ("https-port", "target: {url: 'https://[::1]:8443/events?v=1', headers: {X-Team: loyalty}}\n"),
    ("halt-ordered", "retry: {on_exhausted: halt}\ndelivery: {ordering: key}\n"),
    ("everything", "paused: true\nflags: {disabled_types: [order.test]}\n"),
]


@pytest.mark.parametrize(
    ("name", "extra"), VALID_INTEGRATIONS, ids=[v[0] for v in VALID_INTEGRATIONS]
)
def test_legal_spellings_are_accepted_by_both(tmp_path: Path, name: str, extra: str) -> None:
    text = broken_integration(name, extra)
    errors = list(validator("integration").iter_errors(data_of(text)))
    assert errors == [], [e.message for e in errors]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    pipelines = PipelineChecker(pipelines_dirs=[REPO / "pipelines"])
    assert validate_paths([path], env={}, checkers=[pipelines]) == []


BROKEN_OTHERS: list[tuple[SchemaKind, str]] = [
    ("pipeline", "description: no stages\n"),
    ("pipeline", "stages: []\n"),
    ("pipeline", "stages: [{decode: {format: avro}}]\n"),
    ("pipeline", "stages: [{filter: {match: {a: 1}}}]\nowner: me\n"),
    ("pipeline-test", "cases: []\n"),
    ("pipeline-test", "cases: [{name: no input, expect: pass}]\n"),
    ("pipeline-test", "cases: [{input: {payload: {}}, expect: maybe}]\n"),
    ("process", "backend: {kind: kafka}\n"),
    ("process", "admin: {port: 70000}\n"),
    ("process", "dlq: {retention: forever}\n"),
]


@pytest.mark.parametrize(("kind", "text"), BROKEN_OTHERS)
def test_broken_pipelines_tests_and_process_files_are_rejected(kind: SchemaKind, text: str) -> None:
    assert list(validator(kind).iter_errors(data_of(text)))


def test_stages_come_from_the_registry() -> None:
    class ShoutConfig(StageConfig):
        volume: int

    def build(config: ShoutConfig, context: object) -> Stage:
        return Stage(lambda envelope: True)

    registry = default_registry().copy()
    registry.register(StageType("shout", ShoutConfig, build, "louder"))
    schema = json_schema("pipeline", registry=registry)
    check = Draft202012Validator(schema)
    assert check.is_valid({"stages": [{"shout": {"volume": 11}}]})
    assert not check.is_valid({"stages": [{"shout": {"volume": "loud"}}]})
    assert not Draft202012Validator(json_schema("pipeline")).is_valid(
        {"stages": [{"shout": {"volume": 11}}]}
    )
    empty = Draft202012Validator(json_schema("pipeline", registry=StageRegistry()))
    assert not empty.is_valid({"stages": [{"filter": {"match": {"a": 1}}}]})


@pytest.mark.parametrize("kind", ["integration", "pipeline"])
def test_the_cli_prints_the_schema(kind: SchemaKind, tmp_path: Path) -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "nemesis", "schema", kind],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(printed.stdout) == json_schema(kind)
