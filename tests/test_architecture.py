"""The package's layers (docs/architecture.md): every import points down, and none makes a circle.

Reads every import of ``pyrobdl/`` with :mod:`ast` — at module level, inside functions, under
``if TYPE_CHECKING``, relative and absolute, and ``importlib.import_module("pyrobdl...")`` with a
literal name — gives each module its layer from :data:`LAYERS`, and fails on

* a module the table does not place (a new module must be given its layer);
* an import of a module in a higher layer (:data:`ALLOWED_UPWARD` lists the exceptions: none);
* an import that runs a package's ``__init__`` whose own imports reach above the importer
  (importing ``pkg.mod`` first runs ``pkg/__init__.py``: a package that spans several layers
  re-exports lazily);
* an import circle of any length, within a layer too.

Pure reading of source files: no pyrobdl module is imported, and the test runs in a fraction of a
second.
"""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1] / "pyrobdl"
PKG = ROOT.name

#: Layers from the bottom up, each with its modules.  A name covers the module and, unless a longer
#: name says otherwise, every module below it (``pyrobdl.guides`` covers ``pyrobdl.guides.base``).
#: docs/architecture.md draws the same table.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("pyrobdl._validation", "pyrobdl._io", "pyrobdl._version", "pyrobdl._allocator",
                    "pyrobdl._grad", "pyrobdl.poutine", "pyrobdl.torch_interop")),
    ("data", ("pyrobdl.datasets",)),
    ("model", ("pyrobdl.priors", "pyrobdl.likelihoods", "pyrobdl.model", "pyrobdl._saved")),
    ("flat log joint", ("pyrobdl.flat",)),
    ("diagnostics core", tuple(f"pyrobdl.diagnostics.{m}" for m in (
        "rhat", "rank_diagnostics", "chain_outliers", "energy", "inputs", "metrics", "certificate",
        "certification", "arviz_adapter", "draws"))),
    ("posterior contract", ("pyrobdl.posterior",)),
    ("guides", ("pyrobdl.guides",)),
    ("inference", ("pyrobdl.inference",)),
    ("evaluation and persistence", ("pyrobdl.diagnostics", "pyrobdl.saving", "pyrobdl.references",
                                    *(f"pyrobdl.diagnostics.{m}" for m in (
                                        "agreement", "resolution", "evaluate", "plots", "gradient_variance")))),
    ("public facade", ("pyrobdl",)),
    ("suite", ("pyrobdl.compare",)),
    ("report", ("pyrobdl.report",)),
    ("command line", ("pyrobdl.cli",)),
]

#: ``(importer, imported)`` pairs allowed to point up, each with its reason: none today.  A
#: documented plugin entry point or a lazy import of the command line would go here.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


# ----------------------------------------------------------------------------- reading
def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (p, is_init)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    """Whether ``node`` is ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``), never executed."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    """Every node with ``(in a function, under TYPE_CHECKING)``, in one pass."""
    stack = [(tree, False, False)]
    while stack:
        node, in_function, hidden = stack.pop()
        yield node, in_function, hidden
        if _is_type_checking(node):
            stack.extend((child, in_function, True) for child in node.body)
            stack.extend((child, in_function, hidden) for child in node.orelse)
            continue
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner, hidden) for child in ast.iter_child_nodes(node))


def _targets(mod: str, is_init: bool, node: ast.AST, known: set[str]) -> list[str]:
    """The pyrobdl modules one import node names (a package counts as its ``__init__``)."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".") if is_init else mod.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
        # ``from . import sibling`` names the module sibling, not its package's __init__
        found = subs if len(subs) == len(node.names) else [target, *subs]
    elif isinstance(node, ast.Import):
        found = [a.name for a in node.names]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
          and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        found = [node.args[0].value]
    else:
        return []
    return [t for t in found if t in known and t != mod]


def imports(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """Every module's imports: ``(all, executed, at module level and executed)``.

    ``executed`` leaves out ``if TYPE_CHECKING`` blocks; ``eager`` also leaves out imports inside
    functions (what importing the module runs at once).
    """
    mods = modules(root)
    known = set(mods)
    every = {m: set() for m in mods}
    executed = {m: set() for m in mods}
    eager = {m: set() for m in mods}
    for m, (path, is_init) in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, in_function, hidden in _walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Call)):
                continue
            for t in _targets(m, is_init, node, known):
                every[m].add(t)
                if not hidden:
                    executed[m].add(t)
                    if not in_function:
                        eager[m].add(t)
    return every, executed, eager


# ----------------------------------------------------------------------------- checking
def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    """Index of the layer whose longest name covers ``module``; None when none does."""
    best, best_len = None, -1
    for i, (_, names) in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = i, len(name)
    return best


