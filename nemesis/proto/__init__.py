"""The ``nemesis.v1`` gRPC handler contract, and the build step that compiles it.

``nemesis/v1/handler.proto`` in this directory is the source of truth: it
ships in the package, the ``python-grpc`` handler template copies it, and the
onboarding docs show it. The Python code generated from it is a build
product, never edited and never committed (``.gitignore`` here):
``make proto`` (run by ``make install``) calls ``python -m nemesis.proto``,
which runs the protoc bundled with grpcio-tools *in the same environment*.
That is the point of generating at install time rather than checking code
in or compiling in an isolated build: protobuf refuses gencode newer than its
runtime, and grpcio-tools pins a protobuf range that includes the runtime it
is installed next to.

Only the message classes (``handler_pb2`` and its ``.pyi``) are generated.
The transport calls the two methods by their paths, so no ``_pb2_grpc``
module is needed: it would import itself as ``nemesis.v1``, which is not
where it lives inside this package.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Final

HANDLER_PROTO: Final = "nemesis/v1/handler.proto"
SERVICE: Final = "nemesis.v1.HandlerService"
# The generated modules, relative to proto_root(), for the .gitignore and the build.
GENERATED: Final = ("nemesis/v1/handler_pb2.py", "nemesis/v1/handler_pb2.pyi")


class ProtoBuildError(RuntimeError):
    """protoc could not compile the contract (a build-time failure, not a runtime one)."""


def proto_root() -> Path:
    """The directory the ``.proto`` paths are relative to (protoc's ``-I``)."""
    return Path(__file__).resolve().parent


def handler_proto_text() -> str:
    """The text of ``nemesis/v1/handler.proto`` as shipped."""
    return (importlib.resources.files(__package__) / HANDLER_PROTO).read_text(encoding="utf-8")


def generate(out_dir: Path | None = None) -> list[Path]:
    """Compiles the contract into ``out_dir`` (default: next to the .proto); returns the files."""
    # grpcio-tools is a build tool: imported here so that running Nemesis never needs it.
    from grpc_tools import protoc  # type: ignore[import-untyped]  # ships no type hints

    root = proto_root()
    out = root if out_dir is None else out_dir
    out.mkdir(parents=True, exist_ok=True)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"--proto_path={root}",
            f"--proto_path={well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            str(root / HANDLER_PROTO),
        ]
    )
    if status != 0:
        raise ProtoBuildError(f"protoc failed on {root / HANDLER_PROTO} (exit {status})")
    return [out / name for name in GENERATED]
