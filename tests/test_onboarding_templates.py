"""``nemesis new``: the handler templates run for real, and new integration files validate.

Each handler template is written by the real CLI, linted with the project's
own ruff settings, tested with its own ``make test``, started as a real
process, and probed with the real ``nemesis check-handler``. The handler's
tests run on this virtualenv (which has what the templates' requirements
list); pytest-asyncio is switched off for them because a team's environment
does not have it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import yaml

from nemesis.cli import main
from nemesis.onboarding.schema import json_schema
from nemesis.onboarding.templates import HANDLER_LANGS, IntegrationSpec, render_integration
from nemesis.proto import handler_proto_text
from tests.conftest import REPO

BIN = Path(sys.executable).parent
HANDLER_ENV = {**os.environ, "PYTEST_ADDOPTS": "-p no:asyncio -p no:cacheprovider"}


def nemesis(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nemesis", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_until_listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the handler exited with {process.returncode}:\n{log.read_text()}")
        with socket.socket() as client:
            if client.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"the handler did not listen on {port}:\n{log.read_text()}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


START = {
    "python-fastapi": lambda port: [
        sys.executable,
        "-m",
        "uvicorn",
        "app:create_app",
        "--factory",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ],
    "python-grpc": lambda port: [sys.executable, "server.py", "--port", str(port)],
}
URL = {
    "python-fastapi": "http://127.0.0.1:{port}/events",
    "python-grpc": "grpc://127.0.0.1:{port}",
}


@pytest.mark.slow
# The Python templates; the others (Go, TypeScript, Java) in test_onboarding_polyglot.py.
@pytest.mark.parametrize("lang", [lang for lang in HANDLER_LANGS if lang.startswith("python-")])
def test_template_starts_passes_its_tests_and_the_contract_check(
    tmp_path: Path, lang: str, processes: list[subprocess.Popen[bytes]]
) -> None:
    project = tmp_path / "loyalty-handler"
    created = nemesis("new", "handler", "--lang", lang, str(project), cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert {"README.md", "handler.py", "Makefile", ".gitignore"} <= {
        p.name for p in project.iterdir()
    }
    if lang == "python-grpc":
        assert (project / "proto" / "nemesis_handler.proto").read_text() == handler_proto_text()

    # Clean by the project's own lint settings, before and after code generation.
    for args in (["check", "."], ["format", "--check", "."]):
        linted = subprocess.run(
            [str(BIN / "ruff"), *args], cwd=project, capture_output=True, text=True, check=False
        )
        assert linted.returncode == 0, linted.stdout + linted.stderr

    tested = subprocess.run(
        ["make", "test", f"PYTHON={sys.executable}"],
        cwd=project,
        env=HANDLER_ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert " passed" in tested.stdout
    assert " failed" not in tested.stdout

    port = free_port()
    log = tmp_path / "handler.log"
    with log.open("wb") as output:
        server = subprocess.Popen(
            START[lang](port), cwd=project, stdout=output, stderr=subprocess.STDOUT
        )
    processes.append(server)
    wait_until_listening(server, port, log)

    url = URL[lang].format(port=port)
    checked = nemesis("check-handler", url, "--batch", "3", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert sum(line.startswith("  PASS") for line in lines) == 5, checked.stdout
    assert not any(line.startswith(("  WARN", "  FAIL", "  SKIP")) for line in lines)

    server.send_signal(signal.SIGTERM)
    # Graceful either way; uvicorn re-raises the signal once it has shut down.
    assert server.wait(timeout=15) in (0, -signal.SIGTERM), log.read_text()
    if lang == "python-fastapi":
        assert "Finished server process" in log.read_text()


def in_process(
    args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """The CLI's main() in this process: the error paths, without a subprocess each."""
    monkeypatch.chdir(cwd)
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_new_handler_refuses_a_folder_in_use_unless_forced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "busy"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    code, _, err = in_process(["new", "handler", "busy"], tmp_path, monkeypatch, capsys)
    assert code == 1
    assert "not empty" in err
    code, _, _ = in_process(["new", "handler", "--force", "busy"], tmp_path, monkeypatch, capsys)
    assert code == 0
    assert (project / "notes.txt").read_text() == "mine"
    assert (project / "app.py").is_file()


