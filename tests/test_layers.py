"""The package's layers: no import cycle anywhere in spmd, no layer importing a higher one,
no public name shadowing a module, and ``help(spmd)`` shows no private module.

The import graph is read from the source with ``ast`` (nothing is executed), so the
checker also runs on a planted copy of the package, which is how these tests prove
they can fail.
"""
from __future__ import annotations

import ast
import importlib
import pkgutil
import pydoc
import shutil
import sys
from pathlib import Path

import pytest

import spmd

ROOT = Path(spmd.__file__).parent

# Lowest first. A module may import its own top-level package and the layers before
# it; sibling packages of one layer may not import each other. The root package is
# the facade: it re-exports every layer, and no module of spmd may import it.
LAYERS: list[tuple[str, ...]] = [
    ("core",),          # Mesh, P, Layout, Placeholder, errors: data and arithmetic
    ("random",),        # invariant(seed): draws as pure functions of the global index
    ("comm",),          # the protocol, its backends, rank threads, comm_stats
    ("collectives",),   # JAX-named differentiable collectives, custom_vjp
    ("transforms",),    # scatter/gather, halo_pad, reduce, redistribute
    ("mapping",),       # shard_map
    ("ops",),           # domain-parallel functional layers
    ("fft",),           # distributed FFTs: slab and pencil transposes
    ("nn",),            # their modules and convert
    ("parallel", "checkpoint"),  # GradSync; save and load across meshes
    ("run",),           # launch: threads or gloo processes
    ("testing", "viz"),  # tools
    ("perf",),          # estimate and predict a step's cost (uses testing's SavedBytes)
    ("demo",),          # the demo's pieces and its command line
    ("__main__",),      # python -m spmd
]


def _rank(top: str) -> int:
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"spmd.{top} belongs to no layer: add it to LAYERS in {__file__}")


