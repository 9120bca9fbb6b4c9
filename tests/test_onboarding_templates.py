"""``nemesis new``: the handler templates run for real, and new integration files validate.

Each handler template is written by the real CLI, linted with the project's
own ruff settings, tested with its own ``make test``, started as a real
process, and probed with the real ``nemesis check-handler``. The handler's
tests run on this virtualenv (which has what the templates' requirements
list); pytest-asyncio is switched off for them because a team's environment
does not have it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import yaml

from nemesis.cli import main
from nemesis.onboarding.schema import json_schema
from nemesis.onboarding.templates import (
    HANDLER_LANGS,
    IntegrationSpec,
    new_handler,
    render_integration,
)
from nemesis.proto import handler_proto_text
from tests.conftest import REPO, Workspace, stop_gracefully

BIN = Path(sys.executable).parent
HANDLER_ENV = {**os.environ, "PYTEST_ADDOPTS": "-p no:asyncio -p no:cacheprovider"}


def nemesis(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nemesis", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
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
    generated = sorted(p.name for p in project.iterdir() if p.is_file())
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

    # Without a secret, and without being told that signatures are off, it does not start.
    refused = subprocess.run(
        START[lang](free_port()),
        cwd=project,
        env={k: v for k, v in os.environ.items() if not k.startswith("NEMESIS_SIGNING_")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode != 0
    assert "NEMESIS_SIGNING_DISABLED=true" in refused.stdout + refused.stderr
    # Two instances: one told that signatures are off (accepts every request), one with
    # NEMESIS_SIGNING_SECRET (refuses unsigned and stale ones).
    plain, checking = (
        start_handler(lang, project, tmp_path, processes, {"NEMESIS_SIGNING_DISABLED": "true"}),
        start_handler(
            lang, project, tmp_path, processes, {"NEMESIS_SIGNING_SECRET": SIGNING_SECRET}
        ),
    )
    signed_env = {"HANDLER_SECRET": SIGNING_SECRET}
    signed = ("--signing-secret-env", "HANDLER_SECRET")

    checked = nemesis("check-handler", plain.url, "--batch", "3", cwd=tmp_path)
    assert passes(checked) == 6, checked.stdout + checked.stderr
    if lang == "python-fastapi":
        # The onboarding page walks through this template: what it says is what ran.
        the_page_tells_of(generated, tested.stdout, checked.stdout)
    checked = nemesis(
        "check-handler", checking.url, "--batch", "3", *signed, cwd=tmp_path, env=signed_env
    )
    assert passes(checked) == 7, checked.stdout + checked.stderr
    assert "PASS  checks signatures" in checked.stdout

    unsigned = nemesis("check-handler", checking.url, cwd=tmp_path)
    assert unsigned.returncode == 1
    assert "--signing-secret-env" in unsigned.stdout
    not_checking = nemesis("check-handler", plain.url, *signed, cwd=tmp_path, env=signed_env)
    assert not_checking.returncode == 1
    assert "does NOT check signatures" in not_checking.stdout

    for handler in (plain, checking):
        handler.process.send_signal(signal.SIGTERM)
        # Graceful either way; uvicorn re-raises the signal once it has shut down.
        assert handler.process.wait(timeout=15) in (0, -signal.SIGTERM), handler.log.read_text()
        if lang == "python-fastapi":
            assert "Finished server process" in handler.log.read_text()


def the_page_tells_of(generated: list[str], tested: str, checked: str) -> None:
    """integrations/README.md's step 1 and 3 match the files, the tests and the check."""
    page = (REPO / "integrations" / "README.md").read_text()
    step_1 = page.split("## 1. Create your handler", 1)[1].split("\n## ", 1)[0]
    ran = re.search(r"(\d+) passed", tested)
    assert ran, tested
    claimed = re.search(r"^make test +# (\d+) tests", step_1, re.MULTILINE)
    assert claimed, step_1
    assert claimed.group(1) == ran.group(1), "the page's count of the template's tests"
    table = step_1.split("What you got:", 1)[1]
    listed = {
        name
        for row in table.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([^`]+)`", row.split("|")[1])
    }
    assert set(generated) == listed, "the page's table of the files `new handler` writes"
    step_3 = page.split("## 3. Run it and check the contract", 1)[1].split("\n## ", 1)[0]

    def probes(text: str) -> list[str]:
        return re.findall(r"^  PASS  (.+?)(?:  |$)", text, re.MULTILINE)

    assert probes(step_3) == probes(checked)


SIGNING_SECRET = "template-signing-secret"


@dataclass(frozen=True)
class Started:
    process: subprocess.Popen[bytes]
    url: str
    log: Path


def start_handler(
    lang: str,
    project: Path,
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    env: dict[str, str] | None = None,
) -> Started:
    port = free_port()
    log = tmp_path / f"handler-{port}.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NEMESIS_SIGNING_")}
    with log.open("wb") as output:
        server = subprocess.Popen(
            START[lang](port),
            cwd=project,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**clean, **(env or {})},
        )
    processes.append(server)
    wait_until_listening(server, port, log)
    return Started(server, URL[lang].format(port=port), log)


