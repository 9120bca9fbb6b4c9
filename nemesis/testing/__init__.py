"""Reusable fakes for testing Nemesis and the handlers built for it.

``HandlerServer`` is a real HTTP handler on loopback that records every
delivery in a ``Ledger`` and misbehaves on demand. The handler module is
imported on first use, so that ``python -m nemesis.testing.handler`` does not
find itself imported already by this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nemesis.testing.ledger import Ledger, LedgerEntry

if TYPE_CHECKING:
    from nemesis.testing.handler import HandlerServer, Response, Rule, response

__all__ = ["HandlerServer", "Ledger", "LedgerEntry", "Response", "Rule", "response"]

_FROM_HANDLER = frozenset({"HandlerServer", "Response", "Rule", "response"})


def __getattr__(name: str) -> Any:
    if name in _FROM_HANDLER:
        return getattr(importlib.import_module("nemesis.testing.handler"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
