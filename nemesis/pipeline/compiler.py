"""From YAML to a compiled Pipeline, validated once, every problem named by file, line and field.

A pipeline file, ``pipelines/<name>.yaml``::

    description: Orders from Moscow and St Petersburg above 1000.
    stages:
      - filter:
          match: {order.city: [msk, spb], order.amount: {gt: 1000}}
      - transform:
          keep: [id, order]

An integration names it (``pipeline: city-filter``) or lists its stages
inline (``pipeline: [{filter: {...}}]``). Each stage is a mapping with one
key, its type, holding that type's config. Labels (metrics, reports) are the
stage's ``name`` or ``<index>-<type>``, the index counting from 0 as written.

When a stage reads the payload and no ``decode`` stage ran before it, a JSON
decode is inserted in front of it, labelled ``auto-decode``: messages a
metadata-only stage drops are never parsed. ``pipelines/*.test.yaml`` files
are tests (``nemesis.pipeline.testing``), not pipelines.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, ValidationError

from nemesis.config.document import DataPath, YamlDocument, format_path, yaml_kind
from nemesis.config.loader import YAML_SUFFIXES, parse_file, read_yaml
from nemesis.config.models import NAME_PATTERN, IntegrationConfig, Model
from nemesis.config.problems import sort_problems, validation_problems
from nemesis.errors import ConfigError, ConfigProblem
from nemesis.pipeline.compiled import CompiledStage, Pipeline
from nemesis.pipeline.registry import StageRegistry, default_registry
from nemesis.pipeline.stage import BuildContext, Stage, StageConfig, StageConfigError, digest
from nemesis.pipeline.stages.decode import decode_json
from nemesis.stage_meter import StageMeter

if TYPE_CHECKING:
    from nemesis.metrics import Metrics

AUTO_DECODE = "auto-decode"
TEST_SUFFIXES = tuple(f".test{suffix}" for suffix in YAML_SUFFIXES)

MeterFactory = Callable[[str], StageMeter]


class PipelineFile(Model):
    """The top level of ``pipelines/<name>.yaml``."""

    description: str | None = None
    stages: Annotated[list[Any], Field(min_length=1)]


def fresh_meter(label: str) -> StageMeter:
    """Meters that belong to one pipeline alone (dry runs, tests)."""
    return StageMeter()


def metrics_meters(metrics: Metrics, integration: str) -> MeterFactory:
    """Meters registered on ``metrics`` under the integration's name."""
    return lambda label: metrics.stage_meter(integration, label)


# --- stages ------------------------------------------------------------------------


def compile_stages(
    document: YamlDocument,
    path: DataPath,
    *,
    registry: StageRegistry,
    context: BuildContext,
    name: str = "",
    meters: MeterFactory = fresh_meter,
) -> tuple[Pipeline | None, list[ConfigProblem]]:
    """Builds the stages listed at ``path`` in ``document``; the pipeline is None on any problem."""
    compiler = _Compiler(document, registry, context)
    stages = compiler.stages(_at(document.data, path), path)
    if compiler.problems or stages is None:
        return None, compiler.problems
    compiled = [CompiledStage(label, kind, stage, meters(label)) for label, kind, stage in stages]
    return Pipeline(compiled, name=name), []


