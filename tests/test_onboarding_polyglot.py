"""``nemesis new handler`` in Go, TypeScript and Java: each template used as a team would use it.

For each language, once for the whole module: the real CLI writes the project into a temporary
folder, the language's own toolchain builds it, and the handler starts on 127.0.0.1 (``PORT``).
Then the tests run the project's own tests (the contract through a real server, and the shared
signing vectors, which must fail when the vectors are changed), probe the running handler with
``nemesis check-handler`` (one event, a batch), and have a real ``nemesis run`` on the embedded
backend deliver to it: an event, a batch, an event that fails its first attempt (the template's
demo payload answers 503) and comes back through a retry tier, and a payload the handler rejects
(422) that lands in the dead-letter queue. A second instance with a signing secret checks the
handler's verifier against Nemesis's reference signer over real HTTP.

Toolchains: Go 1.21 or later (Debian's ``golang-go`` is installed here when ``go`` is missing and
the tests run as root, the way ``.ci/run`` installs Chromium; the template's one module, the
Standard Webhooks library, comes from the Go module proxy), Node.js 20 with npm (the TypeScript
template's packages, the Standard Webhooks library among them, come from the npm registry, once
per module), and JDK 17 with Maven (``./build.sh`` has Maven copy the Standard Webhooks jar
into ``lib/``, then compiles with ``javac``). A missing toolchain fails the tests with the command
that installs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

import httpx
import pytest

from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.delivery.signing import Signer
from nemesis.onboarding.templates import (
    DEFAULT_URLS,
    HandlerLang,
    new_handler,
    signing_vectors_text,
)
from tests.conftest import Workspace

# Building a template (go build, npm ci, mvn package) takes minutes on a loaded host; the
# build runs in the first case's setup, which the suite's default timeout would cut.
pytestmark = pytest.mark.timeout(900)

LANGS: tuple[HandlerLang, ...] = ("go-http", "typescript-node", "java-http")
PROJECT = "orders-handler"  # the folder's name: the Java package is orders_handler
SECRET, OLD_SECRET = "s3cret-current", "s3cret-previous"
HANDLED = re.compile(r"handled (\S+) (\S+) \(attempt (\d+)\)")


@dataclass(frozen=True)
class Toolchain:
    """How a language builds, tests and runs its project."""

    build: tuple[tuple[str, ...], ...]
    own_tests: tuple[str, ...]
    signing_tests: tuple[str, ...]  # the vector tests alone, without a rebuild
    start: tuple[str, ...]
    vectors: str  # where the project keeps its copy of the vectors
    passed: re.Pattern[str]  # a line of the test output for each test passed
    failed: re.Pattern[str]
    lint: tuple[str, ...] = ()  # prints nothing when the code is clean (else the build checks)


JAVA_CLASSPATH = "build/classes:build/test-classes:src/test/resources:lib/*"
TOOLCHAINS = {
    "go-http": Toolchain(
        build=(("go", "build", "-o", "handler", "."),),
        own_tests=("make", "test"),
        signing_tests=("go", "test", "-count=1", "-v", "-run", "TestTheSharedVectors", "."),
        start=("./handler",),
        vectors="testdata/signing-vectors.json",
        passed=re.compile(r"^--- PASS", re.MULTILINE),
        failed=re.compile(r"^--- FAIL", re.MULTILINE),
        lint=("gofmt", "-l", "."),
    ),
    "typescript-node": Toolchain(
        build=(("npm", "install", "--no-audit", "--no-fund"), ("npx", "tsc", "-p", ".")),
        own_tests=("npm", "test"),
        signing_tests=("node", "--test", "dist/test/signing.test.js"),
        start=("node", "dist/src/server.js"),
        vectors="test/signing-vectors.json",
        passed=re.compile(r"^ok \d+ ", re.MULTILINE),
        failed=re.compile(r"^not ok \d+ ", re.MULTILINE),
    ),
    "java-http": Toolchain(
        build=(("./build.sh", "compile"),),
        own_tests=("./build.sh",),
        signing_tests=("java", "-cp", JAVA_CLASSPATH, "orders_handler.SigningTest"),
        start=("java", "-cp", "build/classes:lib/*", "orders_handler.Server"),
        vectors="src/test/resources/signing-vectors.json",
        passed=re.compile(r"^ok   ", re.MULTILINE),
        failed=re.compile(r"^FAIL ", re.MULTILINE),
    ),
}
REQUIRED = {
    "go-http": {"go": "Debian's golang-go (apt-get install -y golang-go)", "make": "make"},
    "typescript-node": {"node": "Node.js 20 (apt-get install -y nodejs npm)", "npm": "npm"},
    "java-http": {
        "javac": "JDK 17 (apt-get install -y openjdk-17-jdk-headless)",
        "java": "JDK 17",
        "mvn": "Maven, which fetches the Standard Webhooks library (apt-get install -y maven)",
    },
}


def ensure_toolchain(lang: str) -> None:
    """Installs Go when it is missing (as root with apt, like .ci/run); else fails saying how."""
    missing_go = lang == "go-http" and shutil.which("go") is None
    if missing_go and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "golang-go"],
        ):
            subprocess.run(command, env=env, capture_output=True, timeout=900, check=False)
    for tool, package in REQUIRED[lang].items():
        if shutil.which(tool) is None:
            pytest.fail(f"{lang}: `{tool}` is not installed: the template's tests need {package}")


def run(
    command: tuple[str, ...], cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def nemesis(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run((sys.executable, "-m", "nemesis", *args), cwd, env or dict(os.environ), timeout=120)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_until(condition: Callable[[], bool], what: str, diagnose: Callable[[], str]) -> None:
    """Polls ``condition`` for up to 60 s (a bound for a stuck run, not a speed requirement)."""
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within 60 s:\n{diagnose()}")
        time.sleep(0.1)


@dataclass
class Project:
    lang: str
    path: Path
    env: dict[str, str]
    toolchain: Toolchain


@dataclass
class Handler:
    url: str
    log: Path
    process: subprocess.Popen[bytes]

    def handled(self) -> list[tuple[str, str, int]]:
        """(type, id, attempt) of every event the handler logged as handled."""
        text = self.log.read_text(errors="replace")
        return [(t, i, int(a)) for t, i, a in HANDLED.findall(text)]


@pytest.fixture(scope="module", params=LANGS)
def project(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Project:
    """The template written by the real CLI and built by its own toolchain, once per language."""
    lang: str = request.param
    ensure_toolchain(lang)
    root = tmp_path_factory.mktemp(lang)
    env = {
        **os.environ,
        "GOCACHE": str(root / "go-cache"),  # a clean build, as on a new machine
        "GOPATH": str(root / "go-path"),
        "GOTOOLCHAIN": "local",
        # The handler's own environment decides, per test.
        "NEMESIS_SIGNING_SECRET": "",
        "NEMESIS_SIGNING_SECRET_PREVIOUS": "",
        "NEMESIS_SIGNING_DISABLED": "",
    }
    created = nemesis("new", "handler", "--lang", lang, PROJECT, cwd=root)
    assert created.returncode == 0, created.stderr
    path = root / PROJECT
    toolchain = TOOLCHAINS[lang]
    for command in toolchain.build:
        built = run(command, path, env)
        assert built.returncode == 0, f"{' '.join(command)}:\n{built.stdout}\n{built.stderr}"
    return Project(lang, path, env, toolchain)


def start_handler(project: Project, log: Path, **env: str) -> Handler:
    port = free_port()
    with log.open("wb") as output:
        process = subprocess.Popen(
            project.toolchain.start,
            cwd=project.path,
            env={**project.env, "LISTEN_HOST": "127.0.0.1", "PORT": str(port), **env},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            pytest.fail(f"the handler exited with {process.returncode}:\n{log.read_text()}")
        with socket.socket() as client:
            if client.connect_ex(("127.0.0.1", port)) == 0:
                break
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the handler did not listen on {port}:\n{log.read_text()}")
        time.sleep(0.05)
    return Handler(f"http://127.0.0.1:{port}/events", log, process)


def stop(handler: Handler) -> None:
    handler.process.send_signal(signal.SIGTERM)
    try:
        handler.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        handler.process.kill()
        handler.process.wait(timeout=10)


@pytest.fixture(scope="module")
def handler(project: Project) -> Iterator[Handler]:
    """The project's handler, started as its README says, told that signatures are off."""
    started = start_handler(
        project, project.path.parent / "handler.log", NEMESIS_SIGNING_DISABLED="true"
    )
    yield started
    stop(started)


