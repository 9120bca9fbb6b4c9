"""``nemesis new``: a runnable handler project, and a commented integration file that validates.

Templates are package data under ``templates/``: the ``*.tmpl`` files under
``<lang>/`` (and ``common/`` for the Python ones) make a handler project
(``gitignore.tmpl`` becomes ``.gitignore``), ``integration.yaml.tmpl`` an
integration. ``{{name}}`` placeholders are filled in, in the files and in
their paths (the Java package's folder); a placeholder without a value is an
error, so a template and the code that fills it cannot drift apart silently.
The gRPC template also gets the handler contract,
``proto/nemesis_handler.proto``, copied from ``nemesis.proto``, and every
template gets the signing test vectors,
``nemesis/delivery/signing-vectors.json``, which their own tests check their
verifier against (one source for each everywhere).
"""

from __future__ import annotations

import importlib.resources
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Final

import yaml

from nemesis import __version__
from nemesis.config.models import (
    NAME_PATTERN,
    SOURCE_TOPIC_PATTERN,
    TOPIC_PATTERN,
    IntegrationConfig,
)
from nemesis.errors import NemesisError
from nemesis.onboarding.choices import DEFAULT_PORTS as DEFAULT_PORTS
from nemesis.onboarding.choices import DEFAULT_URLS as DEFAULT_URLS
from nemesis.onboarding.choices import HANDLER_LANGS as HANDLER_LANGS
from nemesis.onboarding.choices import HandlerLang as HandlerLang
from nemesis.proto import handler_proto_text

# The Python templates share handler.py (common/); the others are whole in their folder.
_WITH_COMMON: Final[frozenset[HandlerLang]] = frozenset({"python-fastapi", "python-grpc"})
# Where a template's own tests find the signing vectors they check the verifier against.
_VECTORS_COPY: Final[Mapping[HandlerLang, str]] = {
    "python-fastapi": "signing-vectors.json",
    "python-grpc": "signing-vectors.json",
    "go-http": "testdata/signing-vectors.json",
    "typescript-node": "test/signing-vectors.json",
    "java-http": "src/test/resources/signing-vectors.json",
}
# Names a Java package cannot have (the keywords and the literals).
_JAVA_KEYWORDS: Final = frozenset(
    """abstract assert boolean break byte case catch char class const continue default do
    double else enum extends false final finally float for goto if implements import
    instanceof int interface long native new null package private protected public return
    short static strictfp super switch synchronized this throw throws transient true try void
    volatile while var record yield sealed permits""".split()  # noqa: SIM905  (a list to read)
)
SCHEMA_FILE: Final = "schemas/integration.schema.json"  # relative to the integrations' parent

_PLACEHOLDER: Final = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")
_SUFFIX: Final = ".tmpl"
_PROTO_COPY: Final = "proto/nemesis_handler.proto"


class TemplateError(NemesisError):
    """A template cannot be written as asked (a bad value, a file in the way)."""


