"""botocore's exceptions translated into Nemesis' error tree, at the source's boundary.

Which Nemesis error an SQS answer becomes is decided here and nowhere else.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from nemesis.errors import BrokerAccessDenied, BrokerError, BrokerTimeout, TopicNotFound

T = TypeVar("T")

_XML_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]{1,500})</Message>")

_NO_QUEUE = {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"}
_DENIED = {
    "AccessDenied",
    "AccessDeniedException",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "UnrecognizedClientException",
    "InvalidSecurity",
    "MissingAuthenticationToken",
    "ExpiredToken",
}


def error_code(exc: ClientError) -> str:
    """The answer's error code; from an XML body the client could not read (moto answers a JSON
    request's refusal in XML), else the HTTP status."""
    error: Any = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    if code.isdigit() and (found := _XML_CODE.search(str(error.get("Message", "")))):
        return found.group(1)
    return code


def sqs_error(exc: BaseException, what: str) -> BrokerError:
    """The BrokerError for a failed SQS call; ``what`` names the call and its queue."""
    if isinstance(exc, TimeoutError):
        return BrokerTimeout(f"{what}: no answer in time")
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return BrokerAccessDenied(
            f"{what}: no AWS credentials found (set AWS_ACCESS_KEY_ID and"
            " AWS_SECRET_ACCESS_KEY, or a profile or role the AWS chain finds)"
        )
    if isinstance(exc, ClientError):
        code = error_code(exc)
        message = str(exc.response.get("Error", {}).get("Message", "")) or code
        if found := _XML_MESSAGE.search(message):
            message = found.group(1)
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 403 and code.isdigit():
            code = "Forbidden"
        if code in _NO_QUEUE:
            return TopicNotFound(f"{what}: the queue does not exist ({message})")
        if code in _DENIED or code == "Forbidden":
            return BrokerAccessDenied(f"{what}: credentials refused: {code}: {message}")
        return BrokerError(f"{what}: {code}: {message}")
    return BrokerError(f"{what}: {type(exc).__name__}: {exc}")


async def sqs_call(what: str, call: Awaitable[T], timeout_s: float) -> T:
    """Awaits one client call under a deadline; its failures come out as BrokerErrors."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except (ClientError, BotoCoreError, TimeoutError, OSError) as exc:
        raise sqs_error(exc, what) from exc