@pytest.fixture(scope="module")
def signed_handler(project: Project) -> Iterator[Handler]:
    """A second instance that checks signatures, in the middle of a secret rotation."""
    started = start_handler(
        project,
        project.path.parent / "signed-handler.log",
        NEMESIS_SIGNING_SECRET=SECRET,
        NEMESIS_SIGNING_SECRET_PREVIOUS=OLD_SECRET,
    )
    yield started
    stop(started)


@pytest.mark.slow
def test_the_template_passes_its_own_tests_which_check_the_shared_vectors(
    project: Project,
) -> None:
    toolchain = project.toolchain
    # GOFLAGS: Go's tests run again (no cached result) and name each test (-v); others ignore it.
    tested = run(toolchain.own_tests, project.path, {**project.env, "GOFLAGS": "-count=1 -v=true"})
    output = tested.stdout + tested.stderr
    assert tested.returncode == 0, output
    assert len(toolchain.passed.findall(output)) >= 10, output
    assert not toolchain.failed.search(output), output
    if toolchain.lint:
        linted = run(toolchain.lint, project.path, project.env)
        assert (linted.returncode, linted.stdout + linted.stderr) == (0, "")
    vectors = project.path / toolchain.vectors
    assert vectors.read_text() == signing_vectors_text()

    # The same tests fail when the vectors and the implementation disagree.
    document = json.loads(signing_vectors_text())
    document["signed"][0]["content"] += " "
    vectors.write_text(json.dumps(document))
    try:
        tampered = run(toolchain.signing_tests, project.path, project.env)
    finally:
        vectors.write_text(signing_vectors_text())
    assert tampered.returncode != 0, tampered.stdout + tampered.stderr
    assert toolchain.failed.search(tampered.stdout + tampered.stderr), tampered.stdout


