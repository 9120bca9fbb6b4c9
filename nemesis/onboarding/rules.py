"""The pull-request rules for integration files: a Checker plugged into ``nemesis validate``.

The loader already checks each file against the models (types, ranges,
unknown keys), that names are unique and match their files, and the
``PipelineChecker`` that named pipelines exist. These are the rules a
reviewer would otherwise enforce by hand, across files:

- owners: every entry names a team (``team-loyalty``, ``org/team`` or an
  e-mail), once;
- topics and consumers follow the naming convention (lowercase words joined
  by ``.``, ``-``, ``_`` or ``/``), and never touch Nemesis's own
  ``nemesis.*`` topics;
- one consumer per integration: two integrations reading one topic with one
  consumer name would split its messages between them;
- a consumer name the broker of a process file validated with them refuses
  (``BackendModel.consumer_name_problem``: YDB takes no ``/`` or ``|``);
- the target URL is one a transport accepts (scheme, and the transport's own
  checks: a grpc:// URL is ``host:port``, header names are valid...);
- no secrets inline in integration or process files (``inline_secrets``),
  including files with other problems: a secret in a pull request must be
  reported at once, not after the file is otherwise fixed. ``scan`` names the
  paths ``nemesis validate`` was given; without it only the files that loaded
  are scanned.

A file that did not load is still checked section by section: each rule runs
when the sections it reads (owners, source, target) are valid on their own,
so one run reports every problem in a file.

Every problem points at the file and line of the value concerned.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, TypeVar

from pydantic import Field, TypeAdapter, ValidationError

from nemesis.config.document import DataPath, YamlDocument, format_path, parse_yaml
from nemesis.config.loader import YAML_SUFFIXES, ValidationContext, max_file_size
from nemesis.config.models import SourceConfig, TargetConfig
from nemesis.errors import ConfigError, ConfigProblem
from nemesis.onboarding.inline_secrets import find_inline_secrets
from nemesis.pipeline.checker import PIPELINES_DIR_NAME
from nemesis.pipeline.compiler import is_test_file
from nemesis.transports import Transports, default_transports

OWNER_PATTERN: Final = r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)?$|^[^@\s]+@[^@\s]+\.[a-z]+$"
# Lowercase words joined by single separators: "orders", "billing.invoices", "crm/leads-v2".
TOPIC_CONVENTION: Final = r"^[a-z0-9]+([._/-][a-z0-9]+)*$"
INTERNAL_PREFIX: Final = "nemesis."

T = TypeVar("T")


class IntegrationRulesChecker:
    """Cross-file rules for integration (and process) files, for ``nemesis validate``."""

    def __init__(
        self,
        scan: Sequence[Path] = (),
        *,
        transports: Transports | None = None,
        topic_convention: str = TOPIC_CONVENTION,
        owner_pattern: str = OWNER_PATTERN,
    ) -> None:
        self._scan = list(scan)
        # The transports whose checks the rules run, by URL scheme.
        self._transports = transports or default_transports()
        self._topic = re.compile(topic_convention)
        self._owner = re.compile(owner_pattern)

    def claims(self, path: Path) -> bool:
        """Claims nothing: it checks what the core loaded."""
        return False

    def check(self, paths: Sequence[Path], context: ValidationContext) -> list[ConfigProblem]:
        """Problems in the loaded integrations, across them, and inline secrets."""
        run = _Run(context)
        # (topic, consumer) -> the integration reading it first, and where it says so
        consumers: dict[tuple[str, str], tuple[str, str]] = {}
        for name in sorted(context.integrations.integrations):
            integration = context.integrations.integrations[name]
            document = run.document(name, context.integration_files.get(name))
            self._owners(run, document, integration.owners)
            self._source(run, document, name, integration.source, consumers)
            self._target(run, document, name, integration.target)
            run.secrets(document)
        for path, data in sorted(context.unloaded.items()):
            self._unloaded(run, path, data, consumers)
        for path in [*context.process_configs, *_configuration_files(self._scan)]:
            run.secrets(run.read(path))
        return run.problems

    def _unloaded(
        self,
        run: _Run,
        path: Path,
        data: Mapping[Hashable, Any],
        consumers: dict[tuple[str, str], tuple[str, str]],
    ) -> None:
        """The rules whose sections are valid, in a file that did not load."""
        document = run.read(path)
        raw_name = data.get("name")
        name = raw_name if isinstance(raw_name, str) else path.stem
        owners = _valid(_OWNERS, data.get("owners"))
        if owners is not None:
            self._owners(run, document, owners)
        source = _valid(_SOURCE, data.get("source"))
        if source is not None:
            self._source(run, document, name, source, consumers)
        target = _valid(_TARGET, data.get("target"))
        if target is not None:
            self._target(run, document, name, target)

    def _owners(self, run: _Run, document: YamlDocument, owners: Sequence[str]) -> None:
        seen: set[str] = set()
        for index, owner in enumerate(owners):
            where = ("owners", index)
            if not owner.strip():
                run.report(document, where, "an owner cannot be blank: name the owning team")
            elif not self._owner.match(owner):
                run.report(
                    document,
                    where,
                    f"{owner!r} is not a team: write a team slug (team-loyalty),"
                    " org/team or an e-mail address",
                )
            elif owner in seen:
                run.report(document, where, f"{owner!r} is listed twice")
            seen.add(owner)

    def _source(
        self,
        run: _Run,
        document: YamlDocument,
        name: str,
        source: SourceConfig,
        consumers: dict[tuple[str, str], tuple[str, str]],
    ) -> None:
        for field, value in (("topic", source.topic), ("consumer", source.consumer)):
            where = ("source", field)
            if value.startswith(INTERNAL_PREFIX) or value == INTERNAL_PREFIX.rstrip("."):
                run.report(
                    document,
                    where,
                    f"{field} names starting with {INTERNAL_PREFIX!r} belong to Nemesis"
                    " (retry tiers, replay): read the source topic",
                )
            elif not self._topic.match(value):
                run.report(
                    document,
                    where,
                    f"{value!r} does not follow the naming convention: lowercase words"
                    " joined by '.', '-', '_' or '/' (orders, billing.invoices)",
                )
        for path, config in sorted(run.context.process_configs.items()):
            refused = config.backend.consumer_name_problem(source.consumer)
            if refused is not None:
                run.report(
                    document,
                    ("source", "consumer"),
                    f"{refused} (backend {config.backend.kind} in {path})",
                )
        key = (source.topic, source.consumer)
        where = ("source", "consumer")
        here = f"{document.file}:{document.line_of(where)}"
        first = consumers.setdefault(key, (name, here))
        if first[0] != name:
            run.report(
                document,
                where,
                f"integration {first[0]!r} ({first[1]}) already reads topic {source.topic!r} as"
                f" consumer {source.consumer!r}: the two would split the messages; use a"
                " consumer of this integration's own (its name)",
            )

    def _target(self, run: _Run, document: YamlDocument, name: str, target: TargetConfig) -> None:
        if self._transports.kind_for(target.scheme) is None:
            schemes = ", ".join(f"{s}://" for s in sorted(self._transports.schemes()))
            run.report(
                document,
                ("target", "url"),
                f"no transport for {target.scheme}:// targets (this Nemesis has {schemes})",
            )
            return
        if any("${" in value for value in (target.url, *target.headers.values())):
            # Unexpanded references (secrets absent in CI) cannot be checked as values.
            return
        try:
            # Building a transport opens nothing (connections open on first delivery):
            # it runs the transport's own checks of the URL and headers. The signing
            # secrets and the TLS files are `nemesis run`'s to read, on the host that
            # has them: validating needs only their names.
            self._transports.check(target.model_copy(update={"signing": None, "tls": None}), name)
        except ConfigError as exc:
            for problem in exc.problems:
                path = _path_of(problem.field)
                run.report(document, path, problem.message)


# Owners as the integration model takes them: a list of at least one string.
_OWNERS: Final = TypeAdapter(Annotated[list[str], Field(min_length=1)])
_SOURCE: Final = TypeAdapter(SourceConfig)
_TARGET: Final = TypeAdapter(TargetConfig)


def _valid(adapter: TypeAdapter[T], value: Any) -> T | None:
    """``value`` validated alone, or None when it is absent or has problems of its own."""
    if value is None:
        return None
    try:
        return adapter.validate_python(value)
    except ValidationError:
        return None


def _configuration_files(paths: Sequence[Path]) -> list[Path]:
    """The integration and process files among ``paths``, as ``validate_paths`` sorts them."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            # Pipelines hold sample payloads in their tests, not configuration.
            if path.name != PIPELINES_DIR_NAME:
                files += sorted(
                    entry
                    for entry in path.iterdir()
                    if entry.suffix in YAML_SUFFIXES and not entry.name.startswith(".")
                )
        elif path.suffix in YAML_SUFFIXES and path.parent.name != PIPELINES_DIR_NAME:
            files.append(path)
    return [file for file in files if file.is_file() and not is_test_file(file)]


