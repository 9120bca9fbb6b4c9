"""Garbage-collector settings for a long-running proxy.

Everything loaded at start (FastAPI, pydantic, the SDKs, the integrations)
lives as long as the process: about half a million objects that every full
collection would walk again. ``settle_heap`` moves them out of the
collector's sight (``gc.freeze``) once start-up is done, and raises the
young generation's threshold so that the short-lived objects of each
delivery (a message, its event, its request) mostly die before a collection
looks at them. Measured with tests/bench/delivery.py: batches of 100 deliver
about 15% more messages per second with it.
"""

from __future__ import annotations

import gc
from typing import Final

# Allocations (minus deallocations) between young collections; CPython's default is 700.
YOUNG_THRESHOLD: Final = 20_000


def settle_heap() -> None:
    """Freezes what start-up built and tunes the collector for the delivery loop."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
