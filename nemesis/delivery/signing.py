"""Signed deliveries: how Nemesis signs a request and how a handler checks it.

The scheme (one header, any language can check it with HMAC-SHA256)::

    nemesis-signature: t=<unix seconds>,v1=<hex>[,v1=<hex>]

    v1 = hex(HMAC-SHA256(secret, "<t>.<event id>." + body))

- ``t`` is when Nemesis sent the request, in whole seconds since the epoch;
  a handler refuses a request whose ``t`` is further than its tolerance
  (300 s by default) from its own clock, so a captured request cannot be
  replayed later.
- ``event id`` is the request's ``ce-id`` header; a batch request (whose body
  carries every event's id) signs the empty string in its place.
- ``body`` is the request body exactly as sent, bytes, before any decoding.
- During a rotation Nemesis holds two secrets and sends one ``v1`` for each;
  a handler accepts the request when any ``v1`` matches any of its secrets,
  so old and new handlers both pass while the secrets change.

Over gRPC the header is the call's ``nemesis-signature`` metadata, and what
is signed is defined on the protobuf fields, so that a handler never needs
the bytes of the request as they travelled:

- ``Deliver``: ``event id`` is ``Event.id``; ``body`` is ``Event.data``.
- ``DeliverBatch``: ``event id`` is the empty string, as for an HTTP batch;
  ``body`` is every event's ``id`` (UTF-8) and ``data``, in the request's
  order, each written as a netstring, ``<length in decimal>:<bytes>,``
  (``grpc_batch_body``). Two events ``a`` / ``{}`` and ``b7`` / (empty) sign
  ``1:a,2:{},2:b7,0:,``.

Nemesis takes ``t`` from its clock when it sends the request (a retry is
signed anew), and the secrets from the environment variables the
integration's ``target.signing.secrets_env`` names (``secrets_from_environment``).

A handler answers an unsigned, mis-signed or stale request with 401, which
Nemesis counts as a retryable failure (a configuration error between the two
sides), never as a dead letter.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence

from nemesis.config.models import SigningConfig
from nemesis.errors import ConfigError, ConfigProblem

SIGNATURE_HEADER = "nemesis-signature"
DEFAULT_TOLERANCE_S = 300
_SCHEME = "v1"


def signature(secret: bytes, timestamp: int, event_id: str, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``"<timestamp>.<event_id>." + body`` under ``secret``."""
    mac = hmac.new(secret, f"{timestamp}.{event_id}.".encode(), hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


def sign(secrets: Sequence[bytes], timestamp: int, event_id: str, body: bytes) -> str:
    """The ``nemesis-signature`` header value: the time, then one ``v1`` per secret."""
    if not secrets:
        raise ValueError("signing needs at least one secret")
    parts = [f"t={timestamp}"]
    parts += [f"{_SCHEME}={signature(s, timestamp, event_id, body)}" for s in secrets]
    return ",".join(parts)


class SignatureError(ValueError):
    """A request whose signature is missing, malformed, wrong or stale."""


def parse(header: str) -> tuple[int, list[str]]:
    """The timestamp and the ``v1`` signatures of a header value."""
    timestamp: int | None = None
    signatures: list[str] = []
    for part in header.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            raise SignatureError(f"malformed {SIGNATURE_HEADER} part {part.strip()!r}")
        if name == "t":
            if not value.isdigit():
                raise SignatureError(f"{SIGNATURE_HEADER}: t is not a whole number of seconds")
            timestamp = int(value)
        elif name == _SCHEME:
            signatures.append(value)
        # Other schemes are skipped: a later scheme can be added beside v1.
    if timestamp is None:
        raise SignatureError(f"{SIGNATURE_HEADER} has no t=")
    if not signatures:
        raise SignatureError(f"{SIGNATURE_HEADER} has no {_SCHEME}=")
    return timestamp, signatures


def verify(
    header: str | None,
    secrets: Iterable[bytes],
    event_id: str,
    body: bytes,
    *,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> None:
    """Raises ``SignatureError`` unless ``header`` signs this request with one of ``secrets``."""
    if not header:
        raise SignatureError(f"no {SIGNATURE_HEADER} header")
    timestamp, given = parse(header)
    if abs(now - timestamp) > tolerance_s:
        raise SignatureError(f"{SIGNATURE_HEADER} is {now - timestamp:.0f}s from now")
    for secret in secrets:
        expected = signature(secret, timestamp, event_id, body)
        if any(hmac.compare_digest(expected, candidate) for candidate in given):
            return
    raise SignatureError(f"{SIGNATURE_HEADER} matches no secret")


def grpc_batch_body(events: Iterable[tuple[str, bytes]]) -> bytes:
    """What a ``DeliverBatch`` call signs: each event's (id, data) as netstrings, in order."""
    parts: list[bytes] = []
    for event_id, data in events:
        encoded = event_id.encode()
        parts += [b"%d:" % len(encoded), encoded, b",", b"%d:" % len(data), data, b","]
    return b"".join(parts)


def secrets_from_environment(
    config: SigningConfig, env: Mapping[str, str], *, where: str
) -> tuple[bytes, ...]:
    """The signing secrets the variables of ``config`` hold, in its order.

    Raises ``ConfigError`` naming ``where`` (the integration file) and every
    variable that is unset or empty; the message never holds a value.
    """
    problems: list[ConfigProblem] = []
    secrets: list[bytes] = []
    for index, name in enumerate(config.secrets_env):
        value = env.get(name, "")
        if not value:
            message = (
                f"environment variable {name} is unset or empty: it must hold the signing"
                " secret (set it, or remove target.signing to send unsigned requests)"
            )
            problems.append(
                ConfigProblem(where, None, f"target.signing.secrets_env.{index}", message)
            )
        secrets.append(value.encode())
    if problems:
        raise ConfigError(problems)
    return tuple(secrets)
