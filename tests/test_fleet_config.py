"""A configuration whose replicas could not meet is refused, by the real CLI.

On a broker that spans hosts (kafka, ydb) replicas on several hosts share the
topics; they split the work only through a state store they all reach. The
sqlite stores are files of one host, so ``nemesis validate`` and
``nemesis run`` refuse them there, naming the field and what to set, unless
``single_host: true`` says every replica runs on one host.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, Workspace

KAFKA = "backend: {kind: kafka, bootstrap_servers: ['127.0.0.1:9'], connect_timeout_s: 1}\n"
YDB = "backend: {kind: ydb, endpoint: 'grpc://127.0.0.1:9', database: /local}\n"
SHARED = "state: {kind: postgres, dsn: '${NEMESIS_DB_DSN}'}\n" + (
    "dlq: {kind: postgres, dsn: '${NEMESIS_DB_DSN}'}\n"
)


def write(workspace: Workspace, text: str) -> Path:
    path = workspace.root / "nemesis.yaml"
    path.write_text(text + "data_dir: .\nintegrations_dir: integrations\n")
    return path


def problems_of(output: str) -> dict[str, str]:
    """``file:line: field: message`` lines, by ``file:line: field``."""
    found = {}
    for line in output.splitlines():
        where, sep, message = line.partition(": ")
        field, sep2, text = message.partition(": ")
        if sep and sep2 and where.startswith("nemesis.yaml"):
            found[f"{where}: {field}"] = text
    return found


@pytest.mark.parametrize("backend", ["kafka", "ydb"])
def test_validate_refuses_the_default_state_store_on_a_broker_that_spans_hosts(
    workspace: Workspace, backend: str
) -> None:
    write(workspace, KAFKA if backend == "kafka" else YDB)
    result = workspace.cli("validate", "nemesis.yaml")
    assert result.returncode == 1, result.stdout + result.stderr
    problems = problems_of(result.stdout + result.stderr)
    # No state: or dlq: section: the problem names the section, at the top of the file.
    state = problems["nemesis.yaml:1: state"]
    assert "the sqlite state store (the default) is a file only one host's replicas reach" in state
    assert f"the {backend} backend shares its topics with replicas on any host" in state
    assert "run every integration" in state
    assert "Set state.kind to postgres or ydb" in state
    assert "single_host: true if every replica of this configuration runs on one host" in state
    dlq = problems["nemesis.yaml:1: dlq"]
    assert "the sqlite DLQ (the default)" in dlq
    assert "Set dlq.kind to ydb or postgres" in dlq
    # On YDB the fleet's tables can live in the backend's own database.
    assert ("ydb: tables in the backend's database" in state) == (backend == "ydb")
    assert len(problems) == 2, result.stderr


def test_validate_names_the_line_of_a_sqlite_state_written_out(workspace: Workspace) -> None:
    write(workspace, YDB + "dlq: {kind: ydb}\nstate:\n  kind: sqlite\n  path: fleet.db\n")
    result = workspace.cli("validate", "nemesis.yaml")
    assert result.returncode == 1
    [(where, message)] = problems_of(result.stdout + result.stderr).items()
    assert where == "nemesis.yaml:3: state"
    assert message.startswith("the sqlite state store is a file only one host's replicas reach")


def test_the_problem_comes_with_the_files_other_problems(workspace: Workspace) -> None:
    # One run reports everything: a broken backend section and the stores it would need.
    write(workspace, "backend: {kind: kafka, compression: brotli}\n")
    result = workspace.cli("validate", "nemesis.yaml")
    assert result.returncode == 1
    fields = {where.rsplit(": ", 1)[1] for where in problems_of(result.stdout + result.stderr)}
    assert fields == {"backend.bootstrap_servers", "backend.compression", "dlq", "state"}


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(KAFKA + SHARED, id="kafka-postgres"),
        pytest.param(YDB + "state: {kind: ydb}\ndlq: {kind: ydb}\n", id="ydb-ydb"),
        pytest.param(KAFKA + "single_host: true\n", id="kafka-one-host"),
        pytest.param(YDB + "state: {kind: sqlite}\nsingle_host: true\n", id="ydb-one-host"),
        pytest.param("backend: {kind: embedded}\n", id="embedded"),
        pytest.param("", id="defaults"),
    ],
)
def test_validate_accepts_stores_every_replica_reaches_or_a_single_host(
    workspace: Workspace, text: str
) -> None:
    write(workspace, text)
    result = workspace.cli("validate", "nemesis.yaml")
    assert result.returncode == 0, result.stderr
    assert "all valid" in result.stdout


def test_single_host_is_a_boolean(workspace: Workspace) -> None:
    write(workspace, KAFKA + "single_host: yes please\n")
    result = workspace.cli("validate", "nemesis.yaml")
    assert result.returncode == 1
    problem = problems_of(result.stdout + result.stderr)["nemesis.yaml:2: single_host"]
    assert problem == "expected true or false, got a string"


def test_run_refuses_at_start_before_it_opens_anything(workspace: Workspace) -> None:
    # Nothing listens on the broker's address: a run that got past its configuration
    # would fail on the connection instead, with another message.
    write(workspace, KAFKA + "admin: {port: 0}\nviewer: {enabled: false}\n")
    (workspace.root / "integrations").mkdir(exist_ok=True)
    result = workspace.cli("run", "-c", "nemesis.yaml", timeout=120)
    assert result.returncode == 1, result.stderr
    problems = problems_of(result.stdout + result.stderr)
    assert set(problems) == {"nemesis.yaml:1: state", "nemesis.yaml:1: dlq"}, result.stderr
    assert "single_host: true" in problems["nemesis.yaml:1: state"]
    assert not (workspace.root / "state.db").exists()
    assert not (workspace.root / "dlq.db").exists()


def test_docs_quote_the_problem_as_validate_says_it(workspace: Workspace) -> None:
    doc = (REPO / "docs" / "fleet.md").read_text()
    section = doc[doc.index("### A broker that spans hosts") :]
    start = section.index("```text\n") + len("```text\n")
    quoted = section[start : section.index("\n```", start)]
    write(workspace, KAFKA)
    result = workspace.cli("validate", "nemesis.yaml")
    said = [
        line for line in result.stdout.splitlines() if line.startswith("nemesis.yaml:1: state:")
    ]
    assert [" ".join(line.split()) for line in said] == [" ".join(quoted.split())]