@pytest.mark.slow
def test_without_a_secret_the_handler_refuses_to_start(project: Project) -> None:
    started = run(project.toolchain.start, project.path, {**project.env, "PORT": str(free_port())})
    assert started.returncode != 0, started.stdout + started.stderr
    assert "NEMESIS_SIGNING_DISABLED=true" in started.stdout + started.stderr


@pytest.mark.slow
@pytest.mark.parametrize("batch", [0, 3], ids=["single", "batch"])
def test_the_handler_passes_check_handler(handler: Handler, tmp_path: Path, batch: int) -> None:
    checked = nemesis("check-handler", handler.url, "--batch", str(batch), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert sum(line.startswith("  PASS") for line in lines) == (6 if batch else 4), checked.stdout
    assert not any(line.startswith(("  WARN", "  FAIL", "  SKIP")) for line in lines)


def integration(name: str, topic: str, url: str, *, batch: int = 1, extra: str = "") -> str:
    return (
        f"name: {name}\n"
        "owners: [team-orders]\n"
        f"source: {{topic: {topic}, consumer: {name}}}\n"
        f"target: {{url: '{url}', timeout_s: 5{extra}}}\n"
        f"delivery: {{workers: 4, buffer: 10, batch: {{size: {batch}, max_wait_ms: 300}}}}\n"
        "retry: {tiers: [200ms, 500ms]}\n"
    )


def dead_letters(space: Workspace) -> list[dict[str, object]]:
    listed = space.cli("dlq", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]


@pytest.fixture
def space(tmp_path: Path) -> Workspace:
    workspace = Workspace(tmp_path)
    # No admin API or viewer: they are not under test here, and their ports may be taken.
    workspace.write_config("admin: {enabled: false}\nviewer: {enabled: false, port: 8080}\n")
    return workspace


def publish(space: Workspace, topic: str, consumer: str, *messages: tuple[str, str]) -> None:
    """Creates the topic and writes (payload, type) messages to it, in this process."""

    async def write() -> None:
        broker = await space.open_broker()
        try:
            await broker.admin.create_topic(
                topic, partitions=1, consumers=[ConsumerSpec(consumer)], exist_ok=True
            )
            writer = await broker.writer(topic)
            outgoing = [
                OutgoingMessage(value=p.encode(), metadata={"type": t}) for p, t in messages
            ]
            await writer.write(outgoing)
            await writer.close()
        finally:
            await broker.close()

    asyncio.run(write())


def start_run(space: Workspace) -> subprocess.Popen[bytes]:
    with (space.root / "run.log").open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "nemesis", "run"],
            cwd=space.root,
            env={**os.environ, "NEMESIS_TEST_SIGNING_SECRET": SECRET},
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def still_running(process: subprocess.Popen[bytes], space: Workspace) -> None:
    """Fails the test at once when ``nemesis run`` has exited."""
    if process.poll() is not None:
        log = (space.root / "run.log").read_text()
        pytest.fail(f"nemesis run exited with {process.returncode}:\n{log}")


