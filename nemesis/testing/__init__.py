"""Reusable fakes for testing Nemesis and the handlers built for it.

``HandlerServer`` is a real HTTP handler on loopback that records every
delivery in a ``Ledger`` and misbehaves on demand. ``FakeTransport`` is a
transport answering in-process from a function, for tests that need the
handler's answers but not the wire. Both modules are imported on first use,
so that ``python -m nemesis.testing.handler`` does not find itself imported
already by this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nemesis.testing.ledger import Ledger, LedgerEntry

if TYPE_CHECKING:
    from nemesis.testing.handler import HandlerServer, Response, Rule, response
    from nemesis.testing.transport import FakeRequest, FakeTransport, Reply

__all__ = [
    "FakeRequest",
    "FakeTransport",
    "HandlerServer",
    "Ledger",
    "LedgerEntry",
    "Reply",
    "Response",
    "Rule",
    "response",
]

_LAZY = {
    **dict.fromkeys(("HandlerServer", "Response", "Rule", "response"), "nemesis.testing.handler"),
    **dict.fromkeys(("Reply", "FakeRequest", "FakeTransport"), "nemesis.testing.transport"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
