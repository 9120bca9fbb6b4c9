"""Periodic chores of a running proxy that belong to no single integration."""

from __future__ import annotations

import asyncio
import logging

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.dlq import DeadLetterStore
from nemesis.errors import NemesisError

log = logging.getLogger(__name__)

DLQ_RETENTION_INTERVAL_S = 3600.0


async def enforce_dlq_retention(
    store: DeadLetterStore,
    *,
    interval_s: float = DLQ_RETENTION_INTERVAL_S,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """Deletes expired dead letters now and then every ``interval_s``; runs until cancelled.

    A failure is logged and tried again at the next round: retention is
    housekeeping, and must never stop deliveries.
    """
    while True:
        try:
            deleted = await store.enforce_retention(clock.time())
        except NemesisError as exc:
            log.warning("DLQ retention failed, trying again in %.0fs: %s", interval_s, exc)
        else:
            if deleted:
                log.info("DLQ retention deleted %d expired dead letters", deleted)
        await clock.sleep(interval_s)


def start_dlq_retention(
    tasks: asyncio.TaskGroup, store: DeadLetterStore, *, clock: Clock = SYSTEM_CLOCK
) -> asyncio.Task[None]:
    """Starts the retention loop in the caller's task group (cancel it to stop)."""
    return tasks.create_task(enforce_dlq_retention(store, clock=clock), name="dlq-retention")
