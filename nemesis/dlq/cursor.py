"""Opaque page cursors: a kind tag and a keyset position, base64url-encoded JSON.

A cursor comes back from a browser or a terminal, so decoding trusts
nothing: any malformed, oversized or foreign cursor is ``InvalidCursor``.
A well-formed cursor only positions a page; the filter still decides what
the caller may see, so a forged position reveals nothing.
"""

from __future__ import annotations

import base64
import binascii
import json

from nemesis.errors import InvalidCursor

MAX_CURSOR_CHARS = 256

Part = int | str

# Database integers are 64-bit; a larger number would fail inside the driver, not here.
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def encode_cursor(kind: str, key: tuple[Part, ...]) -> str:
    """``key`` (the last row's sort key) as a URL-safe string tagged with ``kind``."""
    raw = json.dumps([kind, *key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_cursor(
    cursor: str, kind: str, types: tuple[type[int] | type[str], ...]
) -> tuple[Part, ...]:
    """The key inside a cursor of ``kind`` with parts of ``types``, else ``InvalidCursor``."""
    if not cursor or len(cursor) > MAX_CURSOR_CHARS:
        raise InvalidCursor("the page cursor is empty or too long")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        decoded = json.loads(raw)
    except (ValueError, binascii.Error):
        # UnicodeDecodeError and json.JSONDecodeError are ValueErrors too.
        raise InvalidCursor("the page cursor is not one this store issued") from None
    if not isinstance(decoded, list) or len(decoded) != len(types) + 1 or decoded[0] != kind:
        raise InvalidCursor("the page cursor belongs to another list")
    key = tuple(decoded[1:])
    for part, expected in zip(key, types, strict=True):
        # bool is an int to Python, never to us.
        if type(part) is not expected or (
            isinstance(part, int) and not _INT64_MIN <= part <= _INT64_MAX
        ):
            raise InvalidCursor("the page cursor is not one this store issued")
    return key
