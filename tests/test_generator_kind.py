"""Only rag/generators/ knows which family of generator (seq2seq or causal) a reader holds, and no two modules import
each other, type-level imports included.

A "kind test" is code that decides on the generator's family: a comparison with ``"causal"`` / ``"seq2seq"``, an
``isinstance`` of a family's type, ``getattr(model, "is_causal")``, or a condition reading ``is_causal`` /
``decoder_only`` / ``generator_kind``. Everywhere else asks the :class:`~rag.generators.base.Generator` to do the
family's part (``contexts``, ``decoder``, ``targets``, ``teacher_forced``), so a new family is one file in generators/.
"""

from __future__ import annotations

import ast

from test_import_graph import ROOT, _layer, find_cycle, import_graph

KIND_STRINGS = {"causal", "seq2seq"}
KIND_FLAGS = {"is_causal", "decoder_only", "generator_kind"}
KIND_TYPES = {"CausalPrompts", "EncodedContexts", "CausalGenerator", "Seq2SeqGenerator", "CausalLMDecoder"}

ALLOWED: set[str] = set()
"""``"path:line"`` of the kind tests still allowed outside rag/generators/ (none: keep it so)."""


def _name(node: ast.AST):
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts))
    return set()


def kind_tests(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every generator-kind test in `source`."""
    found, conditions = set(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_strings(x) & KIND_STRINGS for x in [node.left, *node.comparators]):
            found.add((node.lineno, "compares a generator kind string"))
        elif isinstance(node, ast.Call) and _name(node.func) == "isinstance" and len(node.args) == 2:
            types = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(_name(t) in KIND_TYPES for t in types):
                found.add((node.lineno, "isinstance of a generator family's type"))
        elif (isinstance(node, ast.Call) and _name(node.func) in ("getattr", "hasattr") and len(node.args) >= 2
              and _strings(node.args[1]) & KIND_FLAGS):
            found.add((node.lineno, "getattr of a generator kind flag"))
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            conditions.append(node.test)
        elif isinstance(node, ast.BoolOp):
            conditions.extend(node.values)
        elif isinstance(node, ast.comprehension):
            conditions.extend(node.ifs)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            conditions.append(node.operand)
    for test in conditions:
        for node in ast.walk(test):
            if isinstance(node, (ast.Name, ast.Attribute)) and _name(node) in KIND_FLAGS:
                found.add((node.lineno, "branches on a generator kind flag"))
    return sorted(found)


def test_the_scan_sees_every_kind_of_kind_test():
    cases = {
        'if model.family == "causal":\n    pass': "compares",
        'x = a if kind != "seq2seq" else b': "compares",
        'ok = kind in ("seq2seq", "causal")': "compares",
        "if isinstance(contexts, CausalPrompts):\n    pass": "isinstance",
        "ok = isinstance(g, (int, gen.Seq2SeqGenerator))": "isinstance",
        'c = getattr(model, "is_causal", False)': "getattr",
        "if self.is_causal:\n    pass": "branches",
        "x = 1 if model.lm.decoder_only else 2": "branches",
        "ok = ready and model.is_causal": "branches",
    }
    for source, what in cases.items():
        found = kind_tests(source)
        assert any(w.startswith(what) for _, w in found), (source, found)
    for source in ('load_generator(path, kind="causal")', "kind = model.lm.kind", "return self.lm.decoder_only",
                   'if spec.kind == "flat":\n    pass', "attention(q, k, v, is_causal=True)"):
        assert kind_tests(source) == [], source


def test_no_generator_kind_test_outside_generators():
    """The 28 such tests of rag/models/rag/, rag/generation/decoding.py, rag/pipeline/api.py, rag/serve/openai_routes.py
    and rag/cli/generate.py are the Generator's (and the Reader's) methods now."""
    found = {f"{p.relative_to(ROOT.parent)}:{line}": what for p in sorted(ROOT.rglob("*.py"))
             if p.relative_to(ROOT).parts[0] != "generators"
             for line, what in kind_tests(p.read_text(encoding="utf-8"))}
    unexpected = sorted(f"{site}: {what}" for site, what in found.items() if site not in ALLOWED)
    assert not unexpected, "generator-kind tests outside rag/generators/ (ask the Generator instead):\n" + "\n".join(unexpected)
    assert not ALLOWED - set(found), f"allowed sites that are gone (drop them from ALLOWED): {sorted(ALLOWED - set(found))}"


def test_no_import_cycle_even_at_type_level():
    """An import under ``if TYPE_CHECKING`` ties two modules too: neither can be read or type-checked alone."""
    cycle = find_cycle(import_graph(lazy=True, type_level=True))
    assert cycle is None, "import cycle (counting TYPE_CHECKING and function-level imports): " + " -> ".join(cycle)


def test_type_level_imports_go_downwards_too():
    graph = import_graph(lazy=True, type_level=True)
    upward = [f"{m} -> {d}" for m, deps in sorted(graph.items()) if m not in ("rag", "rag.__main__")
              for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not upward, "type-level imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_type_level_graph_sees_type_checking_imports():
    assert "rag.models.rag.model" in import_graph(lazy=True, type_level=True)["rag.pipeline.readers"]
    assert "rag.models.rag.model" not in import_graph(lazy=True)["rag.pipeline.readers"]
