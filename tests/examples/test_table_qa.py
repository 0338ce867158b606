"""examples/table_qa.py: ISO 639-3 rows become table pages, and questions ask one cell of a held-out row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

EXAMPLE = "table_qa"

def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_pages_of_rows_and_questions_split_by_row(demo, tmp_path):
    records = [{"alpha_3": f"x{i:02d}", "name": f"Lang {i}", "scope": "I", "type": "L"} for i in range(40)]
    records += [{"alpha_3": "dup", "name": "Lang 3", "scope": "I", "type": "E"}]  # a name twice: both dropped
    (tmp_path / "src.json").write_text(json.dumps({"639-3": records}), encoding="utf-8")
    assert demo.main(["--source", str(tmp_path / "src.json"), "--out", str(tmp_path / "out"), "--rows-per-page", "4",
                      "--held-out", "10", "--train", "20"]) == 0
    pages = _read(tmp_path / "out" / "corpus.jsonl")
    assert [p["text"].count(";") for p in pages] == [4] * 9 + [3]  # 39 rows with a unique name
    assert "x00 | Lang 0 | individual | living;" in pages[0]["text"] and "Lang 3 |" not in "".join(p["text"] for p in pages)
    splits = {name: _read(tmp_path / "out" / f"{name}.jsonl") for name in ("train", "val", "test")}
    assert [len(splits[n]) for n in ("train", "val", "test")] == [20, 5, 5]

    answers = {n: {q["answers"][0] for q in qs} for n, qs in splits.items()}
    # a held-out row's code and name are never a training question's subject or answer
    train_text = " ".join(q["question"] + " " + q["answers"][0] for q in splits["train"])
    for q in splits["val"] + splits["test"]:
        assert q["answers"][0] not in answers["train"]
        assert q["answers"][0] + " " not in train_text + " "
    corpus = " ".join(p["text"] for p in pages)
    assert all(f"{q['answers'][0]} |" in corpus for q in splits["test"])  # every answer is a cell of the corpus


def test_a_missing_source_is_one_line_naming_it(demo, tmp_path):
    with pytest.raises(SystemExit, match="iso-codes"):
        demo.main(["--source", str(tmp_path / "none.json"), "--out", str(tmp_path / "out")])
