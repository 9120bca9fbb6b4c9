"""What pages show: payloads as JSON, text or hex; times; numbers; the overview chart.

Everything here produces text that the templates escape; the one producer
of markup, ``reveal``, escapes first and adds only spans of its own, so a
payload or an error text can never become HTML. Characters that change how
text looks without being seen (bidi overrides, zero-width joiners, control
characters) are wrapped so that they are shown as their code points and
cannot reorder what follows them.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from markupsafe import Markup, escape

from nemesis.dlq import TimeBucket

MAX_SHOWN_CHARS = 256 * 1024  # more than this is offered as a download only
MAX_PARSED_BYTES = 8 * 1024 * 1024  # larger payloads are not parsed for the page
MAX_HEX_BYTES = 64 * 1024
_HEX_WIDTH = 16
_VISIBLE_CONTROLS = frozenset("\n\r\t")


def _hidden(char: str) -> bool:
    if char in _VISIBLE_CONTROLS:
        return False
    # Cc: control characters; Cf: format characters (bidi controls, zero-width
    # space/joiners, BOM, soft hyphen); Zl/Zp: line and paragraph separators.
    return unicodedata.category(char) in {"Cc", "Cf", "Zl", "Zp"}


def _may_hide(text: str) -> bool:
    # str.isprintable (C speed) is False for every character _hidden marks, and for
    # a few more (other spaces, unassigned code points): a cheap test that rules
    # out almost every text before the per-character one.
    return not text.replace("\n", "").replace("\t", "").replace("\r", "").isprintable()


def reveal(text: str) -> Markup:
    """``text`` escaped, with each invisible or reordering character shown as its code point."""
    if not _may_hide(text) or not any(_hidden(char) for char in text):
        return escape(text)
    parts: list[str] = []
    for char in text:
        if not _hidden(char):
            parts.append(str(escape(char)))
            continue
        code = f"U+{ord(char):04X}"
        name = unicodedata.name(char, "control character")
        # The character itself stays (copying gives the original text); CSS
        # isolates it in its span and shows the code point in front of it.
        parts.append(
            f'<span class="cc" data-cp="{code}" title="{code} {escape(name)}">{escape(char)}</span>'
        )
    return Markup("".join(parts))


def hidden_characters(text: str) -> int:
    """How many characters ``reveal`` marks."""
    return sum(1 for char in text if _hidden(char)) if _may_hide(text) else 0


# --- payloads -----------------------------------------------------------------

PayloadKind = Literal["json", "decoded", "text", "binary", "empty"]


@dataclass(frozen=True, slots=True)
class PayloadView:
    """A payload made readable: its kind, the text to show, and what was left out."""

    kind: PayloadKind
    label: str  # e.g. "JSON", "Protobuf shop.v1.Order", "UTF-8 text", "binary"
    text: str
    size: int
    cut: bool  # the text shows only the start; the download has everything
    note: str | None = None  # why the payload is not shown as the integration's format


PayloadDecoder = Callable[[bytes], object]


def payload_view(
    payload: bytes, *, decoder: PayloadDecoder | None = None, decoder_label: str = "decoded"
) -> PayloadView:
    """The best readable form of ``payload``: decoded, JSON, text, or a hex dump."""
    size = len(payload)
    if not payload:
        return PayloadView("empty", "empty", "", 0, False)
    note = None
    if decoder is not None:
        try:
            document = decoder(payload)
        except ValueError as exc:
            note = f"{decoder_label} failed: {exc}"
        else:
            text = _pretty(document)
            if text is not None:
                return _shown("decoded", decoder_label, text, size, None)
    text = None
    if size <= MAX_PARSED_BYTES:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    if text is not None:
        try:
            document = json.loads(text)
        except (ValueError, RecursionError):
            pass
        else:
            pretty = _pretty(document)
            if pretty is not None:
                return _shown("json", "JSON", pretty, size, note)
        if _mostly_printable(text[:MAX_SHOWN_CHARS]):
            return _shown("text", "UTF-8 text", text, size, note)
    shown = payload[:MAX_HEX_BYTES]
    return PayloadView("binary", "binary (hex)", hex_dump(shown), size, len(shown) < size, note)


def _shown(kind: PayloadKind, label: str, text: str, size: int, note: str | None) -> PayloadView:
    if len(text) <= MAX_SHOWN_CHARS:
        return PayloadView(kind, label, text, size, False, note)
    # The rest is in the download.
    return PayloadView(kind, label, text[:MAX_SHOWN_CHARS], size, True, note)


def _pretty(document: object) -> str | None:
    try:
        return json.dumps(document, indent=2, ensure_ascii=False, default=str)
    except (ValueError, TypeError, RecursionError):
        return None


def _mostly_printable(text: str) -> bool:
    if not text:
        return True
    printable = sum(1 for char in text if char.isprintable() or char in "\n\r\t")
    return printable / len(text) >= 0.95


def hex_dump(data: bytes) -> str:
    """Classic offset / hex / ASCII lines, 16 bytes each."""
    lines = []
    for start in range(0, len(data), _HEX_WIDTH):
        chunk = data[start : start + _HEX_WIDTH]
        hex_part = " ".join(f"{b:02x}" for b in chunk)
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"{start:08x}  {hex_part:<{_HEX_WIDTH * 3 - 1}}  {text}")
    return "\n".join(lines)


# --- times and numbers -----------------------------------------------------------


def utc(seconds: float | None, *, with_seconds: bool = True) -> str:
    """``2026-11-30 14:05:09 UTC``; an em dash for None."""
    if seconds is None:
        return "—"
    moment = dt.datetime.fromtimestamp(seconds, dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC" if with_seconds else "%Y-%m-%d %H:%M UTC")


def iso(seconds: float) -> str:
    """ISO 8601 in UTC, for ``<time datetime>`` and the API."""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds")


def ago(seconds: float | None, now: float) -> str:
    """``just now``, ``5 min ago``, ``3 h ago``, ``12 days ago``."""
    if seconds is None:
        return "—"
    delta = now - seconds
    if delta < 0:
        return "in the future"
    if delta < 45:
        return "just now"
    return f"{duration(delta)} ago"


def duration(seconds: float) -> str:
    """A rounded human duration: ``40 s``, ``5 min``, ``3 h 10 min``, ``12 days``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{round(seconds)} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    if seconds < 86400:
        hours, minutes = divmod(round(seconds / 60), 60)
        return f"{hours} h {minutes} min" if minutes and hours < 10 else f"{hours} h"
    days = round(seconds / 86400)
    return f"{days} day" if days == 1 else f"{days} days"