def test_new_handler_refuses_an_unknown_language(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        in_process(["new", "handler", "--lang", "cobol", "x"], tmp_path, monkeypatch, capsys)
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# --- integrations ---------------------------------------------------------------------------


def test_new_integration_with_only_a_name_validates(tmp_path: Path) -> None:
    created = nemesis("new", "integration", "orders-to-loyalty", cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    path = tmp_path / "integrations" / "orders-to-loyalty.yaml"
    document = yaml.safe_load(path.read_text())
    assert document["owners"] == ["team-loyalty"]
    assert document["source"] == {
        "topic": "orders",
        "consumer": "orders-to-loyalty",
        "type_key": "type",
    }
    assert "# yaml-language-server" not in path.read_text()  # no schema file to point at
    validated = nemesis("validate", "integrations", cwd=tmp_path)
    assert validated.returncode == 0, validated.stdout
    assert validated.stdout.strip() == "all valid"


def test_new_integration_with_every_option_validates_with_its_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(REPO / "pipelines", tmp_path / "pipelines")
    (tmp_path / "schemas").mkdir()
    schema = ["schema", "integration", "-o", "schemas/integration.schema.json"]
    assert in_process(schema, tmp_path, monkeypatch, capsys)[0] == 0
    code, _, err = in_process(
        [
            "new",
            "integration",
            "payments-to-billing",
            "--topic",
            "billing.payments",
            "--consumer",
            "billing",
            "--url",
            "grpcs://billing.svc.cluster.local:8443",
            "--owner",
            "team-billing",
            "--owner",
            "payments@example.com",
            "--pipeline",
            "city-filter",
        ],
        tmp_path,
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    path = tmp_path / "integrations" / "payments-to-billing.yaml"
    text = path.read_text()
    assert text.startswith("# yaml-language-server: $schema=../schemas/integration.schema.json\n")
    validated = nemesis("validate", "integrations", "pipelines", cwd=tmp_path)
    assert validated.returncode == 0, validated.stdout
    # And the schema the modeline points at accepts it.
    document = yaml.safe_load(text)
    loaded = json.loads((tmp_path / "schemas" / "integration.schema.json").read_text())
    jsonschema.Draft202012Validator(loaded).validate(document)
    assert document["pipeline"] == "city-filter"
    assert document["owners"] == ["team-billing", "payments@example.com"]


def test_new_integration_refuses_bad_values_and_existing_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def new(*args: str) -> tuple[int, str]:
        code, _, err = in_process(["new", "integration", *args], tmp_path, monkeypatch, capsys)
        return code, err

    code, err = new("Orders_To_X")
    assert (code, "not an integration name" in err) == (1, True)
    code, err = new("a-to-b", "--url", "ftp://x")
    assert (code, "must start with http://" in err) == (1, True)
    assert new("a-to-b") == (0, "")
    code, err = new("a-to-b")
    assert (code, "exists (--force writes over it)" in err) == (1, True)
    assert new("a-to-b", "--force") == (0, "")


@pytest.mark.parametrize(
    "spec",
    [
        IntegrationSpec("orders"),
        IntegrationSpec("x-to-y", topic="123", consumer="true", owners=["org/team-a"]),
        IntegrationSpec("x-to-y", url="http://h/p?a=1#frag: x", owners=["a@b.io"]),
    ],
    ids=["no -to-", "values that YAML would read as other types", "URL with YAML syntax"],
)
def test_rendered_integrations_parse_back_to_what_was_asked(spec: IntegrationSpec) -> None:
    document = yaml.safe_load(render_integration(spec))
    jsonschema.Draft202012Validator(json_schema("integration")).validate(document)
    assert document["name"] == spec.name
    if spec.topic is not None:
        assert document["source"]["topic"] == spec.topic
    assert document["target"]["url"] == spec.url