def stop_run(process: subprocess.Popen[bytes], space: Workspace) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        pytest.fail("nemesis run did not stop on SIGTERM")
    assert code == 0, (space.root / "run.log").read_text()


@pytest.mark.slow
def test_nemesis_run_delivers_single_batched_retried_and_dead_events(
    project: Project, handler: Handler, space: Workspace
) -> None:
    for topic, name, batch in (("orders", "orders-to-x", 1), ("orders.batched", "batched-to-x", 3)):
        space.write_integration(name, integration(name, topic, handler.url, batch=batch))
    publish(
        space,
        "orders",
        "orders-to-x",
        ('{"order_id": 1}', "order.created"),
        ('{"order_id": 2, "demo": "try-later"}', "order.flaky"),  # 503 on its first attempt
        ("not json", "order.broken"),  # 422
    )
    publish(
        space,
        "orders.batched",
        "batched-to-x",
        # Batches of up to 3: a full batch, and one event left over for the next request.
        *[(f'{{"n": {n}}}', "order.batched") for n in range(4)],
    )
    before = len(handler.handled())

    process = start_run(space)
    try:

        def delivered() -> bool:
            still_running(process, space)
            seen = handler.handled()[before:]
            types = [(t, attempt) for t, _, attempt in seen]
            return (
                ("order.created", 1) in types
                and ("order.flaky", 2) in types
                and types.count(("order.batched", 1)) == 4
                and len(dead_letters(space)) == 1
            )

        wait_until(
            delivered,
            "the deliveries",
            lambda: f"{handler.log.read_text()}\n{(space.root / 'run.log').read_text()}",
        )
    finally:
        stop_run(process, space)
    seen = handler.handled()[before:]
    # The event that failed once was handled on its retry, once; nothing else was retried.
    assert sorted((t, a) for t, _, a in seen) == [
        ("order.batched", 1),
        ("order.batched", 1),
        ("order.batched", 1),
        ("order.batched", 1),
        ("order.created", 1),
        ("order.flaky", 2),
    ]
    [dead] = dead_letters(space)
    assert (dead["integration"], dead["http_status"], dead["payload"]) == (
        "orders-to-x",
        422,
        "not json",
    )
    assert dead["attempts"] == 1  # dead-lettered at once, not retried


def signed(
    headers: list[tuple[str, str]], body: bytes, secrets: list[str], at: int, *, batch: bool = False
) -> dict[str, str]:
    """A request's headers with the ``webhook-*`` headers of Nemesis' reference signer."""
    return {**dict(headers), **dict(Signer(secrets).http(headers, body, batch=batch, timestamp=at))}


