"""Packages import downwards only, per the layout table of the style notes (``../shared/style.md``),
row by row; ``docs/cells.md`` carries the same tables (checked here, word for word).

What counts as an import of a ``gyre_hpc`` module, in every module of the package (parsed
with ``ast``, nothing is imported):

- every ``import`` and ``from ... import``, inside functions included (a lazy import cannot
  hide an upward edge), relative ones resolved; ``from gyre_hpc.x import y`` imports the
  module ``gyre_hpc.x.y`` when there is one;
- a string literal that is exactly a module path, ``gyre_hpc.x.y`` or ``gyre_hpc.x.y:attr``:
  ``importlib.import_module("gyre_hpc.rl")``, a table of ``"module:function"`` entry points.

Not an import:

- the same string as a process's entry point, right after ``"-m"`` in a list or tuple
  (``[python, "-m", "gyre_hpc.rl", "--run-dir", d]``, ``config.WORKLOADS``'s
  ``("-m", "gyre_hpc.rl")``): another process runs that module and nothing is imported here;
  that is how the head starts a workload it may not import;
- an import under ``if TYPE_CHECKING:`` (it never runs);
- prose that mentions a module (``"gyre_hpc.trees.synthetic defaults"``).

Checked: every package has a row; every edge between packages is allowed by its row or is
a declared edge (each with its reason); every declared edge is still used; no cycle between
packages, and none between modules (files), so a file cycle inside a package fails too.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gyre_hpc"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "cells.md"

# The layout table of ../shared/style.md, row by row (names as written there). The top row
# may import anything below it, and ``cli.py`` is above ``bench/``.
ANYTHING_BELOW = "anything below"
STYLE_ROWS: list[tuple[tuple[str, ...], tuple[str, ...] | str]] = [
    (("cli.py", "bench/"), ANYTHING_BELOW),
    (("jobs/",), ("cells", "rundir", "config")),
    (("rl/", "substrate/"), ("cells", "harness", "engines", "trees", "models", "sched", "devices")),
    (("cells/",), ("engines", "sched", "devices", "rundir")),
    (("harness/",), ("engines", "trees")),
    (("engines/",), ("models", "devices")),
    (("sim/",), ("sched", "devices", "rundir")),
    (("trees/", "models/", "sched/", "devices/", "rundir/", "config.py", "fsio.py"), ()),
]
TOP_ORDER = ("cli", "bench")            # "anything below": each may import what is not above it
# The row of ``jobs/`` says "`cells` contract": of ``cells`` it may import these modules only.
CELLS_CONTRACT = ("gyre_hpc.cells.checkpoint",)

# What the style table does not name, with its row.
EXTRA_ROWS: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (("gyre_hpc/__init__.py",), ("jobs",), "the package root: `gyre_hpc.submit` (lazily), as `cli.py`"),
    (("warmstart/",), ("harness", "trees", "models", "config"), "the SFT warm start of the rl policy"),
    (("report.py",), (), "printing a command's figures (JSON or a listing): bottom row"),
]

# Edges beyond the rows, declared with why ("*": from every package). Among the bottom row
# they fix its order, lowest first: fsio, models, devices, sched, report; trees (models);
# config (sched, devices); rundir (config, trees).
DECLARED: dict[tuple[str, str], str] = {
    ("*", "fsio"): "the style: atomic writes, fsyncs and directory replaces are one module, used everywhere",
    ("cells", "config"): "the fleet reads its typed run config (the style: the head and the fleet agree in config.py)",
    ("cells", "models"): "one CheckpointError: the fleet's checkpoints raise the one models.checkpoint defines; cells.sharding shards the decoder (FSDP2 per layer)",
    ("rl", "config"): "the workload reads its sections of the run config",
    ("sim", "config"): "workload files are read as run configs are; a simulated run records its config.yaml",
    ("rundir", "config"): "a run directory's config.yaml is read back (inspect, the roles a fleet starts with)",
    ("config", "sched"): "`scheduler.policy` and its parameters are validated by building the policy from sched's registry",
    ("config", "devices"): "`cells.pace` is validated by building the device from its preset",
    ("harness", "models"): "the chat and tool-call format renders through the models' tokenizer",
    ("trees", "models"): "tree attention runs the decoder's batch-invariant kernels; packing pads with its PAD_ID",
    ("rundir", "trees"): "a run directory's trees.zarr is read back (load.open_trees, inspect, tree_stats)",
    ("rl", "rundir"): "the rl step driver writes its steps', engines' and runs' metrics rows",
    ("substrate", "config"): "the workload reads its sections of the run config",
    ("substrate", "rundir"): "the substrate step driver writes its steps' metrics rows",
    ("rl", "warmstart"): "rl's preflight resolves the warm-start checkpoint",
    ("sim", "trees"): "the analysis sample (sim/sample.py) writes synthetic trees with the real builder and store",
    ("sim", "report"): "`gyre-hpc sim` prints through the one printer of a command's figures",
}


def _key(name: str) -> str:
    return "gyre_hpc" if name == "gyre_hpc/__init__.py" else name.removesuffix("/").removesuffix(".py")


def allowed_rows() -> dict[str, set[str]]:
    """package -> the packages its row lets it import (declared edges not included)."""
    rows: dict[str, set[str]] = {}
    for names, may in STYLE_ROWS:
        for name in names:
            rows[_key(name)] = set() if may == ANYTHING_BELOW else set(may)
    for names, may, _ in EXTRA_ROWS:
        for name in names:
            rows[_key(name)] = set(may)
    everything = set(rows) - {"gyre_hpc"}      # the package root is for users; nothing imports it
    for i, top in enumerate(TOP_ORDER):
        rows[top] = everything - set(TOP_ORDER[:i + 1])
    return rows


def _may_text(names: tuple[str, ...], may: tuple[str, ...] | str) -> str:
    if may == ANYTHING_BELOW:
        return "anything below (`bench/` not `cli.py`)"
    contract = ", ".join(f"`{m.split('.', 1)[1].replace('.', '/')}.py`" for m in CELLS_CONTRACT)
    return ", ".join(f"`cells` contract ({contract})" if names == ("jobs/",) and p == "cells" else f"`{p}`"
                     for p in may) or "nothing of gyre_hpc"


def layout_markdown() -> str:
    """The tables as docs/cells.md shows them."""
    def names(ns):
        return ", ".join(f"`{n}`" for n in ns)

    lines = ["| package | may import |", "| --- | --- |"]
    lines += [f"| {names(ns)} | {_may_text(ns, m)} |" for ns, m in STYLE_ROWS]
    lines += ["", "Not in the style table:", "", "| package | may import | what it is |", "| --- | --- | --- |"]
    lines += [f"| {names(ns)} | {_may_text(ns, m)} | {what} |" for ns, m, what in EXTRA_ROWS]
    lines += ["", "Declared edges beyond the rows:", "", "| edge | why |", "| --- | --- |"]
    lines += [f"| {'any package' if s == '*' else f'`{s}`'} -> `{d}` | {why} |" for (s, d), why in DECLARED.items()]
    return "\n".join(lines) + "\n"


# -- finding the imports -----------------------------------------------------------------------

MODULE_PATH = re.compile(r"gyre_hpc(\.[A-Za-z_]\w*)+(:[A-Za-z_][\w.]*)?")


@dataclass(frozen=True)
class Import:
    target: str       # the gyre_hpc module imported
    line: int
    how: str          # "import" or "string"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: set[str]) -> str:
    """The longest known module that ``name`` (a module, maybe followed by an attribute) names."""
    parts = name.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> list[Import]:
    """Every gyre_hpc module ``module`` imports (see the module docstring for what counts)."""
    tree = ast.parse(source)
    package = module.split(".") if is_package else module.split(".")[:-1]
    out: list[Import] = []
    entry_points: set[int] = set()      # id() of strings that follow "-m" in a list or tuple

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.List, ast.Tuple)):
            for a, b in zip(node.elts, node.elts[1:]):
                if isinstance(a, ast.Constant) and a.value == "-m":
                    entry_points.add(id(b))
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "gyre_hpc" or alias.name.startswith("gyre_hpc."):
                    out.append(Import(_resolve(alias.name, known), node.lineno, "import"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                source_mod = ".".join(base + ([node.module] if node.module else []))
            else:
                source_mod = node.module or ""
            if source_mod == "gyre_hpc" or source_mod.startswith("gyre_hpc."):
                for alias in node.names:
                    sub = f"{source_mod}.{alias.name}"
                    out.append(Import(sub if sub in known else _resolve(source_mod, known), node.lineno, "import"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in entry_points
              and MODULE_PATH.fullmatch(node.value)):
            out.append(Import(_resolve(node.value.split(":")[0], known), node.lineno, "string"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [i for i in out if i.target != module]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gyre_hpc"


def module_graph() -> dict[str, list[tuple[Import, str]]]:
    """module -> [(import, where)] of every gyre_hpc module it imports."""
    modules = all_modules()
    known = set(modules)
    graph: dict[str, list[tuple[Import, str]]] = {}
    for name, path in modules.items():
        where = path.relative_to(PACKAGE.parent)
        graph[name] = [(imp, f"{where}:{imp.line}" + (" (string)" if imp.how == "string" else ""))
                       for imp in imports_of(name, path.read_text(), known, path.name == "__init__.py")]
    return graph


def package_edges(graph: dict[str, list[tuple[Import, str]]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(package, package) -> [(target module, where)] for every import between two packages."""
    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for module, imports in graph.items():
        for imp, where in imports:
            src, dst = package_of(module), package_of(imp.target)
            if src != dst:
                edges.setdefault((src, dst), []).append((imp.target, where))
    return edges


