"""The configuration loader: every problem names the right file, line and field."""

from __future__ import annotations

import re
import sys
import textwrap
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from nemesis.backends.ydb import YdbStateConfig
from nemesis.config import (
    IntegrationConfig,
    NemesisConfig,
    ValidationContext,
    format_problems,
    load_integration_file,
    load_integrations,
    load_process_config,
    validate_paths,
)
from nemesis.config.document import MAX_VALUES
from nemesis.config.interpolation import expand
from nemesis.config.models import YdbBackendConfig, YdbDlqConfig
from nemesis.errors import ConfigError, ConfigProblem

ROOT = Path(__file__).resolve().parent.parent

VALID = """
name: orders
owners: [team-orders]
source: {topic: orders, consumer: loyalty}
target:
  url: http://127.0.0.1:9001/events/order
"""
KNOWN_FIELDS = (
    "name, owners, source, pipeline, target, delivery, retry, breaker, rate_limits, flags, paused,"
    " replicas"
)


def write(directory: Path, name: str, text: str) -> Path:
    """Write ``text`` dedented, its first line being line 1."""
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def problems_of(path: Path, env: Mapping[str, str] | None = None) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as info:
        load_integration_file(path, env={} if env is None else env)
    return info.value.problems


def one_problem(path: Path, env: Mapping[str, str] | None = None) -> ConfigProblem:
    problems = problems_of(path, env)
    assert len(problems) == 1, problems
    return problems[0]


# --- fields -------------------------------------------------------------------------


def test_a_valid_file_loads(tmp_path: Path) -> None:
    config = load_integration_file(write(tmp_path, "orders.yaml", VALID), env={})
    assert config.name == "orders"
    assert config.source.consumer == "loyalty"
    assert config.delivery.workers == 32


def test_unknown_key_suggests_the_closest_field(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "  timout_s: 3\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 6, "target.timout_s", "unknown field (did you mean timeout_s?)"
    )


def test_unknown_key_at_the_wrong_level_names_where_it_belongs(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "workers: 4\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 6, "workers", "unknown field (workers belongs under delivery)"
    )


def test_unknown_key_without_a_close_match_lists_the_fields(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "colour: blue\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 6, "colour", f"unknown field (expected one of: {KNOWN_FIELDS})"
    )


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ("paused: maybe", "paused", "expected true or false, got a string"),
        ("breaker: [1]", "breaker", "expected a mapping, got a list"),
        ("flags: {disabled_types: no}", "flags.disabled_types", "expected a list, got a boolean"),
        ("delivery: {workers: [4]}", "delivery.workers", "expected an integer, got a list"),
        ("delivery: {workers: many}", "delivery.workers", "expected an integer, got a string"),
        ("delivery: {workers: 2.5}", "delivery.workers", "expected a whole number, got a number"),
        ("breaker: {cooldown_s: .inf}", "breaker.cooldown_s", "expected a finite number, got .inf"),
        ("breaker: {window_s: .nan}", "breaker.window_s", "expected a finite number, got .nan"),
        ("rate_limits: {main: .inf}", "rate_limits.main", "expected a finite number, got .inf"),
        ("retry: {tiers: [1m, .inf]}", "retry.tiers[1]", "expected a finite number, got .inf"),
        ("rate_limits: {retry: -.inf}", "rate_limits.retry", "expected a finite number, got -.inf"),
        # A union (name or inline stages) fails once, not once per member.
        ("pipeline: 5", "pipeline", "expected a string or a list, got a number"),
    ],
)
def test_wrong_type_names_the_expected_type(
    tmp_path: Path, extra: str, field: str, message: str
) -> None:
    path = write(tmp_path, "orders.yaml", VALID + extra + "\n")
    assert one_problem(path) == ConfigProblem(str(path), 6, field, message)


def test_constraint_violation_uses_the_field_line(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "delivery:\n  buffer: 10\n  workers: 0\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 8, "delivery.workers", "Input should be greater than or equal to 1"
    )


def test_rule_across_fields_points_at_their_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "delivery:\n  buffer: 10\n  batch: {size: 50}\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 6, "delivery", "buffer (10) must hold at least one batch (50)"
    )


