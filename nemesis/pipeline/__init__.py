"""Pipelines: the stages a message goes through between the topic and the handler.

::

    pipelines/<name>.yaml ──compile once──> Pipeline ──process(message)──> PipelineResult
          (or inline stages)        stage registry                  PASS (bytes) | FILTERED | DEAD

* ``stage``: the envelope a stage works on, ``Stage``, ``StageFailure``, reasons.
* ``registry``: stage types by name (config model + factory); ``default_registry()``.
* ``stages/``: the built-in stages: decode, filter, expr, transform, route_by_type, cdc.
* ``patterns``: filter patterns compiled to one generated function.
* ``compiler``: YAML to ``Pipeline``, with problems by file, line and field.
* ``compiled``: ``Pipeline``, ``PipelineResult``, per-stage statistics.
* ``checker``: ``PipelineChecker`` for ``nemesis validate``.
* ``testing``: ``pipelines/<name>.test.yaml`` runner; ``dryrun``: a pipeline over a sample.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from nemesis.pipeline.checker import PipelineChecker
    from nemesis.pipeline.compiled import (
        Pipeline,
        PipelineResult,
        PipelineStats,
        StageStats,
        Verdict,
    )
    from nemesis.pipeline.compiler import (
        AUTO_DECODE,
        build_integration_pipeline,
        compile_file,
        compile_stages,
        find_pipeline,
        load_pipeline,
        pipeline_files,
    )
    from nemesis.pipeline.dryrun import DryRunReport, dry_run, dry_run_file, read_sample
    from nemesis.pipeline.patterns import CompiledPattern, PatternError, compile_pattern
    from nemesis.pipeline.registry import StageRegistry, StageType, default_registry
    from nemesis.pipeline.stage import (
        DECODE_ERROR,
        PIPELINE_ERROR,
        TYPE_ERROR,
        BuildContext,
        Envelope,
        Stage,
        StageConfig,
        StageConfigError,
        StageFailure,
        changed_sources,
        file_digests,
    )
    from nemesis.pipeline.testing import PipelineTestReport, check_test_file, run_pipeline_tests

# Each name is imported from its module on first use: `nemesis validate` needs the
# checker and the compiler, not the test runner or the dry run.
_HOME: Final = {
    "AUTO_DECODE": "nemesis.pipeline.compiler",
    "BuildContext": "nemesis.pipeline.stage",
    "CompiledPattern": "nemesis.pipeline.patterns",
    "DECODE_ERROR": "nemesis.pipeline.stage",
    "DryRunReport": "nemesis.pipeline.dryrun",
    "Envelope": "nemesis.pipeline.stage",
    "PIPELINE_ERROR": "nemesis.pipeline.stage",
    "PatternError": "nemesis.pipeline.patterns",
    "Pipeline": "nemesis.pipeline.compiled",
    "PipelineChecker": "nemesis.pipeline.checker",
    "PipelineResult": "nemesis.pipeline.compiled",
    "PipelineStats": "nemesis.pipeline.compiled",
    "PipelineTestReport": "nemesis.pipeline.testing",
    "Stage": "nemesis.pipeline.stage",
    "StageConfig": "nemesis.pipeline.stage",
    "StageConfigError": "nemesis.pipeline.stage",
    "StageFailure": "nemesis.pipeline.stage",
    "StageRegistry": "nemesis.pipeline.registry",
    "StageStats": "nemesis.pipeline.compiled",
    "StageType": "nemesis.pipeline.registry",
    "TYPE_ERROR": "nemesis.pipeline.stage",
    "Verdict": "nemesis.pipeline.compiled",
    "build_integration_pipeline": "nemesis.pipeline.compiler",
    "changed_sources": "nemesis.pipeline.stage",
    "check_test_file": "nemesis.pipeline.testing",
    "compile_file": "nemesis.pipeline.compiler",
    "compile_pattern": "nemesis.pipeline.patterns",
    "compile_stages": "nemesis.pipeline.compiler",
    "default_registry": "nemesis.pipeline.registry",
    "dry_run": "nemesis.pipeline.dryrun",
    "dry_run_file": "nemesis.pipeline.dryrun",
    "file_digests": "nemesis.pipeline.stage",
    "find_pipeline": "nemesis.pipeline.compiler",
    "load_pipeline": "nemesis.pipeline.compiler",
    "pipeline_files": "nemesis.pipeline.compiler",
    "read_sample": "nemesis.pipeline.dryrun",
    "run_pipeline_tests": "nemesis.pipeline.testing",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AUTO_DECODE",
    "DECODE_ERROR",
    "PIPELINE_ERROR",
    "TYPE_ERROR",
    "BuildContext",
    "CompiledPattern",
    "DryRunReport",
    "Envelope",
    "PatternError",
    "Pipeline",
    "PipelineChecker",
    "PipelineResult",
    "PipelineStats",
    "PipelineTestReport",
    "Stage",
    "StageConfig",
    "StageConfigError",
    "StageFailure",
    "StageRegistry",
    "StageStats",
    "StageType",
    "Verdict",
    "build_integration_pipeline",
    "changed_sources",
    "check_test_file",
    "compile_file",
    "compile_pattern",
    "compile_stages",
    "default_registry",
    "dry_run",
    "dry_run_file",
    "file_digests",
    "find_pipeline",
    "load_pipeline",
    "pipeline_files",
    "read_sample",
    "run_pipeline_tests",
]
