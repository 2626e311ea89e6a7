"""Packages import downwards only, per the layout table of the style notes (docs/cells.md has it).

Every module of ``gyre_hpc`` is parsed (``ast``), imports inside functions included, so a
lazy import cannot hide an upward edge. The test fails on an import a package's row does
not allow, and on any cycle between packages.
"""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gyre_hpc"

# The bottom row: tree math and store, the decoder, pure policies, run directory, typed
# config, the printer of a command's figures. Anyone may import them; among themselves they
# must stay acyclic.
FOUNDATION = {"trees", "models", "sched", "rundir", "config", "report"}
TOP = {"gyre_hpc", "cli", "bench"}          # the package root, commands and benchmarks: anything below
ALLOWED = {
    "jobs": {"cells", "rundir", "config"},
    "rl": {"cells", "harness", "engines", "warmstart", "trees", "models", "sched"} | FOUNDATION,
    "warmstart": {"harness", "engines"} | FOUNDATION,
    "cells": {"engines", "sched", "rundir"} | FOUNDATION,
    "harness": {"engines", "trees"} | FOUNDATION,
    "engines": {"models"} | FOUNDATION,
    "sim": {"sched", "rundir"} | FOUNDATION,
} | {p: FOUNDATION - {p} for p in FOUNDATION}


def package_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    if len(rel.parts) == 1:
        return "gyre_hpc" if rel.parts[0] == "__init__" else rel.parts[0]
    return rel.parts[0]


def imported_packages(path: Path, source: str | None = None) -> set[tuple[str, int]]:
    """(first component under gyre_hpc, line) of every absolute or relative gyre_hpc import."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts
    out = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:      # relative: resolve against this module's package
                base = list(here[:-1] if here[-1] != "__init__" else here[:-1])
                base = base[:len(base) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            elif node.module:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "gyre_hpc" and len(parts) > 1:
                out.add((parts[1], node.lineno))
    return out


def package_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = package_of(path)
        for dst, line in imported_packages(path):
            if dst != src:
                edges.setdefault((src, dst), []).append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return edges


def test_every_package_imports_only_what_its_layout_row_allows():
    bad = []
    for (src, dst), where in sorted(package_edges().items()):
        if src in TOP:
            continue
        if src not in ALLOWED:
            bad.append(f"{src} is not in the layout table (add its row): imports {dst} at {where[0]}")
        elif dst in TOP or dst not in ALLOWED[src]:
            bad.append(f"{src} -> {dst} is upward ({src} may import {sorted(ALLOWED[src])}): {', '.join(where[:3])}")
    assert not bad, "\n".join(bad)


def test_packages_import_each_other_without_a_cycle():
    graph: dict[str, set[str]] = {}
    for src, dst in package_edges():
        graph.setdefault(src, set()).add(dst)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle between packages: {' -> '.join(exc.args[1])}")


@pytest.mark.parametrize("source, expected", [
    ("from gyre_hpc.rl.driver import X\n", {"rl"}),
    ("def f():\n    import gyre_hpc.jobs.cli\n", {"jobs"}),
    ("from ..engines import router\n", {"engines"}),
])
def test_imports_inside_functions_and_relative_ones_are_seen(source, expected):
    assert {p for p, _ in imported_packages(PACKAGE / "cells" / "probe.py", source)} == expected