def row_violations(edges: dict[tuple[str, str], list[tuple[str, str]]]) -> list[str]:
    rows = allowed_rows()
    bad = []
    for (src, dst), uses in sorted(edges.items()):
        where = ", ".join(w for _, w in uses[:3])
        if src not in rows:
            bad.append(f"{src} has no row in the layout table (add one): imports {dst} at {where}")
        elif dst in rows[src] or (src, dst) in DECLARED or ("*", dst) in DECLARED:
            if src == "jobs" and dst == "cells":
                beyond = [(t, w) for t, w in uses if t not in CELLS_CONTRACT]
                if beyond:
                    bad.append(f"jobs -> {beyond[0][0]} is not the cells contract {list(CELLS_CONTRACT)}: "
                               f"{', '.join(w for _, w in beyond[:3])}")
        else:
            declared = sorted(d for s, d in DECLARED if s in (src, "*"))
            bad.append(f"{src} -> {dst} is not allowed ({src} may import {sorted(rows[src])}, "
                       f"declared {declared}): {where}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one node (or a self-loop), as a cycle
    through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(_cycle_in(set(comp), graph))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first node (breadth first), closed."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


@pytest.fixture(scope="module")
def graph():
    return module_graph()


# -- the checks ----------------------------------------------------------------------------------

def test_every_package_imports_only_what_its_row_allows(graph):
    bad = row_violations(package_edges(graph))
    assert not bad, "\n".join(bad)


def test_every_declared_edge_is_still_used(graph):
    edges = package_edges(graph)
    stale = [f"{s} -> {d}" for s, d in DECLARED if s != "*" and (s, d) not in edges]
    assert not stale, f"declared but no longer imported (drop them here and in docs/cells.md): {stale}"


def test_packages_import_each_other_without_a_cycle(graph):
    pkg: dict[str, set[str]] = {}
    for src, dst in package_edges(graph):
        pkg.setdefault(src, set()).add(dst)
    found = cycles(pkg)
    assert not found, "import cycles between packages: " + "; ".join(" -> ".join(c) for c in found)


def test_modules_import_each_other_without_a_cycle(graph):
    mods = {m: {imp.target for imp, _ in imports} for m, imports in graph.items()}
    where = {(m, imp.target): w for m, imports in graph.items() for imp, w in imports}
    found = cycles(mods)
    msgs = [" -> ".join(c) + "  (" + ", ".join(where[(a, b)] for a, b in zip(c, c[1:])) + ")" for c in found]
    assert not found, "import cycles between modules:\n" + "\n".join(msgs)


def test_docs_show_the_same_tables_as_this_test():
    text = DOCS.read_text()
    begin, end = "<!-- import-dag: tests/test_import_dag.py -->\n", "<!-- /import-dag -->"
    assert begin in text and end in text, f"docs/cells.md lacks the block {begin.strip()} ... {end}"
    shown = text.split(begin, 1)[1].split(end, 1)[0]
    assert shown.strip("\n") == layout_markdown().strip("\n"), (
        "docs/cells.md's import tables differ from tests/test_import_dag.py; the test's, to paste:\n"
        + layout_markdown())


def test_every_row_names_packages_that_exist_or_may_come():
    names = {_key(n) for ns, _ in STYLE_ROWS for n in ns} | {_key(n) for ns, _, _ in EXTRA_ROWS for n in ns}
    present = {package_of(m) for m in all_modules()}
    assert present <= names, f"packages without a row: {sorted(present - names)}"
    # ``substrate/`` (the style's name for a workload package) and ``fsio.py`` may be absent.
    assert names - present <= {"substrate", "fsio"}, f"rows for packages that are gone: {sorted(names - present - {'substrate', 'fsio'})}"


# -- the detector itself -------------------------------------------------------------------------

@pytest.mark.parametrize("source, expected", [
    ("from gyre_hpc.rl.driver import X\n", {"gyre_hpc.rl.driver"}),
    ("def f():\n    import gyre_hpc.jobs.cli\n", {"gyre_hpc.jobs.cli"}),
    ("from ..engines import router\n", {"gyre_hpc.engines.router"}),
    ("from . import controller\n", {"gyre_hpc.cells.controller"}),
    ("from gyre_hpc import config\n", {"gyre_hpc.config"}),
    ("from gyre_hpc.jobs import plan as p\n", {"gyre_hpc.jobs.plan"}),
    ("import importlib\nm = importlib.import_module('gyre_hpc.rl')\n", {"gyre_hpc.rl"}),
    ("CHECKS = {'rl': 'gyre_hpc.rl.preflight:check_config'}\n", {"gyre_hpc.rl.preflight"}),
    ("argv = [python, '-m', 'gyre_hpc.rl', '--run-dir', d]\n", set()),
    ("FLEET = ('-m', 'gyre_hpc.rl')\n", set()),
    ("argv = [python, 'gyre_hpc.rl']\n", {"gyre_hpc.rl"}),          # not after -m: a string import
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gyre_hpc.rl import driver\n", set()),
    ("if TYPE_CHECKING:\n    pass\nelse:\n    from gyre_hpc.rl import driver\n", {"gyre_hpc.rl.driver"}),
    ("help = 'gyre_hpc.trees.synthetic defaults (compressions)'\n", set()),
])
def test_the_detector_sees_lazy_relative_and_string_imports_and_not_entry_points(source, expected):
    known = set(all_modules())
    assert {i.target for i in imports_of("gyre_hpc.cells.probe", source, known)} == expected


@pytest.mark.parametrize("edge, message", [
    (("trees", "rl"), "trees -> rl is not allowed"),
    (("engines", "sched"), "engines -> sched is not allowed"),
    (("bench", "cli"), "bench -> cli is not allowed"),
    (("warmstart", "rl"), "warmstart -> rl is not allowed"),
    (("newpkg", "trees"), "newpkg has no row in the layout table"),
])
def test_an_upward_edge_fails_naming_it(edge, message):
    bad = row_violations({edge: [(f"gyre_hpc.{edge[1]}", "gyre_hpc/x.py:1")]})
    assert len(bad) == 1 and message in bad[0]


def test_jobs_may_import_the_cells_contract_and_nothing_else_of_cells():
    assert row_violations({("jobs", "cells"): [("gyre_hpc.cells.checkpoint", "a:1")]}) == []
    bad = row_violations({("jobs", "cells"): [("gyre_hpc.cells.controller", "a:1")]})
    assert len(bad) == 1 and "not the cells contract" in bad[0]


def test_allowed_and_declared_edges_pass():
    assert row_violations({("cells", "engines"): [("gyre_hpc.engines", "a:1")],
                           ("trees", "fsio"): [("gyre_hpc.fsio", "a:1")],
                           ("cli", "bench"): [("gyre_hpc.bench", "a:1")],
                           ("trees", "models"): [("gyre_hpc.models.invariant", "a:1")]}) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c", "a"]]),
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b", "a"]]),
    ({"a": {"a"}}, [["a", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_names_a_cycle(graph, expected):
    assert cycles(graph) == expected
