"""Signed deliveries: the shared test vectors, and what a verifier must refuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemesis.delivery import signing
from nemesis.delivery.signing import SignatureError, parse, sign, verify

VECTORS: list[dict[str, Any]] = json.loads(
    (Path(signing.__file__).with_name("signing-vectors.json")).read_text()
)["vectors"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_the_vectors_every_language_checks_against(vector: dict[str, Any]) -> None:
    secrets = [s.encode() for s in vector["secrets"]]
    body = bytes.fromhex(vector["body_hex"])
    header = sign(secrets, vector["timestamp"], vector["event_id"], body)
    assert header == vector["header"]
    # Each secret alone verifies (a handler that has only the old or only the new one).
    for secret in secrets:
        verify(header, [secret], vector["event_id"], body, now=vector["timestamp"] + 10)


def test_a_verifier_refuses_what_it_must() -> None:
    secret, body, t = b"k1-test-secret", b'{"a":1}', 1_733_060_000
    header = sign([secret], t, "id-1", body)
    cases = {
        "missing": (None, [secret], "id-1", body, t),
        "wrong secret": (header, [b"other"], "id-1", body, t),
        "other event": (header, [secret], "id-2", body, t),
        "tampered body": (header, [secret], "id-1", body + b" ", t),
        "stale": (header, [secret], "id-1", body, t + 301),
        "from the future": (header, [secret], "id-1", body, t - 301),
        "no t": ("v1=00", [secret], "id-1", body, t),
        "no v1": (f"t={t}", [secret], "id-1", body, t),
        "malformed": (f"t={t};v1", [secret], "id-1", body, t),
    }
    for name, (given, secrets, event, data, now) in cases.items():
        with pytest.raises(SignatureError):  # noqa: PT012 - the fail() names the case
            verify(given, secrets, event, data, now=now)
            pytest.fail(f"accepted: {name}")
    verify(header, [secret], "id-1", body, now=t + 300)  # the tolerance's edge still passes


def test_unknown_schemes_are_skipped() -> None:
    body = b"x"
    header = sign([b"s"], 10, "e", body) + ",v9=abc"
    assert parse(header)[0] == 10
    verify(header, [b"s"], "e", body, now=10)
