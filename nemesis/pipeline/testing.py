"""Pipeline tests written next to the pipelines: ``pipelines/<name>.test.yaml``.

::

    pipeline: city-filter          # optional: a pipeline in the same directory (default:
                                   # the file's name without .test.yaml), or inline stages
    disabled_types: []             # flags.disabled_types for route_by_type (per case too)
    cases:
      - name: a big order in Moscow is delivered as it is
        input:
          payload: {order: {city: msk, amount: 1500}}   # or raw: "text", raw_base64: "..."
          metadata: {type: order.created}               # optional, as are key and topic
          key: order-1
        expect: pass                                    # pass | filtered | dead
      - name: the handler gets only what it needs
        input: {payload: {...}}
        expect: {output: {id: 7, amount: 1500}}         # the delivered JSON document
      - input: {raw: "not json"}
        expect: {dead: decode_error}                    # optionally with stage: <label>
      - input: {payload: {...}}
        expect: {filtered: cities}                      # filtered by that stage

``run_pipeline_tests`` runs them (``nemesis test-pipelines`` and the test
suite); ``check_test_file`` only validates one (``nemesis validate``).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, field_validator, model_validator

from nemesis.broker.port import Message
from nemesis.config.document import YamlDocument
from nemesis.config.loader import parse_file
from nemesis.config.models import Model
from nemesis.config.problems import sort_problems
from nemesis.errors import ConfigProblem
from nemesis.pipeline.compiled import Pipeline, PipelineResult, Verdict
from nemesis.pipeline.compiler import (
    TEST_SUFFIXES,
    compile_file,
    compile_stages,
    find_pipeline,
    is_test_file,
    missing_pipeline,
    pipeline_test_files,
)
from nemesis.pipeline.registry import StageRegistry, default_registry
from nemesis.pipeline.stage import BuildContext

_SHOWN_OUTPUT = 300  # characters of an unexpected output shown in a failure


class CaseInput(Model):
    """One input message: exactly one of payload, raw and raw_base64."""

    payload: Any = None
    raw: str | None = None
    raw_base64: str | None = None
    key: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    topic: str = "test"
    partition: int = 0

    @field_validator("raw_base64")
    @classmethod
    def _base64(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                base64.b64decode(value, validate=True)
            except binascii.Error:
                raise ValueError("not valid base64") from None
        return value

    @model_validator(mode="after")
    def _one_payload(self) -> CaseInput:
        given = [n for n in ("payload", "raw", "raw_base64") if n in self.model_fields_set]
        if len(given) != 1:
            raise ValueError("give exactly one of payload, raw or raw_base64")
        return self


class CaseExpectation(Model):
    """What should come out: exactly one of output, output_raw, filtered and dead."""

    output: Any = None  # the delivered document, compared as JSON
    output_raw: str | None = None  # the delivered bytes, as text
    filtered: str | None = None  # the label of the stage that filters
    dead: str | None = None  # the dead-letter reason
    stage: str | None = None  # with dead: the label of the stage that fails

    @model_validator(mode="after")
    def _one_outcome(self) -> CaseExpectation:
        given = [
            n for n in ("output", "output_raw", "filtered", "dead") if n in self.model_fields_set
        ]
        if len(given) != 1:
            raise ValueError("give exactly one of output, output_raw, filtered or dead")
        if self.stage is not None and self.dead is None:
            raise ValueError("stage goes with dead (filtered names its stage itself)")
        return self


class PipelineCase(Model):
    """One message through the pipeline and what should come out."""

    name: str | None = None
    input: CaseInput
    expect: Literal["pass", "filtered", "dead"] | CaseExpectation
    disabled_types: list[str] | None = None


class PipelineTestFile(Model):
    """The top level of ``<name>.test.yaml``."""

    pipeline: str | list[dict[str, Any]] | None = None
    type_key: str = "type"
    disabled_types: list[str] = Field(default_factory=list)
    cases: Annotated[list[PipelineCase], Field(min_length=1)]


@dataclass(frozen=True, slots=True)
class CaseResult:
    """The outcome of one test case."""

    file: str
    line: int | None
    name: str
    passed: bool
    detail: str = ""  # why it failed

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.name}: {'ok' if self.passed else 'FAILED: ' + self.detail}"


@dataclass(slots=True)
class PipelineTestReport:
    """Every case run, and the problems of files that could not be run."""

    cases: list[CaseResult] = field(default_factory=list)
    problems: list[ConfigProblem] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    untested: list[str] = field(default_factory=list)  # pipelines without a test file

    @property
    def passed(self) -> int:
        return sum(1 for case in self.cases if case.passed)

    @property
    def failed(self) -> int:
        """Failed cases plus problems: zero means success."""
        return sum(1 for case in self.cases if not case.passed) + len(self.problems)

    def format(self, *, verbose: bool = False) -> str:
        """The report as text: problems, failures (every case with verbose), then a summary."""
        lines = [str(problem) for problem in sort_problems(self.problems)]
        lines += [str(case) for case in self.cases if verbose or not case.passed]
        lines += [f"{path}: no test file" for path in self.untested]
        failed_cases = len(self.cases) - self.passed
        summary = (
            f"pipeline tests: {self.passed} of {len(self.cases)} cases passed"
            f" in {len(self.files)} files"
        )
        if failed_cases:
            summary += f"; {failed_cases} cases failed"
        if self.problems:
            summary += f"; {len(self.problems)} problems in the files"
        lines.append(summary)
        return "\n".join(lines)


def run_pipeline_tests(
    paths: Sequence[Path],
    *,
    registry: StageRegistry | None = None,
    env: Mapping[str, str] | None = None,
) -> PipelineTestReport:
    """Runs the test files in ``paths`` (files, or directories of them).

    A pipeline file given directly runs its ``<name>.test.yaml``; a pipeline
    without one is listed as untested. Unknown paths are problems.
    """
    registry = registry or default_registry()
    report = PipelineTestReport()
    for path in _test_paths(paths, report):
        report.files.append(str(path))
        _run_file(path, registry, env, report)
    return report


def check_test_file(
    path: Path,
    *,
    registry: StageRegistry | None = None,
    env: Mapping[str, str] | None = None,
    require_env: bool = True,
) -> list[ConfigProblem]:
    """The problems of a test file (and of the pipeline it tests), without running it."""
    loaded = _load(path, registry or default_registry(), env, require_env)
    return loaded.problems


def _test_paths(paths: Sequence[Path], report: PipelineTestReport) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(pipeline_test_files(path))
        elif is_test_file(path) and path.is_file():
            found.append(path)
        elif path.is_file():
            stem = path.name.split(".", 1)[0]
            tests = [path.with_name(stem + suffix) for suffix in TEST_SUFFIXES]
            existing = [test for test in tests if test.is_file()]
            if existing:
                found.append(existing[0])
            else:
                report.untested.append(str(path))
        else:
            report.problems.append(
                ConfigProblem(str(path), None, None, "no such file or directory")
            )
    # A directory and a file in it given together run the file once.
    unique: dict[Path, Path] = {}
    for path in found:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


@dataclass(slots=True)
class _Loaded:
    document: YamlDocument
    tests: PipelineTestFile | None
    pipeline: Pipeline | None
    problems: list[ConfigProblem]
    disabled: list[Collection[str]]  # the holder route_by_type reads, set per case


def _load(
    path: Path, registry: StageRegistry, env: Mapping[str, str] | None, require_env: bool
) -> _Loaded:
    parsed = parse_file(path, PipelineTestFile, env=env, require_env=require_env)
    document, tests = parsed.document, parsed.value
    disabled: list[Collection[str]] = [frozenset()]
    loaded = _Loaded(document, tests, None, list(parsed.problems), disabled)
    if tests is None:
        return loaded
    context = BuildContext(path.parent, tests.type_key, lambda: disabled[0])
    reference = tests.pipeline
    if isinstance(reference, list):
        loaded.pipeline, problems = compile_stages(
            document, ("pipeline",), registry=registry, context=context, name="inline"
        )
        loaded.problems.extend(problems)
        return loaded
    name = reference or path.name.split(".", 1)[0]
    pipeline_file = find_pipeline(name, [path.parent])
    if pipeline_file is None:
        message = missing_pipeline(name, [path.parent])
        line = document.line_of(("pipeline",)) if reference else None
        loaded.problems.append(
            ConfigProblem(str(path), line, "pipeline" if reference else None, message)
        )
        return loaded
    loaded.pipeline, problems = compile_file(
        pipeline_file, registry=registry, context=context, env=env, require_env=require_env
    )
    loaded.problems.extend(problems)
    return loaded


def _run_file(
    path: Path,
    registry: StageRegistry,
    env: Mapping[str, str] | None,
    report: PipelineTestReport,
) -> None:
    loaded = _load(path, registry, env, require_env=True)
    report.problems.extend(loaded.problems)
    if loaded.tests is None or loaded.pipeline is None:
        return
    for index, case in enumerate(loaded.tests.cases):
        types = case.disabled_types
        loaded.disabled[0] = frozenset(loaded.tests.disabled_types if types is None else types)
        line = loaded.document.line_of(("cases", index))
        name = case.name or f"case {index + 1}"
        detail = _run_case(loaded.pipeline, case, index)
        report.cases.append(CaseResult(str(path), line, name, detail is None, detail or ""))


def _run_case(pipeline: Pipeline, case: PipelineCase, index: int) -> str | None:
    """Why the case failed, or None."""
    given = case.input
    try:
        value = _input_bytes(given)
    except orjson.JSONEncodeError as exc:
        return f"the input payload cannot be encoded as JSON: {exc}"
    message = Message(
        topic=given.topic,
        partition=given.partition,
        offset=index,
        value=value,
        key=given.key,
        metadata=given.metadata,
    )
    return _compare(case.expect, pipeline.process(message))


def _input_bytes(given: CaseInput) -> bytes:
    if given.raw is not None:
        return given.raw.encode()
    if given.raw_base64 is not None:
        return base64.b64decode(given.raw_base64)
    # YAML allows keys JSON does not (numbers); JSON turns them into strings.
    return orjson.dumps(given.payload, option=orjson.OPT_NON_STR_KEYS)


def _compare(expect: str | CaseExpectation, result: PipelineResult) -> str | None:
    got = _describe(result)
    if isinstance(expect, str):
        return None if result.verdict.value == expect else f"expected {expect}, got {got}"
    if expect.dead is not None:
        wanted = f"dead ({expect.dead}" + (f" at {expect.stage})" if expect.stage else ")")
        ok = (
            result.verdict is Verdict.DEAD
            and result.reason == expect.dead
            and expect.stage in (None, result.stage)
        )
        return None if ok else f"expected {wanted}, got {got}"
    if expect.filtered is not None:
        ok = result.verdict is Verdict.FILTERED and result.stage == expect.filtered
        return None if ok else f"expected filtered by {expect.filtered}, got {got}"
    if result.verdict is not Verdict.PASS or result.payload is None:
        return f"expected the message to pass, got {got}"
    if expect.output_raw is not None:
        ok = result.payload == expect.output_raw.encode()
        return None if ok else f"expected output {expect.output_raw!r}, got {got}"
    try:
        delivered = orjson.loads(result.payload)
    except orjson.JSONDecodeError:
        return f"expected a JSON output, got {got}"
    wanted_json = orjson.loads(orjson.dumps(expect.output, option=orjson.OPT_NON_STR_KEYS))
    return (
        None
        if same_json(delivered, wanted_json)
        else f"expected output {_short(wanted_json)}, got {got}"
    )


def _describe(result: PipelineResult) -> str:
    if result.verdict is Verdict.FILTERED:
        return f"filtered by {result.stage}"
    if result.verdict is Verdict.DEAD:
        return f"dead ({result.reason} at {result.stage}: {result.error})"
    payload = result.payload or b""
    try:
        return f"pass with {_short(orjson.loads(payload))}"
    except orjson.JSONDecodeError:
        return f"pass with raw {payload[:_SHOWN_OUTPUT]!r}"


def _short(document: Any) -> str:
    text = orjson.dumps(document).decode()
    return text if len(text) <= _SHOWN_OUTPUT else text[:_SHOWN_OUTPUT] + "..."


def same_json(left: Any, right: Any) -> bool:
    """JSON equality: 1 equals 1.0, but true is not 1 (as Python would have it)."""
    if isinstance(left, bool) or isinstance(right, bool):
        return left is right
    if isinstance(left, int | float) and isinstance(right, int | float):
        return left == right
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(same_json(left[k], right[k]) for k in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(same_json, left, right))
    return type(left) is type(right) and bool(left == right)
