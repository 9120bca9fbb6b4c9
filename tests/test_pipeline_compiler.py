"""Pipelines from YAML: problems by file, line and field; `nemesis validate`; integrations."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import orjson
import pytest

from nemesis.broker.port import Message
from nemesis.config import IntegrationConfig, load_integration_file, validate_paths
from nemesis.errors import ConfigError, ConfigProblem
from nemesis.metrics import Metrics
from nemesis.pipeline import (
    PipelineChecker,
    Verdict,
    build_integration_pipeline,
    changed_sources,
    compile_file,
    load_pipeline,
)
from tests.conftest import order_descriptor_set


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def found(problems: list[ConfigProblem]) -> list[tuple[int | None, str | None, str]]:
    return [(p.line, p.field, p.message) for p in problems]


INTEGRATION = """\
name: {name}
owners: [team-loyalty]
source: {{topic: orders, consumer: loyalty}}
target: {{url: "http://127.0.0.1:9/events"}}
"""

BAD_PIPELINE = """\
description: every kind of mistake, each reported at its line
stages:
  - filtr:
      match: {city: msk}
  - filter:
      match:
        order.city: {one_off: [msk]}
        order..amount: {gt: 1}
        order.total: {gt: "1000"}
        $metadata.version: 2
  - filter:
      name: cities
      on_error: crash
      match: {city: msk}
  - transform:
      keep: [$key]
  - cdc: {}
  - [decode]
  - route_by_type: {name: cities}