def test_name_pattern_is_explained(tmp_path: Path) -> None:
    path = write(tmp_path, "Orders_1.yaml", VALID.replace("name: orders", "name: Orders_1"))
    assert one_problem(path) == ConfigProblem(
        str(path),
        1,
        "name",
        "must be lowercase letters, digits and dashes (at most 63),"
        " starting and ending with a letter or a digit",
    )


def test_missing_field_points_at_the_parent_mapping(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "orders.yaml",
        """
        # Leading comments: a missing top-level field points at the first key.

        name: orders
        owners: [team-orders]
        source:
          topic: orders
        """,
    )
    assert problems_of(path) == [
        ConfigProblem(str(path), 3, "target", "required field is missing"),
        ConfigProblem(str(path), 5, "source.consumer", "required field is missing"),
    ]


def test_an_empty_section_is_a_clear_error(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "delivery:\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 6, "delivery", "expected a mapping, got an empty value"
    )


def test_several_errors_in_one_file_are_all_reported_in_line_order(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "orders.yaml",
        """
        name: orders
        owners: team-orders
        source: {topic: orders, consumer: loyalty}
        target:
          url: ftp://loyalty.svc
          timout_s: 5
        delivery:
          workers: 0
          ordering: random
        retry:
          tiers: [1m, soon]
        """,
    )
    assert problems_of(path) == [
        ConfigProblem(str(path), 2, "owners", "expected a list, got a string"),
        ConfigProblem(
            str(path),
            5,
            "target.url",
            "must start with http://, https://, grpc:// or grpcs:// and name a host",
        ),
        ConfigProblem(str(path), 6, "target.timout_s", "unknown field (did you mean timeout_s?)"),
        ConfigProblem(
            str(path), 8, "delivery.workers", "Input should be greater than or equal to 1"
        ),
        ConfigProblem(
            str(path), 9, "delivery.ordering", "Input should be 'none', 'key' or 'partition'"
        ),
        ConfigProblem(
            str(path),
            11,
            "retry.tiers[1]",
            "expected a duration such as 30s, 5m or 1h, got 'soon'",
        ),
    ]


# --- target.tls ---------------------------------------------------------------------

TLS_TARGET = """
name: orders
owners: [team-orders]
source: {topic: orders, consumer: loyalty}
target:
  url: https://10.0.0.7/events/order
  tls:
"""


def test_target_tls_loads_with_variables_expanded(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "orders.yaml",
        TLS_TARGET + "    ca_file: ${CERTS}/company-ca.pem\n"
        "    cert_file: ${CERTS}/client.pem\n"
        "    key_file: ${CERTS}/client.key\n"
        "    server_name: loyalty.internal\n",
    )

    tls = load_integration_file(path, env={"CERTS": "/etc/nemesis"}).target.tls

    assert tls is not None
    assert (tls.ca_file, tls.cert_file, tls.key_file, tls.server_name) == (
        "/etc/nemesis/company-ca.pem",
        "/etc/nemesis/client.pem",
        "/etc/nemesis/client.key",
        "loyalty.internal",
    )


@pytest.mark.parametrize(
    ("url", "scheme"), [("http://loyalty.svc/events", "http"), ("grpc://loyalty.svc:50051", "grpc")]
)
def test_target_tls_on_a_plain_url_is_refused(tmp_path: Path, url: str, scheme: str) -> None:
    text = TLS_TARGET.replace("https://10.0.0.7/events/order", url) + "    ca_file: /ca.pem\n"
    path = write(tmp_path, "orders.yaml", text)

    assert one_problem(path) == ConfigProblem(
        str(path),
        6,
        "target.tls",
        f"{scheme}:// is plain text: TLS settings apply to https:// and grpcs:// targets"
        f" (use {scheme}s://, or remove tls)",
    )


