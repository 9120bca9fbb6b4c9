"""Flow control: which sessions of one reader are paused, and why.

A session is paused at its reader for one of three reasons, each a bound on
memory or on what a crash delivers again:

* ``UNCOMMITTED``: the session holds a buffer of messages read and not
  committed (done ones included, waiting behind one that is not, on a log).
* ``BLOCKED``: the flow cannot read for its uncommitted messages, and this
  session's wait behind its first one, unfinished. Held back, they count
  apart until that message finishes (``nemesis.runtime.runner``).
* ``QUEUED``: an internal flow does not take what the shared reader read for
  it (its own buffer is full), and a buffer of it waits in the flow's queue
  (``nemesis.runtime.internal``).

``Pauses`` is the one record of them per reader: a flow's runner pauses
through it, and so do the views of the reader the internal flows share
(theirs is one record for all of them). A session is paused at the reader
when it gains its first reason and resumed when it loses its last, so no
caller resumes what another one paused.

The counted reasons (``UNCOMMITTED``, ``QUEUED``) follow one threshold rule,
``over_buffer``: a session pauses when its count reaches ``delivery.buffer``
and reads again once it is back at half of that or less. The gap between the
two keeps a session near the bound from pausing and resuming at every
message.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from nemesis.broker.port import PartitionSession
from nemesis.runtime.acks import SessionKey


class Why(enum.Enum):
    """Why a session is paused (see the module docstring)."""

    UNCOMMITTED = "uncommitted"
    BLOCKED = "blocked"
    QUEUED = "queued"


# Paused behind what the flow has not finished: such a session's uncommitted messages
# count apart from the flow's bound (each session holds up to a buffer of its own).
COUNTED_APART = frozenset({Why.UNCOMMITTED, Why.BLOCKED})


def over_buffer(count: int, buffer: int, *, paused: bool) -> bool:
    """Whether ``count`` keeps a session paused, or pauses it: a buffer's worth pauses,
    half of one or less resumes."""
    if paused:
        return count > buffer // 2
    return count >= buffer


class Pausable(Protocol):
    """What a record pauses: a source, or a broker reader."""

    def pause(self, session: PartitionSession) -> None: ...

    def resume(self, session: PartitionSession) -> None: ...


@runtime_checkable
class SharesPauses(Protocol):
    """A source whose reader others pause too (an internal flow's view): its record."""

    @property
    def pauses(self) -> Pauses: ...


def key_of(session: PartitionSession) -> SessionKey:
    return (session.topic, session.partition, session.id)


class Pauses:
    """The paused sessions of one reader, each with its reasons."""

    def __init__(self, reader: Pausable) -> None:
        self._reader = reader
        self._reasons: dict[SessionKey, set[Why]] = {}
        self._sessions: dict[SessionKey, PartitionSession] = {}

    def __len__(self) -> int:
        return len(self._reasons)

    def reasons(self, key: SessionKey) -> frozenset[Why]:
        """Why the session of ``key`` is paused; empty when it is not."""
        reasons = self._reasons.get(key)
        return frozenset() if reasons is None else frozenset(reasons)

    def paused_for(self, key: SessionKey, why: Why) -> bool:
        reasons = self._reasons.get(key)
        return reasons is not None and why in reasons

    def counted_apart(self, key: SessionKey) -> bool:
        """Paused behind what its flow has not finished (``COUNTED_APART``)."""
        reasons = self._reasons.get(key)
        return reasons is not None and not COUNTED_APART.isdisjoint(reasons)

    def pause(self, session: PartitionSession, why: Why) -> None:
        """Adds ``why``; the reader pauses the session at its first reason."""
        key = key_of(session)
        reasons = self._reasons.get(key)
        if reasons is None:
            self._reasons[key] = {why}
            self._sessions[key] = session
            self._reader.pause(session)
        else:
            reasons.add(why)

    def resume(self, session: PartitionSession, why: Why) -> None:
        """Drops ``why``; the reader resumes the session when it was the last reason."""
        key = key_of(session)
        reasons = self._reasons.get(key)
        if reasons is None or why not in reasons:
            return
        reasons.discard(why)
        if not reasons:
            del self._reasons[key]
            del self._sessions[key]
            self._reader.resume(session)

    def weigh(self, session: PartitionSession, why: Why, count: int, buffer: int) -> None:
        """Pauses or resumes the session for a counted reason, by ``over_buffer``."""
        reasons = self._reasons.get((session.topic, session.partition, session.id))
        paused = reasons is not None and why in reasons
        if over_buffer(count, buffer, paused=paused) != paused:
            if paused:
                self.resume(session, why)
            else:
                self.pause(session, why)

    def sessions(self, why: Why, topic: str | None = None) -> Iterator[PartitionSession]:
        """The sessions paused for ``why`` (of ``topic``, when given)."""
        for key, reasons in list(self._reasons.items()):
            if why in reasons and (topic is None or key[0] == topic):
                yield self._sessions[key]

    def resume_all(self, why: Why, topic: str | None = None) -> None:
        """Drops ``why`` from every session paused for it (of ``topic``, when given)."""
        for session in list(self.sessions(why, topic)):
            self.resume(session, why)

    def forget_ended(self) -> None:
        """Drops the sessions that ended: their reader holds them no more."""
        for key, session in list(self._sessions.items()):
            if not session.alive:
                del self._sessions[key]
                del self._reasons[key]
