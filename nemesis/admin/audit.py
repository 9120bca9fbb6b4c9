"""Every change made through the admin API: who, what, when, in a log line and in the audit log.

The audit log is the DLQ store's (``DeadLetterStore.record_action``), the
one the viewer shows and ``nemesis offsets`` writes to, so one query answers
what happened to an integration whoever did it. The log line is written
first and always; a store that does not answer costs the entry there (an
error names the change), never the change, which is made already.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any, Protocol

import orjson

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.dlq.port import Action, ActionPage, ActionRecord, PageRequest
from nemesis.errors import DlqError
from nemesis.identity import Identity

log = logging.getLogger(__name__)


class AuditStore(Protocol):
    """Where entries are kept: a ``DeadLetterStore`` has these two calls."""

    async def record_action(
        self,
        *,
        who: str,
        action: Action,
        integrations: Collection[str],
        count: int,
        description: str,
        at: float | None = None,
    ) -> ActionRecord: ...

    async def actions(
        self, page: PageRequest | None = None, *, integrations: frozenset[str] | None = None
    ) -> ActionPage: ...


def describe(changes: Mapping[str, Any]) -> str:
    """``delivery.workers=4, paused=true``: the fields a change set, in JSON values."""
    return ", ".join(
        f"{field}={orjson.dumps(value).decode()}" for field, value in sorted(changes.items())
    )


class AdminAudit:
    """Writes what an identity changed; ``store`` None: the log line only."""

    def __init__(self, store: AuditStore | None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.store = store
        self._clock = clock

    async def record(
        self,
        identity: Identity,
        action: Action,
        integrations: Collection[str],
        description: str,
        *,
        count: int = 1,
    ) -> None:
        """One change: logged at once, then appended to the store's audit log."""
        names = sorted(integrations)
        at = self._clock.time()
        log.info(
            "audit: %s by %s on %s: %s",
            action.value,
            identity.actor,
            ", ".join(names) or "-",
            description,
            extra={"action": action.value, "who": identity.actor, "integration": ", ".join(names)},
        )
        if self.store is None:
            return
        try:
            await self.store.record_action(
                who=identity.actor,
                action=action,
                integrations=names,
                count=count,
                description=description,
                at=at,
            )
        except DlqError as exc:
            log.error(  # noqa: TRY400 - the store's failure is in the message; no traceback
                "audit: the audit log did not take %s by %s on %s (%s): the log line above is"
                " the only record",
                action.value,
                identity.actor,
                ", ".join(names),
                exc,
            )