def number(value: int) -> str:
    """``1,234,567``."""
    return f"{value:,}"


# --- the overview chart ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bar:
    """One bucket as an SVG rectangle, with its tooltip."""

    x: float
    y: float
    width: float
    height: float
    count: int
    label: str


@dataclass(frozen=True, slots=True)
class Tick:
    """A labelled position on an axis."""

    position: float
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    """An SVG bar chart laid out on the server (no script needed to draw it)."""

    width: int
    height: int
    plot_left: float
    plot_bottom: float
    plot_width: float
    bars: Sequence[Bar]
    y_ticks: Sequence[Tick]
    x_ticks: Sequence[Tick]
    peak: int
    total: int


def _nice_ceiling(value: int) -> int:
    if value <= 4:
        return 4
    magnitude = 10.0 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return math.ceil(step * magnitude)
    return value


def bar_chart(
    buckets: Sequence[TimeBucket], bucket_s: float, *, width: int = 880, height: int = 200
) -> Chart:
    """Lays out ``buckets`` as bars with a y axis from zero to a round number."""
    left, right, top, bottom = 48.0, 8.0, 10.0, 26.0
    plot_width = width - left - right
    plot_height = height - top - bottom
    peak = max((bucket.count for bucket in buckets), default=0)
    ceiling = _nice_ceiling(peak)
    slot = plot_width / max(1, len(buckets))
    gap = min(4.0, slot * 0.2)
    bars = []
    for i, bucket in enumerate(buckets):
        bar_height = plot_height * bucket.count / ceiling
        # A non-empty bucket stays visible even next to a tall one.
        if bucket.count and bar_height < 2:
            bar_height = 2
        end = bucket.start + bucket_s
        label = f"{number(bucket.count)} dead-lettered, {_span(bucket.start, end, bucket_s)}"
        bars.append(
            Bar(
                round(left + i * slot + gap / 2, 2),
                round(top + plot_height - bar_height, 2),
                round(slot - gap, 2),
                round(bar_height, 2),
                bucket.count,
                label,
            )
        )
    y_ticks = [
        Tick(
            round(top + plot_height - plot_height * fraction, 2), number(round(ceiling * fraction))
        )
        for fraction in (0, 0.5, 1)
    ]
    every = max(1, math.ceil(len(buckets) / 8))
    x_ticks = [
        Tick(round(left + (i + 0.5) * slot, 2), _tick_label(bucket.start, bucket_s))
        for i, bucket in enumerate(buckets)
        if (len(buckets) - 1 - i) % every == 0
    ]
    return Chart(
        width,
        height,
        left,
        top + plot_height,
        plot_width,
        bars,
        y_ticks,
        x_ticks,
        peak,
        sum(bucket.count for bucket in buckets),
    )


def _tick_label(start: float, bucket_s: float) -> str:
    moment = dt.datetime.fromtimestamp(start, dt.UTC)
    if bucket_s >= 86400:
        return moment.strftime("%b %d")
    if bucket_s >= 3600 * 6:
        return moment.strftime("%b %d %H:%M")
    return moment.strftime("%H:%M")


def _span(start: float, end: float, bucket_s: float) -> str:
    if bucket_s >= 86400:
        return dt.datetime.fromtimestamp(start, dt.UTC).strftime("%Y-%m-%d (UTC)")
    first = dt.datetime.fromtimestamp(start, dt.UTC)
    last = dt.datetime.fromtimestamp(end, dt.UTC)
    return f"{first:%Y-%m-%d %H:%M}–{last:%H:%M} UTC"


def share(part: int, whole: int) -> float:
    """``part`` as a percentage of ``whole`` (0 when ``whole`` is 0)."""
    return 0.0 if whole <= 0 else 100.0 * part / whole


def join_names(names: Iterable[str], limit: int = 3) -> str:
    """``a, b, c`` or ``a, b, c and 4 more``."""
    items = sorted(names)
    if len(items) <= limit:
        return ", ".join(items)
    return f"{', '.join(items[:limit])} and {len(items) - limit} more"
