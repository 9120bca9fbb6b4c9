"""``nemesis validate`` accepts what ``nemesis run`` accepts, and refuses what run would refuse.

Through the real CLI in a subprocess, the way an author meets it in a pull request.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nemesis.config.passwords import hash_password, hash_token, new_token
from tests.conftest import Workspace

VALID = (
    "name: loyalty\n"
    "owners: [team-loyalty]\n"
    "source: {topic: orders, consumer: loyalty}\n"
    "target:\n"
    "  url: http://127.0.0.1:8000/events\n"
)


def validate(
    workspace: Workspace, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "LOYALTY_TOKEN"}
    environment.update(env or {})
    result = subprocess.run(
        [sys.executable, "-m", "nemesis", "validate", *args],
        cwd=workspace.root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=environment,
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def test_an_unset_variable_is_a_warning_by_default_and_an_error_with_require_env(
    workspace: Workspace,
) -> None:
    workspace.write_integration(
        "loyalty", VALID + "  headers: {authorization: 'Bearer ${LOYALTY_TOKEN}'}\n"
    )
    where = "integrations/loyalty.yaml:6: target.headers.authorization"

    pull_request = validate(workspace, "integrations")
    assert pull_request.returncode == 0, pull_request.stdout + pull_request.stderr
    assert f"{where}: warning: environment variable LOYALTY_TOKEN is not set" in (
        pull_request.stdout
    )
    assert "1 warning(s)" in pull_request.stdout

    github = validate(workspace, "integrations", "--format", "github")
    assert "::warning file=integrations/loyalty.yaml,line=6::" in github.stdout

    production = validate(workspace, "integrations", "--require-env")
    assert production.returncode == 1
    assert f"{where}: environment variable LOYALTY_TOKEN is not set" in production.stdout

    set_here = validate(
        workspace, "integrations", "--require-env", env={"LOYALTY_TOKEN": "s3cret-from-env"}
    )
    assert set_here.returncode == 0, set_here.stdout
    assert "warning" not in set_here.stdout


def test_what_run_refuses_validate_refuses_too(workspace: Workspace) -> None:
    """A port out of range, tiers out of order, halt without ordering: one file, one run."""
    workspace.write_integration(
        "loyalty",
        "name: loyalty\n"
        "owners: [team-loyalty]\n"
        "source: {topic: orders, consumer: loyalty}\n"
        "target: {url: 'http://127.0.0.1:99999/events'}\n"
        "delivery: {workers: lots, ordering: none, buffer: 2, batch: {size: 5}}\n"
        "retry:\n"
        "  tiers: [1m, 5m, 30s]\n"
        "  on_exhausted: halt\n"
        "breaker: {open_above: 0.2, close_below: 0.5}\n",
    )
    result = validate(workspace, "integrations")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    file = "integrations/loyalty.yaml"
    expected = [
        f"{file}:4: target.url: the port must be a number from 1 to 65535",
        f"{file}:5: delivery: buffer (2) must hold at least one batch (5)",
        f"{file}:5: delivery.workers: expected an integer, got a string",
        f"{file}:7: retry.tiers: tier 3 (30s) is shorter than tier 2 (300s): each tier must"
        " wait at least as long as the one before it",
        f"{file}:8: retry.on_exhausted: halt needs delivery.ordering key or partition",
        f"{file}:9: breaker: close_below must be lower than open_above",
    ]
    for start in expected:
        assert any(line.startswith(start) for line in lines), (start, result.stdout)
    assert "6 problem(s) found" in result.stderr


def test_halt_with_an_ordering_is_valid(workspace: Workspace) -> None:
    workspace.write_integration(
        "loyalty",
        VALID + "delivery: {ordering: key}\nretry: {tiers: [1m, 1m, 5m], on_exhausted: halt}\n",
    )
    result = validate(workspace, "integrations")
    assert result.returncode == 0, result.stdout


def test_the_hashes_the_docs_say_to_paste_are_valid(workspace: Workspace) -> None:
    """``python -m dlq_viewer.hash_password`` output, pasted as told, validates and runs."""
    password = subprocess.run(
        [sys.executable, "-m", "dlq_viewer.hash_password"],
        input="correct horse battery staple\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    token = subprocess.run(
        [sys.executable, "-m", "dlq_viewer.hash_password", "--token"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[-1]
    assert password.startswith("password_hash: scrypt$")
    assert token.startswith("token_hash: sha256$")
    config = workspace.root / "nemesis.yaml"
    config.write_text(
        config.read_text()
        + "auth:\n"
        + f"  users:\n    - name: ann\n      {password}\n      teams: [team-loyalty]\n"
        + f"  tokens:\n    - {{name: ci, {token}, admin: true}}\n"
        # Another hash in another form the helpers make.
        + f"    - {{name: ci-2, token_hash: '{hash_token(new_token())}'}}\n"
        + f"    - {{name: bot, token_hash: {hash_token('x' * 40)}}}\n"
    )
    workspace.write_integration("loyalty", VALID)
    result = validate(workspace, "nemesis.yaml", "integrations")
    assert result.returncode == 0, result.stdout + result.stderr
    # What run loads, it loads too (the same file, through the same loader).
    listed = workspace.cli("topics", "list")
    assert listed.returncode == 0, listed.stderr


def test_a_credential_that_is_not_a_hash_is_still_refused(workspace: Workspace) -> None:
    config = workspace.root / "nemesis.yaml"
    scrypt = hash_password("correct horse battery staple", n=2**14)
    config.write_text(
        config.read_text()
        + f"auth:\n  users: [{{name: ann, password_hash: '{scrypt}'}}]\n"
        + "  session_secret: this-is-a-session-secret-written-inline-0123456789\n"
    )
    workspace.write_integration("loyalty", VALID)
    result = validate(workspace, "nemesis.yaml", "integrations")
    assert result.returncode == 1
    assert "auth.session_secret: session_secret is a credential written inline" in result.stdout
    assert "password_hash" not in result.stdout


def test_a_disabled_viewer_needs_no_port(workspace: Workspace) -> None:
    workspace.write_config("viewer: {enabled: false}\n")
    workspace.write_integration("loyalty", VALID)
    result = validate(workspace, "nemesis.yaml", "integrations")
    assert result.returncode == 0, result.stdout + result.stderr


def test_nothing_to_validate_is_an_error(workspace: Workspace) -> None:
    (workspace.root / "empty").mkdir()
    result = validate(workspace, "empty")
    assert result.returncode == 1
    assert "no integration or pipeline files found in empty" in result.stderr
    assert "valid" not in result.stdout
    # In a folder with neither integrations/ nor pipelines/ (a wrong working directory).
    elsewhere = Workspace(workspace.root / "empty")
    bare = subprocess.run(
        [sys.executable, "-m", "nemesis", "validate"],
        cwd=elsewhere.root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bare.returncode == 1
    assert "integrations: no such file or directory" in bare.stdout


def test_a_folder_with_a_valid_file_says_how_many_it_read(workspace: Workspace) -> None:
    workspace.write_integration("loyalty", VALID)
    result = validate(workspace, "integrations")
    assert result.returncode == 0
    assert result.stdout.strip() == "all valid"
    assert result.stderr.strip() == "1 file(s) checked"


def test_hostile_keys_are_printed_inert(workspace: Workspace) -> None:
    path: Path = workspace.write_integration("loyalty", VALID + '"\\e]0;owned\\a\\u202e": 1\n')
    assert "\\e" in path.read_text()
    result = validate(workspace, "integrations")
    assert result.returncode == 1
    assert "\x1b" not in result.stdout
    assert "\u202e" not in result.stdout
    assert "\\x1b]0;owned\\x07\\u202e: unknown field" in result.stdout


def test_the_pull_request_rules_still_run_on_a_file_with_a_field_error(
    workspace: Workspace,
) -> None:
    """A type error in one section does not hide the owner, topic and target rules."""
    workspace.write_integration(
        "loyalty",
        "name: loyalty\n"
        "owners: [Team Loyalty!]\n"
        "source: {topic: Orders_V2, consumer: loyalty}\n"
        "target: {url: 'grpc://127.0.0.1:50051/extra/path'}\n"
        "delivery: {workers: lots}\n",
    )
    result = validate(workspace, "integrations")
    assert result.returncode == 1
    file = "integrations/loyalty.yaml"
    for start in (
        f"{file}:2: owners[0]: 'Team Loyalty!' is not a team",
        f"{file}:3: source.topic: 'Orders_V2' does not follow the naming convention",
        f"{file}:4: target.url: a gRPC target is grpc://host:port",
        f"{file}:5: delivery.workers: expected an integer, got a string",
    ):
        assert any(line.startswith(start) for line in result.stdout.splitlines()), (
            start,
            result.stdout,
        )


def test_a_missing_pipeline_is_reported_with_the_files_other_problems(
    workspace: Workspace,
) -> None:
    pipelines = workspace.root / "pipelines"
    pipelines.mkdir()
    (pipelines / "city-filter.yaml").write_text("stages:\n  - filter: {match: {city: msk}}\n")
    broken = VALID.replace("url: http://127.0.0.1:8000/events", "url: not-a-url")
    workspace.write_integration("loyalty", broken + "pipeline: city-filtr\n")
    result = validate(workspace, "integrations", "pipelines")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert any(line.startswith("integrations/loyalty.yaml:5: target.url:") for line in lines)
    assert (
        "integrations/loyalty.yaml:6: pipeline: no pipeline 'city-filtr' in pipelines"
        " (did you mean city-filter?)"
    ) in lines


def test_a_mismatched_name_that_is_no_name_is_not_offered_as_a_file_name(
    workspace: Workspace,
) -> None:
    workspace.write_integration("loyalty", VALID.replace("name: loyalty", "name: Team_Loyalty"))
    result = validate(workspace, "integrations")
    assert result.returncode == 1
    assert "integrations/loyalty.yaml:1: name: must be lowercase letters" in result.stdout
    assert "rename the file" not in result.stdout
    assert "(change the name)" in result.stdout
    # A valid name that differs from the file's still gets both ways out.
    workspace.write_integration("loyalty", VALID.replace("name: loyalty", "name: points"))
    renamed = validate(workspace, "integrations")
    assert "(rename the file to points.yaml or change the name)" in renamed.stdout
