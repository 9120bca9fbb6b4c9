"""The package as users install it: a wheel with no extras, the image's script, the PR check.

Each case installs Nemesis into a fresh virtual environment from a copy of
the repository as a clone has it (tracked files, nothing generated), with
pip from PyPI and no development tools, then drives the installed
``nemesis`` in a subprocess:

* the wheel with no extras: the gRPC contract and every Kafka codec importable,
  ``--help`` of every command the parser defines,
  ``validate`` of the shipped files, ``demo`` until a delivery, and ``run``
  on a Kafka broker holding an lz4 batch written by librdkafka;
* ``deploy/install.sh`` exactly as ``deploy/Dockerfile`` calls it;
* the ``run:`` steps of ``deploy/ci/validate-integrations.yml``, its package
  spec pointed at a local clone at HEAD.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from nemesis.cli import build_parser
from nemesis.testing import HandlerServer
from tests.conftest import REPO, integration_yaml
from tests.kafka_broker import KafkaBroker, Namespace, free_port
from tests.test_onboarding_docs import integrations_repository
from tests.test_ydb_workflow import actionlint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DOCKERFILE = REPO / "deploy" / "Dockerfile"
WORKFLOW = REPO / "deploy" / "ci" / "validate-integrations.yml"
INSTALL_SCRIPT = "deploy/install.sh"
# Present only where a development tool was installed: none may be in a user's install.
DEV_ONLY = (
    "pytest",
    "httpx",
    "mypy",
    "ruff",
    "grpc_tools",
    "confluent_kafka",
    "opentelemetry.sdk",  # the tracing extra
)


@dataclass(frozen=True)
class Venv:
    """A virtual environment outside the repository, and its commands run from ``cwd``."""

    root: Path

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    def run(self, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.bin(args[0]), *args[1:]],
            cwd=cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def missing(self, modules: tuple[str, ...], cwd: Path) -> list[str]:
        """The modules of ``modules`` that this environment cannot import."""
        probe = (
            "import importlib.util, sys\n"
            "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
        )
        found = self.run("python", "-c", probe, *modules, cwd=cwd)
        assert found.returncode == 0, found.stderr
        return found.stdout.split()


def pip(*args: str, cwd: Path, python: str = sys.executable, timeout: float = 600) -> None:
    done = subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def clean_copy(destination: Path) -> Path:
    """The repository's files as a clone has them: no venv, no generated gRPC code."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for name in listed.decode().split("\0"):
        source = REPO / name
        if name and source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return clean_copy(tmp_path_factory.mktemp("source") / "nemesis")


