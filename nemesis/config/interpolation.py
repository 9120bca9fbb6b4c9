"""``${VAR}`` and ``${VAR:-default}`` in configuration strings.

Secrets come from the environment, never from files in the repository, so any
string value may reference a variable. ``${VAR:-default}`` uses the default
when VAR is unset or empty (as a shell does); ``$${`` writes a literal ``${``.
Keys are never interpolated. The environment is a parameter so that tests do
not touch ``os.environ``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemesis.config.document import DataPath, YamlDocument, format_path
from nemesis.errors import ConfigProblem

# Order matters: the escape first, then a whole reference, then an unclosed "${".
_REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)\}|\$\{")
_BODY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Expansion:
    """A string with its references replaced, and the references that could not be."""

    text: str
    unset: tuple[str, ...] = ()  # variables with neither a value nor a default
    malformed: tuple[str, ...] = ()  # references that are not ${NAME} or ${NAME:-default}


def expand(text: str, env: Mapping[str, str]) -> Expansion:
    """Replace ``${VAR}`` / ``${VAR:-default}`` in ``text`` with values from ``env``."""
    if "${" not in text:
        return Expansion(text)
    unset: list[str] = []
    malformed: list[str] = []

    def replace(match: re.Match[str]) -> str:
        reference = match.group(0)
        if reference == "$${":
            return "${"
        body = _BODY.fullmatch(match.group(1) or "")
        if match.group(1) is None or body is None or "${" in (body.group(2) or ""):
            malformed.append(reference)
            return reference
        name, default = body.group(1), body.group(2)
        value = env.get(name)
        if default is not None and not value:
            return default
        if value is None:
            unset.append(name)
            return reference
        return value

    expanded = _REFERENCE.sub(replace, text)
    return Expansion(expanded, tuple(unset), tuple(malformed))


def interpolate(document: YamlDocument, env: Mapping[str, str], *, require_env: bool) -> None:
    """Expand references in every string value of ``document`` in place, reporting bad ones.

    With ``require_env=False`` (validating a pull request, where production
    secrets are absent) an unset variable is not a problem but a warning in
    ``document.unset_variables``: the value keeps its reference and is left out
    of validation.
    """
    if document.data is not None:
        document.data = _walk(document.data, (), document, env, require_env)


def _walk(
    value: Any, path: DataPath, document: YamlDocument, env: Mapping[str, str], require_env: bool
) -> Any:
    if isinstance(value, dict):
        return {
            key: _walk(item, (*path, key), document, env, require_env)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_walk(item, (*path, i), document, env, require_env) for i, item in enumerate(value)]
    if not isinstance(value, str):
        return value
    expansion = expand(value, env)
    for reference in expansion.malformed:
        document.report(
            path,
            f"invalid variable reference {reference!r}: "
            "write ${NAME} or ${NAME:-default} ($${ for a literal ${)",
        )
    for name in expansion.unset:
        if require_env:
            document.report(
                path,
                f"environment variable {name} is not set "
                f"(set it, or write ${{{name}:-default}} to give a default)",
            )
        else:
            warning = ConfigProblem(
                document.file,
                document.line_of(path),
                format_path(path),
                f"environment variable {name} is not set here: `nemesis run` refuses the file"
                f" unless it is set where it runs (or write ${{{name}:-default}})",
            )
            if warning not in document.unset_variables:
                document.unset_variables.append(warning)
    if expansion.malformed or expansion.unset:
        document.unchecked.add(path)
    return expansion.text
