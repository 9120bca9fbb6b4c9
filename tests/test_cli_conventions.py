"""The command line follows the usual conventions: --version, options anywhere, help on each."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from nemesis import __version__
from nemesis.cli import build_parser


def nemesis(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nemesis", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_version(tmp_path: Path) -> None:
    result = nemesis("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"nemesis {__version__}"


def test_log_level_works_before_and_after_the_command(tmp_path: Path) -> None:
    (tmp_path / "nemesis.yaml").write_text("backend: {kind: embedded, path: n.db}\ndata_dir: .\n")
    for args in (
        ("--log-level", "error", "topics", "list"),
        ("topics", "list", "--log-level", "error"),
        ("dlq", "list", "--log-level", "error"),
        ("validate", "--log-level", "error", "nemesis.yaml"),
    ):
        result = nemesis(*args, cwd=tmp_path)
        assert result.returncode == 0, (args, result.stderr)
    wrong = nemesis("topics", "list", "--log-level", "loud", cwd=tmp_path)
    assert wrong.returncode == 2
    assert "invalid choice: 'loud'" in wrong.stderr


def test_the_log_level_after_the_command_wins_and_none_keeps_the_default() -> None:
    parser = build_parser()
    assert parser.parse_args(["topics", "list"]).log_level == "info"
    assert parser.parse_args(["--log-level", "debug", "topics", "list"]).log_level == "debug"
    assert parser.parse_args(["run", "--log-level", "warning"]).log_level == "warning"
    assert parser.parse_args(["dlq", "show", "x", "--log-level", "error"]).log_level == "error"
    both = ["--log-level", "debug", "topics", "list", "--log-level", "error"]
    assert parser.parse_args(both).log_level == "error"


def _parsers(
    parser: argparse.ArgumentParser, path: str = "nemesis"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_and_argument_has_help() -> None:
    missing = [
        f"{path}: {'/'.join(action.option_strings) or action.dest}"
        for path, parser in _parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and action.help != argparse.SUPPRESS
        and not (action.help or "").strip()
    ]
    assert not missing, "options without help text:\n" + "\n".join(missing)


def test_every_command_has_help() -> None:
    missing = [
        f"{path} {name}"
        for path, parser in _parsers(build_parser())
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
        if not any(choice.dest == name and choice.help for choice in action._choices_actions)
    ]
    assert not missing, "commands without help text:\n" + "\n".join(missing)


def test_publish_refuses_a_timeout_that_is_not_above_zero(tmp_path: Path) -> None:
    (tmp_path / "nemesis.yaml").write_text("backend: {kind: embedded, path: n.db}\ndata_dir: .\n")
    result = nemesis("publish", "orders", "{}", "--timeout", "0", cwd=tmp_path)
    assert result.returncode != 0
    assert "--timeout 0.0: expected a number of seconds above 0" in result.stderr
    assert not (tmp_path / "n.db").exists()  # refused before the broker was opened


def test_a_command_built_alone_is_the_command_built_with_all_the_others() -> None:
    # `nemesis <cmd> ...` builds only <cmd>'s parser: its help must not differ from
    # what the whole command line (the one the help tests above walk) gives.
    everything = dict(_parsers(build_parser()))
    for path, parser in everything.items():
        words = path.split()[1:]
        alone = dict(_parsers(build_parser([*words, "--log-level", "info"])))
        assert alone[path].format_help() == parser.format_help(), path