class _Compiler:
    def __init__(
        self, document: YamlDocument, registry: StageRegistry, context: BuildContext
    ) -> None:
        self.document = document
        self.registry = registry
        self.context = context
        self.problems: list[ConfigProblem] = []

    def report(self, path: DataPath, message: str) -> None:
        problem = ConfigProblem(
            self.document.file, self.document.line_of(path), format_path(path), message
        )
        if problem not in self.problems:
            self.problems.append(problem)

    def stages(self, data: object, path: DataPath) -> list[tuple[str, str, Stage]] | None:
        if not isinstance(data, list):
            self.report(path, f"expected a list of stages, got {yaml_kind(data)}")
            return None
        built: list[tuple[str, str, Stage, DataPath]] = []
        labels: dict[str, DataPath] = {}
        for index, entry in enumerate(data):
            where = (*path, index)
            # Names are checked even for stages with other problems: all at once.
            named = _written_label(index, entry)
            if named is not None:
                label, where = named[0], (*where, named[1])
                if label in labels:
                    self.report(
                        (*where, "name"),
                        f"stage name {label!r} is already used by {format_path(labels[label])}",
                    )
                labels.setdefault(label, where)
            item = self.stage(index, entry, (*path, index))
            if item is not None:
                built.append(item)
        return self.decoded(built)

    def stage(
        self, index: int, entry: object, path: DataPath
    ) -> tuple[str, str, Stage, DataPath] | None:
        if not isinstance(entry, dict) or len(entry) != 1:
            got = (
                f"a mapping with {len(entry)} keys ({', '.join(map(str, entry))})"
                if isinstance(entry, dict)
                else yaml_kind(entry)
            )
            self.report(
                path,
                "a stage is a mapping with one key, its type (`- filter: {match: ...}`),"
                f" got {got}",
            )
            return None
        [(kind, raw)] = entry.items()
        where = (*path, kind)
        stage_type = self.registry.get(kind) if isinstance(kind, str) else None
        if stage_type is None:
            self.report(where, _unknown_stage(kind, self.registry.names()))
            return None
        config = self.config(stage_type.config, {} if raw is None else raw, where)
        if config is None:
            return None
        try:
            stage = stage_type.factory(config, self.context)
        except StageConfigError as exc:
            for issue in exc.issues:
                self.report((*where, *issue.path), issue.message)
            return None
        if config.name == AUTO_DECODE:
            self.report((*where, "name"), f"{AUTO_DECODE} is the label of the implicit JSON decode")
            return None
        return config.name or f"{index}-{kind}", kind, stage, where

    def config(self, model: type[StageConfig], raw: object, base: DataPath) -> StageConfig | None:
        try:
            return model.model_validate(raw)
        except ValidationError as exc:
            # Validate against the stage's own part of the file, then put the
            # problems back at their place in the whole file.
            part = YamlDocument(
                self.document.file,
                data=raw if isinstance(raw, dict) else None,
                lines={
                    p[len(base) :]: line
                    for p, line in self.document.lines.items()
                    if p[: len(base)] == base
                },
                unchecked={
                    p[len(base) :] for p in self.document.unchecked if p[: len(base)] == base
                },
            )
            prefix = format_path(base) or ""
            for problem in validation_problems(exc, part, model):
                field = problem.field
                if field is None:
                    full = prefix
                elif field.startswith("["):
                    full = prefix + field
                else:
                    full = f"{prefix}.{field}"
                new = ConfigProblem(problem.file, problem.line, full, problem.message)
                if new not in self.problems:
                    self.problems.append(new)
            return None

    def decoded(
        self, built: list[tuple[str, str, Stage, DataPath]]
    ) -> list[tuple[str, str, Stage]]:
        """The stages with a JSON decode in front of the first one reading an undecoded payload."""
        stages: list[tuple[str, str, Stage]] = []
        decoded_by: str | None = None
        for label, kind, stage, where in built:
            if stage.decodes:
                if decoded_by is not None:
                    self.report(
                        where,
                        f"the payload is already decoded at this point (by {decoded_by}):"
                        " a decode stage goes before the stages that read the payload",
                    )
                decoded_by = label
            elif stage.reads_payload and decoded_by is None:
                stages.append((AUTO_DECODE, "decode", Stage(decode_json, decodes=True)))
                decoded_by = f"the JSON decode {label} needs"
            stages.append((label, kind, stage))
        return stages


def _written_label(index: int, entry: object) -> tuple[str, Hashable] | None:
    """The label a stage entry asks for, and its type key, read from the raw YAML."""
    if not isinstance(entry, dict) or len(entry) != 1:
        return None
    [(kind, raw)] = entry.items()
    name = raw.get("name") if isinstance(raw, dict) else None
    return (name if isinstance(name, str) else f"{index}-{kind}"), kind


