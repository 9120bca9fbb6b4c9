"""The onboarding page and the PR workflow say what the code does.

The page shows the shipped .proto verbatim and only commands the CLI
accepts; the workflow's steps run for real (bash, the real CLI) on a sample
integrations repository, pass on a good one and fail with annotations on a
broken one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemesis.cli import build_parser
from nemesis.onboarding.schema import json_schema
from nemesis.proto import handler_proto_text
from tests.conftest import REPO

DOCS = REPO / "integrations" / "README.md"
WORKFLOW = REPO / "deploy" / "ci" / "validate-integrations.yml"
BIN = Path(sys.executable).parent


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)


def test_the_page_shows_the_shipped_proto() -> None:
    assert blocks("proto") == [handler_proto_text()]


def test_every_nemesis_command_on_the_page_is_one_the_cli_accepts() -> None:
    commands = [
        line.split("#", 1)[0].strip()
        for block in blocks("sh")
        for line in block.splitlines()
        if line.strip().startswith("nemesis ") and "--help" not in line
    ]
    assert len(commands) >= 10
    parser = build_parser()
    for command in commands:
        try:
            parser.parse_args(shlex.split(command)[1:])
        except SystemExit:
            pytest.fail(f"the docs show a command the CLI refuses: {command}")


def steps() -> list[dict[str, Any]]:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    [job] = workflow["jobs"].values()
    return [step for step in job["steps"] if "run" in step]


def run_steps(
    repository: Path, tmp_path: Path, *, skip: str = "pip install"
) -> list[subprocess.CompletedProcess[str]]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env["RUNNER_TEMP"] = str(tmp_path / "runner-temp")
    Path(env["RUNNER_TEMP"]).mkdir(exist_ok=True)
    results = []
    for step in steps():
        if skip in step["run"] or "pip install" in step["run"]:
            continue  # the package under test is installed already
        results.append(
            subprocess.run(
                ["bash", "-e", "-c", step["run"]],
                cwd=repository,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        )
    return results


def integrations_repository(root: Path) -> Path:
    """An integrations repository at ``root``, as the pull-request workflow checks it out."""
    (root / "integrations").mkdir(parents=True)
    shutil.copy(REPO / "integrations" / "orders-to-loyalty.yaml", root / "integrations")
    shutil.copytree(REPO / "pipelines", root / "pipelines")
    (root / "schemas").mkdir()
    # What `nemesis schema integration -o ...` writes (test_schema.py checks the CLI).
    text = json.dumps(json_schema("integration"), indent=2) + "\n"
    (root / "schemas" / "integration.schema.json").write_text(text)
    # The online check's process file, over an embedded broker where the source topic is.
    (root / "nemesis.ci.yaml").write_text(
        f"backend: {{kind: embedded, path: '{root / 'ci-broker.db'}'}}\n"
        "auth: {admin_teams: [team-loyalty]}\n"
        "limits: {integration: {workers: 64}}\n"
    )
    created = subprocess.run(
        [sys.executable, "-m", "nemesis", "topics", "create", "orders", "-c", "nemesis.ci.yaml"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert created.returncode == 0, created.stdout + created.stderr
    return root


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """An integrations repository as the workflow finds it."""
    return integrations_repository(tmp_path / "integrations-repo")


@pytest.mark.slow
def test_the_workflow_passes_a_good_repository_and_annotates_a_broken_one(
    repository: Path, tmp_path: Path
) -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert workflow["permissions"] == {"contents": "read"}
    good = run_steps(repository, tmp_path)
    assert [r.returncode for r in good] == [0, 0, 0, 0], [r.stdout + r.stderr for r in good]

    example = (REPO / "integrations" / "orders-to-loyalty.yaml").read_text()
    line = next(n for n, text in enumerate(example.splitlines(), 1) if "workers: 32" in text)
    (repository / "integrations" / "orders-to-loyalty.yaml").write_text(
        example.replace("workers: 32", "workers: 0")
    )
    schema = repository / "schemas" / "integration.schema.json"
    schema.write_text(schema.read_text().replace('"minimum": 1', '"minimum": 0', 1))
    validate, online, schemas = run_steps(repository, tmp_path, skip="test-pipelines")
    assert validate.returncode == 1
    assert online.returncode == 1
    assert online.stdout.startswith("::error file=integrations/orders-to-loyalty.yaml,")
    assert validate.stdout.startswith(
        f"::error file=integrations/orders-to-loyalty.yaml,line={line}::delivery.workers:"
    )
    assert schemas.returncode == 1
    assert "::error file=schemas/integration.schema.json::out of date" in schemas.stdout


def test_the_quick_start_puts_the_venv_on_path_before_any_nemesis_command() -> None:
    readme = (REPO / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    venv = re.search(r"^VENV \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert venv
    export = f'export PATH="$PWD/{venv.group(1)}/bin:$PATH"'
    assert export in quick_start
    before = quick_start.split(export, 1)[0]
    assert not re.search(r"^nemesis ", before, re.MULTILINE), "a command before the PATH step"
    # The viewer's credentials: the demo's one user, and where its password is printed.
    assert "Sign in as `demo`" in quick_start
    assert "on the `DLQ viewer:` line" in quick_start
    assert 'name="DLQ viewer"' in (REPO / "dlq_viewer" / "service.py").read_text()
    assert "name: demo," in (REPO / "nemesis" / "demo.py").read_text()
