"""YAML documents as plain data, with the line where every value is defined.

PyYAML's constructors drop positions, so the composed node tree is walked
here instead: each path (a tuple of mapping keys and sequence indices) gets
the 1-based line of its key (or, for a sequence item, of the item). That is
what lets a pydantic error's ``loc`` become ``file:line: field``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.reader import ReaderError

from nemesis.errors import ConfigProblem

DataPath = tuple[Hashable, ...]

_STR = "tag:yaml.org,2002:str"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
_MERGE = "tag:yaml.org,2002:merge"
_CONSTRUCTED = frozenset(f"tag:yaml.org,2002:{kind}" for kind in ("int", "float", "bool", "null"))
_EMPTY = "the file is empty: expected a mapping such as `name: ...`"
# No real configuration comes near these counts (the largest shipped file has
# under 1,000 values). Composing is counted as it goes, so a file of a million
# flow items on one line is refused after the first MAX_NODES, not after all
# of them; alias expansion can grow a small file exponentially ("billion
# laughs"), so the values it expands to are bounded as well.
MAX_NODES = 20_000
MAX_VALUES = 100_000


def format_path(path: Iterable[Hashable]) -> str | None:
    """``("retry", "tiers", 1)`` -> ``"retry.tiers[1]"``; the document root -> None."""
    text = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or None


@dataclass(slots=True)
class YamlDocument:
    """One YAML file as plain data, the line of every path, and what went wrong reading it."""

    file: str
    # The top-level mapping; None when the file is unreadable, empty or not a mapping.
    data: dict[Hashable, Any] | None = None
    lines: dict[DataPath, int] = field(default_factory=dict)
    problems: list[ConfigProblem] = field(default_factory=list)
    # Paths whose value is already reported as wrong, or is an unset variable
    # while validating without secrets: validation errors under them are noise.
    unchecked: set[DataPath] = field(default_factory=set)
    # Variables referenced without a default and not set, when they are not required
    # (validating a pull request without production secrets): warnings, not problems.
    unset_variables: list[ConfigProblem] = field(default_factory=list)

    def line_of(self, path: DataPath) -> int | None:
        """The line of ``path``, or of its nearest ancestor that is in the file."""
        for end in range(len(path), -1, -1):
            if (line := self.lines.get(path[:end])) is not None:
                return line
        return None

    def report(self, path: DataPath, message: str, *, line: int | None = None) -> None:
        """Record a problem at ``path`` (at its line unless ``line`` is given)."""
        problem = ConfigProblem(
            self.file, self.line_of(path) if line is None else line, format_path(path), message
        )
        # Aliases convert one node at several paths; say each thing once.
        if problem not in self.problems:
            self.problems.append(problem)


def parse_yaml(text: str, file: str) -> YamlDocument:
    """Parse ``text`` into a YamlDocument; syntax and structure problems are recorded."""
    document = YamlDocument(file)
    loader: _CountingLoader | None = None
    try:
        loader = _CountingLoader(text)
        root = loader.get_single_node()
        if root is None:
            document.problems.append(ConfigProblem(file, None, None, _EMPTY))
            return document
        root_line = _line(root)
        data = _Converter(loader, document).convert(root, ())
    except yaml.MarkedYAMLError as exc:
        document.problems.append(_syntax_problem(file, exc))
        return document
    except ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        char = exc.character
        shown = f"#x{char:04x}" if isinstance(char, int) else repr(char)
        document.report((), f"invalid YAML: {exc.reason} (character {shown})", line=line)
        return document
    except RecursionError:
        document.report((), "invalid YAML: values are nested too deeply")
        return document
    except _TooManyNodes as exc:
        document.report(
            (),
            f"the file holds more than {MAX_NODES} values: no configuration needs that many",
            line=exc.line,
        )
        return document
    finally:
        if loader is not None:
            loader.dispose()
    if isinstance(data, dict):
        # A missing top-level field points at the first line of the mapping.
        document.lines[()] = root_line
        document.data = data
    elif data is None:  # a lone "---" or "~"
        document.problems.append(ConfigProblem(file, None, None, _EMPTY))
    elif not document.problems:
        document.report(
            (),
            f"the top level must be a mapping of field names to values, not {yaml_kind(data)}",
            line=root_line,
        )
    return document


def kind_name(
    value: object,
    *,
    null: str = "an empty value",
    sequence: str = "a list",
    mapping: str = "a mapping",
) -> str:
    """The kind of ``value`` in words (never the value: it may be a secret or a payload)."""
    if value is None:
        return null
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return sequence
    if isinstance(value, dict):
        return mapping
    return f"a {type(value).__name__}"


def yaml_kind(value: object) -> str:
    """How a YAML author would name the kind of ``value``: a mapping, a list, a number..."""
    return kind_name(value)


def _syntax_problem(file: str, exc: yaml.MarkedYAMLError) -> ConfigProblem:
    # PyYAML splits its message in two halves: the context ("while scanning a
    # quoted scalar") and the problem ("found unexpected end of stream").
    mark = exc.problem_mark or exc.context_mark
    line = None if mark is None else mark.line + 1
    parts = []
    if exc.context:
        context_line = None if exc.context_mark is None else exc.context_mark.line + 1
        parts.append(
            exc.context if context_line in (None, line) else f"{exc.context} (line {context_line})"
        )
    if exc.problem:
        parts.append(exc.problem)
    message = "invalid YAML: " + ", ".join(parts)
    if exc.problem_mark is not None:
        message += f" (column {exc.problem_mark.column + 1})"
    return ConfigProblem(file, line, None, message)


def _unsupported_tag(tag: str) -> str:
    return f"unsupported YAML tag {tag.replace('tag:yaml.org,2002:', '!!')}: write plain values"


def _line(node: Node) -> int:
    return int(node.start_mark.line) + 1


class _TooManyNodes(Exception):
    def __init__(self, line: int) -> None:
        super().__init__(line)
        self.line = line


class _CountingLoader(yaml.SafeLoader):
    """PyYAML's safe loader that stops composing past MAX_NODES nodes (aliases included)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.nodes = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in the stubs
            raise _TooManyNodes(int(event.start_mark.line) + 1)
        return super().compose_node(parent, index)