@pytest.mark.parametrize(
    ("settings", "field", "message"),
    [
        (
            "cert_file: /client.pem",
            "target.tls.cert_file",
            "a client certificate needs its private key: set key_file too",
        ),
        (
            "key_file: /client.key",
            "target.tls.key_file",
            "a private key needs its client certificate: set cert_file too",
        ),
        (
            "server_name: 'loyalty internal'",
            "target.tls.server_name",
            "must be a DNS name, such as loyalty.internal: the one the certificate holds",
        ),
        ("ca_file: ''", "target.tls.ca_file", "String should have at least 1 character"),
        # Deliberately no way to turn verification off.
        ("verify: false", "target.tls.verify", "unknown field (expected one of: ca_file,"),
        ("insecure_skip_verify: true", "target.tls.insecure_skip_verify", "unknown field"),
    ],
)
def test_target_tls_settings_are_checked(
    tmp_path: Path, settings: str, field: str, message: str
) -> None:
    path = write(tmp_path, "orders.yaml", TLS_TARGET + f"    {settings}\n")

    problem = one_problem(path)

    assert (problem.line, problem.field) == (7, field)
    assert problem.message.startswith(message), problem.message


# --- durations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "seconds"),
    [("1m", 60.0), ("250ms", 0.25), ("1.5s", 1.5), ("2h", 7200.0), ("7d", 604800.0), ("90", 90.0)],
)
def test_durations_are_read_in_seconds(tmp_path: Path, written: str, seconds: float) -> None:
    path = write(tmp_path, "orders.yaml", VALID + f"retry: {{tiers: [{written}]}}\n")
    assert load_integration_file(path, env={}).retry.tiers == [seconds]


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("5 minutes", "expected a duration such as 30s, 5m or 1h, got '5 minutes'"),
        ("1w", "expected a duration such as 30s, 5m or 1h, got '1w'"),
        ("-1s", "expected a duration such as 30s, 5m or 1h, got '-1s'"),
        ("true", "expected a duration such as 30s, 5m or 1h"),
    ],
)
def test_bad_durations_name_the_item(tmp_path: Path, written: str, message: str) -> None:
    path = write(tmp_path, "orders.yaml", VALID + f"retry:\n  tiers:\n    - 1m\n    - {written}\n")
    assert one_problem(path) == ConfigProblem(str(path), 9, "retry.tiers[1]", message)


def test_a_zero_retry_tier_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "retry: {tiers: [0s]}\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 6, "retry.tiers", "every retry tier needs a delay above zero"
    )


# --- YAML itself ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (
            "name: orders\nowners: [a\nsource: {}\n",
            3,
            "invalid YAML: while parsing a flow sequence (line 2), expected ',' or ']',"
            " but got ':' (column 7)",
        ),
        ("name: orders: x\n", 1, "invalid YAML: mapping values are not allowed here (column 13)"),
        (
            "name: orders\n\towners: []\n",
            2,
            "invalid YAML: while scanning for the next token,"
            " found character '\\t' that cannot start any token (column 1)",
        ),
        (
            "name: orders\n---\nname: other\n",
            2,
            "invalid YAML: expected a single document in the stream (line 1),"
            " but found another document (column 1)",
        ),
    ],
)
def test_broken_syntax_reports_line_and_column(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    path = write(tmp_path, "orders.yaml", text)
    assert one_problem(path) == ConfigProblem(str(path), line, None, message)


@pytest.mark.parametrize("text", ["", "# nothing yet\n", "---\n"])
def test_an_empty_file_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, "orders.yaml", text)
    assert one_problem(path) == ConfigProblem(
        str(path), None, None, "the file is empty: expected a mapping such as `name: ...`"
    )


def test_the_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", "- name: orders\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 1, None, "the top level must be a mapping of field names to values, not a list"
    )


def test_duplicate_key_names_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "delivery:\n  workers: 4\n  workers: 8\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 8, "delivery.workers", "duplicate key (first defined at line 7)"
    )


def test_anchors_and_merge_keys_work_and_keep_their_lines(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "orders.yaml",
        VALID
        + """
        defaults: &fast {workers: 0, buffer: 64}
        """.strip()
        + "\ndelivery:\n  <<: *fast\n  buffer: 128\n",
    )
    problems = problems_of(path)
    # The merged value is reported where it is written: in the anchor.
    assert (
        ConfigProblem(
            str(path), 6, "delivery.workers", "Input should be greater than or equal to 1"
        )
        in problems
    )
    assert (
        ConfigProblem(str(path), 6, "defaults", f"unknown field (expected one of: {KNOWN_FIELDS})")
        in problems
    )
    assert len(problems) == 2


