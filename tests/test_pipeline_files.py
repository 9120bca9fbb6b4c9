"""The shipped pipelines and their YAML tests; the test runner; the dry run."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemesis.pipeline import (
    AUTO_DECODE,
    compile_file,
    dry_run_file,
    pipeline_files,
    read_sample,
    run_pipeline_tests,
)
from nemesis.pipeline.compiler import pipeline_test_files

PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"


def test_pipelines_are_shipped_with_tests() -> None:
    assert pipeline_test_files(PIPELINES), "no pipeline tests found"
    for pipeline in pipeline_files(PIPELINES):
        tests = pipeline.with_name(pipeline.name.split(".", 1)[0] + ".test.yaml")
        assert tests.is_file(), f"{pipeline} has no {tests.name}"


@pytest.mark.parametrize("path", pipeline_files(PIPELINES), ids=lambda p: p.name)
def test_shipped_pipeline_compiles(path: Path) -> None:
    pipeline, problems = compile_file(path, env={})
    assert problems == []
    assert pipeline is not None


@pytest.mark.parametrize("path", pipeline_test_files(PIPELINES), ids=lambda p: p.name)
def test_shipped_pipeline_tests_pass(path: Path) -> None:
    report = run_pipeline_tests([path], env={})
    assert report.failed == 0, report.format()
    assert report.passed > 0


# --- the runner ----------------------------------------------------------------------


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


PIPELINE = "stages:\n  - filter: {name: cities, match: {city: [msk, spb]}}\n"


def test_the_runner_reports_failing_cases_with_their_line(tmp_path: Path) -> None:
    write(tmp_path, "cities.yaml", PIPELINE)
    tests = write(
        tmp_path,
        "cities.test.yaml",
        """\
cases:
  - name: passes
    input: {payload: {city: msk}}
    expect: pass
  - name: wrong verdict
    input: {payload: {city: msk}}
    expect: filtered
  - name: wrong output
    input: {payload: {city: spb}}
    expect: {output: {city: msk}}
  - name: wrong stage
    input: {payload: {city: kzn}}
    expect: {filtered: other}
  - name: wrong reason
    input: {raw: "{"}
    expect: {dead: type_error}
""",
    )
    report = run_pipeline_tests([tmp_path], env={})
    assert (report.passed, report.failed) == (1, 4)
    assert [str(case) for case in report.cases if not case.passed] == [
        f'{tests}:5: wrong verdict: FAILED: expected filtered, got pass with {{"city":"msk"}}',
        f'{tests}:8: wrong output: FAILED: expected output {{"city":"msk"}},'
        ' got pass with {"city":"spb"}',
        f"{tests}:11: wrong stage: FAILED: expected filtered by other, got filtered by cities",
        f"{tests}:14: wrong reason: FAILED: expected dead (type_error), got dead (decode_error at"
        f" {AUTO_DECODE}: the payload is not valid JSON: unexpected end of data: line 1 column 2"
        " (char 1))",
    ]
    assert report.format().splitlines()[-1] == (
        "pipeline tests: 1 of 5 cases passed in 1 files; 4 cases failed"
    )


def test_the_runner_supports_every_input_and_expectation_form(tmp_path: Path) -> None:
    write(
        tmp_path,
        "shapes.yaml",
        "stages:\n  - route_by_type: {}\n  - transform: {set_from: {k: $key}}\n",
    )
    write(
        tmp_path,
        "shapes.test.yaml",
        """\
disabled_types: [noise]
cases:
  - input: {payload: {n: 1.0, b: true, "1": x}, key: k1}
    expect: {output: {n: 1, b: true, "1": x, k: k1}}
  - input: {raw_base64: "eyJhIjogMX0=", metadata: {type: signal}}
    expect: {output: {a: 1}}
  - input: {raw: "{}", metadata: {type: noise}}
    expect: {filtered: 0-route_by_type}
  - input: {raw: "{}", metadata: {type: signal}}
    disabled_types: [signal]
    expect: filtered
  - input: {raw: "[1]"}
    expect: {dead: type_error, stage: 1-transform}
  - input: {raw: "{ }"}
    expect: {output_raw: "{ }"}