def upward_edges(edges: dict[str, set[str]], layers, allowed=ALLOWED_UPWARD) -> list[str]:
    out = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if la is not None and lb is not None and lb > la and (a, b) not in allowed:
                out.append(f"{a} ({layers[la][0]}) imports {b} ({layers[lb][0]})")
    return out


def package_inits_run(executed: dict[str, set[str]], eager: dict[str, set[str]], layers,
                      allowed=ALLOWED_UPWARD) -> list[str]:
    """Imports that run a package ``__init__`` whose module-level imports reach above the importer."""
    out = []
    for a, targets in sorted(executed.items()):
        la = layer_of(a, layers)
        for b in sorted(targets):
            parts = b.split(".")
            for k in range(1, len(parts)):
                pkg = ".".join(parts[:k])
                if a == pkg or a.startswith(pkg + ".") or pkg not in eager:
                    continue  # the importer's own package is already running
                for q in sorted(eager[pkg]):
                    lq = layer_of(q, layers)
                    if la is not None and lq is not None and lq > la and (a, q) not in allowed:
                        out.append(f"{a} ({layers[la][0]}) imports {b}, which runs {pkg}/__init__.py, "
                                   f"which imports {q} ({layers[lq][0]}): make {pkg}'s re-exports lazy")
    return sorted(set(out))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
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
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


# ----------------------------------------------------------------------------- the house
EVERY, EXECUTED, EAGER = imports()


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in EVERY if layer_of(m) is None)
    assert not unplaced, f"give these modules a layer in LAYERS (and docs/architecture.md): {unplaced}"


def test_no_import_reaches_a_higher_layer():
    up = upward_edges(EVERY, LAYERS)
    assert not up, "imports that point up a layer (docs/architecture.md):\n" + "\n".join(up)


def test_importing_a_module_runs_no_higher_layer():
    up = package_inits_run(EXECUTED, EAGER, LAYERS)
    assert not up, "\n".join(up)


def test_no_import_circle():
    found = circles(EVERY)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_allowed_upward_edges_still_exist():
    stale = [pair for pair in ALLOWED_UPWARD if pair[1] not in EVERY.get(pair[0], set())]
    assert not stale, f"ALLOWED_UPWARD lists imports that no longer exist: {stale}"


def test_the_docs_draw_every_layer():
    text = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [name for name, _ in LAYERS if name not in text]
    assert not missing, f"docs/architecture.md does not name the layers {missing}"


# ----------------------------------------------------------------------------- the checks can fail
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


TOY_LAYERS = [("low", ("pkg.low", "pkg._util")), ("mid", ("pkg.sub",)), ("high", ("pkg", "pkg.high"))]


def test_the_reader_finds_every_kind_of_import(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "_util.py": "",
        "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import X\n"
                  "def f():\n    from . import high\n    import importlib\n    importlib.import_module('pkg.sub.a')\n",
        "high.py": "import pkg.low\nfrom ._util import g\n",
        "sub/__init__.py": "from .a import A\n",
        "sub/a.py": "from ..low import f\n",
    })
    every, executed, eager = imports(root)
    assert every["pkg.low"] == {"pkg.high", "pkg.sub.a"}
    assert executed["pkg.low"] == {"pkg.high", "pkg.sub.a"} and eager["pkg.low"] == set()
    assert every["pkg.high"] == {"pkg.low", "pkg._util"} == eager["pkg.high"]
    assert every["pkg.sub"] == {"pkg.sub.a"} and every["pkg.sub.a"] == {"pkg.low"}


def test_the_checks_fail_on_an_upward_edge_a_package_init_and_a_circle(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "_util.py": "",
        "low.py": "def f():\n    from .sub import a\n",
        "high.py": "from .low import f\n",
        "sub/__init__.py": "from ..high import f\n",
        "sub/a.py": "from ..high import f\n",
    })
    every, executed, eager = imports(root)
    assert upward_edges(every, TOY_LAYERS, {}) == [
        "pkg.low (low) imports pkg.sub.a (mid)", "pkg.sub (mid) imports pkg.high (high)",
        "pkg.sub.a (mid) imports pkg.high (high)"]
    assert upward_edges(every, TOY_LAYERS, {("pkg.low", "pkg.sub.a"), ("pkg.sub", "pkg.high"),
                                            ("pkg.sub.a", "pkg.high")}) == []
    runs = package_inits_run(executed, eager, TOY_LAYERS, {})
    assert len(runs) == 1 and "pkg.low (low) imports pkg.sub.a, which runs pkg.sub/__init__.py" in runs[0]
    assert circles(every) == [["pkg.high", "pkg.low", "pkg.sub.a"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
