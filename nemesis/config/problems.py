"""Pydantic validation errors as ``file:line: field: message`` problems, and their output.

A pydantic ``loc`` is walked against the data that was validated: parts that
exist in the data become the field path (and give the line), parts that do
not are union member tags and are dropped, and the last part of a missing
field (or of a default that a rule across fields blames) is kept so the
message names it while the line points at its parent.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from nemesis.config.document import DataPath, YamlDocument, format_path, yaml_kind
from nemesis.config.models import (
    CROSS_FIELD_ERROR,
    NAME_PATTERN,
    SOURCE_TOPIC_PATTERN,
    TOPIC_PATTERN,
)
from nemesis.errors import ConfigProblem, OmittedProblems
from nemesis.terminal import inert

ProblemFormat = Literal["text", "github"]
Severity = Literal["error", "warning"]

_PATTERN_HELP = {
    NAME_PATTERN: "must be lowercase letters, digits and dashes (at most 63),"
    " starting and ending with a letter or a digit",
    TOPIC_PATTERN: "must be letters, digits, '.', '_', '/' and '-' (at most 200),"
    " starting with a letter or a digit",
    SOURCE_TOPIC_PATTERN: "must be letters, digits, '.', '_', '/' and '-' (at most 200),"
    " starting with a letter or a digit, or with '/' for an absolute path",
}
# Type errors say what was expected and what kind of value was found, in YAML
# words, and never the value itself: it may come from a secret.
_EXPECTED = {
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dict_type": "a mapping",
    "list_type": "a list",
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
}
# One broken list of 100,000 items is one mistake: past this many problems in a
# file, the rest are counted, not listed.
MAX_PROBLEMS_PER_FILE = 50
_DIGITS = re.compile(r"(\d+)")
_TYPE_MESSAGE = re.compile(r"expected (.+), got (.+)")
_INPUT_SHOULD_BE = "Input should be "


def validation_problems(
    error: ValidationError, document: YamlDocument, model: type[BaseModel]
) -> list[ConfigProblem]:
    """Every error in ``error`` as a problem with the file, line and field it concerns."""
    data = document.data
    messages: dict[tuple[int | None, str | None], list[str]] = {}
    for details in error.errors(include_url=False):
        path, missing = _resolve(details, data)
        if any(path[: len(u)] == u for u in document.unchecked):
            continue
        where = (document.line_of(path), format_path((*path, *missing)))
        message = _message(details, path, model)
        if message not in messages.setdefault(where, []):
            messages[where].append(message)
    return [
        ConfigProblem(document.file, line, field, _join(texts))
        for (line, field), texts in messages.items()
    ]


def sort_problems(problems: Iterable[ConfigProblem]) -> list[ConfigProblem]:
    """Problems ordered by file, then line, then field; a file's omitted count comes last."""
    return sorted(problems, key=_order)


def count_problems(problems: Iterable[ConfigProblem]) -> int:
    """How many problems there are, those a ``... and K more`` stands for included."""
    return sum(p.count if isinstance(p, OmittedProblems) else 1 for p in problems)


def _order(problem: ConfigProblem) -> tuple[Any, ...]:
    # Item indices in numeric order: items[2] before items[10].
    field = tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in _DIGITS.split(problem.field or "")
    )
    omitted = isinstance(problem, OmittedProblems)
    return (problem.file, omitted, problem.line or 0, field, problem.message)


def limit_problems(
    problems: Iterable[ConfigProblem], per_file: int = MAX_PROBLEMS_PER_FILE
) -> list[ConfigProblem]:
    """The first ``per_file`` problems of each file, in the given order, then ``... and K more``."""
    kept: list[ConfigProblem] = []
    shown: dict[str, int] = {}
    omitted: dict[str, int] = {}
    for problem in problems:
        if isinstance(problem, OmittedProblems):
            omitted[problem.file] = omitted.get(problem.file, 0) + problem.count
        elif shown.get(problem.file, 0) < per_file:
            kept.append(problem)
            shown[problem.file] = shown.get(problem.file, 0) + 1
        else:
            omitted[problem.file] = omitted.get(problem.file, 0) + 1
    kept.extend(
        OmittedProblems(file, None, None, f"... and {count} more", count)
        for file, count in omitted.items()
    )
    return kept


def format_problems(
    problems: Iterable[ConfigProblem], style: ProblemFormat = "text", severity: Severity = "error"
) -> str:
    """One line per problem, sorted: ``file:line: field: message``, or GitHub annotations.

    Warnings say so: ``file:line: field: warning: message`` (``::warning`` on GitHub).
    """
    ordered = sort_problems(problems)
    # File names, keys and messages can hold what a pull request wrote: keep it inert.
    if style == "github":
        return "\n".join(inert(_github_annotation(p, severity)) for p in ordered)
    if severity == "warning":
        ordered = [replace(p, message=f"warning: {p.message}") for p in ordered]
    return "\n".join(inert(str(p)) for p in ordered)


