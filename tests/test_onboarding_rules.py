"""The pull-request check: ``nemesis validate`` with the cross-file rules, as CI runs it.

A repository of broken integration files goes through the real CLI with
``--format github``; every problem must come out as one ``::error``
annotation carrying the right file and line. The rules are also tested one
by one, and the inline-secret heuristics on their own.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemesis.config.loader import validate_paths
from nemesis.errors import ConfigProblem
from nemesis.onboarding import IntegrationRulesChecker
from nemesis.onboarding.inline_secrets import find_inline_secrets, is_secret_key
from nemesis.pipeline import PipelineChecker
from nemesis.transports import HTTP, TransportKind, Transports
from tests.conftest import REPO

ANNOTATION = re.compile(r"^::error file=(?P<file>[^,]+),line=(?P<line>\d+)::(?P<text>.*)$")


def integration(
    name: str,
    *,
    owners: str = "[team-x]",
    topic: str = "orders",
    consumer: str | None = None,
    url: str = "'http://x.svc/events'",
    headers: str = "",
    extra: str = "",
) -> str:
    return (
        f"name: {name}\n"
        f"owners: {owners}\n"
        "source:\n"
        f"  topic: {topic}\n"
        f"  consumer: {consumer or name}\n"
        "target:\n"
        f"  url: {url}\n" + (f"  headers:\n{headers}" if headers else "") + extra
    )


# file name -> (text, [(marker on the problem's line, field, part of the message)])
BROKEN: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "bad-owners.yaml": (
        integration("bad-owners", owners="\n  - Team Loyalty\n  - team-x\n  - team-x"),
        [
            ("  - Team Loyalty", "owners[0]", "is not a team"),
            ("  - team-x\n  - team-x", "owners[2]", "listed twice"),
        ],
    ),
    "bad-topic.yaml": (
        integration("bad-topic", topic="Orders.Created"),
        [("  topic:", "source.topic", "naming convention")],
    ),
    "internal-topic.yaml": (
        integration("internal-topic", topic="nemesis.retry.other.1"),
        [("  topic:", "source.topic", "belong to Nemesis")],
    ),
    "inline-token.yaml": (
        integration(
            "inline-token",
            headers="    authorization: Bearer 3f9a7c1d2e8b4a6f\n    x-trace: on\n",
        ),
        [
            ("    authorization:", "target.headers.authorization", "credential written inline"),
            # A file with other problems is still scanned for secrets.
            ("    x-trace:", "target.headers.x-trace", "expected a string, got a boolean"),
        ],
    ),
    "aws-key.yaml": (
        integration("aws-key", headers="    x-client: AKIAIOSFODNN7EXAMPLE\n"),
        [("    x-client:", "target.headers.x-client", "an AWS access key written inline")],
    ),
    "url-password.yaml": (
        integration("url-password", url="'https://svc:hunter2@x.svc/events'"),
        [("  url:", "target.url", "a password written inline in the URL")],
    ),
    "url-query-token.yaml": (
        integration("url-query-token", url="'https://x.svc/events?access_token=abc123'"),
        [("  url:", "target.url", "'access_token' parameter is a credential")],
    ),
    "grpc-path.yaml": (
        integration("grpc-path", url="'grpc://x.svc:50051/nemesis.v1.HandlerService'"),
        [("  url:", "target.url", "a gRPC target is grpc://host:port")],
    ),
    "grpc-header.yaml": (
        integration("grpc-header", url="'grpc://x.svc:50051'", headers="    grpc-timeout: 1S\n"),
        [("    grpc-timeout:", "target.headers.grpc-timeout", "set by gRPC itself")],
    ),
    "shares-a-consumer.yaml": (
        integration("shares-a-consumer", consumer="loyalty"),
        [],
    ),
    "shares-a-consumer-too.yaml": (
        integration("shares-a-consumer-too", consumer="loyalty"),
        [("  consumer:", "source.consumer", "already reads topic 'orders' as consumer")],
    ),
    "no-such-pipeline.yaml": (
        integration("no-such-pipeline", extra="pipeline: gone\n"),
        [("pipeline:", "pipeline", "no pipeline 'gone'")],
    ),
    "model-errors.yaml": (
        integration("model-errors", extra="delivery: {workers: 0}\nretry: {tiers: [5 minutes]}\n"),
        [
            ("delivery:", "delivery.workers", "greater than or equal to 1"),
            ("retry:", "retry.tiers[0]", "expected a duration"),
        ],
    ),
    "renamed.yaml": (
        integration("not-the-file-name"),
        [("name:", "name", "does not match the file name")],
    ),
    # Secrets done right: no problem.
    "secrets-from-env.yaml": (
        integration(
            "secrets-from-env",
            url="'https://${SVC_USER}:${SVC_PASSWORD}@x.svc/events?token=${SVC_TOKEN}'",
            headers="    authorization: Bearer ${LOYALTY_TOKEN}\n    x-api-key: ${API_KEY:-dev}\n",
        ),
        [],
    ),
}


def line_of(text: str, marker: str) -> int:
    return text[: text.index(marker)].count("\n") + 1 + marker.count("\n")


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """An integrations repository with every broken file and the shipped pipelines."""
    (tmp_path / "integrations").mkdir()
    for name, (text, _) in BROKEN.items():
        (tmp_path / "integrations" / name).write_text(text)
    shutil.copytree(REPO / "pipelines", tmp_path / "pipelines")
    return tmp_path


def expected_problems() -> set[tuple[str, int, str]]:
    expected = set()
    for name, (text, problems) in BROKEN.items():
        for marker, field, _ in problems:
            expected.add((f"integrations/{name}", line_of(text, marker), field))
    return expected


@pytest.mark.slow
def test_github_annotations_name_file_and_line_of_every_problem(repository: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nemesis", "validate", "--format", "github", "integrations"],
        cwd=repository,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    # Unset variables are warnings in a pull request's CI, apart from the problems.
    warnings = [line for line in result.stdout.splitlines() if line.startswith("::warning ")]
    assert all("is not set here" in line for line in warnings), warnings
    lines = [line for line in result.stdout.splitlines() if line not in warnings]
    matches = [ANNOTATION.match(line) for line in lines]
    assert all(matches), [line for line, m in zip(lines, matches, strict=True) if not m]
    found = [(m["file"], int(m["line"]), m["text"]) for m in matches if m]
    # One annotation per problem: nothing twice, nothing missing, nothing extra.
    assert len(found) == len(set(found))
    got = {(file, line, text.split(": ", 1)[0]) for file, line, text in found}
    assert got == expected_problems()
    for name, (_, problems) in BROKEN.items():
        for _, field, message in problems:
            texts = [t for f, _, t in found if f == f"integrations/{name}" and t.startswith(field)]
            assert any(message in t for t in texts), (name, field, texts)
    assert f"{len(found)} problem(s) found" in result.stderr
    # Secret values never reach the CI log.
    for secret in ("3f9a7c1d2e8b4a6f", "AKIAIOSFODNN7EXAMPLE", "hunter2", "abc123"):
        assert secret not in result.stdout + result.stderr


def test_the_repository_itself_passes(repository: Path) -> None:
    for name in BROKEN:
        (repository / "integrations" / name).unlink()
    shutil.copy(REPO / "integrations" / "orders-to-loyalty.yaml", repository / "integrations")
    problems = validate_paths(
        [repository / "integrations", repository / "pipelines"],
        checkers=[
            PipelineChecker(pipelines_dirs=[repository / "pipelines"]),
            IntegrationRulesChecker(),
        ],
    )
    assert problems == []


def check(tmp_path: Path, **files: str) -> list[ConfigProblem]:
    directory = tmp_path / "integrations"
    directory.mkdir(exist_ok=True)
    for name, text in files.items():
        (directory / f"{name}.yaml").write_text(text)
    return validate_paths([directory], checkers=[IntegrationRulesChecker()])


def test_rules_apply_to_process_configuration_secrets(tmp_path: Path) -> None:
    config = tmp_path / "nemesis.yaml"
    config.write_text(
        "data_dir: https://admin:s3cr3t@files.example.com/data\nintegrations_dir: integrations\n"
    )
    (tmp_path / "integrations").mkdir()
    problems = validate_paths(
        [config, tmp_path / "integrations"], checkers=[IntegrationRulesChecker()]
    )
    assert [(p.line, p.field) for p in problems] == [(1, "data_dir")]
    assert "s3cr3t" not in problems[0].message


def test_the_topic_convention_and_transports_can_be_configured(tmp_path: Path) -> None:
    (tmp_path / "integrations").mkdir()
    (tmp_path / "integrations" / "a.yaml").write_text(
        integration("a", topic="Orders", url="'grpc://x:1'")
    )
    only_http = Transports()
    only_http.register(TransportKind("http", "http", None, HTTP.open, check=HTTP.check))
    checker = IntegrationRulesChecker(topic_convention=r"^[A-Za-z]+$", transports=only_http)
    problems = validate_paths([tmp_path / "integrations"], checkers=[checker])
    assert [(p.field, p.message) for p in problems] == [
        ("target.url", "no transport for grpc:// targets (this Nemesis has http://)")
    ]


def test_unset_variables_in_targets_are_not_checked_as_values(tmp_path: Path) -> None:
    problems = check(tmp_path, a=integration("a", url="'grpc://${HANDLER_HOST}'"))
    assert problems == []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("authorization", "Bearer abcdef012345"),
        ("Authorization", "Basic dXNlcjpwYXNz"),
        ("x-api-key", "k-123"),
        ("apiKey", "k-123"),
        ("client_secret", "s3cr3t-v4lue"),
        ("password", "hunter2"),
        ("x-auth-token", "t0k3n-v4lue"),
        ("cookie", "session=abc"),
        ("x-anything", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.sig"),
        ("x-anything", "ghp_" + "a" * 36),
        ("x-anything", "xoxb-1234567890-abcdef"),
        ("x-anything", "AIza" + "b" * 35),
        ("x-anything", "sk_live_" + "c" * 24),
        ("x-anything", "-----BEGIN RSA PRIVATE KEY-----"),
        ("x-anything", "bearer abcdefgh12345678"),
        ("url", "https://u:p@h/x"),
        ("url", "https://h/x?api_key=k1&b=2"),
        ("url", "https://h/x?sig=abc"),
    ],
)
def test_inline_secrets_are_found(key: str, value: str) -> None:
    found = list(find_inline_secrets({"target": {key: value}}))
    assert len(found) == 1
    assert found[0].path == ("target", key)
    assert value not in found[0].why


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("authorization", "Bearer ${TOKEN}"),
        ("authorization", "${AUTH_HEADER}"),
        ("x-api-key", "${API_KEY:-dev}"),
        ("password", ""),
        ("type_key", "type"),
        ("partition_key", "customer"),
        ("author", "Jane"),
        ("x-request-source", "nemesis"),
        ("url", "https://${USER}:${PASSWORD}@h/x"),
        ("url", "https://user@h/x"),
        ("url", "https://h/x?token=${TOKEN}&page=2"),
        ("url", "grpc://h:50051"),
        ("description", "a token bucket limits the rate"),
    ],
)
def test_harmless_values_are_left_alone(key: str, value: str) -> None:
    assert list(find_inline_secrets({"target": {key: value}})) == []


def test_secret_key_names() -> None:
    assert is_secret_key("X-Api-Key")
    assert is_secret_key("privateKey")
    assert is_secret_key("AUTHORIZATION")
    assert not is_secret_key("type_key")
    assert not is_secret_key("keyring")
    assert not is_secret_key(3)


def test_tls_files_are_named_in_a_pull_request_and_read_where_nemesis_runs(tmp_path: Path) -> None:
    # The certificates are mounted on the hosts that run Nemesis, not where CI validates.
    tls = (
        "  tls:\n"
        "    ca_file: /etc/nemesis/company-ca.pem\n"
        "    cert_file: /etc/nemesis/client.pem\n"
        "    key_file: /etc/nemesis/client.key\n"
        "    server_name: loyalty.internal\n"
    )
    for url in ("'https://10.0.0.7/events'", "'grpcs://10.0.0.7:443'"):
        assert check(tmp_path, a=integration("a", url=url, extra=tls)) == []
