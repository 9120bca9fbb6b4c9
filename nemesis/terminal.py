"""Text from messages, made inert before it reaches a terminal.

Payloads, handler errors and even YAML keys come from other people. Printed
raw, an ESC sequence can rewrite the screen or the window title, and a
RIGHT-TO-LEFT OVERRIDE (U+202E) can make ``exe.txt`` read as ``txt.exe``.
Every character a terminal would act on instead of showing (controls,
format characters such as the bidirectional overrides, line and paragraph
separators, unassigned code points) is written as its escape: ``\\x1b``,
``\\u202e``. The escapes are the ones Python uses, so the text stays
readable and nothing is lost.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["inert", "inert_json"]

# Categories a terminal does not simply draw: controls, format characters
# (bidi overrides, zero-width joiners), surrogates, private use, unassigned,
# and the line/paragraph separators.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# Only characters outside printable ASCII can be hidden; a quick scan skips the rest.
_SUSPECT = re.compile(r"[^\x20-\x7e\n\t]")


def _hidden(char: str) -> bool:
    return unicodedata.category(char) in _HIDDEN


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def inert(text: str, *, multiline: bool = False) -> str:
    """``text`` with every character a terminal would act on escaped.

    With ``multiline``, newlines and tabs stay (a pretty-printed payload);
    otherwise they are escaped too, so one value stays on one line.
    """
    if not _SUSPECT.search(text) and (multiline or not ("\n" in text or "\t" in text)):
        return text
    kept = "\n\t" if multiline else ""
    return "".join(
        _escape(char) if char not in kept and (_hidden(char) or char in "\n\t") else char
        for char in text
    )


def inert_json(text: str) -> str:
    """JSON text with the hidden characters inside its strings written as ``\\uXXXX`` escapes.

    The result parses to the same value. Hidden characters can only be inside
    strings: JSON allows none elsewhere besides whitespace, which is kept.
    """
    if not _SUSPECT.search(text):
        return text
    out = []
    for char in text:
        if char in " \n\t\r" or not _hidden(char):
            out.append(char)
            continue
        code = ord(char)
        if code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:  # a surrogate pair, as JSON writes characters beyond the BMP
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
    return "".join(out)
