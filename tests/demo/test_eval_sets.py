"""The bundled evaluation-only question sets (``demo:natural``, ``demo:natural_dev``) hold what they say."""

from __future__ import annotations

import json

import pytest

from rag.demo import EVAL_SETS, SPLITS, load_demo_corpus, load_demo_qa, qa_path
from rag.eval.metrics import normalize_answer


@pytest.mark.parametrize("name", sorted(EVAL_SETS))
def test_every_answer_is_in_the_passage_of_its_element(name):
    passages = {p.title: p for p in load_demo_corpus()}
    rows = [json.loads(line) for line in qa_path(name).read_text(encoding="utf-8").splitlines()]
    assert rows and len({r["question"] for r in rows}) == len(rows)
    for r in rows:
        p = passages[r["element"]]
        page = f" {normalize_answer(f'{p.title} {p.text}')} "
        assert r["answers"] and all(f" {normalize_answer(a)} " in page for a in r["answers"]), r  # as whole words


def test_the_development_set_asks_about_other_elements_in_the_same_kinds():
    natural, dev = load_demo_qa("natural"), load_demo_qa("natural_dev")
    assert not {r["element"] for r in natural} & {r["element"] for r in dev}
    assert {r["type"] for r in dev} == {r["type"] for r in natural}
    train = {r["question"].lower() for r in load_demo_qa("train")}
    assert not train & {r["question"].lower() for r in dev}


def test_the_development_set_is_what_its_builder_makes():
    from rag.demo.natural_dev import build

    assert build() == load_demo_qa("natural_dev")


@pytest.mark.parametrize("name,least", [("freeform", 60), ("freeform_dev", 40)])
def test_the_freeform_sets_ask_what_no_training_question_asks(name, least):
    freeform = load_demo_qa(name)
    assert len(freeform) >= least
    trained_kinds = {r.get("type") for split in SPLITS for r in load_demo_qa(split)}
    assert not trained_kinds & {r["type"] for r in freeform}
    others = [n for n in (*SPLITS, *EVAL_SETS) if n != name]
    asked = {r["question"].lower() for n in others for r in load_demo_qa(n)}
    assert not asked & {r["question"].lower() for r in freeform}


def test_the_freeform_development_set_asks_about_other_elements_in_the_same_kinds():
    test, dev = load_demo_qa("freeform"), load_demo_qa("freeform_dev")
    assert not {r["element"] for r in test} & {r["element"] for r in dev}
    assert {r["type"] for r in dev} <= {r["type"] for r in test}