def _at(data: object, path: DataPath) -> object:
    node = data
    for part in path:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return None
    return node


def _unknown_stage(kind: Hashable, known: list[str]) -> str:
    import difflib  # here: only a misspelt name needs it

    close = difflib.get_close_matches(str(kind), known, n=1)
    hint = f"did you mean {close[0]}?" if close else f"expected one of: {', '.join(known)}"
    if not known:
        hint = "no stage types are registered"
    return f"unknown stage type {str(kind)!r} ({hint})"


# --- files -------------------------------------------------------------------------


def is_test_file(path: Path) -> bool:
    """``<name>.test.yaml``: a pipeline test, not a pipeline."""
    return path.name.endswith(TEST_SUFFIXES)


def pipeline_files(directory: Path) -> list[Path]:
    """The pipeline files of a directory, sorted (tests and dotfiles left out)."""
    return [entry for entry in _yaml_files(directory) if not is_test_file(entry)]


def pipeline_test_files(directory: Path) -> list[Path]:
    """The pipeline test files of a directory, sorted."""
    return [entry for entry in _yaml_files(directory) if is_test_file(entry)]


def _yaml_files(directory: Path) -> list[Path]:
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    return [
        entry
        for entry in entries
        if entry.suffix in YAML_SUFFIXES and not entry.name.startswith(".") and entry.is_file()
    ]