class _Converter:
    """Walks a composed node tree into plain data, filling the document's lines and problems."""

    def __init__(self, loader: _CountingLoader, document: YamlDocument) -> None:
        self._loader = loader
        self._document = document
        self._values = 0
        # Ids of the collection nodes being converted: an alias to one of them is a cycle.
        self._active: set[int] = set()

    def convert(self, node: Node, path: DataPath) -> Any:
        self._values += 1
        if self._values > MAX_VALUES:
            # At most MAX_NODES nodes were composed: the rest are aliases expanded.
            if self._values == MAX_VALUES + 1:
                self._document.report(
                    (), f"aliases expand to more than {MAX_VALUES} values", line=1
                )
            return None
        if isinstance(node, ScalarNode):
            return self._scalar(node, path)
        if id(node) in self._active:
            self._reject(path, "an alias refers to a value that contains it", _line(node))
            return None
        self._active.add(id(node))
        try:
            if isinstance(node, MappingNode):
                return self._mapping(node, path)
            if isinstance(node, SequenceNode):
                return self._sequence(node, path)
        finally:
            self._active.discard(id(node))
        self._reject(path, f"unsupported YAML node {type(node).__name__}", _line(node))
        return None

    def _reject(self, path: DataPath, message: str, line: int) -> None:
        self._document.report(path, message, line=line)
        self._document.unchecked.add(path)

    def _scalar(self, node: ScalarNode, path: DataPath) -> Any:
        if node.tag == _STR:
            return str(node.value)
        plain = node.style is None
        implicit_tag = self._loader.resolve(  # type: ignore[no-untyped-call]  # untyped in the stubs
            ScalarNode, node.value, (plain, not plain)
        )
        if node.tag != implicit_tag:
            # An explicit tag that disagrees with the text (!!int abc, !!binary, custom
            # !tags) can fail inside PyYAML's constructors with arbitrary exceptions;
            # configuration never needs one.
            self._reject(path, _unsupported_tag(node.tag), _line(node))
            return str(node.value)
        if node.tag in _CONSTRUCTED:
            return self._loader.construct_object(node)
        # Implicit timestamps ("2024-05-01"), "<<" and "=" as values: no
        # configuration field is a date, so they stay the text that was written.
        return str(node.value)

    def _mapping(self, node: MappingNode, path: DataPath) -> dict[Hashable, Any]:
        if node.tag != _MAP:
            self._reject(path, _unsupported_tag(node.tag), _line(node))
            return {}
        result: dict[Hashable, Any] = {}
        # "<<" merges first, whatever their position: the mapping's own keys win.
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                result.update(self._merged(value_node, path))
        key_lines: dict[Hashable, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                continue
            line = _line(key_node)
            if not isinstance(key_node, ScalarNode):
                self._document.report(
                    path, "a key must be a plain value, not a list or a mapping", line=line
                )
                continue
            # A bad key tag concerns that entry alone, not the whole mapping.
            key = self._scalar(key_node, (*path, str(key_node.value)))
            if key in key_lines:
                self._document.report(
                    (*path, key),
                    f"duplicate key (first defined at line {key_lines[key]})",
                    line=line,
                )
                continue
            key_lines[key] = line
            self._document.lines[(*path, key)] = line
            result[key] = self.convert(value_node, (*path, key))
        return result

    def _merged(self, node: Node, path: DataPath) -> dict[Hashable, Any]:
        sources = node.value if isinstance(node, SequenceNode) else [node]
        merged: dict[Hashable, Any] = {}
        # Per the YAML merge spec, earlier mappings in a "<<" list take precedence.
        for source in reversed(sources):
            if not isinstance(source, MappingNode):
                self._document.report(
                    path, "<< must be followed by a mapping or a list of them", line=_line(node)
                )
                continue
            converted = self.convert(source, path)
            if isinstance(converted, dict):
                merged.update(converted)
        return merged

    def _sequence(self, node: SequenceNode, path: DataPath) -> list[Any]:
        if node.tag != _SEQ:
            self._reject(path, _unsupported_tag(node.tag), _line(node))
            return []
        items = []
        for index, item in enumerate(node.value):
            self._document.lines[(*path, index)] = _line(item)
            items.append(self.convert(item, (*path, index)))
        return items