def module_files(root: Path, package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the package at ``root``."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = [package, *f.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, typing_only: bool = False):
    """(node, typing_only) for every import, at any depth (lazy imports count)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, typing_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), typing_only)
        else:
            yield from _imports(node, typing_only)


def import_graph(root: Path, package: str) -> dict[str, dict[str, bool]]:
    """``{module: {imported module: typing_only}}`` within the package.

    ``from a.b import c`` imports the module ``a.b.c`` when there is one, else ``a.b``;
    importing ``a.b.c`` also runs the ``__init__`` of ``a.b``, except where ``a.b``
    encloses the importing module (or is the root, which every module sits in).
    """
    files = module_files(root, package)
    return {mod: _edges(mod, f, files, package) for mod, f in files.items()}


def _edges(mod: str, f: Path, files: dict[str, Path], package: str) -> dict[str, bool]:
    here = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
    edges: dict[str, bool] = {}

    def add(target: str, typing_only: bool) -> None:
        # The target, then the packages it sits in: importing a module runs their
        # __init__ first, unless one encloses this module (already running by the time
        # this module is imported; the root always does).
        first = True
        while target and (first or not (mod == target or mod.startswith(target + "."))):
            if target in files and target != mod:
                edges[target] = edges.get(target, True) and typing_only
            target, first = target.rpartition(".")[0], False

    for node, typing_only in _imports(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == package or a.name.startswith(package + "."):
                    add(a.name, typing_only)
            continue
        if node.level:
            base = here.split(".")
            base = base[:len(base) - (node.level - 1)]
            src = ".".join(base + ([node.module] if node.module else []))
        elif node.module and (node.module == package or node.module.startswith(package + ".")):
            src = node.module
        else:
            continue
        for a in node.names:
            sub = f"{src}.{a.name}"
            add(sub if sub in files else src, typing_only)
    return edges


def find_cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """Import cycles among runtime imports (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, typing_only in graph.get(v, {}).items():
            if typing_only:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_violations(graph: dict[str, dict[str, bool]], package: str) -> list[str]:
    """Imports that go from a layer to a higher one (or to a sibling package of its layer,
    or to the root facade), type-only imports included."""
    bad = []
    for mod, edges in sorted(graph.items()):
        if mod == package:
            continue
        top = mod.split(".")[1]
        for target in sorted(edges):
            if target == package:
                bad.append(f"{mod} imports the package root {package} (the facade)")
                continue
            ttop = target.split(".")[1]
            if ttop == top:
                continue
            if _rank(ttop) >= _rank(top):
                bad.append(f"{mod} (layer {_rank(top)}, {top}) imports {target} "
                           f"(layer {_rank(ttop)}, {ttop})")
    return bad


def test_no_import_cycle_in_spmd():
    cycles = find_cycles(import_graph(ROOT, "spmd"))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_layer_imports_only_layers_below_it():
    graph = import_graph(ROOT, "spmd")
    for mod in graph:  # every top-level package or module has a layer
        if mod != "spmd":
            _rank(mod.split(".")[1])
    assert layer_violations(graph, "spmd") == []


def test_the_graph_sees_what_the_package_imports():
    """Guards the checker: known edges (module-level, lazy and relative) are found."""
    g = import_graph(ROOT, "spmd")
    assert "spmd.core.mesh" in g["spmd.transforms.halo"]
    assert "spmd.comm.threads" in g["spmd.comm"]          # the factory's lazy import
    assert "spmd.core" in g["spmd.comm.threads"]          # implied by importing core.mesh
    assert "spmd.comm" not in g["spmd.comm.threads"]      # its own package: already running
    assert "spmd.comm" in g["spmd.comm.rank_threads"]     # but named explicitly: counted
    assert g["spmd.comm"]["spmd.core.mesh"] is True       # under TYPE_CHECKING only
    assert "spmd" not in g["spmd.mapping"]


def _planted(tmp_path: Path, edits: dict[str, str]) -> dict[str, dict[str, bool]]:
    root = tmp_path / "spmd"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in edits.items():
        f = root / rel
        f.write_text(f.read_text() + text)
    return import_graph(root, "spmd")


def test_a_planted_cycle_and_upward_import_fail(tmp_path):
    # The old mistake: the data layer reaching up to a transform, lazily.
    g = _planted(tmp_path, {"core/placeholder.py":
                            "\n\ndef _late():\n    from ..transforms import scatter_gather\n"})
    cycles = find_cycles(g)
    assert any("spmd.core.placeholder" in c and "spmd.transforms.scatter_gather" in c
               for c in cycles), cycles
    assert ("spmd.core.placeholder (layer 0, core) imports "
            "spmd.transforms.scatter_gather (layer 4, transforms)") in layer_violations(g, "spmd")


def test_a_planted_cycle_inside_one_layer_fails(tmp_path):
    g = _planted(tmp_path, {"ops/conv.py": "\nfrom . import pool  # noqa\n",
                            "ops/pool.py": "\nfrom .conv import conv2d  # noqa\n"})
    assert ["spmd.ops.conv", "spmd.ops.pool"] in find_cycles(g)
    assert layer_violations(g, "spmd") == []


def test_type_checking_imports_break_no_cycle_but_count_for_layers(tmp_path):
    g = _planted(tmp_path, {"core/mesh.py":
                            "\nif TYPE_CHECKING:\n    from ..comm.base import Comm  # noqa\n"})
    assert find_cycles(g) == []
    assert any(v.startswith("spmd.core.mesh (layer 0, core) imports spmd.comm")
               for v in layer_violations(g, "spmd"))


def test_importing_the_root_facade_is_refused(tmp_path):
    g = _planted(tmp_path, {"ops/conv.py": "\nimport spmd  # noqa\n"})
    assert "spmd.ops.conv imports the package root spmd (the facade)" in layer_violations(g, "spmd")


def _all_modules() -> list[str]:
    return sorted(m for m in module_files(ROOT, "spmd") if not m.endswith("__main__"))


@pytest.mark.parametrize("name", _all_modules())
def test_no_public_name_shadows_a_module(name):
    """``spmd.shard_map`` is the function and there is no module ``spmd.shard_map``: a
    package attribute named like one of its submodules must be that module."""
    pytest.importorskip("hypothesis")  # spmd.testing.strategies needs it
    mod = importlib.import_module(name)
    if not hasattr(mod, "__path__"):
        return
    for info in pkgutil.iter_modules(mod.__path__):
        sub = importlib.import_module(f"{name}.{info.name}")
        attr = getattr(mod, info.name, sub)
        assert attr is sub, (f"{name}.{info.name} is {attr!r}, which hides the module "
                             f"{sub.__name__}")


def test_the_public_entry_points_are_functions():
    assert callable(spmd.shard_map) and spmd.shard_map.__module__ == "spmd.mapping"
    assert callable(spmd.launch) and spmd.launch.__module__ == "spmd.run.launcher"
    assert "spmd.shard_map" not in sys.modules and "spmd.launch" not in sys.modules


def test_help_opens_with_an_overview_and_shows_no_private_module():
    text = pydoc.render_doc(spmd, renderer=pydoc.plaintext)
    desc = text[text.index("DESCRIPTION"):text.index("PACKAGE CONTENTS")]
    for name in ("Mesh", "P ", "shard_map", "psum", "halo_pad"):
        assert name in desc
    for layer in ("core/", "comm/", "collectives/", "transforms/", "mapping/", "ops/",
                  "parallel/", "testing/", "Read next"):
        assert layer in desc
    contents = text[text.index("PACKAGE CONTENTS"):].split("\n\n")[0].split("\n")[1:]
    names = [line.split()[0] for line in contents if line.strip()]
    assert "core" in names and "mapping" in names
    assert [n for n in names if n.startswith("_") and n != "__main__"] == []
