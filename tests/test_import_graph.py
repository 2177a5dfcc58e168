"""No import cycle among the project's modules, imports inside functions counted (issue 34).

The graph is built from the source with ``ast`` alone (nothing is imported):

* Nodes: every module of the project packages ``configs``, ``policies``, ``fleet``, ``sim`` and
  ``experience_dict`` (``pkg/__init__.py`` is the node ``pkg``). ``scripts/`` (entry points) and ``tests/``
  are not nodes; nothing outside the project is.
* Edges: every ``import`` statement anywhere in a module: at module level, inside functions and methods,
  inside ``try`` / ``if`` blocks and under ``if TYPE_CHECKING:`` (a type-only import is still a dependency
  of the design). Relative imports are resolved against the importing module's package.
* ``import a.b.c`` (with or without ``as``) is an edge to ``a.b.c``; if ``a.b.c`` is not a module, to the
  longest prefix that is.
* ``from a.b import x`` is an edge to ``a.b.x`` when ``a/b/x.py`` (or ``a/b/x/``) is a module, otherwise an
  edge to ``a.b`` (``x`` is a name defined in ``a.b``; for a package that is its ``__init__``).
* Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but that is no edge to them: the
  importer uses nothing they define, and Python tolerates a partially initialised ancestor package. So a
  package ``__init__`` that re-exports its children (``sim/__init__`` imports ``sim.so100``) and a child that
  imports a sibling by its full name (``sim.so100.env`` imports ``sim.units``) make no cycle. A child that
  imports a *name* from its package's ``__init__`` (``from sim import make_env`` in a module that ``sim``'s
  ``__init__`` imports) does depend on it and is a cycle.
* Not counted: imports by string (``importlib.import_module``, the policy-type registry
  ``policies.factory.POLICY_TYPES``, ``fleet.refusals``): these are late-bound registries, not static
  dependencies.

The test fails on any strongly connected component of more than one module (or a module importing itself)
and prints its modules and every import line between them. ``ALLOWED_CYCLES`` may only shrink: a cycle listed
there that no longer exists fails the test too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("configs", "policies", "fleet", "sim", "experience_dict")

# Cycles that remain, each with why it remains (none today). The list can only shrink: a listed cycle that is
# gone fails the test too.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Import:
    src: str        # importing module
    dst: str        # imported project module
    path: str       # file, relative to the repository root
    line: int
    text: str       # the import statement as written
    local: bool     # inside a function or method
    type_only: bool  # under ``if TYPE_CHECKING:``


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            out[module_name(path)] = path
    return out


def _longest_module(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in modules:
            return cand
    return None


class _Collector(ast.NodeVisitor):
    """The imports of one module's source (``rel_path``: its file, for the report)."""

    def __init__(self, mod: str, rel_path: str, modules: dict[str, Path], source: str):
        self.mod, self.rel_path, self.modules = mod, rel_path, modules
        self.lines = source.splitlines()
        self.is_pkg = Path(rel_path).name == "__init__.py"
        self.depth = 0
        self.type_only = 0
        self.found: list[Import] = []

    def _add(self, node: ast.stmt, dst: str | None) -> None:
        if dst is None:
            return
        text = " ".join(line.strip() for line in self.lines[node.lineno - 1:node.end_lineno])
        self.found.append(Import(self.mod, dst, self.rel_path, node.lineno, text,
                                 self.depth > 0, self.type_only > 0))

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            self.visit(test)
            self.type_only += 1
            for stmt in node.body:
                self.visit(stmt)
            self.type_only -= 1
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, _longest_module(alias.name, self.modules))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.mod.split(".") if self.is_pkg else self.mod.split(".")[:-1]
            base = package[:len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if _longest_module(target, self.modules) is None:
            return
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            self._add(node, sub if sub in self.modules else _longest_module(target, self.modules))


def collect_imports() -> list[Import]:
    modules = project_modules()
    found: list[Import] = []
    for mod, path in modules.items():
        source = path.read_text()
        c = _Collector(mod, str(path.relative_to(ROOT)), modules, source)
        c.visit(ast.parse(source, filename=str(path)))
        found.extend(c.found)
    return found


def strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the strongly connected components, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def import_cycles() -> dict[frozenset[str], list[Import]]:
    """Each cycle (a strongly connected component of more than one module, or a module importing itself)
    and the imports between its modules."""
    imports = collect_imports()
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        edges[imp.src].add(imp.dst)
    cycles = {}
    for comp in strongly_connected(sorted(project_modules()), edges):
        members = set(comp)
        if len(comp) > 1 or comp[0] in edges.get(comp[0], ()):
            cycles[frozenset(comp)] = [i for i in imports if i.src in members and i.dst in members]
    return cycles


def describe(cycle: frozenset[str], imports: list[Import]) -> str:
    lines = [f"cycle among {sorted(cycle)}:"]
    for i in sorted(set(imports), key=lambda i: (i.path, i.line, i.dst)):
        where = "in a function" if i.local else "module level"
        if i.type_only:
            where += ", TYPE_CHECKING"
        lines.append(f"    {i.path}:{i.line} ({where}) {i.src} -> {i.dst}: {i.text}")
    return "\n".join(lines)


def test_collector_sees_function_local_and_relative_imports():
    modules = {m: Path(m.replace(".", "/") + ".py") for m in ("pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c")}
    source = ("import os\n"
              "from . import b\n"
              "from .sub import c as cc, NAME\n"
              "def f():\n"
              "    import pkg.sub.c.attr\n"
              "    from pkg import thing\n"
              "if TYPE_CHECKING:\n"
              "    from .b import B\n")
    col = _Collector("pkg.a", "pkg/a.py", modules, source)
    col.visit(ast.parse(source))
    got = [(i.dst, i.local, i.type_only) for i in col.found]
    assert got == [("pkg.b", False, False), ("pkg.sub.c", False, False), ("pkg.sub", False, False),
                   ("pkg.sub.c", True, False), ("pkg", True, False), ("pkg.b", False, True)]


def test_tarjan_finds_components():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    comps = {frozenset(c) for c in strongly_connected(list("abcdef"), edges)}
    assert {frozenset("abc"), frozenset("de"), frozenset("f")} == comps


def test_no_import_cycles():
    cycles = import_cycles()
    new = {c: imps for c, imps in cycles.items() if c not in ALLOWED_CYCLES}
    gone = [sorted(c) for c in ALLOWED_CYCLES if c not in cycles]
    msg = [describe(c, imps) for c, imps in sorted(new.items(), key=lambda kv: sorted(kv[0]))]
    if gone:
        msg.append(f"allow-listed cycles that no longer exist (remove them from ALLOWED_CYCLES): {gone}")
    assert not new and not gone, f"{len(new)} import cycle(s):\n" + "\n".join(msg)


def test_graph_sees_the_project():
    """The scan is not vacuous: every package is found and function-local imports are edges."""
    modules = project_modules()
    assert {"configs.schema", "fleet.coordinator", "policies.factory", "sim", "experience_dict.store.reader"} <= set(modules)
    edges = {(i.src, i.dst, i.local) for i in collect_imports()}
    assert ("fleet.fert.learner", "policies.factory", True) in edges
    assert ("fleet.coordinator", "fleet.worker", False) in edges


def test_composing_a_config_loads_no_torch_zarr_mujoco_or_ray():
    """Issue 50: ``configs.typed`` (every typed group, imported by each Hydra script before it composes) imports no
    torch, zarr, MuJoCo or Ray, so ``policies.threads.passive_wait`` after it still runs before torch loads (the
    steer group's config lives in ``policies.steer_config``; the store package loads its reader and writer lazily)."""
    code = ("import sys, configs.typed; "
            "bad = sorted({'torch', 'zarr', 'mujoco', 'ray'} & set(sys.modules)); assert not bad, bad; "
            "from experience_dict.store import ExperienceStore, StoreError; assert 'zarr' in sys.modules; "
            "from policies.noise_actor import SteerConfig as A; from policies.steer_config import SteerConfig as B; "
            "assert A is B")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 0, p.stderr[-2000:]


def test_composing_a_config_loads_no_heavy_library():
    """Issue 50: ``configs.typed`` (every typed group, what each Hydra script imports first) imports no torch, zarr,
    MuJoCo or Ray, so ``policies.threads.passive_wait()`` can run after it and before torch loads."""
    code = ("import sys, configs.typed\n"
            "heavy = [m for m in ('torch', 'zarr', 'mujoco', 'ray') if m in sys.modules]\n"
            "assert not heavy, heavy")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
