"""Password and API-token hashes for the configuration (stdlib scrypt and SHA-256).

Passwords: ``scrypt$<n>$<r>$<p>$<salt>$<hash>`` (base64url, no padding),
memory-hard so a leaked configuration does not give the passwords away.
API tokens are random 256-bit strings: a plain SHA-256 is enough for those
(nothing to guess), and it lets a request find its token in one dictionary
lookup instead of one scrypt per configured token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

SCRYPT_N = 2**15
SCRYPT_R = 8
SCRYPT_P = 1
SALT_BYTES = 16
HASH_BYTES = 32
TOKEN_PREFIX = "nmsv_"
_MAX_PASSWORD_BYTES = 1024  # longer input is refused before it costs a hash


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _scrypt(password: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    # scrypt needs 128 * r * n bytes; the default cap (32 MiB) is just too small for n = 2^15.
    return hashlib.scrypt(
        password, salt=salt, n=n, r=r, p=p, dklen=HASH_BYTES, maxmem=256 * r * n + 2**20
    )


def hash_password(password: str, *, n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P) -> str:
    """A salted scrypt hash of ``password`` for ``auth.users[].password_hash``."""
    raw = password.encode()
    if not raw or len(raw) > _MAX_PASSWORD_BYTES:
        raise ValueError(f"a password has 1 to {_MAX_PASSWORD_BYTES} bytes")
    salt = secrets.token_bytes(SALT_BYTES)
    return f"scrypt${n}${r}${p}${_b64(salt)}${_b64(_scrypt(raw, salt, n, r, p))}"


@dataclass(frozen=True, slots=True)
class _Scrypt:
    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes


def _parse(stored: str) -> _Scrypt | None:
    parts = stored.split("$")
    if len(parts) != 6 or parts[0] != "scrypt":
        return None
    try:
        return _Scrypt(
            int(parts[1]), int(parts[2]), int(parts[3]), _unb64(parts[4]), _unb64(parts[5])
        )
    except (ValueError, binascii.Error):
        return None


def verify_password(password: str, stored: str) -> bool:
    """True when ``password`` matches ``stored`` (a ``hash_password`` result); constant time."""
    parsed = _parse(stored)
    raw = password.encode()
    if parsed is None or not raw or len(raw) > _MAX_PASSWORD_BYTES:
        return False
    candidate = _scrypt(raw, parsed.salt, parsed.n, parsed.r, parsed.p)
    return hmac.compare_digest(candidate, parsed.digest)


def new_token() -> str:
    """A fresh API token: give it to the client, put ``hash_token(token)`` in the config."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The ``auth.tokens[].token_hash`` of a token."""
    return "sha256$" + hashlib.sha256(token.encode()).hexdigest()


_TOKEN_HASH = re.compile(r"sha256\$[0-9a-f]{64}")


def is_stored_hash(value: str) -> bool:
    """Whether ``value`` is what ``hash_password`` or ``hash_token`` writes.

    Such a value is meant to be committed (it cannot be turned back into the
    password or token), unlike the credential itself.
    """
    if _TOKEN_HASH.fullmatch(value):
        return True
    parsed = _parse(value)
    return parsed is not None and len(parsed.digest) == HASH_BYTES and len(parsed.salt) > 0