@pytest.mark.slow
def test_the_handler_checks_signatures_made_by_the_reference_signer(
    signed_handler: Handler,
) -> None:
    body = b'{"order_id": 1}'
    now = int(time.time())
    before = len(signed_handler.handled())

    def post(event_id: str, secrets: list[str] | None, at: int = now, payload: bytes = body) -> int:
        headers = [("ce-specversion", "1.0"), ("ce-id", event_id), ("ce-type", "order.created")]
        headers.append(("content-type", "application/json"))
        sent = dict(headers) if secrets is None else signed(headers, body, secrets, at)
        return httpx.post(signed_handler.url, content=payload, headers=sent).status_code

    assert post("a", None) == 401  # unsigned
    assert post("b", ["not-the-secret"]) == 401
    assert post("c", [SECRET], now - 400) == 401  # stale
    assert post("d", [SECRET], payload=b'{"order_id": 2}') == 401
    assert post("e", [SECRET]) == 200
    assert post("f", [OLD_SECRET]) == 200  # the previous secret
    # Nemesis during a rotation: a v1 for each of its two secrets.
    assert post("g", ["newer", SECRET]) == 200
    batch = json.dumps([{"specversion": "1.0", "id": "h", "type": "t", "data": {}}]).encode()
    batch_headers = [("content-type", "application/cloudevents-batch+json")]
    sent = signed(batch_headers, batch, [SECRET], now, batch=True)
    assert httpx.post(signed_handler.url, content=batch, headers=sent).status_code == 200
    assert [i for _, i, _ in signed_handler.handled()[before:]] == ["e", "f", "g", "h"]


VECTORS = json.loads(signing_vectors_text())


@pytest.mark.slow
def test_forgeries_and_hostile_headers_are_answered_401(signed_handler: Handler) -> None:
    """The shared tables: each forgery of a signed request, each hostile signature header."""
    now = int(time.time())
    answers: dict[str, int] = {}
    for forgery in VECTORS["forgeries"]:
        original, forged = forgery["original"], forgery["forged"]
        # A fresh id for each, so that de-duplication by ce-id cannot hide a forgery.
        fresh = [
            (n, f"{v}-{len(answers)}" if n == "ce-id" else v)
            for n, v in original["request_headers"]
        ]
        body = bytes.fromhex(original["body_hex"])
        headers = signed(fresh, body, [SECRET], now)
        webhook = {n: v for n, v in headers.items() if n.startswith("webhook-")}
        forged_headers = [
            (n, f"{v}-{len(answers)}" if n == "ce-id" else v) for n, v in forged["request_headers"]
        ]
        answers[forgery["name"]] = httpx.post(
            signed_handler.url,
            content=bytes.fromhex(forged["body_hex"]),
            headers=[*forged_headers, *webhook.items()],
        ).status_code
        answers[f"{forgery['name']}: the original"] = httpx.post(
            signed_handler.url, content=body, headers=headers
        ).status_code
    vector = next(v for v in VECTORS["signed"] if v["transport"] == "http")
    body = bytes.fromhex(vector["body_hex"])
    for hostile in VECTORS["hostile_headers"]:
        pairs = [(n, f"{v}-hostile" if n == "ce-id" else v) for n, v in vector["request_headers"]]
        headers = signed(pairs, body, [SECRET], now)
        for name, value in hostile.items():
            if name == "name":
                continue
            if value is None:
                headers.pop(name, None)
            else:
                headers[name] = value
        raw = [(n.encode(), v.encode()) for n, v in headers.items()]
        answers[hostile["name"]] = httpx.post(
            signed_handler.url, content=body, headers=raw
        ).status_code
    # Each original passes the signature check (the handler may still reject its payload, 422);
    # each forgery and each hostile header is refused by it.
    refused = {name: status == 401 for name, status in answers.items()}
    assert refused == {name: not name.endswith(": the original") for name in answers}


@pytest.mark.slow
def test_an_unsigned_probe_is_refused_by_a_handler_with_a_secret(
    signed_handler: Handler, tmp_path: Path
) -> None:
    checked = nemesis("check-handler", signed_handler.url, cwd=tmp_path)
    assert checked.returncode == 1, checked.stdout
    assert "HTTP 401" in checked.stdout


