"""The wheel's build step that compiles the gRPC handler contract (``nemesis.proto``).

``pyproject.toml`` names it as setuptools' ``build_py``: a wheel (``pip
install``, ``pip wheel``, the Docker image) carries ``handler_pb2`` generated
by the grpcio-tools the build requires. That version is pinned: protobuf
refuses gencode newer than its runtime, and the one it pins writes the gencode
of the oldest protobuf the package accepts. An editable install (``make
install``) skips it: ``make proto`` generates into the checkout.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from setuptools.command.build_py import build_py

PROTO_ROOT = Path("nemesis") / "proto"
HANDLER_PROTO = "nemesis/v1/handler.proto"


class BuildPy(build_py):
    """``build_py``, then protoc on ``nemesis/proto`` into the build directory."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        from grpc_tools import protoc

        out = Path(self.build_lib) / PROTO_ROOT
        well_known = importlib.resources.files("grpc_tools") / "_proto"
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"--proto_path={PROTO_ROOT}",
                f"--proto_path={well_known}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                str(PROTO_ROOT / HANDLER_PROTO),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / HANDLER_PROTO} (exit {status})")