def test_a_recursive_alias_is_rejected_without_recursing(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "flags: {disabled_types: &loop [*loop]}\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 6, "flags.disabled_types[0]", "an alias refers to a value that contains it"
    )


def test_alias_expansion_is_bounded(tmp_path: Path) -> None:
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    path = write(tmp_path, "orders.yaml", "\n".join(levels) + "\n")
    assert ConfigProblem(
        str(path), 1, None, f"aliases expand to more than {MAX_VALUES} values"
    ) in problems_of(path)


def test_explicit_tags_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "delivery: {workers: !!int many}\n")
    assert one_problem(path) == ConfigProblem(
        str(path), 6, "delivery.workers", "unsupported YAML tag !!int: write plain values"
    )


def test_control_characters_and_deep_nesting_are_reported_not_raised(tmp_path: Path) -> None:
    control = write(tmp_path, "orders.yaml", "name: orders\nowners: [\x07]\n")
    assert one_problem(control) == ConfigProblem(
        str(control), 2, None, "invalid YAML: special characters are not allowed (character #x0007)"
    )
    # PyYAML composes recursively, two frames a level; its scanner is quadratic in depth.
    depth = sys.getrecursionlimit() // 2 + 100
    deep = write(tmp_path, "orders.yaml", "name: " + "[" * depth + "]" * depth + "\n")
    assert one_problem(deep) == ConfigProblem(
        str(deep), None, None, "invalid YAML: values are nested too deeply"
    )


def test_a_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "orders.yaml"
    path.write_bytes(b"name: orders\nowners: [\xff]\n")
    assert one_problem(path) == ConfigProblem(str(path), 2, None, "the file is not valid UTF-8")


# --- environment variables ------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "env", "value"),
    [
        ("Bearer ${TOKEN}", {"TOKEN": "s3cret"}, "Bearer s3cret"),
        ("${TOKEN:-dev}", {}, "dev"),
        ("${TOKEN:-dev}", {"TOKEN": ""}, "dev"),
        ("${TOKEN:-dev}", {"TOKEN": "prod"}, "prod"),
        ("${TOKEN}", {"TOKEN": ""}, ""),
        ("$${TOKEN} costs $5", {}, "${TOKEN} costs $5"),
    ],
)
def test_environment_variables_are_interpolated(
    tmp_path: Path, written: str, env: dict[str, str], value: str
) -> None:
    path = write(tmp_path, "orders.yaml", VALID + f"  headers: {{authorization: '{written}'}}\n")
    assert load_integration_file(path, env=env).target.headers == {"authorization": value}


def test_an_unset_variable_names_file_line_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "  headers:\n    authorization: ${TOKEN}\n")
    assert one_problem(path) == ConfigProblem(
        str(path),
        7,
        "target.headers.authorization",
        "environment variable TOKEN is not set (set it, or write ${TOKEN:-default} to give a"
        " default)",
    )


def test_a_malformed_reference_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "  headers: {authorization: '${MY TOKEN}'}\n")
    assert one_problem(path) == ConfigProblem(
        str(path),
        6,
        "target.headers.authorization",
        "invalid variable reference '${MY TOKEN}': write ${NAME} or ${NAME:-default}"
        " ($${ for a literal ${)",
    )


def test_interpolated_numbers_are_validated_without_echoing_the_value(tmp_path: Path) -> None:
    path = write(tmp_path, "nemesis.yaml", "admin: {port: '${ADMIN_PORT}'}\n")
    assert load_process_config(path, env={"ADMIN_PORT": "9000"}).admin.port == 9000
    with pytest.raises(ConfigError) as info:
        load_process_config(path, env={"ADMIN_PORT": "hunter2"})
    assert info.value.problems == [
        ConfigProblem(
            str(path),
            1,
            "admin.port",
            "expected an integer, got a string",
        )
    ]
    assert "hunter2" not in str(info.value)


def test_expand_reports_every_unset_variable() -> None:
    expansion = expand("${A}-${B:-b}-${C}", {"B": ""})
    assert expansion.unset == ("A", "C")
    assert expansion.text == "${A}-b-${C}"


# --- files and directories ------------------------------------------------------------


