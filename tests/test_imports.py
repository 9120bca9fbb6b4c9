"""Imports point down: no circle of modules, and no layer importing one above it.

Read from the source (``ast``), not by importing it, so that an import under
``if TYPE_CHECKING:`` counts like any other: a circle the type checker needs
is still a circle. An import inside a function body is left out: it runs when
the function is called, never at import time, and it is how a registered
kind loads its implementation (``nemesis.backends``) or a command its
dependencies (``nemesis.cli``).

The layers, lowest first, are those ``docs/design.md`` draws; a module may
import from its own layer and below.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

LAYERS: list[list[str]] = [
    [  # what every layer shares
        "nemesis",
        "nemesis.aio",
        "nemesis.clock",
        "nemesis.config_base",
        "nemesis.errors",
        "nemesis.heap",
        "nemesis.logs",
        "nemesis.metrics",
        "nemesis.processes",
        "nemesis.proto",
        "nemesis.sqlite_thread",
        "nemesis.terminal",
    ],
    # The ports, and the internal topics' names (over the broker port).
    [
        "nemesis.broker.port",
        "nemesis.broker.source",
        "nemesis.dlq.port",
        "nemesis.dlq.signature",
        "nemesis.fleet.port",
    ],
    # Over the broker port: the internal topics, the trace context, the delivery port.
    ["nemesis.topology", "nemesis.tracecontext", "nemesis.delivery.port"],
    # Each kind's config model and factory: backends and sources, transports by URL scheme.
    ["nemesis.backends", "nemesis.transports"],
    ["nemesis.config"],
    ["nemesis.identity"],  # who asks, from the configured tokens and teams
    # The parts: brokers, transports, stages, limits; the PostgreSQL connection.
    ["nemesis.broker", "nemesis.delivery", "nemesis.pipeline", "nemesis.resilience"],
    ["nemesis.postgres"],
    ["nemesis.dlq", "nemesis.fleet"],  # the stores, and the fleet's member
    ["nemesis.runtime"],
    ["nemesis.admin", "nemesis.onboarding", "nemesis.testing"],
    [
        "nemesis.__main__",
        "nemesis.cli",
        "nemesis.cli_ctl",
        "nemesis.cli_dlq",
        "nemesis.cli_offsets",
        "nemesis.cli_queues",
        "nemesis.demo",
    ],
]

# Imports known to run up a layer, each with why it is left so (none today).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((root / "nemesis").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import that runs at import time or for the type checker (not in a function)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        else:
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(node, name, None)
                if isinstance(inner, list):
                    yield from _module_level([n for n in inner if isinstance(n, ast.stmt)])
            for handler in getattr(node, "handlers", ()):
                yield from _module_level(handler.body)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of ``nemesis`` and the modules of ``nemesis`` it imports."""
    modules = _modules(root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in _module_level(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*kept, base] if base else kept)
                # A name is a submodule, or something the module (package) defines.
                names = [
                    full if (full := f"{base}.{alias.name}") in modules else base
                    for alias in node.names
                ]
            for name in names:
                target = known(name) if name.startswith("nemesis") else None
                if target is not None and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layer_of(module: str) -> int:
    """The layer of a module: its longest prefix in ``LAYERS``."""
    best: tuple[int, int] | None = None
    for number, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (number, len(prefix))
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best[0]


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports that run from a layer to one above it."""
    return sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )


def test_no_module_imports_itself_back_through_others() -> None:
    assert circles(import_graph()) == []


def test_no_layer_imports_one_above_it() -> None:
    found = {pair for pair in upward(import_graph()) if pair not in KNOWN_UPWARD}
    assert found == set()
    stale = set(KNOWN_UPWARD) - set(upward(import_graph()))
    assert stale == set(), "a known exception that no longer holds: take it out"


BACKENDS = ("nemesis.broker.embedded", "nemesis.broker.kafka", "nemesis.broker.ydb")


def test_no_broker_backend_imports_another() -> None:
    """What two backends share belongs in the port (``partition_for_key``, say)."""

    def backend(module: str) -> str | None:
        return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)

    found = sorted(
        (module, target)
        for module, targets in import_graph().items()
        for target in targets
        if backend(module) and backend(target) and backend(module) != backend(target)
    )
    assert found == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "nemesis" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "import_back",
    [
        "from nemesis.config.models import X\n",
        "import typing\nif typing.TYPE_CHECKING:\n    from nemesis.config import models\n",
        "from ..config.models import X\n",
    ],
)
def test_a_circle_is_found_however_it_is_imported(tmp_path: Path, import_back: str) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "config/__init__.py": "",
            "config/models.py": "from nemesis.backends import base\n",
            "backends/__init__.py": "",
            "backends/base.py": import_back,
        },
    )
    assert circles(import_graph(tmp_path)) == [["nemesis.backends.base", "nemesis.config.models"]]


def test_an_import_in_a_function_body_is_no_circle(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from nemesis import b\n",
            "b.py": "def f():\n    from nemesis import a\n",
        },
    )
    assert circles(import_graph(tmp_path)) == []


def test_an_import_up_a_layer_is_found(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "fleet/__init__.py": "",
            "fleet/member.py": "from nemesis.runtime import overrides\n",
            "runtime/__init__.py": "",
            "runtime/overrides.py": "",
        },
    )
    assert upward(import_graph(tmp_path)) == [("nemesis.fleet.member", "nemesis.runtime.overrides")]
