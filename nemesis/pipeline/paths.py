"""Field paths: where a stage reads a value, in the payload or in the message around it.

::

    order.city            payload field "city" inside the object "order"
    items.0.sku           a digit segment also indexes a list
    a\\.b                  a literal dot in a key ("a.b")
    $payload              the whole payload (any JSON value)
    $payload.any          payload field "any" (a key that is also a pattern keyword)
    $metadata.type        a metadata item (the name is taken verbatim, dots included)
    $key $topic           the message key (missing when the message has none), its topic
    $partition $offset    integers

A value that is not there is ``MISSING``: a field that is absent, or a path
that goes through something that is not an object (or a list, for a digit
segment). Writes (transform) go into objects only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from nemesis.config.document import kind_name
from nemesis.pipeline.stage import TYPE_ERROR, Envelope, StageFailure

MAX_SEGMENTS = 64


class _Missing:
    """The value of a path that leads nowhere."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()


class Root(enum.Enum):
    PAYLOAD = "$payload"
    METADATA = "$metadata"
    KEY = "$key"
    TOPIC = "$topic"
    PARTITION = "$partition"
    OFFSET = "$offset"


# What a message-level root always holds: patterns that need another kind are rejected.
ROOT_KINDS: Final = {
    Root.METADATA: "string",
    Root.KEY: "string",
    Root.TOPIC: "string",
    Root.PARTITION: "number",
    Root.OFFSET: "number",
}

_ROOTS = {root.value: root for root in Root}
_EXPECTED_ROOTS = "$payload, $metadata.<name>, $key, $topic, $partition or $offset"


class PathError(ValueError):
    """A path that cannot be parsed; the message says why."""


@dataclass(frozen=True, slots=True)
class FieldPath:
    """A parsed path: its root and, under $payload, the segments; under $metadata, the name."""

    text: str
    root: Root
    segments: tuple[str, ...] = ()

    @property
    def indexes(self) -> tuple[int | None, ...]:
        """Per segment, the list index it also stands for (digits only), else None."""
        return tuple(_index(segment) for segment in self.segments)

    @property
    def reads_payload(self) -> bool:
        return self.root is Root.PAYLOAD


def parse_path(text: object, *, payload_only: bool = False) -> FieldPath:
    """Parse a path as written in YAML; raises PathError."""
    if not isinstance(text, str):
        raise PathError(f"a path must be a string, not {type(text).__name__}")
    if not text:
        raise PathError("a path cannot be empty")
    if not text.startswith("$"):
        return FieldPath(text, Root.PAYLOAD, _segments(text))
    head, dot, rest = text.partition(".")
    root = _ROOTS.get(head)
    if root is None:
        raise PathError(f"unknown message field {head!r}: expected {_EXPECTED_ROOTS}")
    if payload_only and root is not Root.PAYLOAD:
        raise PathError(f"{head} cannot be written: write payload fields only")
    if root is Root.PAYLOAD:
        return FieldPath(text, root, _segments(rest) if dot else ())
    if root is Root.METADATA:
        if not rest:
            raise PathError("$metadata needs an item name: $metadata.<name>")
        return FieldPath(text, root, (rest,))
    if dot:
        raise PathError(f"{head} has no fields: write {head} alone")
    return FieldPath(text, root)


def _segments(text: str) -> tuple[str, ...]:
    segments: list[str] = []
    current: list[str] = []
    chars = iter(text)
    for char in chars:
        if char == "\\":
            escaped = next(chars, None)
            if escaped not in (".", "\\"):
                raise PathError(r"a backslash escapes only '.' or '\' in a path")
            current.append(escaped)
        elif char == ".":
            segments.append("".join(current))
            current = []
        else:
            current.append(char)
    segments.append("".join(current))
    if any(not segment for segment in segments):
        raise PathError("empty segment in the path (two dots, or a dot at an end)")
    if len(segments) > MAX_SEGMENTS:
        raise PathError(f"a path has at most {MAX_SEGMENTS} segments")
    return tuple(segments)


def _index(segment: str) -> int | None:
    # str.isdigit() accepts "²" and other digits int() rejects.
    return int(segment) if segment.isascii() and segment.isdigit() else None


def lookup(document: Any, segments: tuple[str, ...], indexes: tuple[int | None, ...]) -> Any:
    """The value at ``segments`` inside ``document``, or MISSING."""
    node = document
    for segment, index in zip(segments, indexes, strict=True):
        if type(node) is dict:
            node = node.get(segment, MISSING)
            if node is MISSING:
                return MISSING
        elif index is not None and type(node) is list:
            if index >= len(node):
                return MISSING
            node = node[index]
        else:
            return MISSING
    return node


def getter(path: FieldPath) -> Callable[[Envelope], Any]:
    """A function reading ``path`` from an envelope; MISSING when it is not there."""
    root = path.root
    if root is Root.PAYLOAD:
        segments, indexes = path.segments, path.indexes
        if not segments:
            return _whole_payload
        return lambda env: lookup(env.document, segments, indexes)
    if root is Root.METADATA:
        name = path.segments[0]
        return lambda env: env.message.metadata.get(name, MISSING)
    if root is Root.KEY:
        return _key
    if root is Root.TOPIC:
        return _topic
    if root is Root.PARTITION:
        return _partition
    return _offset


def _whole_payload(env: Envelope) -> Any:
    return env.document


def _key(env: Envelope) -> Any:
    key = env.message.key
    return MISSING if key is None else key


def _topic(env: Envelope) -> Any:
    return env.message.topic


def _partition(env: Envelope) -> Any:
    return env.message.partition


def _offset(env: Envelope) -> Any:
    return env.message.offset


def pop(document: dict[str, Any], segments: tuple[str, ...]) -> Any:
    """Removes the value at ``segments`` (through objects only) and returns it, or MISSING."""
    parent: Any = document
    for segment in segments[:-1]:
        parent = parent.get(segment) if type(parent) is dict else None
    if type(parent) is not dict:
        return MISSING
    return parent.pop(segments[-1], MISSING)


def put(document: dict[str, Any], path: FieldPath, value: Any) -> None:
    """Sets the value at ``path``, creating objects on the way; StageFailure on a non-object."""
    parent = document
    for depth, segment in enumerate(path.segments[:-1]):
        child = parent.get(segment, MISSING)
        if child is MISSING:
            child = parent[segment] = {}
        elif type(child) is not dict:
            where = ".".join(path.segments[: depth + 1])
            raise StageFailure(
                TYPE_ERROR, f"cannot set {path.text}: {where} is {json_kind(child)}, not an object"
            )
        parent = child
    parent[path.segments[-1]] = value


def json_kind(value: object) -> str:
    """How JSON would name the kind of ``value``; never the value itself."""
    return kind_name(value, null="null", sequence="an array", mapping="an object")
