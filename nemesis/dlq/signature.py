"""Pure functions behind the DLQ's identities: row ids, failure signatures, error patterns.

Every store computes these the same way, so a row id or a group signature
means the same thing in SQLite, in YDB, in the UI's URLs and in the CLI.
"""

from __future__ import annotations

import hashlib
import re

# Longer patterns add nothing to a group's identity and would make two
# errors that differ only in a long tail (a dumped body) two groups.
MAX_PATTERN_CHARS = 200

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_HEX_LITERAL = re.compile(r"\b0[xX][0-9a-fA-F]+\b")
# A bare hex id (object id, hash, trace id) mixes digits and letters; requiring
# both keeps words such as "deadbeef" or "accede" and plain numbers out.
_HEX_ID = re.compile(r"\b(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b")
# Every digit run, even inside a word: "utf8" becomes "utf<n>" in every message
# alike, so grouping stays right, and "order_42" joins "order_43".
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_SPACE = re.compile(r"\s+")


def dead_letter_id(integration: str, event_id: str) -> str:
    """The row id of a source message in one integration's DLQ: 32 hex characters.

    ``event_id`` is the message's CloudEvents id (``nemesis.runtime.events.event_id``):
    the source ``topic:partition:offset`` of its first appearance, carried through
    retry tiers and replays in the ``nemesis-event-id`` metadata. So a message
    dead-lettered twice (a redelivery after a crash, or a requeue that fails
    again) is one row, and the same source message dead in two integrations is
    two rows.
    """
    digest = hashlib.sha256(f"{integration}\x00{event_id}".encode())
    return digest.hexdigest()[:32]


def normalise_error(text: str) -> str:
    """The error text with its variable parts replaced, for grouping similar failures.

    UUIDs become ``<uuid>``, hex ids and ``0x`` literals ``<hex>``, digit runs
    ``<n>``; whitespace collapses; the result is cut at ``MAX_PATTERN_CHARS``.
    """
    text = _UUID.sub("<uuid>", text)
    text = _HEX_LITERAL.sub("<hex>", text)
    text = _HEX_ID.sub("<hex>", text)
    text = _NUMBER.sub("<n>", text)
    text = _SPACE.sub(" ", text).strip()
    return text[:MAX_PATTERN_CHARS]


def failure_signature(integration: str, reason: str, http_status: int | None, error: str) -> str:
    """A failure's group: 16 hex characters over integration, reason, status, error pattern."""
    return pattern_signature(integration, reason, http_status, normalise_error(error))


def pattern_signature(integration: str, reason: str, http_status: int | None, pattern: str) -> str:
    """``failure_signature`` for an error text normalised already."""
    status = "" if http_status is None else str(http_status)
    parts = "\x1f".join((integration, reason, status, pattern))
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


def escape_like(text: str, escape: str = "\\") -> str:
    """``text`` as a literal inside a LIKE pattern that declares ``ESCAPE escape``."""
    return (
        text.replace(escape, escape + escape).replace("%", escape + "%").replace("_", escape + "_")
    )