"""


def test_an_invalid_pipeline_reports_every_problem_with_file_line_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.yaml", BAD_PIPELINE)
    pipeline, problems = compile_file(path, env={})
    assert pipeline is None
    assert {p.file for p in problems} == {str(path)}
    assert found(problems) == [
        (3, "stages[0].filtr", "unknown stage type 'filtr' (did you mean filter?)"),
        (
            7,
            "stages[1].filter.match.order.city.one_off",
            "unknown operator 'one_off' (did you mean one_of?)",
        ),
        (
            8,
            "stages[1].filter.match.order..amount",
            "bad path: empty segment in the path (two dots, or a dot at an end)",
        ),
        (9, "stages[1].filter.match.order.total.gt", "gt needs a number, got a string"),
        (
            10,
            "stages[1].filter.match.$metadata.version",
            "$metadata.version is always a string, so a number never equals it (write '2')",
        ),
        (13, "stages[2].filter.on_error", "Input should be 'no_match' or 'dead_letter'"),
        (
            16,
            "stages[3].transform.keep[0]",
            "bad path: $key cannot be written: write payload fields only",
        ),
        (17, "stages[4].cdc.key_columns", "required field is missing"),
        (
            18,
            "stages[5]",
            "a stage is a mapping with one key, its type (`- filter: {match: ...}`), got a list",
        ),
        (
            19,
            "stages[6].route_by_type.name",
            "stage name 'cities' is already used by stages[2].filter",
        ),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "stages: []\n",
            [(1, "stages", "List should have at least 1 item after validation, not 0")],
        ),
        ("stages: {filter: {}}\n", [(1, "stages", "expected a list, got a mapping")]),
        (
            "stage: []\n",
            [
                (1, "stage", "unknown field (did you mean stages?)"),
                (1, "stages", "required field is missing"),
            ],
        ),
        (
            "stages:\n  - filter: {match: {a: 1}}\n  - decode: {}\n",
            [
                (
                    3,
                    "stages[1].decode",
                    "the payload is already decoded at this point"
                    " (by the JSON decode 0-filter needs):"
                    " a decode stage goes before the stages that read the payload",
                )
            ],
        ),
        (
            "stages:\n  - decode: {name: auto-decode}\n",
            [(2, "stages[0].decode.name", "auto-decode is the label of the implicit JSON decode")],
        ),
        (
            "stages:\n  - decode: {format: json, message_type: x.Y}\n",
            [(2, "stages[0].decode.message_type", "only used with format: protobuf")],
        ),
        (
            "stages:\n  - filter:\n      match: {city: msk}\n      extra: 1\n",
            [
                (
                    4,
                    "stages[0].filter.extra",
                    "unknown field (expected one of: name, match, on_error)",
                )
            ],
        ),
        ("stages:\n  - filter: 5\n", [(2, "stages[0].filter", "expected a mapping, got a number")]),
        ("stages:\n  - filter:\n", [(2, "stages[0].filter.match", "required field is missing")]),
        (
            "stages:\n  - {filter: {match: {a: 1}}, transform: {}}\n",
            [
                (
                    2,
                    "stages[0]",
                    "a stage is a mapping with one key, its type (`- filter: {match: ...}`),"
                    " got a mapping with 2 keys (filter, transform)",
                )
            ],
        ),
    ],
)
def test_pipeline_file_problems(
    tmp_path: Path, text: str, expected: list[tuple[int, str, str]]
) -> None:
    _, problems = compile_file(write(tmp_path, "p.yaml", text), env={})
    assert found(problems) == expected


def test_load_pipeline_raises_a_config_error_listing_the_problems(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yaml", "stages:\n  - nope: {}\n  - filter: {match: {a: {gtt: 1}}}\n")
    with pytest.raises(ConfigError) as caught:
        load_pipeline(path, env={})
    assert [str(p) for p in caught.value.problems] == [
        f"{path}:2: stages[0].nope: unknown stage type 'nope' (expected one of:"
        " cdc, decode, expr, filter, route_by_type, transform)",
        f"{path}:3: stages[1].filter.match.a.gtt: unknown operator 'gtt' (did you mean gt?)",
    ]


def test_environment_variables_work_in_pipelines_as_in_integrations(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yaml", "stages:\n  - filter: {match: {env: '${DEPLOY_ENV:-dev}'}}\n")
    pipeline = load_pipeline(path, env={"DEPLOY_ENV": "prod"})
    assert pipeline.process(Message("t", 0, 0, b'{"env": "prod"}')).verdict is Verdict.PASS


# --- nemesis validate --------------------------------------------------------------------


def layout(tmp_path: Path) -> tuple[Path, Path]:
    pipelines = tmp_path / "pipelines"
    integrations = tmp_path / "integrations"
    write(pipelines, "city-filter.yaml", "stages:\n  - filter: {match: {city: [msk, spb]}}\n")
    write(
        pipelines,
        "city-filter.test.yaml",
        "cases:\n  - input: {payload: {city: msk}}\n    expect: pass\n",
    )
    write(integrations, "good.yaml", INTEGRATION.format(name="good") + "pipeline: city-filter\n")
    return pipelines, integrations


def test_validate_accepts_a_correct_layout(tmp_path: Path) -> None:
    pipelines, integrations = layout(tmp_path)
    assert validate_paths([integrations, pipelines], env={}, checkers=[PipelineChecker()]) == []


def test_validate_reports_pipeline_problems_across_files(tmp_path: Path) -> None:
    pipelines, integrations = layout(tmp_path)
    write(pipelines, "broken.yaml", "stages:\n  - filter: {match: {city: {one_off: [msk]}}}\n")
    write(
        pipelines,
        "broken.test.yaml",
        "cases:\n  - input: {payload: {}, raw: x}\n    expect: pass\n",
    )
    missing = write(
        integrations, "missing.yaml", INTEGRATION.format(name="missing") + "pipeline: nope\n"
    )
    inline = write(
        integrations,
        "inline.yaml",
        INTEGRATION.format(name="inline")
        + "pipeline:\n  - route_by_type: {}\n  - filter:\n"
        + "      match:\n        amount: {gt: lots}\n",
    )
    traversal = write(
        integrations, "sneaky.yaml", INTEGRATION.format(name="sneaky") + "pipeline: ../secrets\n"
    )
    problems = validate_paths([integrations, pipelines], env={}, checkers=[PipelineChecker()])
    assert [(p.file, p.line, p.field, p.message) for p in problems] == [
        (
            str(inline),
            9,
            "pipeline[1].filter.match.amount.gt",
            "gt needs a number, got a string",
        ),
        (str(missing), 5, "pipeline", f"no pipeline 'nope' in {pipelines}"),
        (
            str(traversal),
            5,
            "pipeline",
            "'../secrets' is not a pipeline name: lowercase letters, digits and dashes,"
            " the name of a file in the pipelines directory without .yaml",
        ),
        (
            str(pipelines / "broken.test.yaml"),
            2,
            "cases[0].input",
            "give exactly one of payload, raw or raw_base64",
        ),
        (
            str(pipelines / "broken.yaml"),
            2,
            "stages[0].filter.match.city.one_off",
            "unknown operator 'one_off' (did you mean one_of?)",
        ),
    ]


def test_the_checker_claims_pipeline_dirs_files_and_tests_only(tmp_path: Path) -> None:
    pipelines, integrations = layout(tmp_path)
    flows = tmp_path / "flows"
    flows.mkdir()
    checker = PipelineChecker(pipelines_dirs=[flows])
    assert checker.claims(pipelines)
    assert checker.claims(pipelines / "city-filter.yaml")
    assert checker.claims(flows)
    assert checker.claims(tmp_path / "anywhere" / "x.test.yaml")
    assert not checker.claims(integrations)
    assert not checker.claims(integrations / "good.yaml")


def test_integrations_find_their_pipelines_in_the_configured_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flows = tmp_path / "flows"
    write(flows, "cities.yaml", "stages:\n  - filter: {match: {city: {gtt: 1}}}\n")
    write(tmp_path, "nemesis.yaml", "pipelines_dir: flows\n")
    integrations = tmp_path / "integrations"
    write(integrations, "orders.yaml", INTEGRATION.format(name="orders") + "pipeline: cities\n")
    monkeypatch.chdir(tmp_path)
    problems = validate_paths(
        [Path("nemesis.yaml"), Path("integrations")], env={}, checkers=[PipelineChecker()]
    )
    # The referenced pipeline is compiled (and its problems reported) although
    # its directory was not given: the process config names it.
    assert [(p.file, p.field) for p in problems] == [
        (str(Path("flows/cities.yaml")), "stages[0].filter.match.city.gtt")
    ]


# --- building an integration's pipeline ---------------------------------------------------------


def message(payload: object, type_: str = "order.created") -> Message:
    return Message("orders", 0, 0, orjson.dumps(payload), metadata={"type": type_})


def test_an_integration_names_a_pipeline_and_passes_a_live_flags_holder(tmp_path: Path) -> None:
    pipelines = tmp_path / "pipelines"
    write(
        pipelines,
        "cities.yaml",
        "stages:\n  - route_by_type: {}\n  - filter: {match: {city: msk}}\n",
    )
    path = write(tmp_path, "orders.yaml", INTEGRATION.format(name="orders") + "pipeline: cities\n")
    config = load_integration_file(path, env={})
    disabled: list[Collection[str]] = [()]
    metrics = Metrics()
    pipeline = build_integration_pipeline(
        config, pipelines_dir=pipelines, disabled_types=lambda: disabled[0], metrics=metrics
    )
    assert pipeline.name == "cities"
    assert pipeline.process(message({"city": "msk"})).verdict is Verdict.PASS
    disabled[0] = ["order.created"]
    assert pipeline.process(message({"city": "msk"})).stage == "0-route_by_type"
    assert metrics.stage_meter("orders", "0-route_by_type").filtered == 1


def test_a_pipeline_knows_the_files_it_was_built_from(tmp_path: Path) -> None:
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    descriptors = order_descriptor_set(pipelines)
    named = write(
        pipelines,
        "cities.yaml",
        "stages:\n  - decode: {format: protobuf, descriptor_set: orders.pb,"
        " message_type: shop.v1.Order}\n  - filter: {match: {city: msk}}\n",
    )
    path = write(tmp_path, "orders.yaml", INTEGRATION.format(name="orders") + "pipeline: cities\n")
    pipeline = build_integration_pipeline(
        load_integration_file(path, env={}), pipelines_dir=pipelines
    )
    assert set(pipeline.sources) == {descriptors, named}
    assert changed_sources(pipeline.sources) == []
    named.write_text(named.read_text() + "# a comment is a change too\n")
    assert changed_sources(pipeline.sources) == [named]
    descriptors.unlink()
    assert set(changed_sources(pipeline.sources)) == {descriptors, named}
    # Inline stages: the integration file is compared as configuration, not as a source.
    inline = write(
        tmp_path,
        "inline.yaml",
        INTEGRATION.format(name="inline") + "pipeline:\n  - filter: {match: {city: msk}}\n",
    )
    built = build_integration_pipeline(
        load_integration_file(inline, env={}), pipelines_dir=pipelines, integration_file=inline
    )
    assert built.sources == {}


def test_without_a_holder_the_flags_of_the_config_are_used(tmp_path: Path) -> None:
    config = IntegrationConfig.model_validate(
        {
            "name": "orders",
            "owners": ["t"],
            "source": {"topic": "orders", "consumer": "c"},
            "target": {"url": "http://x/y"},
            "pipeline": [{"route_by_type": None}],
            "flags": {"disabled_types": ["order.created"]},
        }
    )
    pipeline = build_integration_pipeline(config, pipelines_dir=tmp_path)
    assert pipeline.process(message({})).verdict is Verdict.FILTERED


def test_integrations_without_a_pipeline_get_the_identity(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", INTEGRATION.format(name="orders"))
    pipeline = build_integration_pipeline(
        load_integration_file(path, env={}), pipelines_dir=tmp_path
    )
    assert pipeline.is_empty


def test_integration_pipeline_problems_name_the_integration_file(tmp_path: Path) -> None:
    missing = write(tmp_path, "orders.yaml", INTEGRATION.format(name="orders") + "pipeline: nope\n")
    with pytest.raises(ConfigError) as caught:
        build_integration_pipeline(
            load_integration_file(missing, env={}),
            pipelines_dir=tmp_path / "pipelines",
            integration_file=missing,
        )
    assert [str(p) for p in caught.value.problems] == [
        f"{missing}:5: pipeline: no pipeline 'nope' in {tmp_path / 'pipelines'}"
    ]
    inline = write(
        tmp_path,
        "inline.yaml",
        INTEGRATION.format(name="inline") + "pipeline:\n  - filter:\n      match: {a: {gt: x}}\n",
    )
    with pytest.raises(ConfigError) as caught:
        build_integration_pipeline(
            load_integration_file(inline, env={}), pipelines_dir=tmp_path, integration_file=inline
        )
    assert [str(p) for p in caught.value.problems] == [
        f"{inline}:7: pipeline[0].filter.match.a.gt: gt needs a number, got a string"
    ]
