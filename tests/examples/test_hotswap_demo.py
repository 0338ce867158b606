"""examples/hotswap_demo.py: the counterfactual edit of the real Elements corpus, and the demo end to end.

The edit is checked on the bundled corpus file itself: every chosen fact changes, to the real
value of another chosen element, in the original surface form, and nothing else changes (other
passages byte-identical in the written JSONL). The script then runs end to end with a tiny
random RAG model over tiny-DPR knowledge bases of the full corpus (accuracy ~0 is expected; the
test checks the 2x2 matrix, the files, and that the live swap answers from A, then B, then A).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from rag.demo import CORPUS_PATH, load_demo_corpus, load_demo_qa
from rag.utils.errors import RagError

EXAMPLE = "hotswap_demo"

@pytest.fixture(scope="module")
def edited(demo):
    passages = load_demo_corpus()
    elements = demo.held_out_elements()
    new, edits = demo.edit_corpus(passages, elements, seed=0)
    return passages, elements, new, edits


def test_held_out_elements_are_absent_from_training_questions(demo):
    held = set(demo.held_out_elements())
    assert len(held) == 38
    assert not held & {q["element"] for q in load_demo_qa("train")}


def test_edit_is_a_derangement_of_real_values(demo, edited):
    passages, elements, new, edits = edited
    by_title = {p.title: p for p in passages}
    original = {(t, f): s.value for t, p in by_title.items() for f, s in demo.locate_facts(p.text).items()}
    # Every fact of every chosen element that the passage states is edited, once.
    stated = {(e, f) for e in elements for f in demo.locate_facts(by_title[e].text)}
    assert {(e.element, e.field) for e in edits} == stated
    assert Counter(e.field for e in edits) == {"symbol": 38, "atomic_weight": 35, "year": 19}
    for e in edits:
        assert e.old == original[(e.element, e.field)]
        assert e.new != e.old  # derangement: every edited value differs
        assert e.source != e.element and e.source in elements and e.new == original[(e.source, e.field)]  # a real value
    for field in demo.FIELDS:  # a rotation: each value is given away exactly once (the multiset is unchanged)
        fe = [e for e in edits if e.field == field]
        assert Counter(e.new for e in fe) == Counter(e.old for e in fe)
        assert sorted(e.source for e in fe) == sorted(e.element for e in fe)
    # Same seed, same edits; another seed, other edits.
    assert demo.edit_corpus(passages, list(reversed(elements)), seed=0)[1] == edits
    assert demo.edit_corpus(passages, elements, seed=1)[1] != edits


def test_edit_keeps_the_surface_form_and_everything_else(demo, edited, tmp_path):
    passages, elements, new, edits = edited
    assert [(p.id, p.title) for p in new] == [(p.id, p.title) for p in passages]
    edits_of = {}
    for e in edits:
        edits_of.setdefault(e.element, []).append(e)
    for a, b in zip(passages, new):
        if a.title not in edits_of:
            assert b is a
            continue
        facts = demo.locate_facts(b.text)
        for e in edits_of[a.title]:
            assert facts[e.field].value == e.new  # where the questions look for it
            form = {"symbol": f"Symbol: {e.new}.", "atomic_weight": f"Atomic weight: {e.new}.", "year": f" {e.new}"}[e.field]
            assert form in b.text
        # Only the values differ: putting the old values back (right to left) restores the original text.
        olds = {e.new: e.old for e in edits_of[a.title]}
        changed = [(i, x, y) for i, (x, y) in enumerate(zip(a.text.split(" "), b.text.split(" "))) if x != y]
        assert len(a.text.split(" ")) == len(b.text.split(" ")) and changed
        for _, x, y in changed:
            core = re.sub(r"[.,;]$", "", y)
            assert core in olds and y.replace(core, olds[core]) == x
    # Unedited passages are byte-identical in the written corpus; edited ones differ.
    (tmp_path / "b.jsonl").write_text(demo.corpus_jsonl(new), encoding="utf-8")
    lines_a = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    lines_b = (tmp_path / "b.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines_a) == len(lines_b) == len(passages)
    for p, la, lb in zip(passages, lines_a, lines_b):
        assert (la == lb) == (p.title not in edits_of)
    assert demo.corpus_jsonl(passages) == CORPUS_PATH.read_text(encoding="utf-8")  # the format is the corpus's own


def test_question_sets_follow_the_edit(demo, edited):
    passages, elements, new, edits = edited
    rows = [q for s in ("dev", "test") for q in load_demo_qa(s)]
    sets = demo.question_sets(rows, edits)
    assert len(sets["A"]) == len(sets["B"]) == 130 and len(sets["control"]) == 72
    b_facts = {p.title: demo.locate_facts(p.text) for p in new}
    a_facts = {p.title: demo.locate_facts(p.text) for p in passages}
    for qa, qb in zip(sets["A"], sets["B"]):
        assert qa["question"] == qb["question"] and qa["answers"] != qb["answers"] and qb["original_answers"] == qa["answers"]
        [ans_b] = qb["answers"]
        if qa["type"] == "name_from_symbol":  # the element that now carries the asked symbol
            sym = a_facts[qa["element"]]["symbol"].value
            assert b_facts[ans_b]["symbol"].value == sym and ans_b != qa["element"]
        else:
            assert b_facts[qa["element"]][qa["type"]].value == ans_b
            assert a_facts[qa["element"]][qa["type"]].value == qa["answers"][0]
    assert {q["type"] for q in sets["control"]} == set(demo.CONTROL_TYPES)
    only = demo.question_sets(rows, edits, types=["year"])
    assert {q["type"] for q in only["A"]} == {"year"} and len(only["A"]) == 19
    with pytest.raises(RagError):
        demo.question_sets(rows, edits, types=["atomic_number"])
    broken = [dict(q, answers=["Xx"]) if q["type"] == "symbol" else q for q in rows]
    with pytest.raises(RagError, match="corpus states"):
        demo.question_sets(broken, edits)


def test_value_derangement_handles_repeated_values(demo):
    values = ["1898", "1898", "1898", "1774", "1808", "1750"]
    for seed in range(20):
        perm = demo.value_derangement(values, random.Random(seed))
        assert sorted(perm) == list(range(len(values)))
        assert all(values[perm[i]] != values[i] for i in range(len(values)))
    with pytest.raises(RagError):
        demo.value_derangement(["1898", "1898", "1700"], random.Random(0))
    with pytest.raises(RagError):
        demo.value_derangement(["Fe"], random.Random(0))
    with pytest.raises(RagError, match="no passage"):
        demo.edit_corpus(load_demo_corpus(), ["Unobtainium"])


def test_demo_end_to_end_with_a_tiny_model(demo, tmp_path, tiny_dpr_question_dir, tiny_dpr_context_dir, tiny_bart_dir, capsys):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.models.rag.model import RagModel

    kb_a = KnowledgeBase.build(load_demo_corpus(), TextEncoder(tiny_dpr_context_dir), tmp_path / "kb_A", index="flat",
                               show_progress=False)
    RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kb_a.path, n_docs=2).save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    argv = ["--model", str(tmp_path / "model"), "--kb-a", str(kb_a.path), "--out", str(out), "--limit", "3",
            "--max-new-tokens", "3", "--quiet"]
    res = demo.run(demo.parse_args(argv))  # knowledge base B: encoder re-loaded from A's manifest
    printed = capsys.readouterr().out

    edited = res["edited"]
    assert len(edited["em"]) == 2 and all(len(r) == 2 and all(0.0 <= v <= 1.0 for v in r) for r in edited["em"])
    assert edited["kb_versions"] == [kb_a.version, res["kb_B"]["version"]] and kb_a.version != res["kb_B"]["version"]
    assert edited["n_questions"] == [3, 3] and len(res["control"]["em"]) == 2 and len(res["control"]["em"][0]) == 1
    kb_b = KnowledgeBase.open(out / "kb_B")
    assert kb_b.encoder["fingerprint"] == kb_a.encoder["fingerprint"] and kb_b.index_spec == kb_a.index_spec
    assert res["kb_B"]["changed_passages"] == 38
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(res))
    assert (out / "hotswap_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "results.md").read_text()
    assert table.startswith("| knowledge base |") and table.count("\n| ") == 2 and "Matched EM" in table and table in printed
    assert len(json.loads((out / "edits.json").read_text())["edits"]) == 92
    qa_b = [json.loads(line) for line in (out / "qa_B.jsonl").read_text().splitlines()]
    assert len(qa_b) == 130

    # Live swap: the answers name A, then B, then A again.
    live = res["live_swap"]
    assert [ph["kb_version"] for ph in live["phases"]] == [kb_a.version, kb_b.version, kb_a.version]
    for ph in live["phases"]:
        assert len(ph["answers"]) == 3 and all(a["kb_version"] == ph["kb_version"] for a in ph["answers"])
    assert [q["type"] for q in live["questions"]] == ["symbol", "atomic_weight", "year"]
    assert live["phases"][1]["swap"]["kind"] == "swap" and live["phases"][2]["swap"]["kind"] == "swap_back"
    assert "[B] serving " + kb_b.version in printed

    # A second run reuses knowledge base B (same passages, encoder and index).
    again = demo.run(demo.parse_args(argv + ["--live", "0", "--no-control"]))
    assert again["kb_B"]["version"] == kb_b.version and again["control"] is None and again["live_swap"] is None
