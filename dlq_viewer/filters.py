"""The list filter as a page's query string: parsed, checked, scoped, described, re-linked.

Everything here comes from a browser, so it is checked as text first
(lengths, shapes) and then by ``DeadLetterFilter`` itself; every problem is
an ``InvalidQuery`` with a sentence for the person, which pages show next
to the form and the API returns as a 400. A person's scope (the
integrations their teams own) is applied here, once: asking for an
integration outside it gives an empty list, never an error that would
confirm the integration exists.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from urllib.parse import urlencode

from dlq_viewer.render import utc
from nemesis.dlq import DeadLetterFilter, Reason, Status
from nemesis.errors import InvalidQuery

STATUS_ANY = "any"
RANGES: dict[str, tuple[str, float]] = {
    "15m": ("last 15 minutes", 900.0),
    "1h": ("last hour", 3600.0),
    "6h": ("last 6 hours", 6 * 3600.0),
    "24h": ("last 24 hours", 86400.0),
    "7d": ("last 7 days", 7 * 86400.0),
    "30d": ("last 30 days", 30 * 86400.0),
}
RANGE_CUSTOM = "custom"
MAX_PARAM_CHARS = 300  # any longer query value is refused before it is looked at
_INTEGRATION = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_LOCAL_TIME_FORMATS = ("%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d")
_EARLIEST = dt.datetime(2000, 1, 1, tzinfo=dt.UTC).timestamp()
_LATEST = dt.datetime(2200, 1, 1, tzinfo=dt.UTC).timestamp()


def parse_time(text: str, name: str) -> float:
    """A time typed in a form (UTC) or sent by a script: ISO 8601 or Unix seconds."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
        for form in _LOCAL_TIME_FORMATS:
            try:
                moment = dt.datetime.strptime(text, form).replace(tzinfo=dt.UTC)
            except ValueError:
                continue
            seconds = moment.timestamp()
            break
        else:
            try:
                moment = dt.datetime.fromisoformat(text)
            except ValueError:
                raise InvalidQuery(
                    f"{name}: expected a time such as 2026-11-30T14:05 (UTC)"
                ) from None
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=dt.UTC)
            seconds = moment.timestamp()
    return check_time(seconds, name)


def check_time(seconds: float, name: str) -> float:
    """``seconds`` if it is a time the viewer and the store can work with, else ``InvalidQuery``.

    Every time from a request passes here before it reaches the store or a
    date formatter: both fail on values like 1e20 (beyond any date).
    """
    if not (math.isfinite(seconds) and _EARLIEST <= seconds <= _LATEST):
        raise InvalidQuery(f"{name}: the time is out of range (years 2000 to 2200)")
    return seconds


def form_time(seconds: float) -> str:
    """``seconds`` as a ``datetime-local`` input value (UTC)."""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M")


def search_text(text: str) -> str:
    """A text to search for, else ``InvalidQuery`` (control characters never match on purpose)."""
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in text):
        # Nobody types them, and the stores keep a NUL differently in the error text (as
        # U+FFFD) and in the payload (as is): refused rather than half found.
        raise InvalidQuery("the search text has control characters")
    return text


def integration_name(text: str) -> str:
    """A well-formed integration name, else ``InvalidQuery``."""
    if not _INTEGRATION.match(text):
        raise InvalidQuery("an integration name has lowercase letters, digits and dashes")
    return text


