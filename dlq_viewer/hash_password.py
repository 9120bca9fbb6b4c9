"""``python -m dlq_viewer.hash_password``: a password hash or a new API token for nemesis.yaml.

Asks for the password twice on a terminal (or reads one line from stdin
when piped), and prints the ``password_hash`` to paste under
``auth.users``. With ``--token`` it makes a new API token instead and prints
the token (for the client) and its ``token_hash`` (for the configuration).
"""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Sequence

from dlq_viewer.passwords import hash_password, hash_token, new_token


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m dlq_viewer.hash_password", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--token", action="store_true", help="make a new API token and its hash")
    args = parser.parse_args(argv)
    if args.token:
        token = new_token()
        print(f"token (give it to the client; it is not stored anywhere): {token}")
        print(f"token_hash: {hash_token(token)}")
        return 0
    if sys.stdin.isatty():
        password = getpass.getpass("password: ")
        if getpass.getpass("again: ") != password:
            print("the passwords differ", file=sys.stderr)
            return 1
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    try:
        print(f"password_hash: {hash_password(password)}")
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
