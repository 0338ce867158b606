"""QA data readers: every format, one training pair per answer, bad input named by file:line."""

from __future__ import annotations

import json
import warnings

import pytest

from rag.eval.qa_data import EmptyExamplesWarning, QADataError, expand_answers, read_qa, read_source_target
from rag.training.data import QADataModule, QAEvalDataset, QAPairsDataset, collate_qa
from rag.utils.errors import ConfigError


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_nq_open_style_and_answer_expansion(tmp_path):
    p = _jsonl(tmp_path / "qa.jsonl", [
        {"question": "capital of France?", "answers": ["Paris", "City of Paris"]},
        "",  # blank lines are ignored
        {"question": "who wrote Hamlet?", "answer": ["Shakespeare"]},  # NQ-open's field name
    ])
    ex = read_qa(p)
    assert [e.question for e in ex] == ["capital of France?", "who wrote Hamlet?"]
    assert ex[0].answers == ("Paris", "City of Paris")
    assert ex[1].where == f"{p}:3"
    assert expand_answers(ex) == [
        ("capital of France?", "Paris"), ("capital of France?", "City of Paris"), ("who wrote Hamlet?", "Shakespeare")]
    train = QAPairsDataset(ex)
    assert len(train) == 3 and train[1] == {"question": "capital of France?", "target": "City of Paris"}
    ev = QAEvalDataset(ex)
    assert len(ev) == 2 and ev[0]["answers"] == ["Paris", "City of Paris"] and ev[0]["target"] == "Paris"


def test_json_array(tmp_path):
    p = tmp_path / "qa.json"
    p.write_text(json.dumps([{"question": "q1", "answers": ["a"]}, {"question": "q2", "answers": ["b", "c"]}]))
    assert [e.answers for e in read_qa(p)] == [("a",), ("b", "c")]


def test_tsv_dpr_style(tmp_path):
    p = tmp_path / "nq-test.qa.csv"
    p.write_text('who got the first nobel prize in physics\t["Wilhelm Conrad R\\u00f6ntgen"]\n'
                 "where is it\t['Paris', 'France']\n"
                 "plain answer\tRome\tRoma\n", encoding="utf-8")
    ex = read_qa(p)
    assert ex[0].answers == ("Wilhelm Conrad Röntgen",)
    assert ex[1].answers == ("Paris", "France")
    assert ex[2].answers == ("Rome", "Roma")
    h = tmp_path / "h.tsv"
    h.write_text("question\tanswers\nq\t[\"a\"]\n")
    assert [(e.question, e.answers, e.where) for e in read_qa(h)] == [("q", ("a",), f"{h}:2")]


def test_source_target_directory(tmp_path):
    for split, qs, ans in (("train", ["q1", "q2"], ["a1", "a2"]), ("val", ["v1"], ["b1"])):
        (tmp_path / f"{split}.source").write_text("\n".join(qs) + "\n")
        (tmp_path / f"{split}.target").write_text("\n".join(ans) + "\n")
    ex = read_source_target(tmp_path / "train.source")
    assert [(e.question, e.answers) for e in ex] == [("q1", ("a1",)), ("q2", ("a2",))]
    assert ex[1].where == f"{tmp_path / 'train.source'}:2"
    dm = QADataModule(data_dir=str(tmp_path), batch_size=2)
    dm.setup("fit")
    assert next(iter(dm.train_dataloader()))["targets"] in (["a1", "a2"], ["a2", "a1"])
    assert next(iter(dm.val_dataloader())) == {"questions": ["v1"], "targets": ["b1"], "answers": [["b1"]]}
    (tmp_path / "val.target").write_text("b1\nextra\n")
    with pytest.raises(QADataError, match="has 1 lines but .*val.target has 2"):
        read_qa(tmp_path / "val.source")


def test_saved_datasets_dir(tmp_path):
    import datasets

    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"question": ["q1"], "answer": [["a1", "a2"]]}),
        "validation": datasets.Dataset.from_dict({"question": ["v1"], "answer": [["b"]]}),
    })
    dd.save_to_disk(str(tmp_path / "nq"))
    assert read_qa(str(tmp_path / "nq"), stage="train")[0].answers == ("a1", "a2")
    assert read_qa(str(tmp_path / "nq"), stage="val")[0].question == "v1"  # val -> 'validation'
    assert read_qa(f"{tmp_path / 'nq'}#train", stage="test")[0].question == "q1"
    with pytest.raises(QADataError, match="no split test"):
        read_qa(str(tmp_path / "nq"), stage="test")
    assert read_qa(dd["train"])[0].where.endswith("[0]")  # an in-memory Dataset