def pipeline_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a pipeline file, or None."""
    if re.match(NAME_PATTERN, name):
        return None
    return (
        f"{name!r} is not a pipeline name: lowercase letters, digits and dashes,"
        " the name of a file in the pipelines directory without .yaml"
    )


def find_pipeline(name: str, directories: Sequence[Path]) -> Path | None:
    """``<name>.yaml`` (or ``.yml``) in the first directory that has it."""
    if pipeline_name_problem(name) is not None:
        return None
    for directory in directories:
        for suffix in YAML_SUFFIXES:
            candidate = directory / f"{name}{suffix}"
            if candidate.is_file():
                return candidate
    return None


def missing_pipeline(name: str, directories: Sequence[Path]) -> str:
    """The problem with a reference to ``name`` that ``find_pipeline`` did not find."""
    problem = pipeline_name_problem(name)
    if problem is not None:
        return problem
    places = ", ".join(str(directory) for directory in directories)
    known = sorted({file.stem for directory in directories for file in pipeline_files(directory)})
    import difflib  # here: only a misspelt name needs it

    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"no pipeline {name!r} in {places}{hint}"


def compile_file(
    path: Path,
    *,
    registry: StageRegistry | None = None,
    context: BuildContext | None = None,
    meters: MeterFactory = fresh_meter,
    env: Mapping[str, str] | None = None,
    require_env: bool = True,
) -> tuple[Pipeline | None, list[ConfigProblem]]:
    """Reads and compiles one pipeline file; the pipeline is None on any problem."""
    parsed = parse_file(path, PipelineFile, env=env, require_env=require_env)
    problems = list(parsed.problems)
    data = parsed.document.data
    pipeline = None
    if data is not None and isinstance(data.get("stages"), list) and data["stages"]:
        pipeline, stage_problems = compile_stages(
            parsed.document,
            ("stages",),
            registry=registry or default_registry(),
            context=context or BuildContext(base_dir=path.parent),
            name=path.name.split(".", 1)[0],
            meters=meters,
        )
        problems.extend(stage_problems)
    return (None if problems else pipeline), sort_problems(problems)


def load_pipeline(
    path: Path,
    *,
    registry: StageRegistry | None = None,
    context: BuildContext | None = None,
    meters: MeterFactory = fresh_meter,
    env: Mapping[str, str] | None = None,
) -> Pipeline:
    """The compiled pipeline in ``path``; raises ConfigError listing every problem."""
    pipeline, problems = compile_file(
        path, registry=registry, context=context, meters=meters, env=env
    )
    if pipeline is None:
        raise ConfigError(problems)
    return pipeline


def build_integration_pipeline(
    integration: IntegrationConfig,
    *,
    pipelines_dir: Path | str,
    disabled_types: Callable[[], Collection[str]] | None = None,
    metrics: Metrics | None = None,
    registry: StageRegistry | None = None,
    integration_file: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Pipeline:
    """The pipeline of an integration, ready for ``process``; raises ConfigError.

    ``disabled_types`` must return the integration's *current*
    ``flags.disabled_types`` (it is called per message by ``route_by_type``);
    without it, the set in ``integration`` is used and never changes. With
    ``metrics``, the stages are counted on it under the integration's name.
    ``integration_file`` gives inline stages' problems their lines. Built
    from the default registry without ``env``, it carries the recipe that
    builds it again in a worker process (``nemesis.pipeline.offload``).
    """
    pipeline = _build_integration_pipeline(
        integration,
        pipelines_dir=pipelines_dir,
        disabled_types=disabled_types,
        metrics=metrics,
        registry=registry,
        integration_file=integration_file,
        env=env,
    )
    if registry is None and env is None and not pipeline.is_empty:
        from nemesis.pipeline.compiled import PipelineRecipe

        files = "".join(f"{path}={sha}\n" for path, sha in sorted(pipeline.sources.items()))
        key = digest(f"{integration.model_dump_json()}\n{pipelines_dir}\n{files}".encode())
        pipeline.recipe = PipelineRecipe(key, integration, Path(pipelines_dir), integration_file)
    return pipeline


def _build_integration_pipeline(
    integration: IntegrationConfig,
    *,
    pipelines_dir: Path | str,
    disabled_types: Callable[[], Collection[str]] | None,
    metrics: Metrics | None,
    registry: StageRegistry | None,
    integration_file: Path | None,
    env: Mapping[str, str] | None,
) -> Pipeline:
    name = integration.name
    reference = integration.pipeline
    if reference is None or reference == []:
        return Pipeline.empty(name)
    holder = disabled_types or _fixed(frozenset(integration.flags.disabled_types))
    meters = fresh_meter if metrics is None else metrics_meters(metrics, name)
    registry = registry or default_registry()
    where = str(integration_file) if integration_file else f"integration {name}"
    if isinstance(reference, str):
        found = find_pipeline(reference, [Path(pipelines_dir)])
        if found is None:
            message = missing_pipeline(reference, [Path(pipelines_dir)])
            raise ConfigError(
                [ConfigProblem(where, _line(integration_file, env), "pipeline", message)]
            )
        context = BuildContext(found.parent, integration.source.type_key, holder)
        with contextlib.suppress(OSError):  # unreadable: load_pipeline says so
            # Before the build: a change made meanwhile makes the next reload rebuild
            # once more, never miss it.
            context.sources[found] = digest(found.read_bytes())
        named = load_pipeline(found, registry=registry, context=context, meters=meters, env=env)
        named.sources = context.sources
        return named
    document = YamlDocument(where, data={"pipeline": reference})
    base_dir = Path()
    if integration_file is not None:
        written = read_yaml(integration_file, env=env)
        # Lines are only borrowed from the file if it still says what was loaded.
        if written.data is not None and written.data.get("pipeline") == reference:
            document.lines = written.lines
        base_dir = integration_file.parent
    context = BuildContext(base_dir, integration.source.type_key, holder)
    pipeline, problems = compile_stages(
        document,
        ("pipeline",),
        registry=registry,
        context=context,
        name=f"{name} (inline)",
        meters=meters,
    )
    if pipeline is None:
        raise ConfigError(sort_problems(problems))
    pipeline.sources = context.sources
    return pipeline


def _fixed(types: frozenset[str]) -> Callable[[], Collection[str]]:
    return lambda: types


def _line(path: Path | None, env: Mapping[str, str] | None) -> int | None:
    if path is None:
        return None
    return read_yaml(path, env=env).line_of(("pipeline",))