@pytest.mark.slow
def test_check_handler_signs_with_the_secret_from_the_environment(
    signed_handler: Handler, tmp_path: Path
) -> None:
    env = {**os.environ, "NEMESIS_TEST_SIGNING_SECRET": SECRET}
    for batch in ("0", "3"):
        checked = nemesis(
            "check-handler",
            signed_handler.url,
            "--batch",
            batch,
            "--signing-secret-env",
            "NEMESIS_TEST_SIGNING_SECRET",
            cwd=tmp_path,
            env=env,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.slow
def test_nemesis_run_delivers_signed_events(signed_handler: Handler, space: Workspace) -> None:
    # The secret comes from the environment of `nemesis run` (start_run sets it).
    signing = ", signing: {secrets_env: [NEMESIS_TEST_SIGNING_SECRET]}"
    for topic, name, batch in (("orders", "signed-to-x", 1), ("orders.batched", "batched-to-x", 3)):
        space.write_integration(
            name, integration(name, topic, signed_handler.url, batch=batch, extra=signing)
        )
    publish(space, "orders", "signed-to-x", ('{"order_id": 1}', "order.signed"))
    publish(space, "orders.batched", "batched-to-x", ('{"order_id": 2}', "order.signed-batch"))
    process = start_run(space)
    try:

        def delivered() -> bool:
            still_running(process, space)
            return {"order.signed", "order.signed-batch"} <= {
                t for t, _, _ in signed_handler.handled()
            }

        wait_until(
            delivered,
            "the signed deliveries",
            lambda: f"{signed_handler.log.read_text()}\n{(space.root / 'run.log').read_text()}",
        )
    finally:
        stop_run(process, space)
    # Accepted at the first attempt: no 401 and retry on the way.
    signed = {(t, a) for t, _, a in signed_handler.handled() if t.startswith("order.signed")}
    assert signed == {("order.signed", 1), ("order.signed-batch", 1)}


# --- what `nemesis new handler` writes, without building it -----------------------------------


@pytest.mark.parametrize("lang", LANGS)
def test_a_new_project_is_complete_and_every_placeholder_filled(
    lang: HandlerLang, tmp_path: Path
) -> None:
    written = new_handler(tmp_path / "class", lang)  # a Java keyword as the folder's name
    names = {path.relative_to(tmp_path / "class").as_posix() for path in written}
    assert {"README.md", ".gitignore", TOOLCHAINS[lang].vectors} <= names
    for path in written:
        assert "{{" not in path.read_text(), path
    assert (tmp_path / "class" / TOOLCHAINS[lang].vectors).read_text() == signing_vectors_text()
    assert DEFAULT_URLS[lang] == "http://127.0.0.1:8000/events"  # where `new integration` points
    if lang == "java-http":
        # `class` cannot be a package; the sources sit in their package's folder.
        assert "src/main/java/handler_class/Handler.java" in names
        handler = (tmp_path / "class/src/main/java/handler_class/Handler.java").read_text()
        assert handler.startswith("package handler_class;")
        assert (tmp_path / "class/build.sh").stat().st_mode & stat.S_IXUSR
        pom = ElementTree.parse(tmp_path / "class/pom.xml").getroot()
        namespace = {"m": "http://maven.apache.org/POM/4.0.0"}
        assert pom.findtext("m:artifactId", namespaces=namespace) == "class"
    if lang == "typescript-node":
        package = json.loads((tmp_path / "class/package.json").read_text())
        assert set(package["devDependencies"]) == {"typescript", "@types/node"}
        assert set(package["dependencies"]) == {"standardwebhooks"}  # the verifier
        json.loads((tmp_path / "class/tsconfig.json").read_text())
    if lang == "go-http":
        assert (tmp_path / "class/go.mod").read_text().splitlines() == [
            "module class",
            "",
            "go 1.21.0",
            "",
            "require github.com/standard-webhooks/standard-webhooks/libraries v1.3.0",
        ]
