"""The package's imports go one way: no cycle, no import against the layer order, no reach into
another module's private names.

The order lives in one place, the table under "Layers and modules" in docs/design.md: a module
may import modules of its own layer or of the layers above it in the table, never below, and no
two modules may import each other, directly or around a circle. Every import counts: at the top
of a module, inside a function, and under ``TYPE_CHECKING``. A new module must be put into the
table before it can be imported. Pure static analysis (``ast``): nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "yashard"
DESIGN = ROOT / "docs" / "design.md"


def read_layers(text: str) -> dict[str, int]:
    """``{module: layer number}`` from the markdown table under ``## Layers and modules``: rows
    ``| <n> | <layer name> | `mod`, `mod.sub`, ... |`` (module names relative to ``yashard``)."""
    section = text.split("## Layers and modules", 1)
    if len(section) < 2:
        raise AssertionError(f"{DESIGN} has no '## Layers and modules' section: the layer order lives there")
    layers: dict[str, int] = {}
    for line in section[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`([A-Za-z0-9_.]+)`", cells[2]):
            if name in layers:
                raise AssertionError(f"module {name} is listed twice in the layer table")
            layers[name] = int(cells[0])
    return layers


def modules() -> dict[str, Path]:
    """``{dotted name relative to yashard: file}``; a package is named by its ``__init__.py``
    (the package root itself is ``""``)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(importer: str, is_package: bool, module: str | None, level: int, names: list[str],
             known: set[str]) -> set[str]:
    """The yashard modules one ``import``/``from ... import`` statement loads (relative to yashard)."""
    if level:
        base = importer.split(".") if importer else []
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (level - 1)] if level > 1 else base
        target = ".".join(base + ([module] if module else []))
    elif module is not None and (module == "yashard" or module.startswith("yashard.")):
        target = module[len("yashard."):] if module != "yashard" else ""
    else:
        return set()
    found = set()
    subs = {f"{target}.{n}" if target else n for n in names} & known  # from .pkg import submodule
    found |= subs
    ancestor = target == "" or importer == target or importer.startswith(target + ".")
    # (``from . import sibling`` inside a package loads the sibling only; a name defined in the
    # package's own __init__, ``from . import __version__``, needs that __init__: an edge to it)
    if target in known and not (ancestor and names and len(subs) == len(names)):
        found.add(target)
    # importing a.b runs a's __init__ first, unless the importer is inside a already
    parts = target.split(".") if target else []
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in known and not (importer == parent or importer.startswith(parent + ".")):
            found.add(parent)
    return found


def import_graph(mods: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """``{importer: {imported: [line, ...]}}`` over every import statement of every module."""
    known = set(mods)
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(name, is_package, node.module, node.level, [a.name for a in node.names], known)
            elif isinstance(node, ast.Import):
                targets = set()
                for a in node.names:
                    targets |= _resolve(name, is_package, a.name, 0, [], known)
            else:
                continue
            for t in targets - {name}:
                graph[name].setdefault(t, []).append(node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def private_reaches(mods: dict[str, Path]) -> list[str]:
    """Reaches into another module's private names: ``from .x import _name`` between yashard
    modules, and reading ``obj._attr`` where ``_attr`` is a private attribute that a yashard class
    sets on ``self`` and ``obj`` is not ``self``/``cls`` (another object's internals)."""
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in mods.items()}
    own_private: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                own_private.add(node.attr)
    found = []
    for name, tree in trees.items():
        rel = mods[name].relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("yashard")):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{rel}:{node.lineno}: imports private name {a.name} from "
                                     f"{'.' * node.level}{node.module or ''}")
            elif (isinstance(node, ast.Attribute) and node.attr in own_private
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{rel}:{node.lineno}: reads {ast.unparse(node)}, another object's private attribute")
    return found


def test_the_import_graph_has_no_cycle():
    found = cycles(import_graph(modules()))
    assert not found, "modules that import each other (directly or around a circle): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_every_import_follows_the_layer_order_in_docs_design():
    mods = modules()
    layers = read_layers(DESIGN.read_text())
    unlisted = sorted(m for m in mods if m and m not in layers)
    assert not unlisted, f"modules missing from the layer table in {DESIGN.relative_to(ROOT)}: {unlisted}"
    stale = sorted(m for m in layers if m not in mods)
    assert not stale, f"the layer table in {DESIGN.relative_to(ROOT)} lists modules that do not exist: {stale}"
    wrong = []
    for importer, targets in import_graph(mods).items():
        if not importer:  # the package root re-exports the public names: it sits above every layer
            continue
        for target, lines in targets.items():
            if not target or layers[target] > layers[importer]:
                where = layers.get(target, "the package root")
                wrong.append(f"yashard/{importer} (layer {layers[importer]}) imports {target or 'yashard'} "
                             f"(layer {where}) at line {lines[0]}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_module_reaches_into_another_modules_private_names():
    found = private_reaches(modules())
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_are_for():
    """The analysis itself: a cycle through a function-level import, a TYPE_CHECKING import and
    a submodule's package are seen; a private attribute read through another object is seen."""
    import textwrap

    src = {
        "a": "from .b import f\n",
        "b": "def f():\n    from .c import g\n",
        "c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n",
        "p": "from ..q import y\n",
        "p.s": "",
        "q": "from .p.s import z\n",
        "r": "class R:\n    def __init__(self):\n        self._hidden = 1\n\ndef peek(o):\n    return o._hidden\n",
        "k": "from .m import z\nX = 1\n",   # a package k: k/__init__.py
        "k.m": "from . import X\n",          # needs k's __init__: a circle with it
        "k.n": "from . import m\n",          # loads the sibling only: no edge to k
    }
    tmp = Path(__import__("tempfile").mkdtemp())
    paths = {}
    for name, text in src.items():
        path = tmp / (name.replace(".", "/") + ".py") if name not in ("p", "k") else tmp / name / "__init__.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        paths[name] = path
    graph = import_graph(paths)
    assert sorted(map(tuple, cycles(graph))) == [("a", "b", "c"), ("k", "k.m"), ("p", "q")]
    assert set(graph["k.n"]) == {"k.m"}
    assert read_layers("## Layers and modules\n| 0 | base | `a`, `b` |\n| 1 | top | `c` |\n") == {"a": 0, "b": 0, "c": 1}
    global ROOT
    saved, ROOT = ROOT, tmp
    try:
        assert [f.split(": ", 1)[1] for f in private_reaches(paths)] == [
            "reads o._hidden, another object's private attribute"]
    finally:
        ROOT = saved
