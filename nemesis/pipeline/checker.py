"""Pipeline validation for ``nemesis validate``: a Checker plugged into ``validate_paths``.

It claims pipeline directories (named ``pipelines``, or given to it), the
YAML files in them and every ``*.test.yaml``; it compiles each pipeline file
(unknown stage, unknown operator, bad path, a pattern that cannot match...)
and validates each test file without running it. Then it checks the
pipelines of the integrations that loaded: a named pipeline must exist in a
pipelines directory (those claimed, those of the process configs validated,
those given to the checker, else ``./pipelines``), inline stages must compile.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from nemesis.config.document import YamlDocument
from nemesis.config.loader import YAML_SUFFIXES, ValidationContext, read_yaml
from nemesis.config.models import IntegrationConfig, NemesisConfig
from nemesis.errors import ConfigProblem
from nemesis.pipeline.compiler import (
    compile_file,
    compile_stages,
    find_pipeline,
    is_test_file,
    missing_pipeline,
    pipeline_files,
    pipeline_test_files,
)
from nemesis.pipeline.registry import StageRegistry, default_registry
from nemesis.pipeline.stage import BuildContext

PIPELINES_DIR_NAME = "pipelines"


class PipelineChecker:
    """Validates pipeline files, pipeline tests and the pipelines integrations use."""

    def __init__(
        self,
        *,
        registry: StageRegistry | None = None,
        pipelines_dirs: Sequence[Path | str] = (),
    ) -> None:
        self._registry = registry or default_registry()
        self._dirs = [Path(directory) for directory in pipelines_dirs]
        self._resolved = {directory.resolve() for directory in self._dirs}

    def claims(self, path: Path) -> bool:
        """Pipeline directories, the YAML files in them, and every ``*.test.yaml``."""
        if is_test_file(path):
            return True
        if path.is_dir():
            return self._is_pipelines_dir(path)
        return path.suffix in YAML_SUFFIXES and self._is_pipelines_dir(path.parent)

    def _is_pipelines_dir(self, directory: Path) -> bool:
        return directory.name == PIPELINES_DIR_NAME or directory.resolve() in self._resolved

    def check(self, paths: Sequence[Path], context: ValidationContext) -> list[ConfigProblem]:
        """Problems in the claimed files, and in the pipelines of the loaded integrations."""
        run = _Run(self._registry, context)
        directories: list[Path] = []
        for path in paths:
            if path.is_dir():
                directories.append(path)
                for file in pipeline_files(path) + pipeline_test_files(path):
                    run.file(file)
            elif path.is_file():
                if not is_test_file(path):
                    directories.append(path.parent)
                run.file(path)
            else:
                run.problems.append(
                    ConfigProblem(str(path), None, None, "no such file or directory")
                )
        directories += [Path(config.pipelines_dir) for config in context.process_configs.values()]
        directories += self._dirs
        if not directories:
            directories.append(Path(NemesisConfig().pipelines_dir))
        directories = _unique(directories)
        for name, integration in context.integrations.integrations.items():
            run.integration(name, integration, directories)
        # A file with other problems still names its pipeline: one run reports them all.
        for path, data in sorted(context.unloaded.items()):
            reference = data.get("pipeline")
            if isinstance(reference, str):
                document = read_yaml(path, env=context.env, require_env=context.require_env)
                run.reference(document, reference, directories)
        return run.problems


class _Run:
    """One check: problems so far, and the files already compiled (each is reported once)."""

    def __init__(self, registry: StageRegistry, context: ValidationContext) -> None:
        self.registry = registry
        self.context = context
        self.problems: list[ConfigProblem] = []
        self.done: set[Path] = set()

    def file(self, path: Path) -> None:
        key = path.resolve()
        if key in self.done:
            return
        self.done.add(key)
        env, require_env = self.context.env, self.context.require_env
        if is_test_file(path):
            # Here: a pull request with no pipeline tests does not load their runner.
            from nemesis.pipeline.testing import check_test_file

            self.problems += check_test_file(
                path, registry=self.registry, env=env, require_env=require_env
            )
        else:
            _, problems = compile_file(
                path, registry=self.registry, env=env, require_env=require_env
            )
            self.problems += problems

    def integration(
        self, name: str, integration: IntegrationConfig, directories: list[Path]
    ) -> None:
        reference = integration.pipeline
        if reference is None:
            return
        file = self.context.integration_files.get(name)
        document = self.document(name, integration, file)
        if isinstance(reference, str):
            self.reference(document, reference, directories)
            return
        context = BuildContext(file.parent if file else Path(), integration.source.type_key)
        _, problems = compile_stages(
            document, ("pipeline",), registry=self.registry, context=context
        )
        self.problems += problems

    def reference(self, document: YamlDocument, reference: str, directories: list[Path]) -> None:
        """An integration's pipeline by name: compiled once if found, else a problem."""
        found = find_pipeline(reference, directories)
        if found is None:
            message = missing_pipeline(reference, directories)
            line = document.line_of(("pipeline",))
            self.problems.append(ConfigProblem(document.file, line, "pipeline", message))
        else:
            self.file(found)

    def document(
        self, name: str, integration: IntegrationConfig, file: Path | None
    ) -> YamlDocument:
        """The integration's file with lines, or a stand-in without them."""
        if file is not None:
            document = read_yaml(file, env=self.context.env, require_env=self.context.require_env)
            if document.data is not None:
                return document
        data: dict[Hashable, Any] = dict(integration.model_dump().items())
        return YamlDocument(str(file) if file else f"integration {name}", data=data)


def _unique(directories: list[Path]) -> list[Path]:
    seen: set[Path] = set()
    unique = []
    for directory in directories:
        key = directory.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(directory)
    return unique
