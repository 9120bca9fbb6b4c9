"""Requeue and discard of dead letters (they live in ``nemesis.dlq.requeue`` now).

The path needs only the state store, a broker and the topic names, so the
viewer shares it without importing the runtime; this name stays for the
runtime's callers.
"""

from nemesis.dlq.requeue import ActionResult, discard, matching_ids, requeue

__all__ = ["ActionResult", "discard", "matching_ids", "requeue"]