def test_the_file_name_must_match_the_name(tmp_path: Path) -> None:
    path = write(tmp_path, "loyalty.yaml", VALID)
    assert one_problem(path) == ConfigProblem(
        str(path),
        1,
        "name",
        "'orders' does not match the file name 'loyalty.yaml': an integration lives in"
        " <name>.yaml (rename the file to orders.yaml or change the name)",
    )


def test_a_directory_yields_the_good_configs_and_the_problems_of_the_bad(
    tmp_path: Path,
) -> None:
    good = write(tmp_path, "orders.yaml", VALID)
    bad = write(tmp_path, "payments.yml", VALID.replace("orders", "payments") + "paused: 3\n")
    write(tmp_path, "README.md", "not YAML: ignored")
    write(tmp_path, ".#orders.yaml", "editor lock file: ignored")
    integrations, problems = load_integrations(tmp_path, env={})
    assert integrations == {"orders": load_integration_file(good, env={})}
    assert problems == [
        ConfigProblem(str(bad), 6, "paused", "expected true or false, got a number")
    ]


def test_a_duplicate_name_names_both_files(tmp_path: Path) -> None:
    first = write(tmp_path, "orders.yaml", VALID + "delivery: {workers: 1}\n")
    second = write(tmp_path, "orders.yml", "# the same integration again\n" + VALID.lstrip())
    loaded = load_integrations(tmp_path, env={})
    # Both are valid: the first in file order keeps the name.
    assert loaded.integrations["orders"].delivery.workers == 1
    assert loaded.problems == [
        ConfigProblem(
            str(second), 2, "name", f"integration name 'orders' is already used by {first}:1"
        )
    ]


def test_a_broken_duplicate_cannot_take_the_name_from_a_valid_file(tmp_path: Path) -> None:
    broken = write(tmp_path, "orders.yaml", VALID + "paused: 3\n")
    write(tmp_path, "orders.yml", VALID + "delivery: {workers: 2}\n")
    loaded = load_integrations(tmp_path, env={})
    assert loaded.integrations["orders"].delivery.workers == 2
    assert [(p.file, p.line, p.field) for p in loaded.problems] == [
        (str(broken), 1, "name"),
        (str(broken), 6, "paused"),
    ]


def test_a_missing_integrations_directory_is_a_problem(tmp_path: Path) -> None:
    loaded = load_integrations(tmp_path / "nope", env={})
    assert loaded.integrations == {}
    assert loaded.problems == [
        ConfigProblem(str(tmp_path / "nope"), None, None, "no such directory")
    ]


# --- process configuration ------------------------------------------------------------


def test_no_process_config_file_means_defaults() -> None:
    assert load_process_config(None) == NemesisConfig()


def test_process_directories_are_resolved_against_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "nemesis.yaml", f"data_dir: var\npipelines_dir: {tmp_path / 'p'}\n")
    config = load_process_config(path, env={})
    assert config.data_dir == str(tmp_path / "var")
    assert config.integrations_dir == str(tmp_path / "integrations")
    assert config.pipelines_dir == str(tmp_path / "p")


