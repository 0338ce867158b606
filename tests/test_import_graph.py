"""The package's module-level import graph: no cycles, so every module can be imported (and read) on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import rag

ROOT = Path(rag.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, name: str, is_package: bool, modules: set[str], *, lazy: bool,
             type_level: bool = False) -> set[str]:
    """Modules of the package that `name` imports: at module level (also inside module-level if/try/with),
    plus with `lazy` those imported inside functions and classes; under ``if TYPE_CHECKING`` only with `type_level`."""
    out: set[str] = set()

    def add(node) -> None:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules)

    def visit(stmts) -> None:
        for node in stmts:
            add(node)
            if isinstance(node, ast.If):
                if type_level or not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With):
                visit(node.body)
            elif lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body)
            elif lazy and isinstance(node, (ast.For, ast.While)):
                visit(node.body)
                visit(node.orelse)

    visit(tree.body)
    return {m for m in out if m in modules and m != name}


def import_graph(*, lazy: bool = False, type_level: bool = False) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``; `lazy` also counts imports inside functions and classes,
    `type_level` those under ``if TYPE_CHECKING``."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files) - {"rag"}  # every module imports its package; `rag/__init__` imports nothing eagerly
    return {name: _imports(ast.parse(p.read_text(encoding="utf-8")), name, p.name == "__init__.py", modules, lazy=lazy,
                           type_level=type_level) for name, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_sees_the_package():
    graph = import_graph()
    assert "rag.knowledge.types" in graph["rag.knowledge.retriever"]
    assert "rag.knowledge.passages" in graph["rag.knowledge.types"]
    assert "rag.models.rag.model" not in import_graph(lazy=True)["rag.models.rag.checkpoint"]  # TYPE_CHECKING only
    snippet = ast.parse("import rag.utils.io\ndef f():\n    from rag.knowledge import types\n")
    modules = {"rag.utils.io", "rag.knowledge", "rag.knowledge.types"}
    assert _imports(snippet, "rag.x", False, modules, lazy=False) == {"rag.utils.io"}
    assert _imports(snippet, "rag.x", False, modules, lazy=True) == modules  # imported inside a function


def test_module_level_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_imports_inside_functions_close_no_cycle_either():
    """A cycle through a deferred import still ties two modules into one: neither can be read, tested or
    replaced alone. (The knowledge_base -> bm25 -> retriever and rag_model <-> hf_compat cycles were such.)"""
    cycle = find_cycle(import_graph(lazy=True))
    assert cycle is None, "import cycle (counting imports inside functions): " + " -> ".join(cycle)


LAYERS = ("rag.utils", "rag.knowledge", "rag.demo", "rag.generation", "rag.generators", "rag.models", "rag.retrobust",
          "rag.pipeline", "rag.eval", "rag.training", "rag.serve", "rag.cli")
"""The package's layers, bottom first (docs/architecture.md): the data flows up this list, and a module imports only
from its own layer or those below it. `rag` itself and `rag.__main__` stand above all."""


def _layer(module: str) -> int:
    found = [i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + ".")]
    if not found:
        raise AssertionError(f"{module} belongs to no layer: add its folder to LAYERS and to docs/architecture.md")
    return found[-1]


def test_every_module_belongs_to_a_layer_and_imports_only_downwards():
    graph = import_graph(lazy=True)
    upward = [f"{m} -> {d}" for m, deps in sorted(graph.items()) if m not in ("rag", "rag.__main__")
              for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_layer_check_sees_an_upward_import():
    assert _layer("rag.knowledge.index") < _layer("rag.training.data")
    assert _layer("rag.models.rag.model") == _layer("rag.models.ralm.model")


def test_at_most_one_module_over_600_lines():
    long = sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
                  if len(p.read_text(encoding="utf-8").splitlines()) > 600)
    assert len(long) <= 1, f"modules over 600 lines (split them by concern): {long}"


MAX_FUNCTION_LEVEL_IMPORTS = 60
"""Imports of the package inside functions and classes (``if TYPE_CHECKING`` blocks aside) allowed at most: a file's
header says what it uses. An optional heavy third-party dependency may still be imported where it is used."""


def function_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """The imports of ``rag.*`` (or relative ones) nested in a function or class body of `tree`, except under
    ``if TYPE_CHECKING``."""
    found: list[ast.stmt] = []

    def of_the_package(node) -> bool:
        if isinstance(node, ast.ImportFrom):
            return node.level > 0 or (node.module or "").split(".")[0] == "rag"
        return any(a.name.split(".")[0] == "rag" for a in node.names)

    def visit(node, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                visit(ast.Module(body=child.orelse, type_ignores=[]), inside)
                continue
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)) and of_the_package(child):
                found.append(child)
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))

    visit(tree, False)
    return found


def test_the_counter_sees_imports_inside_functions_and_classes_only():
    snippet = ast.parse(
        "import rag.utils.io\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rag.knowledge import types\n"
        "def f():\n    import json\n    from rag.knowledge.types import Retrieved\n    if True:\n        import rag.utils.files\n"
        "class C:\n    from . import sibling\n    def g(self):\n        if TYPE_CHECKING:\n            from rag import x\n")
    assert [ast.unparse(n) for n in function_level_imports(snippet)] == [
        "from rag.knowledge.types import Retrieved", "import rag.utils.files", "from . import sibling"]


def test_few_imports_of_the_package_inside_functions():
    found = [f"{p.relative_to(ROOT.parent)}:{n.lineno}: {ast.unparse(n)}" for p in sorted(ROOT.rglob("*.py"))
             for n in function_level_imports(ast.parse(p.read_text(encoding="utf-8")))]
    assert len(found) <= MAX_FUNCTION_LEVEL_IMPORTS, (
        f"{len(found)} imports of rag.* inside functions (at most {MAX_FUNCTION_LEVEL_IMPORTS}): move them to the top of "
        "their file; where that closes a cycle, move the imported thing down a layer:\n" + "\n".join(found))
