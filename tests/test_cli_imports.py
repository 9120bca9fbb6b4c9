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
print(json.dumps({
    "code": code,
    "modules": sorted({m.split(".")[0] for m in sys.modules}),
    "plugins_looked_up": getattr(loader, "_plugins", None) is not None,
}))
"""

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
    assert not modules & {"pydantic", "yaml", "prometheus_client"}


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