def test_process_config_reports_every_problem(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "nemesis.yaml",
        """
        backend:
          kind: pulsar
          retention: forever
        admin: {port: 70000}
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_process_config(path, env={})
    assert [(p.line, p.field) for p in info.value.problems] == [
        (2, "backend.kind"),
        (3, "backend.retention"),
        (4, "admin.port"),
    ]


def test_a_missing_process_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_process_config(tmp_path / "nemesis.yaml", env={})
    assert info.value.problems == [
        ConfigProblem(
            str(tmp_path / "nemesis.yaml"),
            None,
            None,
            "cannot read the file: No such file or directory",
        )
    ]


# --- validate -------------------------------------------------------------------------


def test_validate_takes_files_and_directories_and_reports_everything(tmp_path: Path) -> None:
    integrations = tmp_path / "integrations"
    integrations.mkdir()
    write(integrations, "orders.yaml", VALID)
    bad = write(integrations, "payments.yaml", "name: payments\n")
    process = write(tmp_path, "nemesis.prod.yaml", "log_format: xml\n")
    lone = write(tmp_path, "lone.yaml", VALID.replace("orders", "lone") + "  timeout_s: 0\n")
    problems = validate_paths(
        # The same file twice (directly and through its directory) is not a duplicate.
        [process, integrations, integrations / "orders.yaml", lone, tmp_path / "missing"],
        env={},
    )
    assert [(Path(p.file).name, p.line, p.field) for p in problems] == [
        ("payments.yaml", 1, "owners"),
        ("payments.yaml", 1, "source"),
        ("payments.yaml", 1, "target"),
        ("lone.yaml", 6, "target.timeout_s"),
        ("missing", None, None),
        ("nemesis.prod.yaml", 1, "log_format"),
    ]
    assert problems[0].file == str(bad)


def test_validate_does_not_need_secrets_unless_asked(tmp_path: Path) -> None:
    path = write(tmp_path, "orders.yaml", VALID + "  headers: {authorization: '${TOKEN}'}\n")
    assert validate_paths([path], env={}) == []
    assert [p.field for p in validate_paths([path], env={}, require_env=True)] == [
        "target.headers.authorization"
    ]


def test_validate_without_paths_uses_the_configured_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "teams").mkdir()
    write(tmp_path, "nemesis.yaml", "integrations_dir: teams\n")
    write(tmp_path / "teams", "orders.yaml", VALID + "paused: 3\n")
    monkeypatch.chdir(tmp_path)
    assert [(p.file, p.line, p.field) for p in validate_paths([], env={})] == [
        (str(Path("teams/orders.yaml")), 6, "paused")
    ]


@dataclass
class PipelineChecker:
    """A stand-in for the pipeline validation that plugs into validate_paths."""

    calls: list[tuple[list[Path], ValidationContext]] = field(default_factory=list)

    def claims(self, path: Path) -> bool:
        return path.name == "pipelines"

    def check(self, paths: Sequence[Path], context: ValidationContext) -> list[ConfigProblem]:
        self.calls.append((list(paths), context))
        return [ConfigProblem(str(p / "city.yaml"), 3, "stages", "unknown stage") for p in paths]


def test_checkers_claim_their_paths_and_see_what_was_loaded(tmp_path: Path) -> None:
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    write(pipelines, "city.yaml", "stages: [{frobnicate: {}}]\n")  # not an integration
    orders = write(tmp_path, "orders.yaml", VALID)
    checker = PipelineChecker()
    problems = validate_paths([pipelines, orders], env={}, checkers=[checker])
    assert problems == [ConfigProblem(str(pipelines / "city.yaml"), 3, "stages", "unknown stage")]
    [(paths, context)] = checker.calls
    assert paths == [pipelines]
    assert list(context.integrations.integrations) == ["orders"]


# --- output ---------------------------------------------------------------------------


def test_problems_format_as_sorted_lines_or_github_annotations() -> None:
    problems = [
        ConfigProblem("integrations/b.yaml", 3, "target.url", "bad"),
        ConfigProblem("integrations/a.yaml", 12, "delivery.workers", "too low, really: 0%"),
        ConfigProblem("integrations/a.yaml", 7, None, "invalid YAML"),
        ConfigProblem("integrations/a.yaml", None, None, "the file is empty"),
    ]
    assert format_problems(problems) == "\n".join(
        [
            "integrations/a.yaml: the file is empty",
            "integrations/a.yaml:7: invalid YAML",
            "integrations/a.yaml:12: delivery.workers: too low, really: 0%",
            "integrations/b.yaml:3: target.url: bad",
        ]
    )
    assert format_problems(problems, "github").splitlines() == [
        "::error file=integrations/a.yaml::the file is empty",
        "::error file=integrations/a.yaml,line=7::invalid YAML",
        "::error file=integrations/a.yaml,line=12::delivery.workers: too low, really: 0%25",
        "::error file=integrations/b.yaml,line=3::target.url: bad",
    ]


# --- shipped examples -----------------------------------------------------------------


def test_the_shipped_examples_validate() -> None:
    paths = [ROOT / "nemesis.example.yaml", ROOT / "integrations"]
    assert validate_paths(paths, env={}, require_env=True) == []


def test_the_example_integration_reads_as_documented() -> None:
    config = load_integration_file(ROOT / "integrations" / "orders-to-loyalty.yaml", env={})
    assert config == IntegrationConfig.model_validate(
        {
            "name": "orders-to-loyalty",
            "owners": ["team-loyalty"],
            "source": {"topic": "orders", "consumer": "loyalty"},
            "target": {"url": "http://127.0.0.1:9001/events/order", "timeout_s": 5},
            "retry": {"tiers": ["1m", "5m", "15m"]},
            "rate_limits": {"main": 500, "retry": 50, "replay": 20},
        }
    )


def test_the_example_process_config_holds_the_defaults() -> None:
    config = load_process_config(ROOT / "nemesis.example.yaml", env={})
    assert config == load_process_config(None).model_copy(
        update={
            name: str(ROOT / value)
            for name, value in [
                ("data_dir", "data"),
                ("integrations_dir", "integrations"),
                ("pipelines_dir", "pipelines"),
            ]
        }
    )


def _model_keys(
    model: type[BaseModel], prefix: str = "", seen: set[type] | None = None
) -> Iterator[str]:
    """Dotted paths of a model's keys, through nested models, lists and unions.

    With ``seen``, a model met a second time (the YDB credentials of the
    backend and of the DLQ's connection) is not expanded again: the example
    describes it once. Without, every path is expanded.
    """
    if seen is not None:
        seen.add(model)
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        yield path
        pending: list[Any] = [info.annotation]
        while pending:
            kind = pending.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                if seen is None or kind not in seen:
                    yield from _model_keys(kind, f"{path}.", seen)
            else:
                pending.extend(typing.get_args(kind))


def _example_keys(text: str) -> set[str]:
    """Dotted paths of the keys a YAML file names, set or commented out.

    Nesting comes from indentation (a commented-out key's indentation is
    what follows its ``#``). The names that open each item in braces after a
    key, as in ``{a: 1, b: 2}`` or ``# [{name, teams}]``, are its children;
    other comment text is not read.
    """
    paths: set[str] = set()
    stack: list[tuple[int, str]] = []
    for raw in text.splitlines():
        uncommented = re.match(r"( *)# ?(.*)", raw)
        line = uncommented[1] + uncommented[2] if uncommented else raw
        found = re.match(r"( *)([a-z_]+):(.*)", line)
        if found is None:
            continue
        indent, key, rest = len(found[1]), found[2], found[3]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(k for _, k in stack), key])
        paths.add(path)
        for braced in re.findall(r"\{([^{}]*)(?:\}|$)", rest):
            for item in re.sub(r"\([^)]*\)", "", braced).split(","):  # notes in parentheses
                if child := re.match(r"\s*([a-z_]+)\b", item):
                    paths.add(f"{path}.{child[1]}")
        stack.append((indent, key))
    return paths


EXAMPLE = ROOT / "nemesis.example.yaml"


def test_the_example_process_config_names_every_key() -> None:
    """The README says nemesis.example.yaml comments every key: each key of the
    process configuration appears in it, under its parent, set or commented out,
    and it names no key the configuration does not have."""
    named = _example_keys(EXAMPLE.read_text())
    assert sorted(set(_model_keys(NemesisConfig, seen=set())) - named) == []
    assert sorted(named - set(_model_keys(NemesisConfig))) == []


def _commented_block(text: str, key: str) -> dict[str, Any]:
    """The commented-out ``# key:`` block of a YAML file, uncommented and parsed."""
    lines = text.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith(f"# {key}:"))
    block = [f"{key}:"]
    for line in lines[start + 1 :]:
        if not line.startswith("#  "):
            break
        block.append(line[2:])
    expanded = expand("\n".join(block), env={})
    assert (expanded.unset, expanded.malformed) == ((), ()), f"# {key}: as nemesis run reads it"
    parsed: dict[str, Any] = yaml.safe_load(expanded.text)
    return parsed


def test_the_example_alternatives_validate_when_uncommented() -> None:
    text = EXAMPLE.read_text()
    backend, dlq = _commented_block(text, "backend"), _commented_block(text, "dlq")
    state = _commented_block(text, "state")
    config = NemesisConfig.model_validate({**backend, **dlq, **state})
    assert isinstance(config.backend, YdbBackendConfig)
    assert isinstance(config.dlq, YdbDlqConfig)
    assert config.dlq.connection is not None
    assert isinstance(config.state, YdbStateConfig)
    assert config.state.connection is not None


def test_the_example_key_check_sees_nesting_and_comments() -> None:
    text = textwrap.dedent(
        """\
        admin:        # health, readiness: not keys
          port: 8081
        # backend:
        #   kind: ydb
        #   credentials:
        #     mode: token
        auth:
          users: []   # [{name, password_hash (a note, with commas), teams}]
          # trusted_header: {user_header: X,
          #                  trusted_proxies: []}
        """
    )
    assert _example_keys(text) == {
        "admin", "admin.port", "backend", "backend.kind", "backend.credentials",
        "backend.credentials.mode", "auth", "auth.users", "auth.users.name",
        "auth.users.password_hash", "auth.users.teams", "auth.trusted_header",
        "auth.trusted_header.user_header", "auth.trusted_header.trusted_proxies",
    }  # fmt: skip


def test_the_readme_integration_outline_names_every_key_and_validates() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("`integrations/<name>.yaml` describes one integration", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert sorted(set(_model_keys(IntegrationConfig, seen=set())) - _example_keys(block)) == []
    expanded = expand(block, env={"LOYALTY_TOKEN": "t"})
    config = IntegrationConfig.model_validate(yaml.safe_load(expanded.text))
    assert config.retry.on_exhausted == "dead_letter"


def test_rules_across_fields_hold_for_models_built_in_code() -> None:
    from pydantic import ValidationError

    from nemesis.config.models import DeliveryConfig, IntegrationConfig, RetryConfig

    base: dict[str, Any] = {
        "name": "orders",
        "owners": ["team"],
        "source": {"topic": "orders", "consumer": "orders"},
        "target": {"url": "http://127.0.0.1:8000/"},
    }
    with pytest.raises(
        ValidationError, match=re.escape("halt needs delivery.ordering key or partition")
    ):
        IntegrationConfig(**base, retry=RetryConfig(on_exhausted="halt"))
    ordered = IntegrationConfig(
        **base, retry=RetryConfig(on_exhausted="halt"), delivery=DeliveryConfig(ordering="key")
    )
    assert ordered.retry.on_exhausted == "halt"
    with pytest.raises(ValidationError, match="must hold at least one batch"):
        DeliveryConfig(buffer=1, batch={"size": 2})


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ("[5m, 1m]", "tier 2 (60s) is shorter than tier 1 (300s)"),
        ("[1s, 2s, 2s, 1500ms]", "tier 4 (1.5s) is shorter than tier 3 (2s)"),
    ],
)
def test_retry_tiers_must_not_shrink(tmp_path: Path, tiers: str, message: str) -> None:
    path = write(tmp_path, "orders.yaml", VALID + f"retry: {{tiers: {tiers}}}\n")
    problem = one_problem(path)
    assert (problem.line, problem.field) == (6, "retry.tiers")
    assert problem.message.startswith(message)


@pytest.mark.parametrize("url", ["http://h:0/", "http://h:65536/", "grpc://h:99999", "http://h:x/"])
def test_a_target_port_out_of_range_is_refused(tmp_path: Path, url: str) -> None:
    path = write(tmp_path, "orders.yaml", VALID.replace("http://127.0.0.1:9001/events/order", url))
    problem = one_problem(path)
    assert problem.field == "target.url"
    assert problem.message == "the port must be a number from 1 to 65535"


def test_a_disabled_viewer_needs_no_port(tmp_path: Path) -> None:
    path = write(tmp_path, "nemesis.yaml", "viewer: {enabled: false}\n")
    assert load_process_config(path).viewer.enabled is False


def test_a_ydb_state_store_without_a_connection_needs_the_ydb_backend() -> None:
    with pytest.raises(ValidationError, match=r"state\.kind ydb needs state\.connection"):
        NemesisConfig.model_validate({"state": {"kind": "ydb"}})
    backend = {"kind": "ydb", "endpoint": "grpc://localhost:2136", "database": "/local"}
    config = NemesisConfig.model_validate(
        {"backend": backend, "state": {"kind": "ydb"}, "dlq": {"kind": "ydb"}}
    )
    assert isinstance(config.state, YdbStateConfig)
    assert config.state.location("data") == "ydb:nemesis/fleet"
