"""The imports of src/hora follow the layers that docs/architecture.md declares.

The layers are read from the ``layers`` block of docs/architecture.md (top to bottom), so the
document and this check cannot disagree. Every ``import`` in src/hora, module level or inside a
function, is an edge from one module to another. Three rules:

1. no module imports a module of a layer above its own;
2. no two top-level packages import each other, directly or through others;
3. no two modules of one package import each other, directly or through others.

``KNOWN`` lists the edges that still break a rule, each with the work that removes it; an entry
whose edge is gone fails :func:`test_known_exceptions_still_exist`, so that it is deleted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"

Edge = tuple[str, str]  # (importing module, imported module)

# Edges that break a rule today. Each is being removed by work in progress; delete an entry
# as soon as its edge is gone (test_known_exceptions_still_exist says which).
KNOWN: dict[Edge, str] = {
    # The one place launch/ reaches up, by design: the `hora run` CLI chooses between a static
    # Job and the elastic driver (which is built on launch/). Nothing else in launch/ imports
    # elastic/ (docs/architecture.md, the elastic layer).
    ("hora.launch.cli", "hora.elastic.driver"): "launch -> elastic (CLI dispatch)",
}


# -- the layers -----------------------------------------------------------------------------
def layers() -> list[tuple[str, list[str]]]:
    """``(layer, module prefixes)`` from the ``layers`` block of the document, top first."""
    text = DOC.read_text()
    start = text.index("```layers\n") + len("```layers\n")
    block = text[start : text.index("```", start)]
    out = []
    for line in block.splitlines():
        if line.strip():
            name, _, mods = line.partition(":")
            out.append((name.strip(), mods.split()))
    return out


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> int:
    """The index (0 = top) of the layer whose longest prefix names ``module``."""
    best, found = -1, -1
    for i, (_, prefixes) in enumerate(table):
        for p in prefixes:
            inside = module.startswith(p + ".") and p != "hora"  # `hora` is __init__.py alone
            if (module == p or inside) and len(p) > best:
                best, found = len(p), i
    if found < 0:
        raise AssertionError(f"{module} is in no layer of {DOC.name}'s layers block: add it")
    return found


# -- the import graph -----------------------------------------------------------------------
def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "hora").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _target(name: str, known: Iterable[str]) -> str | None:
    """The longest name of a module in the tree that ``name`` is or lies in."""
    known = set(known)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The hora modules ``module`` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` mod
            names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin
                     for a in node.names]  # fmt: skip
        else:
            continue
        for n in names:
            target = _target(n, known) if n.split(".")[0] == "hora" else None
            if target is not None and target != module:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(m, p, known) for m, p in mods.items()}


def package_of(module: str) -> str:
    """``hora.core.engine`` -> ``hora.core``; a top-level module is its own package."""
    parts = module.split(".")
    return ".".join(parts[:2])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _checked() -> dict[str, set[str]]:
    """The graph without the known exceptions."""
    return {m: {t for t in ts if (m, t) not in KNOWN} for m, ts in graph().items()}


# -- the rules ------------------------------------------------------------------------------
def test_no_import_points_upward() -> None:
    table = layers()
    upward = [
        f"{m} ({table[layer_of(m, table)][0]}) imports {t} ({table[layer_of(t, table)][0]})"
        for m, ts in sorted(_checked().items())
        for t in sorted(ts)
        if layer_of(t, table) < layer_of(m, table)
    ]
    assert not upward, "imports against the layers of docs/architecture.md:\n" + "\n".join(upward)


def test_top_level_packages_do_not_import_each_other_in_a_cycle() -> None:
    packages: dict[str, set[str]] = {}
    for m, ts in _checked().items():
        packages.setdefault(package_of(m), set()).update(
            package_of(t) for t in ts if package_of(t) != package_of(m)
        )
    assert not cycles(packages), f"packages that import each other: {cycles(packages)}"


def test_no_import_cycle_inside_a_package() -> None:
    found = []
    edges = _checked()
    for pkg in sorted({package_of(m) for m in edges}):
        inside = {m: {t for t in ts if package_of(t) == pkg}
                  for m, ts in edges.items() if package_of(m) == pkg}  # fmt: skip
        found += cycles(inside)
    assert not found, f"modules that import each other: {found}"


def test_known_exceptions_still_exist() -> None:
    full = graph()
    gone = [f"{m} -> {t} ({why})" for (m, t), why in KNOWN.items() if t not in full.get(m, ())]
    assert not gone, "no longer imported: delete these entries from KNOWN:\n" + "\n".join(gone)


def test_every_module_is_in_a_layer() -> None:
    table = layers()
    for m in modules():
        layer_of(m, table)


# -- the check itself can fail ----------------------------------------------------------------
def test_the_checks_catch_an_upward_import_and_cycles() -> None:
    table = [("top", ["hora.a"]), ("bottom", ["hora.b"])]
    assert layer_of("hora.b.x", table) > layer_of("hora.a", table)
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_imports_resolve_relative_and_from_package_forms(tmp_path: Path) -> None:
    pkg = tmp_path / "hora" / "p"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from . import b\nfrom .c import thing\nimport hora.q.r\n"
        "def f():\n    from hora.errors import E\n"
    )
    known = {"hora", "hora.p", "hora.p.a", "hora.p.b", "hora.p.c", "hora.q", "hora.q.r",
             "hora.errors"}  # fmt: skip
    got = imports("hora.p.a", pkg / "a.py", known)
    assert got == {"hora.p.b", "hora.p.c", "hora.q.r", "hora.errors"}