def render(text: str, values: Mapping[str, str]) -> str:
    """``text`` with every ``{{name}}`` replaced; an unknown name is an error."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"template placeholder {{{{{name}}}}} has no value")
        return values[name]

    return _PLACEHOLDER.sub(fill, text)


def new_handler(
    directory: Path, lang: HandlerLang = "python-fastapi", *, force: bool = False
) -> list[Path]:
    """Writes a handler project into ``directory`` (new or empty); returns the files written."""
    if lang not in HANDLER_LANGS:
        raise TemplateError(f"unknown --lang {lang!r}: one of {', '.join(HANDLER_LANGS)}")
    if directory.exists() and not directory.is_dir():
        raise TemplateError(f"{directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        raise TemplateError(f"{directory} is not empty (--force writes over it)")
    project = directory.resolve().name
    module = _module_name(project)
    java_package = _java_package(module)
    values = {
        "project": project,
        "module": module,
        "port": str(DEFAULT_PORTS[lang]),
        "nemesis_version": __version__,
        "java_package": java_package,
        "java_package_dir": java_package.replace(".", "/"),
    }
    files: dict[str, str] = {}
    sources = (_templates("common") if lang in _WITH_COMMON else []) + _templates(lang)
    for relative, source in sources:
        folder, _, name = render(relative, values).removesuffix(_SUFFIX).rpartition("/")
        name = "." + name if name == "gitignore" else name
        files[f"{folder}/{name}" if folder else name] = render(source.read_text(), values)
    if lang == "python-grpc":
        files[_PROTO_COPY] = handler_proto_text()
    if lang in _VECTORS_COPY:
        files[_VECTORS_COPY[lang]] = signing_vectors_text()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in sorted(files.items()):
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        if path.suffix == ".sh":
            path.chmod(0o755)  # ./build.sh, as its README says
        written.append(path)
    return written


@dataclass(frozen=True, slots=True)
class IntegrationSpec:
    """What ``nemesis new integration`` puts in the file; unset parts get defaults."""

    name: str
    topic: str | None = None  # default: the part of the name before "-to-", else the name
    consumer: str | None = None  # default: the integration's name
    url: str = DEFAULT_URLS["python-fastapi"]
    owners: Sequence[str] = ()  # default: team-<the part of the name after "-to-">
    pipeline: str | None = None


def render_integration(spec: IntegrationSpec, *, schema_ref: str | None = None) -> str:
    """The commented YAML of a new integration; it validates as it is."""
    if not re.match(NAME_PATTERN, spec.name):
        raise TemplateError(
            f"{spec.name!r} is not an integration name: lowercase letters, digits and dashes"
        )
    # The naming convention is <topic>-to-<team or service>: orders-to-loyalty.
    source_part, _, target_part = spec.name.partition("-to-")
    topic = spec.topic or source_part
    consumer = spec.consumer or spec.name
    owners = list(spec.owners) or [f"team-{target_part or spec.name}"]
    for what, value, pattern in (
        ("topic", topic, SOURCE_TOPIC_PATTERN),
        ("consumer", consumer, TOPIC_PATTERN),
    ):
        if not re.match(pattern, value):
            raise TemplateError(f"{value!r} is not a valid {what} name")
    if spec.pipeline is not None:
        if not re.match(NAME_PATTERN, spec.pipeline):
            raise TemplateError(f"{spec.pipeline!r} is not a pipeline name")
        pipeline_line = f"pipeline: {spec.pipeline}"
    else:
        pipeline_line = "# pipeline: city-filter"
    modeline = f"# yaml-language-server: $schema={schema_ref}\n" if schema_ref else ""
    text = render(
        _template_file("integration.yaml.tmpl").read_text(),
        {
            "schema_modeline": modeline,
            "name": spec.name,
            "topic_text": topic,
            "url_text": spec.url,
            "owners": "[" + ", ".join(_scalar(owner) for owner in owners) + "]",
            "topic": _scalar(topic),
            "consumer": _scalar(consumer),
            "url": _scalar(spec.url),
            "pipeline_line": pipeline_line,
        },
    )
    _check_renders(text, spec.name)
    return text


def new_integration(
    spec: IntegrationSpec, directory: Path = Path("integrations"), *, force: bool = False
) -> Path:
    """Writes ``<directory>/<name>.yaml``; returns its path."""
    path = directory / f"{spec.name}.yaml"
    if path.exists() and not force:
        raise TemplateError(f"{path} exists (--force writes over it)")
    schema = directory.parent / SCHEMA_FILE
    # A modeline to a schema that is not there makes editors complain: only when it is.
    schema_ref = f"../{SCHEMA_FILE}" if schema.is_file() else None
    text = render_integration(spec, schema_ref=schema_ref)
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def signing_vectors_text() -> str:
    """The shared signing test vectors, as the package ships them."""
    vectors = importlib.resources.files("nemesis.delivery").joinpath("signing-vectors.json")
    return vectors.read_text(encoding="utf-8")


def _templates(folder: str) -> list[tuple[str, Traversable]]:
    """The ``*.tmpl`` files under ``folder``, at any depth, by their path inside it."""
    found: list[tuple[str, Traversable]] = []
    pending: list[tuple[str, Traversable]] = [("", _template_file(folder))]
    while pending:
        prefix, directory = pending.pop()
        for entry in directory.iterdir():
            if entry.is_dir():
                pending.append((f"{prefix}{entry.name}/", entry))
            elif entry.name.endswith(_SUFFIX):
                found.append((prefix + entry.name, entry))
    return sorted(found, key=lambda item: item[0])


def _template_file(name: str) -> Traversable:
    return importlib.resources.files(__package__).joinpath("templates", name)


def _module_name(project: str) -> str:
    module = re.sub(r"\W+", "_", project).strip("_").lower()
    return module or "handler"


def _java_package(module: str) -> str:
    """``module`` as a Java package name: not a keyword, not starting with a digit."""
    if module[0].isdigit() or module in _JAVA_KEYWORDS:
        return f"handler_{module}"
    return module


def _scalar(value: str) -> str:
    """``value`` as a YAML scalar: plain when it reads back as the same string, else quoted."""
    try:
        plain_ok = yaml.safe_load(value) == value and "#" not in value and ": " not in value
    except yaml.YAMLError:
        plain_ok = False
    # JSON strings are YAML double-quoted scalars.
    return value if plain_ok else json.dumps(value)


def _check_renders(text: str, name: str) -> None:
    """The rendered file parses as an integration: a bad value never writes a broken file."""
    try:
        IntegrationConfig.model_validate(yaml.safe_load(text))
    except (yaml.YAMLError, ValueError) as exc:
        message = f"the values given do not make a valid integration {name}: {exc}"
        raise TemplateError(message) from exc
