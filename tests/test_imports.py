"""The package graph of ``src/deltasync`` is the layered DAG the README describes.

Every ``deltasync.*`` import in the library's source (lazy ones inside functions included) is
checked against the allowed edges below, and no two modules may import each other, directly or
through others. Adding a backward import (say ``publish`` -> ``receiver``) fails this test.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "deltasync"

# Layers, bottom to top. A package may import its own layer's foundations listed here and
# anything in a lower layer; the two sides (publish | receiver | cluster + exchange) never
# import each other: they share through commit, layout, format and store.
BASE = {"errors", "names", "validate", "atomic", "scratch", "interrupts", "exclusive"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "names": {"errors", "validate"},  # a version argument is checked as any int argument
    "validate": {"errors"},
    "atomic": {"errors"},
    "scratch": set(),
    "interrupts": set(),
    "exclusive": {"errors"},
    "native": BASE,
    "trainer": BASE | {"native"},
    "format": BASE | {"native"},
    "store": BASE,
    "layout": BASE | {"native", "format"},
    "commit": BASE | {"format", "store"},
    "publish": BASE | {"native", "trainer", "format", "store", "layout", "commit"},
    "receiver": BASE | {"format", "store", "layout", "commit"},
    "exchange": BASE,
    "cluster": BASE | {"native", "trainer", "format", "layout", "exchange"},
    "engines": BASE | {"format", "layout", "store", "commit", "receiver"},
    "cli": BASE | {"commands"},
    # commands may start an engine (``layout probe --engine vllm``); engines never see commands
    "commands": BASE
    | {"format", "store", "layout", "commit", "receiver", "cluster", "exchange", "engines"},
    "__main__": {"cli"},
}
# The package root re-exports the public API, so it may import every package below the top
# layer; only the top layer (engines, the CLI's commands) may use the root's names in turn.
TOP = {"engines", "commands", "cli", "__main__"}
ROOT_MAY_IMPORT = set(ALLOWED) - TOP
for _top in TOP - {"cli", "__main__"}:
    ALLOWED[_top] = ALLOWED[_top] | {""}


def _module_name(path: Path) -> str:
    parts = ("deltasync", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """Every deltasync module ``path`` imports (``from deltasync import names`` is the module
    ``deltasync.names``, not the package root)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m.startswith("deltasync")}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    names = set(files)
    return {
        m: {i for i in _imports(p, m, names) if i in files and i != m} for m, p in files.items()
    }


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        src = _package(module)
        for target in targets:
            dst = _package(target)
            if dst == src or (src == "" and dst in ROOT_MAY_IMPORT):
                continue
            if src not in ALLOWED:
                bad.append(f"{module}: package {src!r} is not in the layer table")
            elif dst not in ALLOWED[src]:
                bad.append(f"{module} imports {target} ({src} -> {dst or 'deltasync'})")
    return sorted(bad)


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    # A package's __init__ re-exports its modules; only edges into other files make circles.
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    try:
        tuple(TopologicalSorter(edges).static_order())
    except CycleError as exc:
        return list(exc.args[1])
    return None


def test_every_import_between_packages_follows_the_layers():
    bad = _violations(_graph())
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_two_modules_import_each_other_even_through_others():
    circle = _circle(_graph())
    assert circle is None, f"import circle: {' -> '.join(circle or [])}"


def test_the_checks_catch_a_backward_import_and_a_circle():
    graph = _graph()
    graph["deltasync.publish.publisher"] = graph["deltasync.publish.publisher"] | {
        "deltasync.receiver.store_receiver"
    }
    assert _violations(graph) == [
        "deltasync.publish.publisher imports deltasync.receiver.store_receiver (publish -> receiver)"
    ]
    graph = _graph()
    graph["deltasync.layout.blocks"] = graph["deltasync.layout.blocks"] | {"deltasync.layout.table"}
    assert _circle(graph) is not None