@pytest.fixture(scope="module")
def bare(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """The wheel, installed with no extras into a new environment (``pip install nemesis``)."""
    work = tmp_path_factory.mktemp("bare")
    pip("wheel", "--no-deps", "--wheel-dir", str(work / "dist"), str(source), cwd=work)
    [wheel] = (work / "dist").glob("nemesis-*.whl")
    venv = Venv(work / "venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv.root)], check=True, timeout=120)
    pip("install", str(wheel), cwd=work, python=venv.bin("python"))
    assert venv.missing(DEV_ONLY, cwd=work) == list(DEV_ONLY)
    return venv


@pytest.fixture
def here(tmp_path: Path) -> Path:
    """A working directory outside the repository (nothing imported from the checkout)."""
    return tmp_path


def commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Every command path the parser accepts: ``()``, ``("run",)``, ``("dlq", "list")``..."""
    yield prefix
    for action in parser._actions:  # argparse offers no public walk
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*prefix, name))


def test_every_command_s_help_starts_without_extras(bare: Venv, here: Path) -> None:
    paths = list(commands(build_parser()))
    assert len(paths) > 20  # the walk reached the subcommands
    failed = {}
    for path in paths:
        shown = bare.run("nemesis", *path, "--help", cwd=here)
        if shown.returncode != 0 or "usage: nemesis" not in shown.stdout:
            failed[" ".join(path) or "(none)"] = shown.stderr[-600:]
    assert not failed, failed


def test_without_the_tracing_extra_nothing_of_it_is_imported_and_enabling_it_says_how(
    bare: Venv, here: Path
) -> None:
    probe = (
        "import sys\n"
        "import nemesis.cli, nemesis.runtime.app, nemesis.runtime.runner\n"
        "from nemesis.config.models import TracingConfig\n"
        "from nemesis.errors import ConfigError\n"
        "from nemesis.runtime.tracing import delivery_tracing\n"
        "assert delivery_tracing(TracingConfig(), 'embedded') is None\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk',"
        " 'opentelemetry.trace', 'opentelemetry.exporter'))))\n"
        "try:\n"
        "    delivery_tracing(TracingConfig(enabled=True), 'embedded')\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    done = bare.run("python", "-c", probe, cwd=here)
    assert done.returncode == 0, done.stderr
    imported, refused = done.stdout.strip().splitlines()
    assert imported == "[]"
    assert "tracing.enabled" in refused
    assert "pip install 'nemesis[tracing]'" in refused


def test_the_wheel_carries_the_compiled_grpc_contract_and_every_kafka_codec(
    bare: Venv, here: Path
) -> None:
    probe = (
        "import nemesis.delivery.grpc\n"
        "from aiokafka import codec\n"
        "print([c for c in ('gzip', 'snappy', 'lz4', 'zstd') if not getattr(codec, f'has_{c}')()])"
    )
    done = bare.run("python", "-c", probe, cwd=here)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_validate_accepts_the_shipped_files(
    bare: Venv, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What each deployment's pods get in their environment (deploy/kubernetes/*).
    for name, value in {
        "NEMESIS_KAFKA_BOOTSTRAP": "kafka:9092",
        "NEMESIS_DB_DSN": "postgresql://nemesis@postgres:5432/nemesis",
        "NEMESIS_YDB_ENDPOINT": "grpc://ydb:2136",
        "NEMESIS_YDB_DATABASE": "/local",
    }.items():
        monkeypatch.setenv(name, value)
    checked: dict[str, tuple[str, ...]] = {
        "integrations and pipelines": ("integrations", "pipelines"),
        "the example process file": ("nemesis.example.yaml",),
    }
    deployments = sorted((source / "deploy/config").glob("nemesis.*.yaml"))
    assert deployments, "no deployment configuration shipped in deploy/config"
    for config in deployments:
        checked[config.name] = (
            str(config.relative_to(source)),
            "deploy/config/integrations",
            "pipelines",
        )
    for what, paths in checked.items():
        done = bare.run("nemesis", "validate", *paths, cwd=source)
        assert done.returncode == 0, f"{what}: {done.stdout}{done.stderr}"
        assert done.stdout.splitlines()[-1].startswith("all valid"), done.stdout
    tests = bare.run("nemesis", "test-pipelines", "pipelines", cwd=source)
    assert tests.returncode == 0, tests.stdout + tests.stderr


async def test_the_demo_delivers(bare: Venv, here: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        bare.bin("nemesis"),
        "demo",
        "--dir",
        str(here / "demo"),
        "--viewer-port",
        "0",
        "--rate",
        "100",
        cwd=here,
        env=bare.env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(120):
            while True:
                line = (await process.stdout.readline()).decode()
                assert line, "the demo ended before a delivery:\n" + "".join(seen)
                seen.append(line)
                delivered = re.search(r"\bdelivered +(\d+)", line)
                if delivered and int(delivered.group(1)) > 0:
                    break
    finally:
        if process.returncode is None:
            process.terminate()
        rest, _ = await process.communicate()
    assert process.returncode == 0, "".join(seen) + rest.decode(errors="replace")


def produce_lz4(bootstrap: str, topic: str, count: int) -> set[str]:
    """Writes ``count`` orders in lz4-compressed batches with librdkafka (confluent-kafka)."""
    from confluent_kafka import Producer

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "compression.type": "lz4",
            "linger.ms": 50,
            "enable.idempotence": True,
        }
    )
    ids = set()
    failures: list[str] = []

    def delivered(error: Any, _message: Any) -> None:
        if error is not None:
            failures.append(str(error))

    for n in range(count):
        ids.add(f"order-{n}")
        producer.produce(
            topic,
            orjson.dumps({"id": f"order-{n}", "n": n}),
            key=f"order-{n}",
            on_delivery=delivered,
        )
    assert producer.flush(30) == 0
    assert not failures, failures
    return ids


async def test_run_delivers_an_lz4_batch_from_a_third_party_producer(
    bare: Venv, here: Path, kafka: KafkaBroker
) -> None:
    """Apache Kafka, the backend's default configuration, records written by librdkafka."""
    names = Namespace()
    topic = names("orders")
    (here / "integrations").mkdir()
    (here / "nemesis.yaml").write_text(
        "backend:\n"
        "  kind: kafka\n"
        f"  bootstrap_servers: ['{kafka.bootstrap}']\n"
        "single_host: true\n"  # one process, its state and DLQ in SQLite files here
        "data_dir: .\n"
        "integrations_dir: integrations\n"
        f"admin: {{port: {free_port()}}}\n"
        "viewer: {enabled: false}\n"
    )
    created = bare.run("nemesis", "topics", "create", topic, "--partitions", "2", cwd=here)
    assert created.returncode == 0, created.stderr
    ids = await asyncio.to_thread(produce_lz4, kafka.bootstrap, topic, 200)
    async with HandlerServer() as handler:
        name = names("loyalty")
        (here / "integrations" / f"{name}.yaml").write_text(
            integration_yaml(name, handler.url, topic=topic)
        )
        initialised = bare.run("nemesis", "init", cwd=here)
        assert initialised.returncode == 0, initialised.stdout + initialised.stderr
        log = (here / "run.log").open("wb")
        process = await asyncio.create_subprocess_exec(
            bare.bin("nemesis"), "run", cwd=here, env=bare.env(), stderr=log
        )
        try:
            await handler.ledger.wait_for(len(ids), timeout_s=120)
        except TimeoutError:
            pytest.fail((here / "run.log").read_text(errors="replace")[-3000:])
        finally:
            process.terminate()
            await process.wait()
            log.close()
    received = {orjson.loads(entry.body)["id"] for entry in handler.ledger if entry.done}
    assert received == ids


# --- the image's install ------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, rest = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


@dataclass(frozen=True)
class ScriptCall:
    """How the Dockerfile runs deploy/install.sh: its working directory, env and arguments.

    ``copies`` are the build stage's ``COPY`` instructions before it, (sources, target):
    the files the install can see.
    """

    workdir: str
    env: dict[str, str]
    args: list[str]
    copies: list[tuple[list[str], str]]


def dockerfile_install_call() -> ScriptCall:
    """The one RUN of the build stage that calls the install script, parsed."""
    workdir = "/"
    copies: list[tuple[list[str], str]] = []
    calls: list[ScriptCall] = []
    for keyword, rest in dockerfile_instructions(DOCKERFILE.read_text()):
        if keyword == "FROM" and calls:
            break  # the final stage
        if keyword == "WORKDIR":
            workdir = rest
        elif keyword == "COPY" and "--from" not in rest:
            *sources, target = rest.split()
            copies.append((sources, os.path.join(workdir, target)))
        elif keyword == "RUN":
            words = shlex.split(rest)
            env = {}
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if words and words[0].endswith("install.sh"):
                script = os.path.normpath(os.path.join(workdir, words[0]))
                copied = [(s, os.path.normpath(t)) for s, t in copies]
                assert ([INSTALL_SCRIPT], script) in copied, f"{words[0]} was not copied there"
                assert "&&" not in words, "the install is the script alone"
                calls.append(ScriptCall(workdir, env, words[1:], list(copies)))
    assert len(calls) == 1, f"deploy/Dockerfile calls {INSTALL_SCRIPT} {len(calls)} times"
    return calls[0]


def test_the_dockerfile_installs_through_the_script() -> None:
    call = dockerfile_install_call()
    venv, requirement = call.args
    # The final stage copies the environment the script made, and runs its nemesis.
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    assert ("COPY", f"--from=build {venv} {venv}") in instructions
    assert any(k == "ENV" and f"PATH={venv}/bin:" in rest for k, rest in instructions)
    assert requirement == f"{call.workdir}[speed]"
    # Nothing else installs packages past the script.
    runs = [shlex.split(rest) for keyword, rest in instructions if keyword == "RUN"]
    assert not [run for run in runs if {"pip", "pip3"} & {Path(w).name for w in run}], runs


def test_the_image_s_install_script_makes_an_environment_that_runs(
    source: Path, tmp_path: Path
) -> None:
    call = dockerfile_install_call()
    venv = Venv(tmp_path / "image-venv")
    # The build stage's file system, mapped under tmp_path: what its COPY lines put there
    # (from the clean copy of the repository), nothing else.
    root = tmp_path / "image"

    def inside(path: str) -> Path:
        return root / path.lstrip("/")

    for sources, target in call.copies:
        for name in sources:
            origin, destination = source / name, inside(target)
            if origin.is_dir():
                shutil.copytree(origin, destination)
            else:
                into = len(sources) > 1 or target.endswith("/") or destination.is_dir()
                destination = destination / origin.name if into else destination
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, destination)
    workdir = inside(call.workdir)
    args = [
        str(venv.root) if arg == call.args[0] else arg.replace(call.workdir, str(workdir), 1)
        for arg in call.args
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # "python" in the image is its interpreter; here the one running the tests.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.update(call.env)
    done = subprocess.run(
        [str(workdir / INSTALL_SCRIPT), *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert venv.missing(DEV_ONLY, cwd=tmp_path) == list(DEV_ONLY)
    # The speed extra and the compiled gRPC contract are in; the tool that compiled it is not.
    assert (
        venv.missing(("uvloop", "cramjam", "nemesis.proto.nemesis.v1.handler_pb2"), tmp_path) == []
    )
    shown = venv.run("nemesis", "--help", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    checked = venv.run("nemesis", "validate", "integrations", "pipelines", cwd=source)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --- the pull-request check ---------------------------------------------------------

KNOWN_ACTIONS = ("actions/checkout@", "actions/setup-python@")
HASHFILES_IF = re.compile(r"hashFiles\('([^']+)'\) != ''")


def test_actionlint_accepts_the_pull_request_check() -> None:
    done = subprocess.run(
        [actionlint(), "-no-color", str(WORKFLOW)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_pull_request_check_installs_nemesis_from_its_repository_at_a_revision() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    spec = workflow["env"]["NEMESIS_PIP_SPEC"]
    assert re.fullmatch(r"nemesis @ git\+https://[^@\s]+@[\w.\-/]+", spec), spec
    runs = " ".join(step.get("run", "") for step in workflow["jobs"]["validate"]["steps"])
    assert '"$NEMESIS_PIP_SPEC"' in runs


def test_the_pull_request_check_runs_as_shipped(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Every ``run:`` step of the workflow, in order, with the spec at a local clone's HEAD."""

    clone = tmp_path_factory.mktemp("clone") / "nemesis.git"
    subprocess.run(
        ["git", "clone", "--quiet", "--bare", str(REPO), str(clone)], check=True, timeout=120
    )
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    workflow = yaml.safe_load(WORKFLOW.read_text())
    env_block = {k: str(v) for k, v in workflow["env"].items()}
    env_block["NEMESIS_PIP_SPEC"] = re.sub(
        r"git\+https://\S+", f"git+file://{clone}@{head}", env_block["NEMESIS_PIP_SPEC"]
    )

    repository = integrations_repository(tmp_path / "integrations-repo")

    # actions/setup-python: a fresh interpreter first on the PATH, with a current pip (as the
    # action's are; the pip bundled with older Pythons refuses git+file:// URLs).
    python = Venv(tmp_path / "runner-python")
    subprocess.run([sys.executable, "-m", "venv", str(python.root)], check=True, timeout=120)
    pip("install", "--upgrade", "pip", cwd=tmp_path, python=python.bin("python"))
    env = {**python.env(), **env_block, "RUNNER_TEMP": str(tmp_path / "runner-temp")}
    Path(env["RUNNER_TEMP"]).mkdir()

    [job] = workflow["jobs"].values()
    ran = []
    for step in job["steps"]:
        if "uses" in step:
            assert step["uses"].startswith(KNOWN_ACTIONS), step["uses"]
            continue
        condition = step.get("if")
        if condition is not None:
            matched = HASHFILES_IF.fullmatch(condition)
            assert matched, f"the test knows no such condition: {condition}"
            if not list(repository.glob(matched.group(1))):
                continue
        done = subprocess.run(
            ["bash", "-e", "-c", step["run"]],
            cwd=repository,
            env={**env, **{k: str(v) for k, v in step.get("env", {}).items()}},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, f"{step.get('name')}:\n{done.stdout}{done.stderr[-3000:]}"
        ran.append(step.get("name"))
    assert len(ran) == len([s for s in job["steps"] if "run" in s]), ran
    # And the check fails a broken file, with an annotation.
    broken = repository / "integrations" / "orders-to-loyalty.yaml"
    broken.write_text(broken.read_text().replace("workers: 32", "workers: 0"))
    refused = subprocess.run(
        ["nemesis", "validate", "--format", "github"],
        cwd=repository,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 1
    assert refused.stdout.startswith("::error file=integrations/orders-to-loyalty.yaml,")
