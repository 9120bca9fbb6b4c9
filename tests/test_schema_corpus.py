"""``nemesis validate`` and ``nemesis schema`` judge one corpus of broken integrations alike.

Each file of ``tests/broken_integrations/`` is one integration with one thing
wrong, named by its first-line comment. Both run as a user runs them: the CLI's
``validate`` on the folder, and the ``jsonschema`` package on each file against
what ``nemesis schema integration`` prints (the editors' view). Every file
``validate`` refuses, the schema must refuse too, unless its rule is one JSON
Schema cannot say (``INEXPRESSIBLE``); and the schema must never refuse a file
``validate`` accepts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from nemesis.config.document import parse_yaml
from tests.conftest import REPO

CORPUS = REPO / "tests" / "broken_integrations"

# The files whose rule the schema cannot carry, and why.
INEXPRESSIBLE: dict[str, str] = {
    # Two values of the file compared: JSON Schema compares a value with constants
    # only (draft 2020-12 has no reference to another value of the instance).
    "buffer-below-batch": "delivery.buffer >= delivery.batch.size compares two values",
    "breaker-without-hysteresis": "breaker.close_below < open_above compares two values",
    "tiers-that-shorten": "each retry tier >= the one before compares items of a list",
    # Beyond the file: a schema sees one document, not its name or its neighbours.
    "name-not-the-file": "the name must be the file's name, which a schema never sees",
    "pipeline-not-found": "a named pipeline must exist in pipelines/, another file",
}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nemesis", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def corpus() -> list[Path]:
    return sorted(CORPUS.glob("*.yaml"))


def refused_by_validate() -> dict[str, list[str]]:
    """The problems ``nemesis validate`` prints, by corpus file."""
    result = cli("validate", str(CORPUS.relative_to(REPO)))
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    found: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        match = re.match(r"tests/broken_integrations/([^/:]+)\.yaml:", line)
        if match:
            found.setdefault(match.group(1), []).append(line)
    return found


def refused_by_schema(schema: dict[str, Any]) -> dict[str, list[str]]:
    """The schema's errors, by corpus file, on the YAML as the loader reads it."""
    validator = Draft202012Validator(schema)
    found: dict[str, list[str]] = {}
    for path in corpus():
        document = parse_yaml(path.read_text(), str(path))
        assert document.problems == [], document.problems
        errors = [
            f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
            for error in validator.iter_errors(document.data)
        ]
        if errors:
            found[path.stem] = errors
    return found


def test_every_corpus_file_says_what_is_broken() -> None:
    assert len(corpus()) >= 20
    for path in corpus():
        first = path.read_text().splitlines()[0]
        assert first.startswith("# broken: "), path.name
        assert f"name: {path.stem}\n" in path.read_text() or path.stem in INEXPRESSIBLE
    assert set(INEXPRESSIBLE) <= {path.stem for path in corpus()}


def test_the_schema_refuses_what_validate_refuses_where_json_schema_can_say_it() -> None:
    printed = cli("schema", "integration")
    assert printed.returncode == 0, printed.stderr
    schema = json.loads(printed.stdout)
    Draft202012Validator.check_schema(schema)
    by_validate, by_schema = refused_by_validate(), refused_by_schema(schema)

    disagreements = []
    for path in corpus():
        name = path.stem
        if name in by_validate and name not in by_schema and name not in INEXPRESSIBLE:
            disagreements.append(
                f"{name}: validate refuses, the schema accepts: {by_validate[name]}"
            )
        if name in by_schema and name not in by_validate:
            disagreements.append(f"{name}: the schema refuses, validate accepts: {by_schema[name]}")
        if name not in by_validate:
            disagreements.append(f"{name}: validate accepts a file of the broken corpus")
    assert disagreements == [], "\n".join(disagreements)
    # The allow-list holds only rules the schema really misses.
    assert sorted(name for name in INEXPRESSIBLE if name in by_schema) == []
