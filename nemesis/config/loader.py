"""Loading and validating configuration files: ``nemesis.yaml`` and ``integrations/*.yaml``.

Every problem names file, line and field, and all of them are reported, not
only the first. Loading a directory of integrations keeps going past bad
files: a running proxy keeps the integrations that are fine.

Rules that span files:

- an integration lives in ``<name>.yaml`` (or ``.yml``): a file whose name does
  not match its ``name`` is an error, so a reviewer finds an integration by
  name and two files can only clash as ``x.yaml`` / ``x.yml``;
- names are unique: the first valid file (in reading order, sorted within a
  directory) keeps the name, every other file using it gets an error naming
  the first; a broken file never takes a name from a valid one.

``validate_paths`` is what ``nemesis validate`` runs. Other kinds of files
(pipelines) plug in as ``Checker`` objects that claim their paths and
cross-check what the core loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from nemesis.config.document import YamlDocument, parse_yaml
from nemesis.config.interpolation import interpolate
from nemesis.config.models import NAME_PATTERN, IntegrationConfig, NemesisConfig
from nemesis.config.problems import (
    format_problems,
    limit_problems,
    sort_problems,
    validation_problems,
)
from nemesis.errors import ConfigError, ConfigProblem

__all__ = [
    "DEFAULT_PROCESS_CONFIG",
    "YAML_SUFFIXES",
    "Checker",
    "IntegrationSet",
    "Parsed",
    "ValidationContext",
    "ValidationReport",
    "check_paths",
    "format_problems",
    "is_process_config_file",
    "load_integration_file",
    "load_integrations",
    "load_process_config",
    "parse_file",
    "read_yaml",
    "validate_paths",
]

ModelT = TypeVar("ModelT", bound=BaseModel)

YAML_SUFFIXES = (".yaml", ".yml")
# A configuration file is a few KiB; a larger one is refused before it is parsed.
MAX_FILE_SIZE_ENV = "NEMESIS_MAX_FILE_SIZE"
DEFAULT_MAX_FILE_SIZE = 1024 * 1024
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
DEFAULT_PROCESS_CONFIG = Path("nemesis.yaml")
_PROCESS_DIRS = ("data_dir", "integrations_dir", "pipelines_dir")


@dataclass(frozen=True, slots=True)
class Parsed(Generic[ModelT]):
    """A file read and validated: the model when the file is clean, and every problem found."""

    document: YamlDocument
    # None when there is any problem. With require_env=False a value may still
    # hold unexpanded ${VAR} text: it is for checking, never for running.
    value: ModelT | None
    problems: list[ConfigProblem]


class IntegrationSet(NamedTuple):
    """The integrations that loaded, by name, and the problems of the files that did not."""

    integrations: dict[str, IntegrationConfig]
    problems: list[ConfigProblem]


@dataclass(frozen=True, slots=True)
class ValidationContext:
    """What validate_paths loaded, for checkers that cross-check against it."""

    env: Mapping[str, str]
    require_env: bool
    process_configs: Mapping[Path, NemesisConfig]  # the valid ones, directories resolved
    integrations: IntegrationSet
    # The file each loaded integration came from, by name (problems in it need its lines).
    integration_files: Mapping[str, Path] = field(default_factory=dict)
    # Integration files that did not load, as data (variables expanded): a checker
    # can still judge the sections that are valid, so one run reports every problem.
    unloaded: Mapping[Path, Mapping[Hashable, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ValidationReport:
    """What ``check_paths`` found: the problems, the warnings, and how many files it read."""

    problems: list[ConfigProblem]
    # Unset variables without a default, when they were not required.
    warnings: list[ConfigProblem]
    files: int  # configuration files read, claimed paths included


class Checker(Protocol):
    """An extra validation pass for validate_paths (pipelines, ...)."""

    def claims(self, path: Path) -> bool:
        """Whether this checker validates ``path`` itself (the core then leaves it alone)."""
        ...

    def check(self, paths: Sequence[Path], context: ValidationContext) -> list[ConfigProblem]:
        """Problems in the claimed ``paths`` (maybe none) and across them and ``context``."""
        ...


def parse_size(text: str) -> int:
    """``"1048576"``, ``"512KiB"``, ``"4MiB"``, ``"1MB"``, ``"2M"`` -> bytes (K, M, G are 1024s)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"expected a size such as 1MiB or 512KiB, got {text!r}")
    unit = (match.group(2) or "").lower()
    decimal = unit.endswith("b") and not unit.endswith("ib") and unit != "b"
    factor = 1000 ** "bkmg".index(unit[0]) if decimal else _SIZE_UNITS[unit[:1]]
    return int(match.group(1)) * factor


