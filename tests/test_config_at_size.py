"""Bad input at size: large and pathological files are refused at once, with honest messages.

Through the real CLI in a subprocess (``validate``, ``run`` and its reload, the
viewer), the way an author or an operator meets them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemesis.config.loader import parse_size
from tests.conftest import Workspace, integration_yaml

VALID = (
    "name: loyalty\n"
    "owners: [team-loyalty]\n"
    "source: {topic: orders, consumer: loyalty}\n"
    "target:\n"
    "  url: http://127.0.0.1:8000/events\n"
)
MIB = 1024 * 1024


def nemesis(
    cwd: Path, *args: str, env: dict[str, str] | None = None, module: str = "nemesis"
) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "NEMESIS_MAX_FILE_SIZE"}
    environment.update(env or {})
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=environment,
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def padded(text: str, size: int) -> str:
    """``text`` followed by comment lines up to ``size`` bytes: valid YAML, only too big."""
    line = "# " + "x" * 97 + "\n"
    return text + line * ((size - len(text)) // len(line) + 1)


def test_a_file_over_the_limit_is_refused_before_parsing_with_one_line(
    workspace: Workspace,
) -> None:
    path = workspace.write_integration("loyalty", padded(VALID + "paused: maybe\n", 2 * MIB))
    size = path.stat().st_size
    result = nemesis(workspace.root, "validate", "integrations")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"integrations/loyalty.yaml: the file is 2 MiB ({size} bytes), over the 1 MiB limit"
        " for a configuration file (set NEMESIS_MAX_FILE_SIZE to change it)"
    ]
    assert "1 problem(s) found" in result.stderr


def test_the_limit_is_set_with_units(workspace: Workspace) -> None:
    workspace.write_integration("loyalty", padded(VALID, 2 * MIB))
    raised = nemesis(
        workspace.root, "validate", "integrations", env={"NEMESIS_MAX_FILE_SIZE": "4MiB"}
    )
    assert raised.returncode == 0, raised.stdout + raised.stderr
    lowered = nemesis(
        workspace.root, "validate", "integrations", env={"NEMESIS_MAX_FILE_SIZE": "512KiB"}
    )
    assert "over the 512 KiB limit" in lowered.stdout
    wrong = nemesis(
        workspace.root, "validate", "integrations", env={"NEMESIS_MAX_FILE_SIZE": "lots"}
    )
    assert wrong.returncode == 1
    assert (
        "integrations/loyalty.yaml: NEMESIS_MAX_FILE_SIZE: expected a size such as 1MiB or"
        " 512KiB, got 'lots'" in wrong.stdout
    )


@pytest.mark.parametrize(
    ("text", "size"),
    [("1048576", MIB), ("4MiB", 4 * MIB), ("512 KiB", 512 * 1024), ("2M", 2 * MIB), ("1MB", 10**6)],
)
def test_sizes_are_read_with_their_unit(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_an_oversized_pipeline_is_refused_by_the_pipeline_checker(workspace: Workspace) -> None:
    pipelines = workspace.root / "pipelines"
    pipelines.mkdir()
    stages = "stages:\n  - filter: {match: {city: msk}}\n"
    (pipelines / "city.yaml").write_text(padded(stages, 2 * MIB))
    workspace.write_integration("loyalty", VALID + "pipeline: city\n")
    result = nemesis(workspace.root, "validate", "integrations", "pipelines")
    assert result.returncode == 1
    assert "pipelines/city.yaml: the file is 2 MiB" in result.stdout


def test_the_viewer_refuses_an_oversized_process_config(workspace: Workspace) -> None:
    config = workspace.root / "nemesis.yaml"
    config.write_text(padded(config.read_text(), 2 * MIB))
    viewer = nemesis(workspace.root, "-c", "nemesis.yaml", module="dlq_viewer")
    assert viewer.returncode == 2
    assert "nemesis.yaml: the file is 2 MiB" in viewer.stderr
    run = nemesis(workspace.root, "run", "-c", "nemesis.yaml")
    assert run.returncode == 1
    assert "nemesis.yaml: the file is 2 MiB" in run.stderr


async def test_run_and_its_reload_refuse_an_oversized_integration_and_keep_running(
    workspace: Workspace,
) -> None:
    workspace.write_integration("alpha", integration_yaml("alpha", "http://127.0.0.1:9/events"))
    workspace.write_integration(
        "beta", padded(integration_yaml("beta", "http://127.0.0.1:9/"), 2 * MIB)
    )
    process = await workspace.start("run", "-c", "nemesis.yaml")
    await workspace.wait_for_log(process, "beta.yaml: the file is 2 MiB")
    # The watcher reloads a file written while running: refused the same way.
    workspace.write_integration(
        "gamma", padded(integration_yaml("gamma", "http://127.0.0.1:9/"), 3 * MIB)
    )
    await workspace.wait_for_log(process, "gamma.yaml: the file is 3 MiB")
    assert process.returncode is None


def test_a_long_flow_list_under_the_size_limit_is_refused_without_composing_it(
    workspace: Workspace,
) -> None:
    items = ",".join(["1"] * 400_000)
    path = workspace.write_integration("loyalty", VALID + f"flags: {{disabled_types: [{items}]}}\n")
    assert path.stat().st_size < MIB
    result = nemesis(workspace.root, "validate", "integrations")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "integrations/loyalty.yaml:6: the file holds more than 20000 values:"
        " no configuration needs that many"
    ]
    assert "aliases" not in result.stdout


def test_problems_past_fifty_in_a_file_are_counted_not_listed(workspace: Workspace) -> None:
    items = ", ".join(["1"] * 80)
    workspace.write_integration("loyalty", VALID + f"flags: {{disabled_types: [{items}]}}\n")
    result = nemesis(workspace.root, "validate", "integrations")
    lines = result.stdout.splitlines()
    assert len(lines) == 51
    # The first fifty in item order, then the count of the rest.
    assert lines[0] == (
        "integrations/loyalty.yaml:6: flags.disabled_types[0]: expected a string, got a number"
    )
    assert lines[49].startswith("integrations/loyalty.yaml:6: flags.disabled_types[49]: ")
    assert lines[50] == "integrations/loyalty.yaml: ... and 30 more"
    assert "80 problem(s) found" in result.stderr


def test_the_alias_message_appears_only_when_aliases_expanded(workspace: Workspace) -> None:
    plain = ", ".join(["x"] * 15_000)
    workspace.write_integration("loyalty", VALID + f"flags: {{disabled_types: [{plain}]}}\n")
    assert nemesis(workspace.root, "validate", "integrations").returncode == 0
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    workspace.write_integration("loyalty", "\n".join(levels) + "\n")
    laughs = nemesis(workspace.root, "validate", "integrations")
    assert "integrations/loyalty.yaml:1: aliases expand to more than 100000 values" in (
        laughs.stdout.splitlines()
    )


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ("paused: maybe\n", "6: paused: expected true or false, got a string"),
        (
            "breaker: {cooldown_s: .inf}\n",
            "6: breaker.cooldown_s: expected a finite number, got .inf",
        ),
        ("breaker: {window_s: .nan}\n", "6: breaker.window_s: expected a finite number, got .nan"),
        ("rate_limits: {main: .inf}\n", "6: rate_limits.main: expected a finite number, got .inf"),
        (
            "pipeline: [{filter: {match: {amount: {gt: .inf}}}}]\n",
            "6: pipeline[0].filter.match.amount.gt: gt needs a finite number",
        ),
    ],
)
def test_wrong_values_get_the_right_reason(workspace: Workspace, extra: str, line: str) -> None:
    workspace.write_integration("loyalty", VALID + extra)
    result = nemesis(workspace.root, "validate", "integrations")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"integrations/loyalty.yaml:{line}"]