def passes(checked: subprocess.CompletedProcess[str]) -> int:
    """The PASS lines of a check-handler run that passed without a warning; -1 otherwise."""
    lines = checked.stdout.splitlines()
    if checked.returncode != 0 or any(
        line.startswith(("  WARN", "  FAIL", "  SKIP")) for line in lines
    ):
        return -1
    return sum(line.startswith("  PASS") for line in lines)


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


# --- signed deliveries, end to end -----------------------------------------------------------

NEW_SECRET, OLD_SECRET, OTHER_SECRET = "orders-hook-new-5b1e", "orders-hook-old-77c2", "not-ours-9d"
MESSAGES = 5


def signed_integration(name: str, url: str, secrets_env: str, extra: str = "") -> str:
    return (
        f"name: {name}\nowners: [team-test]\n"
        f"source: {{topic: orders, consumer: {name}}}\n"
        f"target: {{url: '{url}', timeout_s: 5, signing: {{secrets_env: {secrets_env}}}}}\n"
        # The first retry comes fast, the second waits longer than the test runs.
        "retry: {tiers: [200ms, 10m]}\n" + extra
    )


def committed(workspace: Workspace) -> dict[str, int]:
    described = workspace.cli("topics", "describe", "orders", "--json")
    assert described.returncode == 0, described.stderr
    totals: dict[str, int] = {}
    for partition in json.loads(described.stdout)["partitions"]:
        for consumer, offset in partition["committed"].items():
            totals[consumer] = totals.get(consumer, 0) + offset
    return totals