class _Run:
    """One check: the problems found so far, and the files read for their lines."""

    def __init__(self, context: ValidationContext) -> None:
        self.context = context
        self.problems: list[ConfigProblem] = []
        self.scanned: set[Path] = set()

    def document(self, name: str, file: Path | None) -> YamlDocument:
        """The integration's file as written (before ``${VAR}`` expansion), with lines."""
        if file is None:
            return YamlDocument(f"integration {name}")
        return self.read(file)

    def read(self, file: Path) -> YamlDocument:
        try:
            too_large = file.stat().st_size > max_file_size()
            text = "" if too_large else file.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError, ValueError):
            # The loader already reported why the file cannot be read.
            return YamlDocument(str(file))
        if too_large:
            return YamlDocument(str(file))
        return parse_yaml(text, str(file))

    def report(self, document: YamlDocument, path: DataPath, message: str) -> None:
        problem = ConfigProblem(document.file, document.line_of(path), format_path(path), message)
        if problem not in self.problems:
            self.problems.append(problem)

    def secrets(self, document: YamlDocument) -> None:
        key = Path(document.file).resolve()
        if document.data is None or key in self.scanned:
            return
        self.scanned.add(key)
        for found in find_inline_secrets(document.data):
            self.report(
                document,
                found.path,
                f"{found.why}: read it from the environment with ${{VAR}}"
                ' (e.g. "Bearer ${HANDLER_TOKEN}"); the value is in git history now,'
                " so rotate it",
            )


def _path_of(field: str | None) -> DataPath:
    # "target.headers.X-Api-Key" -> ("target", "headers", "X-Api-Key"); a header name with
    # dots resolves to its nearest ancestor's line, which is still the right place.
    return () if field is None else tuple(field.split("."))