def _github_annotation(problem: ConfigProblem, severity: Severity = "error") -> str:
    # Workflow command escaping: data escapes %, CR, LF; properties also ':' and ','.
    def data(text: str) -> str:
        return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")

    def prop(text: str) -> str:
        return data(text).replace(":", "%3A").replace(",", "%2C")

    where = f"file={prop(problem.file)}"
    if problem.line is not None:
        where += f",line={problem.line}"
    message = f"{problem.field}: {problem.message}" if problem.field else problem.message
    return f"::{severity} {where}::{data(message)}"


def _resolve(details: ErrorDetails, data: Any) -> tuple[DataPath, DataPath]:
    """The part of ``loc`` that exists in ``data``, and the name of a missing field."""
    loc = details["loc"]
    path: list[Hashable] = []
    node = data
    for index, part in enumerate(loc):
        in_mapping = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_mapping or in_list:
            node = node[part]
            path.append(part)
        elif details["type"] in ("missing", CROSS_FIELD_ERROR) and index == len(loc) - 1:
            return tuple(path), (part,)
        # Anything else is a union member tag ("str", "list[...]") or "[key]": not a field.
    return tuple(path), ()


def _message(details: ErrorDetails, path: DataPath, model: type[BaseModel]) -> str:
    kind = details["type"]
    text = details["msg"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return _unknown_field(path, model)
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {yaml_kind(details['input'])}"
    if kind == "finite_number":
        value = details["input"]
        written = ".nan" if value != value else ("-.inf" if value < 0 else ".inf")
        return f"expected a finite number, got {written}"
    if kind == "string_pattern_mismatch":
        pattern = details.get("ctx", {}).get("pattern")
        return _PATTERN_HELP.get(pattern, text) if isinstance(pattern, str) else text
    if kind in ("value_error", "assertion_error"):
        return text.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return text


def _join(messages: list[str]) -> str:
    # Union members fail one by one ("a string", "a list"): say it once.
    if len(messages) == 1:
        return messages[0]
    matches = [m for m in map(_TYPE_MESSAGE.fullmatch, messages) if m]
    if len(matches) == len(messages) and len({m.group(2) for m in matches}) == 1:
        return f"expected {' or '.join(m.group(1) for m in matches)}, got {matches[0].group(2)}"
    if all(m.startswith(_INPUT_SHOULD_BE) for m in messages):
        return _INPUT_SHOULD_BE + " or ".join(m.removeprefix(_INPUT_SHOULD_BE) for m in messages)
    return "; ".join(messages)


def _unknown_field(path: DataPath, model: type[BaseModel]) -> str:
    key = str(path[-1]) if path else ""
    # A right name at the wrong level ("workers" at the top) is likelier than a typo.
    homes = [p for p in _field_paths(model) if p[-1] == key and p[:-1] != _names(path[:-1])]
    if homes:
        places = " or ".join(format_path(p[:-1]) or "the top level" for p in homes)
        return f"unknown field ({key} belongs under {places})"
    fields = _fields_at(model, path[:-1])
    import difflib  # here: only a misspelt key needs it

    close = difflib.get_close_matches(key, fields, n=1)
    if close:
        return f"unknown field (did you mean {close[0]}?)"
    if fields:
        return f"unknown field (expected one of: {', '.join(fields)})"
    return "unknown field"


def _names(path: DataPath) -> tuple[str, ...]:
    return tuple(str(part) for part in path if not isinstance(part, int))


def _fields_at(model: type[BaseModel], path: DataPath) -> list[str]:
    """The field names of the model found at ``path`` inside ``model``, if there is one."""
    annotation: Any = model
    for part in path:
        annotation = _step(annotation, part)
        if annotation is None:
            return []
    models = [c for c in _candidates(annotation) if _is_model(c)]
    return list(models[0].model_fields) if len(models) == 1 else []


def _field_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every field of ``model`` and of the models nested in it, as name paths."""
    paths = []
    for name, info in model.model_fields.items():
        paths.append((*prefix, name))
        for candidate in _candidates(info.annotation):
            if _is_model(candidate):
                paths.extend(_field_paths(candidate, (*prefix, name)))
    return paths


def _step(annotation: Any, part: Hashable) -> Any:
    for candidate in _candidates(annotation):
        origin = typing.get_origin(candidate)
        if _is_model(candidate):
            if isinstance(part, str) and part in candidate.model_fields:
                return candidate.model_fields[part].annotation
        elif origin in (list, tuple, Sequence) and isinstance(part, int):
            return typing.get_args(candidate)[0]
        elif origin in (dict, Mapping):
            return typing.get_args(candidate)[1]
    return None


def _candidates(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _candidates(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(annotation) for c in _candidates(arg)]
    return [annotation]


def _is_model(annotation: Any) -> typing.TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
