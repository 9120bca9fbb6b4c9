"""The ledger of a test handler: every event it received, as it received it.

One entry per event: a binary-mode request gives one, a batch request one per
event in it. Entries are recorded on arrival with the answer the server chose
for them, so a request that hangs is already in the ledger. The ledger can be
mirrored to a JSON-lines file and read back with ``Ledger.load``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from nemesis.delivery.contract import VERDICT_HEADER, answer_for_response


@dataclass(slots=True)
class LedgerEntry:
    """One event as the handler received it, with the answer it got."""

    request: int  # 1-based number of the HTTP request that carried the event
    connection: int  # 1-based number of the TCP connection it came on
    id: str | None  # ce-id (None when the request was not a CloudEvent)
    topic: str | None
    partition: int | None
    offset: int | None
    attempt: int | None  # ce-attempt as the sender numbered it
    type: str | None
    source: str | None
    time: str | None
    key: str | None  # ce-partitionkey, percent-decoded
    content_type: str | None  # the request's content type, or a batch event's datacontenttype
    body: bytes  # binary mode: the request body; batch: the event's data (JSON re-serialised)
    headers: dict[str, str]  # the request headers, names lower-cased
    received_monotonic: float
    received_wall: float
    mode: str = "binary"  # binary | structured | batch
    batch_size: int = 0  # events in the batch request, 0 outside batch mode
    method: str = "POST"
    path: str = "/"
    receipt: int = 0  # how many times this id has arrived, this one included
    status: int = 0  # the status the server answered; 0: it dropped the connection instead
    verdict: str | None = None  # the nemesis-verdict header the server answered, if any

    @property
    def done(self) -> bool:
        """Whether the answer finishes the event for the sender (delivered or dropped)."""
        headers = None if self.verdict is None else {VERDICT_HEADER: self.verdict}
        return answer_for_response(self.status, headers).outcome.done

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: the body as text when it is UTF-8, else as ``body_base64``."""
        record: dict[str, Any] = {
            name: getattr(self, name) for name in _JSON_FIELDS if name not in ("body",)
        }
        try:
            record["body"] = self.body.decode("utf-8")
        except UnicodeDecodeError:
            record["body_base64"] = base64.b64encode(self.body).decode("ascii")
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> LedgerEntry:
        """The inverse of ``to_json``."""
        fields = {name: record[name] for name in _JSON_FIELDS if name in record and name != "body"}
        if "body_base64" in record:
            body = base64.b64decode(record["body_base64"])
        else:
            body = str(record.get("body", "")).encode("utf-8")
        return cls(body=body, **fields)


_JSON_FIELDS = tuple(LedgerEntry.__dataclass_fields__)


@dataclass(slots=True)
class _Index:
    arrivals: Counter[str] = field(default_factory=Counter)
    done: Counter[str] = field(default_factory=Counter)


class Ledger:
    """Entries in arrival order, with the per-id views tests ask for."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.entries: list[LedgerEntry] = []
        self.requests = 0
        self._index = _Index()
        self._changed = asyncio.Event()
        # Appended to, so that a handler restarted on the same file keeps one history.
        self._file: io.BufferedWriter | None = open(path, "ab") if path is not None else None  # noqa: SIM115

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[LedgerEntry]:
        return iter(self.entries)

    def admit(self, entries: Sequence[LedgerEntry]) -> None:
        """Numbers each entry's receipt of its id (called by the server before it answers)."""
        arrivals = self._index.arrivals
        for entry in entries:
            if entry.id is not None:
                arrivals[entry.id] += 1
                entry.receipt = arrivals[entry.id]

    def record(self, entries: Sequence[LedgerEntry]) -> None:
        """Appends the entries of one request, answered (called by the server)."""
        self.requests += 1
        self.entries.extend(entries)
        done = self._index.done
        for entry in entries:
            if entry.id is not None and entry.done:
                done[entry.id] += 1
        if self._file is not None:
            for entry in entries:
                self._file.write(orjson.dumps(entry.to_json(), option=orjson.OPT_APPEND_NEWLINE))
            # Flushed per request: a test may read the file while the server runs.
            self._file.flush()
        self._changed.set()

    def ids(self) -> set[str]:
        """Every id that arrived, whatever the answer."""
        return set(self._index.arrivals)

    def done_ids(self) -> set[str]:
        """Ids answered done (2xx or a drop verdict) at least once."""
        return set(self._index.done)

    def counts(self) -> Counter[str]:
        """Arrivals per id: attempts and duplicates alike."""
        return Counter(self._index.arrivals)

    def duplicates(self) -> dict[str, int]:
        """Ids answered done more than once, with how many times."""
        return {id_: n for id_, n in self._index.done.items() if n > 1}

    def by_id(self, id_: str) -> list[LedgerEntry]:
        """Every arrival of one id, in order."""
        return [entry for entry in self.entries if entry.id == id_]

    async def wait_until(
        self, predicate: Callable[[Ledger], bool], timeout_s: float = 10.0, what: str = ""
    ) -> None:
        """Waits until ``predicate(ledger)`` holds; TimeoutError after ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate(self):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"{what or 'condition'} not met after {timeout_s}s "
                f"({self.requests} requests, {len(self._index.arrivals)} ids, "
                f"{len(self._index.done)} done)"
            ) from None

    async def wait_for(self, count: int, timeout_s: float = 10.0) -> None:
        """Waits until ``count`` distinct ids were answered done."""
        await self.wait_until(
            lambda ledger: len(ledger._index.done) >= count, timeout_s, f"{count} ids done"
        )

    def clear(self) -> None:
        """Forgets every entry (the file, if any, keeps them)."""
        self.entries.clear()
        self.requests = 0
        self._index = _Index()

    def close(self) -> None:
        """Closes the JSON-lines file."""
        if self._file is not None:
            self._file.close()
            self._file = None

    @classmethod
    def load(cls, path: str | Path) -> Ledger:
        """A ledger read back from a JSON-lines file (requests counted by request number)."""
        ledger = cls()
        with open(path, "rb") as lines:
            entries = [LedgerEntry.from_json(orjson.loads(line)) for line in lines if line.strip()]
        # Consecutive lines of one request number: a restarted server numbers from 1 again.
        for _, request in itertools.groupby(entries, key=lambda entry: entry.request):
            request_entries = list(request)
            ledger.admit(request_entries)
            ledger.record(request_entries)
        return ledger