""",
    )
    report = run_pipeline_tests([tmp_path / "shapes.yaml"], env={})
    assert (report.passed, report.failed) == (6, 0), report.format()


def test_the_runner_reports_bad_files_missing_pipelines_and_untested_ones(tmp_path: Path) -> None:
    write(tmp_path, "lonely.yaml", PIPELINE)
    orphan = write(tmp_path, "orphan.test.yaml", "cases:\n  - input: {raw: x}\n    expect: pass\n")
    broken = write(tmp_path, "broken.test.yaml", "pipeline: lonely\ncases:\n  - expect: maybe\n")
    report = run_pipeline_tests(
        [tmp_path / "lonely.yaml", orphan, broken, tmp_path / "nope"], env={}
    )
    assert [str(problem) for problem in report.problems] == [
        f"{tmp_path / 'nope'}: no such file or directory",
        f"{orphan}: no pipeline 'orphan' in {tmp_path}",
        f"{broken}:3: cases[0].input: required field is missing",
        f"{broken}:3: cases[0].expect: Input should be 'pass', 'filtered' or 'dead';"
        " expected a mapping, got a string",
    ]
    assert report.untested == [str(tmp_path / "lonely.yaml")]
    assert report.failed == 4


# --- the dry run -------------------------------------------------------------------------

CITY_WEIGHTS = {"msk": 25, "spb": 15, "kzn": 12, "nsk": 12, "ekb": 11, "nnv": 9, "sam": 8, "krd": 8}


def realistic_orders(count: int, seed: int = 7) -> list[dict[str, Any]]:
    """Orders with big-city skew and a long tail of amounts."""
    rng = random.Random(seed)
    cities = rng.choices(list(CITY_WEIGHTS), weights=list(CITY_WEIGHTS.values()), k=count)
    return [
        {
            "order_id": i,
            "order": {
                "city": city,
                "amount": round(rng.lognormvariate(7.2, 0.9), 2),
                "currency": "RUB",
                "items": [{"sku": f"sku-{rng.randrange(500)}", "qty": rng.randint(1, 3)}],
            },
            "customer": {"id": f"c-{rng.randrange(10_000)}"},
        }
        for i, city in enumerate(cities)
    ]


def test_dry_run_shows_the_share_each_stage_drops(tmp_path: Path) -> None:
    orders = realistic_orders(4000)
    sample = tmp_path / "orders.jsonl"
    lines = [orjson.dumps(order) for order in orders]
    lines[10] = b"not json at all"  # real topics hold garbage too
    lines[20] = b""  # blank lines are skipped
    sample.write_bytes(b"\n".join(lines) + b"\n")
    started = time.perf_counter()
    report = dry_run_file(PIPELINES / "city-filter.yaml", sample)
    took_s = time.perf_counter() - started

    parsed = [o for i, o in enumerate(orders) if i not in (10, 20)]
    expected_pass = sum(
        1 for o in parsed if o["order"]["city"] in ("msk", "spb") and o["order"]["amount"] > 1000
    )
    assert report.messages == 3999
    assert (report.passed, report.filtered, report.dead) == (expected_pass, 3998 - expected_pass, 1)
    assert report.dead_reasons == {"decode_error": 1}
    assert 0.2 < report.passed / report.messages < 0.3  # about 1 in 4, as the pipeline says
    decode, cities = report.stages
    assert (decode.stage, decode.processed, decode.failed) == (AUTO_DECODE, 3999, 1)
    assert (cities.stage, cities.processed, cities.passed) == (
        "msk-spb-over-1000",
        3998,
        expected_pass,
    )
    assert cities.filtered_share == pytest.approx(1 - expected_pass / 3998)
    # The figures are measured, and measured within the run: no more time than it took.
    assert 0 < cities.mean_duration_s * cities.processed <= took_s
    assert 0 < report.seconds_per_message * report.messages <= took_s

    text = report.format()
    assert text.splitlines()[0] == f"dry run of city-filter over {sample}: 3999 messages"
    assert f"{cities.filtered_share:.1%}" in text
    assert "dead-letter reasons: decode_error: 1" in text


def test_sample_lines_may_carry_the_message_around_the_payload(tmp_path: Path) -> None:
    sample = tmp_path / "s.jsonl"
    sample.write_text(
        '{"payload": {"a": 1}, "metadata": {"type": "x", "n": 5}, "key": "k", "topic": "orders"}\n'
        '{"raw": "plain text", "partition": 3}\n'
        '{"payload": 1, "extra": true}\n'
        "[1, 2]\n"
    )
    first, second, third, fourth = read_sample(sample)
    assert (first.value, first.metadata, first.key, first.topic) == (
        b'{"a":1}',
        {"type": "x", "n": "5"},
        "k",
        "orders",
    )
    assert (second.value, second.partition) == (b"plain text", 3)
    assert third.value == b'{"payload": 1, "extra": true}'  # not an envelope: kept as it is
    assert fourth.value == b"[1, 2]"
    assert [m.offset for m in (first, second, third, fourth)] == [0, 1, 2, 3]