@dataclass(frozen=True, slots=True)
class ListFilter:
    """The filter form's fields as the page's query string holds them (all text)."""

    integration: str = ""
    reason: str = ""
    status: str = Status.DEAD.value  # the list shows what waits for someone unless asked
    http_status: str = ""
    group: str = ""  # a failure signature
    q: str = ""  # text inside the payload or the error
    range: str = ""  # a RANGES key, RANGE_CUSTOM, or "" (any time)
    since: str = ""  # with range=custom: UTC times as typed, or Unix seconds
    until: str = ""

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> ListFilter:
        """The filter in a query string or a form; unknown keys are ignored."""
        values: dict[str, str] = {}
        for item in fields(cls):
            value = params.get(item.name)
            if value is None:
                continue
            if len(value) > MAX_PARAM_CHARS:
                raise InvalidQuery(f"{item.name}: longer than {MAX_PARAM_CHARS} characters")
            values[item.name] = value if item.name == "q" else value.strip()
        return cls(**values)

    def to_filter(self, scope: frozenset[str] | None, now: float) -> DeadLetterFilter:
        """The store filter this form asks for, within ``scope``; ``InvalidQuery`` if malformed."""
        integrations = scope
        if self.integration:
            wanted = frozenset({integration_name(self.integration)})
            integrations = wanted if scope is None else wanted & scope
        try:
            reason = Reason(self.reason) if self.reason else None
        except ValueError:
            raise InvalidQuery(f"reason: one of {', '.join(r.value for r in Reason)}") from None
        status: Status | None = None
        if self.status and self.status != STATUS_ANY:
            try:
                status = Status(self.status)
            except ValueError:
                raise InvalidQuery(
                    f"status: one of {', '.join(s.value for s in Status)} or {STATUS_ANY}"
                ) from None
        http_status = None
        if self.http_status:
            if not self.http_status.isdigit() or len(self.http_status) > 3:
                raise InvalidQuery("HTTP status: a number from 100 to 599")
            http_status = int(self.http_status)
        since, until = self.time_range(now)
        return DeadLetterFilter(
            integrations=integrations,
            reason=reason,
            status=status,
            http_status=http_status,
            signature=self.group or None,
            since=since,
            until=until,
            text=search_text(self.q) if self.q else None,
        )

    def time_range(self, now: float) -> tuple[float | None, float | None]:
        """(since, until) in Unix seconds; None where open."""
        if not self.range:
            if self.since or self.until:
                return self._custom()
            return None, None
        if self.range == RANGE_CUSTOM:
            return self._custom()
        if self.range not in RANGES:
            raise InvalidQuery(f"range: one of {', '.join(RANGES)}, {RANGE_CUSTOM} or empty")
        return now - RANGES[self.range][1], None

    def _custom(self) -> tuple[float | None, float | None]:
        since = parse_time(self.since, "from") if self.since else None
        until = parse_time(self.until, "to") if self.until else None
        if since is not None and until is not None and since > until:
            raise InvalidQuery("the time range ends before it starts")
        return since, until

    def frozen_at(self, now: float) -> ListFilter:
        """This filter over dead rows with absolute times ending no later than ``now``.

        A bulk action acts on what the person counted: rows that die after
        the confirmation are not part of it.
        """
        since, until = self.time_range(now)
        until = now if until is None else min(until, now)
        return replace(
            self,
            status=Status.DEAD.value,
            range=RANGE_CUSTOM,
            since="" if since is None else repr(since),
            until=repr(until),
        )

    def params(self, **changes: str) -> dict[str, str]:
        """The fields that differ from an empty form, after ``changes``."""
        chosen = replace(self, **changes) if changes else self
        default = ListFilter()
        values = {}
        for item in fields(chosen):
            value = getattr(chosen, item.name)
            if value != getattr(default, item.name):
                values[item.name] = value
        if chosen.status == default.status:
            values.pop("status", None)
        return values

    def query(self, **changes: str) -> str:
        """``params`` as a query string (without the ``?``)."""
        return urlencode(self.params(**changes))

    @property
    def narrowed(self) -> bool:
        """True when anything but the default status is set."""
        return bool(self.params())

    def describe(self, now: float) -> str:
        """The filter in words, for confirmations and the audit log."""
        parts = []
        if self.integration:
            parts.append(f"integration {self.integration}")
        parts += filter_terms(self.group, self.reason, self.http_status, self.q)
        since, until = self.time_range(now)
        if self.range in RANGES:
            parts.append(RANGES[self.range][0])
        else:
            if since is not None:
                parts.append(f"since {utc(since)}")
            if until is not None:
                parts.append(f"before {utc(until)}")
        if self.status and self.status not in (STATUS_ANY, Status.DEAD.value):
            parts.insert(0, f"status {self.status}")
        return ", ".join(parts) if parts else "any integration, any time"


def filter_terms(
    group: str | None, reason: str | None, http_status: int | str | None, text: str | None
) -> list[str]:
    """The words for the parts of a filter that pages and the API describe alike."""
    parts = []
    if group:
        parts.append(f"group {group}")
    if reason:
        parts.append(f"reason {reason}")
    if http_status:
        parts.append(f"HTTP {http_status}")
    if text:
        parts.append(f"text contains {text!r}")
    return parts