@pytest.mark.slow
async def test_nemesis_run_signs_what_a_generated_handler_verifies(
    workspace: Workspace,
    processes: list[subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project = workspace.root / "loyalty-handler"
    created = nemesis(
        "new", "handler", "--lang", "python-fastapi", str(project), cwd=workspace.root
    )
    assert created.returncode == 0, created.stderr
    handlers = {
        name: start_handler("python-fastapi", project, workspace.root, processes, env)
        for name, env in {
            "new": {"NEMESIS_SIGNING_SECRET": NEW_SECRET},
            "old": {"NEMESIS_SIGNING_SECRET": OLD_SECRET},
            "other": {"NEMESIS_SIGNING_SECRET": OTHER_SECRET},
        }.items()
    }
    monkeypatch.setenv("ORDERS_HOOK_SECRET", NEW_SECRET)
    monkeypatch.setenv("ORDERS_HOOK_SECRET_PREVIOUS", OLD_SECRET)
    monkeypatch.delenv("ORDERS_HOOK_SECRET_UNSET", raising=False)
    one, rotation = "[ORDERS_HOOK_SECRET]", "[ORDERS_HOOK_SECRET, ORDERS_HOOK_SECRET_PREVIOUS]"
    files = {
        "signed": signed_integration("signed", handlers["new"].url, one),
        "wrong-secret": signed_integration("wrong-secret", handlers["other"].url, one),
        "rotation-new": signed_integration("rotation-new", handlers["new"].url, rotation),
        "rotation-old": signed_integration(
            "rotation-old",
            handlers["old"].url,
            rotation,
            "delivery: {batch: {size: 3, max_wait_ms: 50}}\n",
        ),
        "unset": signed_integration(
            "unset", handlers["new"].url, "[ORDERS_HOOK_SECRET, ORDERS_HOOK_SECRET_UNSET]"
        ),
    }
    for name, text in files.items():
        workspace.write_integration(name, text)
    assert workspace.cli("validate").returncode == 0  # validate needs no secret
    assert workspace.cli("topics", "create", "orders", "--partitions", "2").returncode == 0
    lines = "".join(json.dumps({"id": f"order-{n}"}) + "\n" for n in range(MESSAGES))
    (workspace.root / "orders.jsonl").write_text(lines)
    published = workspace.cli("publish", "orders", "--file", "orders.jsonl", "--lines")
    assert published.returncode == 0, published.stderr

    proxy = await workspace.start("run")
    delivered = {"signed", "rotation-new", "rotation-old"}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        refused = handlers["other"].log.read_text().count('"POST /events HTTP/1.1" 401')
        totals = committed(workspace)
        if all(totals.get(name) == MESSAGES for name in delivered) and refused >= 2 * MESSAGES:
            break
        await asyncio.sleep(0.3)
    assert await stop_gracefully(proxy) == 0, workspace.logs()

    totals = committed(workspace)
    assert {name: totals.get(name) for name in delivered} == dict.fromkeys(delivered, MESSAGES)
    # A handler with another secret answers 401: every message is retried (the first tier
    # ran: twice each), none is dead-lettered and none reaches the handler's code.
    other_log = handlers["other"].log.read_text()
    assert other_log.count('"POST /events HTTP/1.1" 401') >= 2 * MESSAGES
    assert '"POST /events HTTP/1.1" 200' not in other_log
    dead = workspace.cli("dlq", "list", "--json")
    assert dead.returncode == 0, dead.stderr
    assert dead.stdout.strip() == ""  # JSON lines: one per dead letter
    # The batch integration sent batches, signed with both secrets, to the old-secret handler.
    assert '"POST /events HTTP/1.1" 401' not in handlers["old"].log.read_text()
    # The integration whose variable is unset was refused, naming its file and the variable.
    logs = workspace.logs()
    assert (
        "integrations/unset.yaml: target.signing.secrets_env.1: environment variable"
        " ORDERS_HOOK_SECRET_UNSET is unset or empty"
    ) in logs
    assert "unset" not in totals
    for secret in (NEW_SECRET, OLD_SECRET):
        assert secret not in logs


@pytest.mark.parametrize(
    ("secrets_env", "message"),
    [
        ("[ORDERS-HOOK]", "String should match pattern"),
        ("[]", "at least 1 item"),
        ("[A, B, C]", "at most 2 items"),
        ("[A, A]", "the same variable twice"),
        ("ORDERS_HOOK_SECRET", "a list of 1 or 2 environment variable names"),
    ],
)
def test_validate_checks_the_secret_variable_names(
    workspace: Workspace, secrets_env: str, message: str
) -> None:
    workspace.write_integration(
        "signed", signed_integration("signed", "http://127.0.0.1:9/events", secrets_env)
    )
    validated = workspace.cli("validate", "integrations")
    assert validated.returncode == 1
    assert "target.signing.secrets_env" in validated.stdout + validated.stderr
    assert message in validated.stdout + validated.stderr


def test_the_python_templates_share_one_signature_check(tmp_path: Path) -> None:
    written = {
        lang: (tmp_path / lang / "signatures.py").read_text()
        for lang in ("python-fastapi", "python-grpc")
        if new_handler(tmp_path / lang, lang)
    }
    assert written["python-fastapi"] == written["python-grpc"]
    assert "from standardwebhooks" in written["python-fastapi"]
