"""What every stage is made of: the envelope it works on, its result, and its config base.

A stage is a plain function over an ``Envelope`` (one message and its
decoded document) returning True to pass the message on or False to filter
it out; it raises ``StageFailure`` to dead-letter the message. Stages are
synchronous: the pipeline runs on the runner's hot path and creates no
coroutine per message.

``StageFailure`` is control flow inside ``Pipeline.process`` and never leaves
it (the pipeline turns it into a DEAD result), which is why it is not part of
the ``nemesis.errors`` tree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field

from nemesis.broker.port import Message
from nemesis.config.models import NAME_PATTERN

# Dead-letter reasons: a bounded set, they label DLQ metrics and DLQ searches.
DECODE_ERROR: Final = "decode_error"  # the payload is not what the pipeline decodes
TYPE_ERROR: Final = "type_error"  # a field has the wrong type for the stage (on_error: dead_letter)
PIPELINE_ERROR: Final = "pipeline_error"  # anything else a stage could not do with the message


class _Undecoded:
    """The document of an envelope before any stage decoded the payload."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNDECODED"


UNDECODED: Final = _Undecoded()


class Envelope:
    """One message on its way through a pipeline, and what the stages made of it."""

    __slots__ = ("changed", "content_type", "document", "message")

    def __init__(self, message: Message, document: Any = UNDECODED) -> None:
        self.message = message
        # The decoded payload (any JSON value); UNDECODED until a decode stage ran.
        self.document = document
        # Whether a stage changed the document: only then is it encoded again.
        self.changed = False
        self.content_type: str | None = None


class StageFailure(Exception):
    """Raised by a stage to dead-letter the message; the text never holds payload values."""

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason
        self.text = text


StageFunction = Callable[[Envelope], bool]


def dropping_failures(process: StageFunction) -> StageFunction:
    """``on_error: drop``: a message the stage cannot handle is filtered out instead."""

    def run(envelope: Envelope) -> bool:
        try:
            return process(envelope)
        except StageFailure:
            return False

    return run


def _no_details() -> Mapping[str, int]:
    return {}


@dataclass(frozen=True, slots=True)
class Stage:
    """A built stage: its function and what the compiler must know about it."""

    process: StageFunction
    # The stage reads env.document: the compiler decodes JSON before it unless a decode ran.
    reads_payload: bool = False
    # The stage sets env.document itself (decode).
    decodes: bool = False
    # Extra counters for statistics(), e.g. skips per message type.
    details: Callable[[], Mapping[str, int]] = _no_details


def _no_types() -> Collection[str]:
    return ()


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a stage factory may use besides its own config."""

    # Relative files named in a stage (descriptor sets) are taken from here:
    # the directory of the pipeline file, or of the integration for inline stages.
    base_dir: Path = field(default_factory=Path)
    # The metadata key naming a message's type (the integration's source.type_key).
    type_key: str = "type"
    # The integration's flags.disabled_types as they are *now*: called per message.
    disabled_types: Callable[[], Collection[str]] = _no_types
    # The files the build read, each with the digest of what was read: a reload
    # rebuilds the integration when one of them has changed (see ``read``).
    sources: dict[Path, str] = field(default_factory=dict)

    def read(self, path: Path) -> bytes:
        """The bytes of a file a stage is built from (a descriptor set); kept in ``sources``."""
        data = path.read_bytes()
        self.sources[path] = digest(data)
        return data


def digest(data: bytes) -> str:
    """What ``BuildContext.sources`` keeps of a file's content."""
    return hashlib.sha256(data).hexdigest()


def file_digests(paths: Iterable[Path]) -> dict[Path, str | None]:
    """The digest of each file as it is now (None: unreadable or gone), each read once.

    Blocking (it reads every file): call it from a thread when on the event loop.
    """
    digests: dict[Path, str | None] = {}
    for path in paths:
        if path not in digests:
            try:
                digests[path] = digest(path.read_bytes())
            except OSError:
                digests[path] = None
    return digests


def changed_sources(
    sources: Mapping[Path, str], now: Mapping[Path, str | None] | None = None
) -> list[Path]:
    """The files among ``sources`` whose content is no longer what was read (or that are gone).

    ``now`` is ``file_digests`` of them when already at hand (several pipelines
    built from one file); otherwise the files are read (blocking).
    """
    current = file_digests(sources) if now is None else now
    return [path for path, known in sources.items() if current.get(path) != known]


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """A problem in a stage's config found by its factory, at a path inside that config."""

    path: tuple[Hashable, ...]
    message: str


class StageConfigError(Exception):
    """A factory rejects its config; every issue names the path inside the stage's config."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        super().__init__("; ".join(issue.message for issue in issues))
        self.issues = issues


class StageConfig(BaseModel):
    """Fields every stage accepts; a stage type's config model extends it."""

    # .inf and .nan are never a setting: a breaker with cooldown_s: .inf never recovers.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # The stage's label in metrics and reports; `<index>-<type>` when unset.
    name: Annotated[str, Field(pattern=NAME_PATTERN)] | None = None
