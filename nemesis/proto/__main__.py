"""``python -m nemesis.proto``: generates the Python code of the handler contract (make proto)."""

from __future__ import annotations

import sys

from nemesis.proto import ProtoBuildError, generate


def main() -> int:
    """Generates the code next to the .proto and names the files written."""
    try:
        written = generate()
    except ProtoBuildError as exc:
        print(f"nemesis.proto: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"generated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
