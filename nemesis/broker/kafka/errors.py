"""aiokafka exceptions translated into Nemesis' error tree, at the backend boundary.

Which Nemesis error each client error becomes is decided here and nowhere
else. Every call into the client runs under a deadline (``kafka_call``):
aiokafka retries retriable errors on its own, some of them (a commit while
the coordinator is away) forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka import errors

from nemesis.errors import (
    BrokerAccessDenied,
    BrokerError,
    BrokerTimeout,
    TopicExists,
    TopicNotFound,
)

T = TypeVar("T")

_DENIED = (
    errors.AuthenticationFailedError,
    errors.AuthenticationMethodNotSupported,
    errors.SaslAuthenticationFailed,
    errors.UnsupportedSaslMechanismError,
    errors.IllegalSaslStateError,
    errors.TopicAuthorizationFailedError,
    errors.GroupAuthorizationFailedError,
    errors.ClusterAuthorizationFailedError,
)
_TIMED_OUT = (TimeoutError, errors.KafkaTimeoutError, errors.RequestTimedOutError)


def broker_error(exc: BaseException, what: str) -> BrokerError:
    """The BrokerError for a failed Kafka call; ``what`` names the call and its object."""
    text = f"{what}: {describe(exc)}"
    if isinstance(exc, _TIMED_OUT):
        return BrokerTimeout(text)
    if isinstance(exc, errors.UnknownTopicOrPartitionError):
        return TopicNotFound(text)
    if isinstance(exc, errors.TopicAlreadyExistsError):
        return TopicExists(text)
    if isinstance(exc, _DENIED):
        return BrokerAccessDenied(text)
    return BrokerError(text)


def error_for_code(code: int, what: str, message: str | None = None) -> BrokerError:
    """The BrokerError for an error code in a response (admin answers carry codes, not raises)."""
    exc = errors.for_code(code)(message or "")
    return broker_error(exc, what)


async def kafka_call(what: str, call: Awaitable[T], timeout_s: float) -> T:
    """Awaits one client call under a deadline; its failures come out as BrokerErrors."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except (errors.KafkaError, TimeoutError, OSError) as exc:
        raise broker_error(exc, what) from exc


async def kafka_call_retrying(what: str, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """``kafka_call`` that repeats ``call()`` on retriable errors until the deadline.

    For the calls aiokafka does not retry itself, such as finding a group's
    coordinator: a fresh cluster answers "coordinator not available" while it
    creates its offsets topic, and a coordinator that moved says so once.
    """
    backoff_s = 0.1
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    return await call()
                except errors.KafkaError as exc:
                    if not exc.retriable:
                        raise
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 1.0)
    except (errors.KafkaError, TimeoutError, OSError) as exc:
        raise broker_error(exc, what) from exc


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "no answer in time"
    return f"{type(exc).__name__}: {exc}"
