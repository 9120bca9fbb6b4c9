"""Credentials written into YAML instead of read from the environment with ``${VAR}``.

A file in the integrations repository is read by everyone who can read the
repository, forever (git history). Secrets belong in the environment:
``authorization: "Bearer ${LOYALTY_TOKEN}"``. This module finds string
values that look like a credential written literally, on the file as
written (before ``${VAR}`` expansion), with three rules:

- a value under a key whose name says credential (``authorization``,
  ``x-api-key``, ``password``, ``client_secret``...) must hold nothing but
  ``${VAR}`` references and an auth scheme word (``Bearer``, ``Basic``...);
- any value holding a token in a well-known format (JWT, GitHub, AWS, Slack,
  Google, Stripe, a PEM private key, ``Bearer <token>``);
- a URL with a password in it (``https://user:pass@host``) or a query
  parameter named like a credential (``?token=...``).

Messages name the rule and the field, never the value: CI logs are read by
more people than the file.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

from nemesis.config.document import DataPath
from nemesis.config.passwords import is_stored_hash

_REFERENCE: Final = re.compile(r"\$?\$\{[^}]*\}")
_AUTH_SCHEMES: Final = frozenset({"bearer", "basic", "token", "digest", "apikey", "negotiate"})
# Words in a key name that make its value a credential ("X-Api-Key", "client_secret").
_SECRET_WORDS: Final = frozenset(
    {
        "authorization",
        "auth",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "secret",
        "token",
        "apikey",
        "credential",
        "credentials",
        "cookie",
        "signature",
        "sig",
    }
)
_SECRET_PAIRS: Final = frozenset({("api", "key"), ("access", "key"), ("private", "key")})
_WORD_SPLIT: Final = re.compile(r"[^a-z0-9]+")
_CAMEL: Final = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_TOKEN_FORMATS: Final = (
    ("a JSON Web Token", re.compile(r"eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.")),
    ("a GitHub token", re.compile(r"\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})")),
    ("an AWS access key", re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("a Slack token", re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("a Stripe key", re.compile(r"\b[sr]k_(live|test)_[0-9A-Za-z]{16,}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("a bearer token", re.compile(r"\bBearer\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)),
)
_URL: Final = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


@dataclass(frozen=True, slots=True)
class InlineSecret:
    """A value at ``path`` that looks like a credential, and why."""

    path: DataPath
    why: str


def find_inline_secrets(data: Any, path: DataPath = ()) -> Iterator[InlineSecret]:
    """Every string value in ``data`` (plain YAML data) that looks like an inline credential."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from find_inline_secrets(value, (*path, key))
    elif isinstance(data, list):
        for index, item in enumerate(data):
            yield from find_inline_secrets(item, (*path, index))
    elif isinstance(data, str):
        why = _why_secret(path[-1] if path else None, data)
        if why is not None:
            yield InlineSecret(path, why)


def is_secret_key(key: Hashable) -> bool:
    """Whether a key's name says its value is a credential."""
    if not isinstance(key, str):
        return False
    words = [w for w in _WORD_SPLIT.split(_CAMEL.sub("-", key).lower()) if w]
    if any(word in _SECRET_WORDS for word in words):
        return True
    return any(pair in _SECRET_PAIRS for pair in itertools.pairwise(words))


def _why_secret(key: Hashable | None, value: str) -> str | None:
    literal = _REFERENCE.sub(" ", value)
    if is_stored_hash(value):
        # A password or token hash (auth.users[].password_hash): committing it is the point.
        return None
    if key is not None and is_secret_key(key) and not _only_scheme_words(literal):
        return f"{key!s} is a credential written inline"
    for name, pattern in _TOKEN_FORMATS:
        if pattern.search(literal):
            return f"{name} written inline"
    if _URL.match(value):
        return _url_secret(value)
    return None


def _only_scheme_words(literal: str) -> bool:
    words = [w for w in re.split(r"[\s:]+", literal) if w]
    return all(word.lower() in _AUTH_SCHEMES for word in words)


def _url_secret(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return None
    if password is not None and not _REFERENCE.fullmatch(password):
        return "a password written inline in the URL"
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if is_secret_key(name) and value and not _only_scheme_words(_REFERENCE.sub(" ", value)):
            return f"the URL's {name!r} parameter is a credential written inline"
    return None
