"""The package's folders are its layers: a module imports only modules of its own layer or below.

Read from the source (every ``import`` and ``from ... import``, at module level or inside a
function), so a lazy import that reaches up a layer is caught as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shardckpt"

#: Lowest first. ``errors`` is the vocabulary every layer shares; ``demo`` runs the whole stack.
LAYERS = ["errors", "format", "storage", "checkpoint", "interop", "tools", "training", "runtime",
          "watch", "integrations", "hf", "demo", "cli"]
#: Layers whose modules must not need torch to be imported (torch only inside functions).
TORCH_FREE = {"errors", "format", "storage", "checkpoint", "tools"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "shardckpt" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out.append((".".join(rel.parts).removesuffix(".__init__"), path))
    return out


def _imports(tree: ast.Module) -> list[tuple[int, str, bool]]:
    """(line, imported module or module.name, at module level) for every absolute import."""
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{a.name}", id(node) in top) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, id(node) in top) for a in node.names]
    return found


def test_every_module_sits_in_a_layer() -> None:
    loose = [m for m, _ in _modules() if m not in ("shardckpt", "shardckpt.__main__") and _layer(m) is None]
    assert not loose, f"modules outside every layer folder: {loose}"


def test_no_module_imports_a_layer_above_its_own() -> None:
    problems = []
    for module, path in _modules():
        mine = _layer(module)
        if mine is None:
            continue
        for line, name, _ in _imports(ast.parse(path.read_text())):
            other = _layer(name)
            if other is not None and LAYERS.index(other) > LAYERS.index(mine):
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({mine}) imports {name} ({other})")
    assert not problems, "\n".join(problems)


def test_lower_layers_import_torch_only_inside_functions() -> None:
    problems = []
    for module, path in _modules():
        if _layer(module) not in TORCH_FREE:
            continue
        for line, name, top in _imports(ast.parse(path.read_text())):
            if top and name.split(".")[0] == "torch":
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} at module level")
    assert not problems, "\n".join(problems)


#: Modules that still reach into another module's private names (importer, imported module).
#: None: a name another module needs is public where it lives. No module may join this list.
PRIVATE_IMPORTS_LEFT: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, other module, name) for every private name of another shardckpt module this module
    imports (``from shardckpt.x import _name``) or reaches through an imported name
    (``x._name``, ``x.y._name`` where ``x`` was imported from shardckpt)."""
    bound: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardckpt"):
            for a in node.names:
                if _private(a.name):
                    found.append((node.lineno, node.module, a.name))
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("shardckpt"):
                    bound[a.asname or a.name.split(".")[0]] = a.asname and a.name or "shardckpt"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append((node.lineno, bound[base.id], ast.unparse(node)))
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    """A leading underscore means "this module only": another module that needs the name gets
    it made public (or is handed the object), never reaches in."""
    problems = []
    cli = PACKAGE.parent / "cli"
    paths = _modules() + [(f"shardckpt.cli.{p.stem}", p) for p in sorted(cli.glob("*.py"))]
    for module, path in paths:
        for line, other, name in _private_uses(ast.parse(path.read_text())):
            if (module, other) not in PRIVATE_IMPORTS_LEFT:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} uses {other}: {name}")
    assert not problems, "\n".join(problems)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in its source (inside functions and
    under ``TYPE_CHECKING`` too: a cycle of either kind means two modules that cannot be read,
    tested or moved apart)."""
    modules = {m for m, _ in _modules()}
    graph: dict[str, set[str]] = {}
    for module, path in _modules():
        out = graph.setdefault(module, set())
        for _, name, _ in _imports(ast.parse(path.read_text())):
            parts = name.split(".")
            for n in range(len(parts), 1, -1):  # the longest prefix that is a module
                target = ".".join(parts[:n])
                if target in modules:
                    if target != module and not module.startswith(target + "."):
                        out.add(target)
                    break
    return graph


def test_no_import_cycles() -> None:
    """No two modules import each other, directly or around a loop (strongly connected
    components of the import graph, Tarjan's algorithm without recursion)."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    assert not cycles, "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in cycles)


def _storage_face() -> set[str]:
    """The names ``shardckpt.storage`` exports (its ``__all__``, read from the source)."""
    tree = ast.parse((PACKAGE / "storage" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("shardckpt/storage/__init__.py has no __all__")


def test_storage_is_used_through_its_package() -> None:
    """Outside ``storage/`` every storage name comes from ``shardckpt.storage`` itself: no
    ``from shardckpt.storage.<module> import``, no ``import shardckpt.storage.<module>``, no
    ``from shardckpt.storage import <module>`` unless the package exports that module as a
    namespace. How storage splits its modules is its own business."""
    submodules = {p.stem for p in (PACKAGE / "storage").glob("*.py")} - {"__init__"}
    face = _storage_face()
    cli = PACKAGE.parent / "cli"
    paths = [p for _, p in _modules() if "storage" not in p.relative_to(PACKAGE).parts[:1]]
    problems = []
    for path in paths + sorted(cli.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith("shardckpt.storage."):
                    names = [node.module]
                elif node.module == "shardckpt.storage":
                    names = [f"shardckpt.storage.{a.name}" for a in node.names
                             if a.name in submodules and a.name not in face]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("shardckpt.storage.")]
            problems += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {n}" for n in names]
    assert not problems, "import these names from shardckpt.storage (export them there):\n" + "\n".join(problems)