def max_file_size(env: Mapping[str, str] | None = None) -> int:
    """The largest configuration file read, in bytes: NEMESIS_MAX_FILE_SIZE or 1 MiB."""
    text = (os.environ if env is None else env).get(MAX_FILE_SIZE_ENV)
    return DEFAULT_MAX_FILE_SIZE if text is None or not text.strip() else parse_size(text)


def format_size(size: int) -> str:
    """Bytes in the largest binary unit that keeps the figure at or above 1: ``1.5 MiB``."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= factor:
            return f"{size / factor:.1f} {unit}".replace(".0 ", " ")
    return f"{size} bytes"


def read_yaml(
    path: Path, *, env: Mapping[str, str] | None = None, require_env: bool = True
) -> YamlDocument:
    """Read a YAML file into plain data with lines, variables expanded; problems are recorded.

    A file over ``max_file_size`` is refused before it is parsed, with one problem.
    """
    file = str(path)
    document = YamlDocument(file)
    try:
        limit = max_file_size(env)
    except ValueError as exc:
        document.report((), f"{MAX_FILE_SIZE_ENV}: {exc}")
        return document
    try:
        with path.open("rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            raw = b"" if size > limit else stream.read(limit + 1)
    except OSError as exc:
        document.report((), f"cannot read the file: {exc.strerror or exc}")
        return document
    if size > limit or len(raw) > limit:
        size = max(size, len(raw))
        document.report(
            (),
            f"the file is {format_size(size)} ({size} bytes), over the {format_size(limit)}"
            f" limit for a configuration file (set {MAX_FILE_SIZE_ENV} to change it)",
        )
        return document
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        document.report((), "the file is not valid UTF-8", line=line)
        return document
    document = parse_yaml(text, file)
    interpolate(document, os.environ if env is None else env, require_env=require_env)
    return document


def parse_file(
    path: Path,
    model: type[ModelT],
    *,
    env: Mapping[str, str] | None = None,
    require_env: bool = True,
) -> Parsed[ModelT]:
    """Read ``path`` and validate it as ``model``, collecting every problem."""
    document = read_yaml(path, env=env, require_env=require_env)
    if document.data is None:
        return Parsed(document, None, limit_problems(document.problems))
    try:
        value = model.model_validate(document.data)
    except ValidationError as exc:
        problems = [*document.problems, *validation_problems(exc, document, model)]
        return Parsed(document, None, limit_problems(problems))
    problems = limit_problems(document.problems)
    return Parsed(document, None if problems else value, problems)


def load_process_config(path: Path | None, env: Mapping[str, str] | None = None) -> NemesisConfig:
    """The process configuration in ``path`` (defaults when None); raises ConfigError."""
    if path is None:
        return NemesisConfig()
    parsed = parse_file(path, NemesisConfig, env=env)
    if parsed.value is None:
        raise ConfigError(limit_problems(sort_problems(parsed.problems)))
    return _resolve_dirs(parsed.value, path.parent)


def load_integration_file(path: Path, env: Mapping[str, str] | None = None) -> IntegrationConfig:
    """One integration file (its name must match the file name); raises ConfigError."""
    loaded = _load_integration(path, env, require_env=True)
    if loaded.config is None:
        raise ConfigError(limit_problems(sort_problems(loaded.problems)))
    return loaded.config


def load_integrations(directory: Path, env: Mapping[str, str] | None = None) -> IntegrationSet:
    """Every ``*.yaml``/``*.yml`` in ``directory``: the good ones, and the problems of the rest."""
    files, problems = _integration_files(directory)
    loaded = _load_integration_set(files, env, require_env=True)
    return IntegrationSet(
        loaded.integrations, limit_problems(sort_problems([*problems, *loaded.problems]))
    )


def is_process_config_file(path: Path) -> bool:
    """``nemesis.yaml``, ``nemesis.yml`` and ``nemesis.<anything>.yaml`` hold process config."""
    return path.name.startswith("nemesis.") and path.suffix in YAML_SUFFIXES


def validate_paths(
    paths: Sequence[Path],
    *,
    env: Mapping[str, str] | None = None,
    require_env: bool = False,
    checkers: Sequence[Checker] = (),
) -> list[ConfigProblem]:
    """Every problem in the given files and directories, sorted (``check_paths``' problems)."""
    return check_paths(paths, env=env, require_env=require_env, checkers=checkers).problems


def check_paths(
    paths: Sequence[Path],
    *,
    env: Mapping[str, str] | None = None,
    require_env: bool = False,
    checkers: Sequence[Checker] = (),
) -> ValidationReport:
    """Every problem and warning in the given files and directories: what ``nemesis validate`` runs.

    A directory is an integrations directory; a file is process configuration
    when ``is_process_config_file`` says so, an integration otherwise; a
    checker that claims a path takes it instead. Without paths: ``nemesis.yaml``
    if present, its integrations directory, and its pipelines directory if a
    checker claims it. Unset variables are errors only with ``require_env``
    (a pull request is validated without production secrets); without it they
    are warnings.
    """
    env = os.environ if env is None else env
    if not paths:
        paths = _default_paths(env, require_env, checkers)
    problems: list[ConfigProblem] = []
    warnings: list[ConfigProblem] = []
    claimed: list[list[Path]] = [[] for _ in checkers]
    process_files: list[Path] = []
    integration_files: list[Path] = []
    for path in paths:
        owner = next((i for i, checker in enumerate(checkers) if checker.claims(path)), None)
        if owner is not None:
            claimed[owner].append(path)
        elif path.is_dir():
            files, listing_problems = _integration_files(path)
            integration_files.extend(files)
            problems.extend(listing_problems)
        elif not path.exists():
            problems.append(ConfigProblem(str(path), None, None, "no such file or directory"))
        elif is_process_config_file(path):
            process_files.append(path)
        else:
            integration_files.append(path)

    process_configs: dict[Path, NemesisConfig] = {}
    for path in _unique(process_files):
        parsed = parse_file(path, NemesisConfig, env=env, require_env=require_env)
        problems.extend(parsed.problems)
        warnings.extend(parsed.document.unset_variables)
        if parsed.value is not None:
            process_configs[path] = _resolve_dirs(parsed.value, path.parent)

    integration_files = _unique(integration_files)
    loaded = [_load_integration(path, env, require_env) for path in integration_files]
    warnings.extend(w for item in loaded for w in item.unset_variables)
    integrations, sources = _integration_set(loaded)
    problems.extend(integrations.problems)
    unloaded = {
        item.path: item.data
        for item in loaded
        if item.config is None and item.data is not None and item.path not in sources.values()
    }
    context = ValidationContext(env, require_env, process_configs, integrations, sources, unloaded)
    # Checkers run even without claimed paths: they may cross-check integrations.
    for checker, checker_paths in zip(checkers, claimed, strict=True):
        problems.extend(checker.check(checker_paths, context))
    read = len(process_files) + len(integration_files)
    read += sum(_yaml_files_in(path) for paths_of in claimed for path in paths_of)
    return ValidationReport(
        limit_problems(sort_problems(problems)), limit_problems(sort_problems(warnings)), read
    )


# --- internals -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _IntegrationFile:
    path: Path
    name: str | None  # as written, even when the file has problems
    name_line: int | None
    config: IntegrationConfig | None
    problems: list[ConfigProblem] = field(default_factory=list)
    unset_variables: list[ConfigProblem] = field(default_factory=list)
    data: Mapping[Hashable, Any] | None = None  # as read, variables expanded


def _load_integration(
    path: Path, env: Mapping[str, str] | None, require_env: bool
) -> _IntegrationFile:
    parsed = parse_file(path, IntegrationConfig, env=env, require_env=require_env)
    document = parsed.document
    raw_name = (document.data or {}).get("name")
    name = raw_name if isinstance(raw_name, str) and ("name",) not in document.unchecked else None
    name_line = document.line_of(("name",))
    problems = list(parsed.problems)
    if name is not None and name != path.stem:
        # Renaming the file only helps when the name is one (else its own problem says why).
        fix = (
            f"rename the file to {name}{path.suffix} or change the name"
            if re.match(NAME_PATTERN, name)
            else "change the name"
        )
        problems.append(
            ConfigProblem(
                str(path),
                name_line,
                "name",
                f"{name!r} does not match the file name {path.name!r}: an integration lives in"
                f" <name>.yaml ({fix})",
            )
        )
    config = parsed.value if not problems else None
    return _IntegrationFile(
        path, name, name_line, config, problems, document.unset_variables, document.data
    )


def _load_integration_set(
    files: Sequence[Path], env: Mapping[str, str] | None, require_env: bool
) -> IntegrationSet:
    return _load_integration_files(files, env, require_env)[0]


def _load_integration_files(
    files: Sequence[Path], env: Mapping[str, str] | None, require_env: bool
) -> tuple[IntegrationSet, dict[str, Path]]:
    """The integration set, and the file each loaded integration came from."""
    return _integration_set([_load_integration(path, env, require_env) for path in files])


def _integration_set(loaded: Sequence[_IntegrationFile]) -> tuple[IntegrationSet, dict[str, Path]]:
    problems = [problem for item in loaded for problem in item.problems]
    by_name: dict[str, list[_IntegrationFile]] = {}
    for item in loaded:
        if item.name is not None:
            by_name.setdefault(item.name, []).append(item)
    integrations: dict[str, IntegrationConfig] = {}
    paths: dict[str, Path] = {}
    for name, group in by_name.items():
        # A valid file keeps its name over a broken one, so a bad new file
        # cannot take a running integration down.
        owner = next((item for item in group if item.config is not None), group[0])
        problems.extend(
            ConfigProblem(
                str(other.path),
                other.name_line,
                "name",
                f"integration name {name!r} is already used by {owner.path}:{owner.name_line}",
            )
            for other in group
            if other is not owner
        )
        if owner.config is not None:
            integrations[name] = owner.config
            paths[name] = owner.path
    return IntegrationSet(integrations, sort_problems(problems)), paths


def _integration_files(directory: Path) -> tuple[list[Path], list[ConfigProblem]]:
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        return [], [ConfigProblem(str(directory), None, None, what)]
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        return [], [ConfigProblem(str(directory), None, None, f"cannot list: {exc.strerror}")]
    # Dotfiles are editor and tool leftovers (.#orders.yaml), not integrations.
    files = [
        entry
        for entry in entries
        if entry.suffix in YAML_SUFFIXES and not entry.name.startswith(".") and entry.is_file()
    ]
    return files, []


def _yaml_files_in(path: Path) -> int:
    """1 for a file, the YAML files under a directory (a checker's folder may have subfolders)."""
    if not path.is_dir():
        return 1
    return sum(1 for entry in path.rglob("*") if entry.suffix in YAML_SUFFIXES and entry.is_file())


def _unique(paths: Sequence[Path]) -> list[Path]:
    # "integrations" and "integrations/orders.yaml" together must not make
    # orders.yaml clash with itself.
    seen: set[Path] = set()
    unique = []
    for path in paths:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def _resolve_dirs(config: NemesisConfig, base: Path) -> NemesisConfig:
    updates = {
        name: str(base / value)
        for name in _PROCESS_DIRS
        if not Path(value := getattr(config, name)).is_absolute()
    }
    return config.model_copy(update=updates)


def _default_paths(
    env: Mapping[str, str], require_env: bool, checkers: Sequence[Checker]
) -> list[Path]:
    paths: list[Path] = []
    config = NemesisConfig()
    if DEFAULT_PROCESS_CONFIG.is_file():
        paths.append(DEFAULT_PROCESS_CONFIG)
        parsed = parse_file(DEFAULT_PROCESS_CONFIG, NemesisConfig, env=env, require_env=require_env)
        # A broken nemesis.yaml is reported when it is validated; fall back to defaults here.
        if parsed.value is not None:
            config = _resolve_dirs(parsed.value, DEFAULT_PROCESS_CONFIG.parent)
    paths.append(Path(config.integrations_dir))
    pipelines = Path(config.pipelines_dir)
    if any(checker.claims(pipelines) for checker in checkers):
        paths.append(pipelines)
    return paths
