"""Evaluation-set readers: each format's fixture file (tests/fixtures/eval/, written in the format as its project
publishes it) read into EvalExamples; bad input is one EvalDataError naming the file, the line and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rag.eval.benchmarks import EvalDataError, detect_format, read_eval_set

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "eval"


def test_kilt():
    exs = read_eval_set(FIXTURES / "kilt_nq.jsonl")
    assert detect_format(FIXTURES / "kilt_nq.jsonl") == "kilt"
    assert [e.id for e in exs] == ["-1001", "-1002", "-1003"]
    assert exs[0].answers == ("Ar",) and exs[0].evidence == (("elements/argon",),)  # the duplicate "Ar " merged
    assert exs[1].evidence == (("elements/helium",), ("elements/hydrogen", "elements/helium"))
    assert exs[1].qrels == {"elements/helium": 1, "elements/hydrogen": 1}
    assert exs[2].answers == ("Priestley", "Joseph Priestley")


def test_dpr_qa_csv_and_json():
    csv = read_eval_set(FIXTURES / "dpr_nq-test.qa.csv")
    assert [(e.id, e.question, e.answers) for e in csv] == [
        ("0", "what is the chemical symbol of argon?", ("Ar",)),
        ("1", "who discovered oxygen?", ("Priestley", "Joseph Priestley"))]
    assert csv[0].qrels is None
    js = read_eval_set(FIXTURES / "dpr_trivia-dev.json")
    assert detect_format(FIXTURES / "dpr_trivia-dev.json") == "dpr"
    assert js[0].answers == ("Ar", "AR") and js[0].qrels == {"elements/argon": 1}  # hard negatives are not gold
    assert js[1].qrels == {"elements/helium": 1}


def test_hotpotqa():
    exs = read_eval_set(FIXTURES / "hotpot_dev_distractor.json")
    assert detect_format(FIXTURES / "hotpot_dev_distractor.json") == "hotpotqa"
    assert exs[0].id == "5a8b57f25542995d1e6f1371" and exs[0].answers == ("yes",) and exs[0].category == "comparison"
    assert exs[0].match == "title" and exs[0].evidence == (("Argon", "Helium"),) and exs[0].extra == {"level": "medium"}


def test_beir():
    exs = read_eval_set(FIXTURES / "beir")
    assert detect_format(FIXTURES / "beir") == "beir"
    assert [e.id for e in exs] == ["q1", "q2"]  # q3 has no judgements: not evaluated (as BEIR)
    assert exs[0].qrels == {"elements/argon": 2, "elements/helium": 1} and exs[0].answers == ()
    assert exs[1].qrels == {"elements/oxygen": 1, "elements/argon": 0}
    assert read_eval_set(f"{FIXTURES / 'beir'}#test")[0].id == "q1"


def test_own_jsonl_and_demo():
    exs = read_eval_set(FIXTURES / "own.jsonl")
    assert [e.id for e in exs] == ["argon-symbol", "helium-number", "oxygen-discoverer"]
    assert exs[0].qrels == {"elements/argon": 1} and exs[1].qrels == {"elements/helium": 1} and exs[2].qrels is None
    assert [e.category for e in exs] == ["symbol", "atomic_number", "discoverer"]
    demo = read_eval_set("demo:test")
    assert len(demo) == 100 and demo[0].id == "0" and demo[0].category == "symbol"


def _copy_beir(tmp_path) -> Path:
    root = tmp_path / "beir"
    shutil.copytree(FIXTURES / "beir", root)
    return root


def test_qrels_naming_an_unknown_query(tmp_path):
    root = _copy_beir(tmp_path)
    with open(root / "qrels" / "test.tsv", "a") as f:
        f.write("q9\telements/argon\t1\n")
    with pytest.raises(EvalDataError, match=r"test\.tsv:6: query id 'q9' is not in .*queries\.jsonl; remove the row or add"):
        read_eval_set(root)


def test_malformed_tsv_row(tmp_path):
    root = _copy_beir(tmp_path)
    with open(root / "qrels" / "test.tsv", "a") as f:
        f.write("q1 elements/oxygen 1\n")
    with pytest.raises(EvalDataError, match=r"test\.tsv:6: expected 'query-id<TAB>corpus-id<TAB>score'.*fix or remove the row"):
        read_eval_set(root)
    bad = tmp_path / "nq.qa.csv"
    bad.write_text("what?\t['Ar'\n")
    with pytest.raises(EvalDataError, match=r"nq\.qa\.csv:1: column 'answers'"):
        read_eval_set(bad)


def test_kilt_without_output(tmp_path):
    path = tmp_path / "nq-test_without_answers-kilt.jsonl"
    path.write_text(json.dumps({"id": "1", "input": "q?", "output": []}) + "\n"
                    + json.dumps({"id": "2", "input": "q2?"}) + "\n")
    assert detect_format(path) == "kilt"
    with pytest.raises(EvalDataError, match=r"kilt\.jsonl:1: KILT record '1' has no 'output' list.*evaluate on the dev file"):
        read_eval_set(path)


def test_duplicate_ids(tmp_path):
    path = tmp_path / "dup.jsonl"
    lines = (FIXTURES / "own.jsonl").read_text().splitlines()
    path.write_text("\n".join(lines + [lines[1]]) + "\n")
    with pytest.raises(EvalDataError, match=r"dup\.jsonl:4: duplicate id 'helium-number' \(first at .*dup\.jsonl:2\)"):
        read_eval_set(path)
    kilt = tmp_path / "k.jsonl"
    kilt.write_text((FIXTURES / "kilt_nq.jsonl").read_text().splitlines()[0] * 1 + "\n"
                    + (FIXTURES / "kilt_nq.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(EvalDataError, match=r"k\.jsonl:2: duplicate id '-1001'"):
        read_eval_set(kilt)