def test_demo_splits():
    train, dev = read_qa("demo:train"), read_qa("demo:dev")
    assert len(train) > 100 and len(dev) > 50
    assert {e.question for e in train}.isdisjoint({e.question for e in dev})
    with pytest.raises(ConfigError, match="demo:train"):
        read_qa("demo:nope")


@pytest.mark.parametrize(
    "line, field, message",
    [
        ('{"question": "q", "answers": "Paris"}', "answers", "must be a list of answer strings, got str"),
        ('{"question": "q", "answers": [1]}', "answers", "item 0 must be a string"),
        ('{"question": 3, "answers": ["a"]}', "question", "must be a string, got int"),
        ('{"answers": ["a"]}', "question", "missing field"),
        ('{"question": "q"}', "answers", "no 'answers'"),
        ('{"question": "q", "answers": [', None, "invalid JSON"),
        ("[1, 2]", None, "expected a JSON object"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, line, field, message):
    p = _jsonl(tmp_path / "bad.jsonl", ['{"question": "fine", "answers": ["ok"]}', line])
    with pytest.raises(QADataError, match=message) as e:
        read_qa(p)
    assert f"{p}:2" in str(e.value)
    if field:
        assert repr(field) in str(e.value) or field in str(e.value)


def test_tsv_bad_list_and_missing_tab(tmp_path):
    p = tmp_path / "bad.tsv"
    p.write_text("q\t[\"a\", \n")
    with pytest.raises(QADataError, match=rf"{p}:1: column 'answers'"):
        read_qa(p)
    p.write_text("ok\ta\nno tab here\n")
    with pytest.raises(QADataError, match=rf"{p}:2: expected 'question<TAB>answers'"):
        read_qa(p)


def test_empty_question_and_answers_skipped_with_one_warning(tmp_path):
    p = _jsonl(tmp_path / "e.jsonl", [
        {"question": "  ", "answers": ["a"]},         # empty question: skipped
        {"question": "q2", "answers": ["", "b"]},     # empty answer dropped, example kept
        {"question": "q3", "answers": [""]},          # no answer left: skipped
        {"question": "q4", "answers": []},            # empty list: skipped
        {"question": "q5", "answers": ["c"]},
    ])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ex = read_qa(p)
    assert [(e.question, e.answers) for e in ex] == [("q2", ("b",)), ("q5", ("c",))]
    ours = [x for x in w if issubclass(x.category, EmptyExamplesWarning)]
    assert len(ours) == 1
    msg = str(ours[0].message)
    assert "skipped 3 example(s)" in msg and "dropped 2 empty answer" in msg and f"{p}:1" in msg
    with pytest.raises(QADataError, match=rf"{p}:1: empty 'question'"):
        read_qa(p, on_empty="error")


def test_predict_allows_missing_answers(tmp_path):
    p = _jsonl(tmp_path / "q.jsonl", [{"question": "only a question"}])
    assert read_qa(p, require_answers=False)[0].answers == ()
    dm = QADataModule(predict=str(p))
    dm.setup("predict")
    assert next(iter(dm.predict_dataloader()))["questions"] == ["only a question"]


def test_datamodule_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="batch_size"):
        QADataModule(train="demo:train", batch_size=0)
    dm = QADataModule(train="demo:train")
    with pytest.raises(ConfigError, match="no test data configured; set data.test"):
        dm.setup("test")
    dm.setup("fit")  # validation is optional during fit
    assert dm.val_dataloader() == []
    with pytest.raises(QADataError, match="unknown QA format"):
        read_qa(tmp_path.joinpath("x.txt").__fspath__() if tmp_path.joinpath("x.txt").write_text("q") else "")


def test_collate_and_max_eval_examples():
    dm = QADataModule(train="demo:train", val="demo:dev", batch_size=3, eval_batch_size=5, max_eval_examples=7)
    dm.setup("fit")
    assert len(dm.val_dataloader().dataset) == 7
    b = next(iter(dm.val_dataloader()))
    assert len(b["questions"]) == 5 and set(b) == {"questions", "targets", "answers"}
    assert set(collate_qa([{"question": "q", "target": "a"}])) == {"questions", "targets"}
