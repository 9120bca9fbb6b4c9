"""``nemesis --help`` and ``nemesis validate`` load only what they use.

Every pull request runs ``nemesis validate``; neither it nor ``--help`` may
pay for the admin API, the proxy or a broker's SDK. Each case runs the
command's code path in a fresh interpreter and lists what it imported (the
start-up time itself is measured by tests/bench/cli_startup.py, not here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO

# What the proxy, the admin API and the backends load; none is needed to print help or to
# validate files.
HEAVY = ("fastapi", "starlette", "uvicorn", "aiokafka", "ydb", "grpc", "asyncpg", "aiohttp")

PROBE = """
import contextlib, io, json, sys
from nemesis.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exit:
        code = exit.code
loader = sys.modules.get("pydantic.plugin._loader")
base = getattr(sys.modules.get("nemesis.config_base"), "Model", None)
models, built = [base] if base else [], []
while models:
    model = models.pop()
    models.extend(model.__subclasses__())
    if model.__pydantic_complete__:
        built.append(model.__name__)
print(json.dumps({
    "code": code,
    "modules": sorted({m.split(".")[0] for m in sys.modules}),
    "plugins_looked_up": getattr(loader, "_plugins", None) is not None,
    "built_models": sorted(set(built)),
    "frozen": __import__("gc").get_freeze_count(),
}))
"""

# The process file's models (nemesis.yaml): validating integration and pipeline files
# builds none of them. Each build is a few milliseconds of every pull request's check.
PROCESS_MODELS = (
    "NemesisConfig",
    "AdminConfig",
    "ViewerConfig",
    "AuthConfig",
    "TracingConfig",
    "ReloadConfig",
    "MetricsConfig",
    "LimitsConfig",
    "EmbeddedBackendConfig",
    "SqliteDlqConfig",
    "SqliteStateConfig",
    "YdbCredentialsConfig",
)

# What the shipped deployments' pods get in their environment (deploy/kubernetes/*).
DEPLOYMENT_ENV = {
    "NEMESIS_KAFKA_BOOTSTRAP": "kafka:9092",
    "NEMESIS_DB_DSN": "postgresql://nemesis@postgres:5432/nemesis",
    "NEMESIS_YDB_ENDPOINT": "grpc://ydb:2136",
    "NEMESIS_YDB_DATABASE": "/local",
}


def probe(*argv: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=REPO,
        env={**os.environ, **DEPLOYMENT_ENV},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def loaded_by(*argv: str) -> tuple[object, set[str]]:
    report = probe(*argv)
    return report["code"], set(report["modules"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["validate", "--help"],
        ["dlq", "list", "--help"],
        ["validate", "integrations", "pipelines"],
        ["validate", "nemesis.example.yaml"],
        ["validate", "deploy/config/nemesis.kafka.yaml", "deploy/config/integrations"],
        ["validate", "deploy/config/nemesis.ydb.yaml", "deploy/config/integrations"],
    ],
    ids=" ".join,
)
def test_the_command_loads_no_proxy_admin_or_broker_sdk(argv: list[str]) -> None:
    code, modules = loaded_by(*argv)
    assert code == 0
    assert sorted(modules & set(HEAVY)) == []


def test_help_loads_no_config_models() -> None:
    _, modules = loaded_by("--help")
    # orjson: only a JSON log line needs it, and help writes none.
    assert not modules & {"pydantic", "yaml", "prometheus_client", "orjson"}


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "integrations", "pipelines"],
        ["validate", "deploy/config/nemesis.kafka.yaml", "deploy/config/integrations"],
    ],
    ids=" ".join,
)
def test_validate_loads_no_metrics_client_event_loop_or_pydantic_plugins(
    argv: list[str],
) -> None:
    # Compiling a pipeline needs its counters, not prometheus_client; nemesis uses no
    # pydantic plugin, and looking for them reads every installed package's metadata.
    report = probe(*argv)
    assert report["code"] == 0
    assert "prometheus_client" not in report["modules"]
    # An http target is checked as the transport checks it, without building one.
    assert not {"asyncio", "httptools"} & set(report["modules"])
    assert report["plugins_looked_up"] is False


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "integrations", "pipelines"],
        ["validate", "integrations/orders-to-loyalty.yaml"],
        ["validate"],
    ],
    ids=" ".join,
)
def test_validating_integrations_builds_no_process_model(argv: list[str]) -> None:
    report = probe(*argv)
    assert report["code"] == 0
    assert "IntegrationConfig" in report["built_models"]  # the probe sees what is built
    assert sorted(set(report["built_models"]) & set(PROCESS_MODELS)) == []


def test_validating_a_valid_file_loads_no_did_you_mean_matcher() -> None:
    # difflib serves the "did you mean" hints of misspelt keys, stages and pipelines.
    report = probe("validate", "integrations", "pipelines")
    assert report["code"] == 0
    assert "difflib" not in report["modules"]


def test_validating_a_process_file_builds_its_models() -> None:
    # The other side of the lazy build: a process file among the paths is still checked.
    report = probe("validate", "nemesis.example.yaml")
    assert report["code"] == 0
    assert "NemesisConfig" in report["built_models"]


FROM_THE_SHELL = """
import gc, sys
from nemesis.cli import main
sys.argv = ["nemesis", *sys.argv[1:]]
code = main()
print(code, gc.get_freeze_count() > 0)
"""


def test_validate_run_as_the_command_skips_the_garbage_collection_at_exit() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FROM_THE_SHELL, "validate", "integrations", "pipelines"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.split()[-2:] == ["0", "True"]


def test_validate_called_by_a_program_leaves_its_heap_alone() -> None:
    # A test or a tool that calls main() goes on running: its objects stay collectable.
    report = probe("validate", "integrations", "pipelines")
    assert report["code"] == 0
    assert report["frozen"] == 0
