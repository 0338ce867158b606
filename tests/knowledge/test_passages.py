"""Corpus ingestion: every input format, 100-word splitting, stable ids, and bad-input errors."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import pytest

from rag.knowledge.documents import Document, detect_format, read_documents
from rag.knowledge.passages import EmptyDocumentsWarning, Passage, content_id, iter_corpus, load_corpus, split_passages
from rag.utils.errors import ConfigError, CorpusError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "corpora"


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path: Path, rows: list[dict]) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def _words(n: int, prefix: str = "w") -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


# ----------------------------------------------------------------------------- formats


def test_jsonl_fixture_reads_ids_titles_and_sources():
    docs = list(read_documents(FIXTURES / "docs.jsonl"))
    assert [d.id for d in docs] == ["d1", "d2", None]  # the blank line is skipped
    assert [d.title for d in docs] == ["Aaron", "Zebra", "No id"]
    assert docs[0].text.startswith("Aaron is a prophet")
    assert docs[2].source.endswith("docs.jsonl:4")  # line numbers count the blank line


def test_csv_fixture_handles_quotes_commas_and_multiline_fields():
    docs = list(read_documents(FIXTURES / "docs.csv"))
    assert [(d.id, d.title) for d in docs] == [("d1", "Aaron"), ("d2", "Zebra")]
    assert docs[0].text == "Aaron is a prophet, high priest"
    assert docs[1].text == 'Zebras are "striped"\nequines'
    assert docs[1].source.endswith("docs.csv:3")


def test_tsv_without_id_column_gets_content_hash_ids():
    assert detect_format(FIXTURES / "docs.tsv") == "tsv"
    passages = load_corpus(FIXTURES / "docs.tsv", show_progress=False)
    assert [p.title for p in passages] == ["Aaron", "Zebra"]
    assert passages[0].id == content_id("Aaron", "Aaron is a prophet high priest")
    assert len(passages[0].id) == 16 and int(passages[0].id, 16) >= 0


def test_psgs_w100_detected_and_kept_whole_with_ids():
    path = FIXTURES / "psgs_w100.tsv"
    assert detect_format(path) == "psgs_w100"
    passages = load_corpus(path, words_per_passage=3, show_progress=False)  # would split anything else
    assert passages == [
        Passage("1", "Aaron", 'Aaron Aaron ( or ; "Ahärôn") is a prophet, high priest'),
        Passage("2", "Zebra", "Zebras are African equines with distinctive stripes"),
    ]


def test_psgs_w100_gzip_and_explicit_format(tmp_path):
    raw = (FIXTURES / "psgs_w100.tsv").read_bytes()
    gz = _write(tmp_path / "psgs_w100.tsv.gz", gzip.compress(raw))
    assert detect_format(gz) == "psgs_w100"
    assert load_corpus(gz, show_progress=False) == load_corpus(FIXTURES / "psgs_w100.tsv", show_progress=False)
    with pytest.raises(CorpusError, match=r"docs\.tsv:1.*psgs_w100.*--format tsv"):
        list(read_documents(FIXTURES / "docs.tsv", format="psgs_w100"))


def test_text_folder_recursive_sorted_relative_ids(tmp_path):
    docs = list(read_documents(FIXTURES / "texts"))
    assert [d.id for d in docs] == ["amsterdam.txt", "paris.txt", "sub/berlin.txt"]
    assert [d.title for d in docs] == ["amsterdam", "paris", "berlin"]
    assert "It is on the Seine." in docs[1].text
    single = list(read_documents(FIXTURES / "texts" / "sub" / "berlin.txt"))
    assert single == [Document("berlin.txt", "berlin", "Berlin is the capital of Germany.\n", single[0].source)]
    # hidden folders are ignored
    _write(tmp_path / "t" / ".git" / "x.txt", "hidden")
    _write(tmp_path / "t" / "a.txt", "visible text")
    assert [d.id for d in read_documents(tmp_path / "t")] == ["a.txt"]


def test_datasets_object_and_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"title": ["A", "B", "C"], "text": [_words(5, "a"), _words(150, "b"), "c text"], "id": ["x", "y", ""]}
    )
    docs = list(read_documents(ds))
    assert [d.source for d in docs] == ["dataset[0]", "dataset[1]", "dataset[2]"]
    assert docs[2].id is None  # empty id -> content hash later
    passages = load_corpus(ds, show_progress=False)
    assert [p.id for p in passages] == ["x", "y-0", "y-1", content_id("C", "c text")]
    saved = tmp_path / "saved"
    ds.save_to_disk(str(saved))
    assert detect_format(saved) == "dataset"
    assert load_corpus(saved, show_progress=False) == passages
    # a DatasetDict with one split is read; several splits must be chosen between
    dd_path = tmp_path / "dd"
    datasets.DatasetDict({"train": ds}).save_to_disk(str(dd_path))
    assert load_corpus(dd_path, show_progress=False) == passages
    with pytest.raises(CorpusError, match="several splits"):
        list(read_documents(datasets.DatasetDict({"train": ds, "test": ds})))


def test_multiple_sources_in_order_and_custom_fields(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"name": "T1", "body": "one two", "pid": 7}])
    b = _write(tmp_path / "b.csv", "name,body\nT2,three four\n")
    passages = load_corpus(
        [a, b], title_field="name", text_field="body", id_field="pid", show_progress=False
    )
    assert passages == [Passage("7", "T1", "one two"), Passage(content_id("T2", "three four"), "T2", "three four")]


def test_no_title_field_and_bom_and_other_encoding(tmp_path):
    path = _write(tmp_path / "c.csv", b"\xef\xbb\xbfid,text\n1,caf\xc3\xa9 au lait\n")
    assert load_corpus(path, title_field=None, show_progress=False) == [Passage("1", "", "café au lait")]
    latin = _write(tmp_path / "l.jsonl", '{"title": "t", "text": "café"}\n'.encode("latin-1"))
    assert load_corpus(latin, encoding="latin-1", show_progress=False)[0].text == "café"


def test_json_array_file(tmp_path):
    path = _write(tmp_path / "arr.json", json.dumps([{"title": "t", "text": "a b c", "id": 1}]))
    assert load_corpus(path, show_progress=False) == [Passage("1", "t", "a b c")]


# ----------------------------------------------------------------------------- splitting


def test_split_is_disjoint_in_order_keeps_title_last_shorter():
    text = "  ".join(_words(250).split())  # irregular whitespace is normalized
    doc = Document("doc", "My Title", text, "mem:1")
    passages = list(split_passages([doc], words_per_passage=100))
    assert [p.id for p in passages] == ["doc-0", "doc-1", "doc-2"]
    assert [len(p.text.split()) for p in passages] == [100, 100, 50]
    assert all(p.title == "My Title" for p in passages)
    # concatenating the chunks gives back every word, once, in order
    assert " ".join(p.text for p in passages).split() == text.split()


def test_short_tail_joins_the_previous_passage():
    """A document's last piece of a few words ('display.') would be a passage that is all title and wins retrieval for
    the title's words: under a fifth of a passage (default) it joins the passage before it; 0 keeps it alone."""
    text = _words(201)
    doc = Document("doc", "Monitor", text, "mem:1")
    merged = list(split_passages([doc], words_per_passage=100))
    assert [p.id for p in merged] == ["doc-0", "doc-1"] and [len(p.text.split()) for p in merged] == [100, 101]
    assert " ".join(p.text for p in merged).split() == text.split()
    assert [len(p.text.split()) for p in split_passages([doc], 100, min_tail_words=0)] == [100, 100, 1]
    assert [len(p.text.split()) for p in split_passages([Document("d", "T", _words(220), "m")], 100)] == [100, 100, 20]
    assert [len(p.text.split()) for p in split_passages([Document("d", "T", _words(219), "m")], 100)] == [100, 119]
    one = list(split_passages([Document("d", "T", _words(105), "m")], 100))
    assert [p.id for p in one] == ["d"] and len(one[0].text.split()) == 105  # one passage keeps the document's id
    with pytest.raises(ConfigError, match="min_tail_words"):
        list(split_passages([doc], 100, min_tail_words=-1))


def test_split_single_chunk_keeps_doc_id_and_none_keeps_text_verbatim():
    doc = Document("d", "T", "exactly  five words here ok", "mem:1")
    assert list(split_passages([doc], 5)) == [Passage("d", "T", "exactly five words here ok")]
    assert list(split_passages([doc], 4))[0].id == "d-0"
    for no_split in (None, 0):
        assert list(split_passages([doc], no_split)) == [Passage("d", "T", "exactly  five words here ok")]


@pytest.mark.parametrize("bad", [-1, 2.5, True, "100"])
def test_split_rejects_bad_words_per_passage(bad):
    with pytest.raises(ConfigError, match="words_per_passage"):
        list(split_passages([Document("d", "", "x", "m")], bad))


def test_ids_stable_across_rebuilds_and_reordering(tmp_path):
    rows = [{"title": f"T{i}", "text": _words(30 + 40 * i, f"r{i}_")} for i in range(4)]
    first = load_corpus(_jsonl(tmp_path / "a.jsonl", rows), words_per_passage=50, show_progress=False)
    again = load_corpus(_jsonl(tmp_path / "a.jsonl", rows), words_per_passage=50, show_progress=False)
    shuffled = load_corpus(_jsonl(tmp_path / "b.jsonl", rows[::-1]), words_per_passage=50, show_progress=False)
    assert first == again
    assert {p.id: p for p in first} == {p.id: p for p in shuffled}
    assert len({p.id for p in first}) == len(first) == 1 + 2 + 3 + 3


def test_iter_corpus_streams_lazily(tmp_path):
    # an invalid line far down must not be read before the first passages are produced
    path = _write(tmp_path / "big.jsonl", '{"title": "t", "text": "a"}\n' + "{not json\n")
    it = iter_corpus(path)
    assert next(it) == Passage(content_id("t", "a"), "t", "a")
    with pytest.raises(CorpusError, match=r"big\.jsonl:2"):
        next(it)


# ----------------------------------------------------------------------------- bad input


def test_empty_file_names_the_file(tmp_path):
    for name, content in [("e.jsonl", ""), ("e.csv", "title,text\n"), ("e.tsv", "\n")]:
        path = _write(tmp_path / name, content)
        with pytest.raises(CorpusError, match=rf"{name} contains no documents"):
            load_corpus(path, show_progress=False)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(CorpusError, match="emptydir contains no documents"):
        load_corpus(tmp_path / "emptydir", show_progress=False)


def test_missing_text_field_lists_present_fields(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [{"title": "t", "body": "x"}])
    with pytest.raises(CorpusError) as e:
        load_corpus(path, show_progress=False)
    msg = str(e.value)
    assert "m.jsonl:1" in msg and "'text'" in msg and "'body'" in msg and "--text-field" in msg


def test_missing_title_field_in_csv_header(tmp_path):
    path = _write(tmp_path / "m.csv", "heading,text\nh,x\n")
    with pytest.raises(CorpusError) as e:
        load_corpus(path, show_progress=False)
    msg = str(e.value)
    assert "m.csv:1" in msg and "title field 'title'" in msg and "'heading'" in msg and "--title-field" in msg


def test_missing_field_in_dataset_columns():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"title": ["a"], "content": ["x"]})
    with pytest.raises(CorpusError, match=r"dataset.*text field 'text'.*'content'.*--text-field"):
        load_corpus(ds, show_progress=False)


def test_undecodable_bytes_name_line_and_offset(tmp_path):
    path = _write(tmp_path / "bad.jsonl", b'{"title": "a", "text": "ok"}\n{"title": "b", "text": "caf\xe9"}\n')
    with pytest.raises(CorpusError) as e:
        load_corpus(path, show_progress=False)
    msg = str(e.value)
    offset = path.read_bytes().index(b"\xe9")
    assert "bad.jsonl:2" in msg and f"byte offset {offset}" in msg and "--encoding" in msg
    bad_txt = _write(tmp_path / "dir" / "x.txt", b"ok \xff")
    with pytest.raises(CorpusError, match=r"x\.txt:1.*byte offset 3.*--encoding"):
        load_corpus(tmp_path / "dir", show_progress=False)
    assert bad_txt.exists()


def test_undecodable_bytes_in_large_tsv(tmp_path):
    body = "".join(f"{i}\tword {i}\tT\n" for i in range(5000))
    path = _write(tmp_path / "big.tsv", b"id\ttext\ttitle\n" + body.encode() + b"9999\tbad \x80 byte\tT\n")
    with pytest.raises(CorpusError, match=r"big\.tsv:5002.*0x80|big\.tsv:5002.*\\x80"):
        load_corpus(path, show_progress=False)


def test_duplicate_ids_name_both_locations(tmp_path):
    path = _jsonl(tmp_path / "dup.jsonl",
                  [{"id": "a", "title": "", "text": "x"}, {"id": "b", "title": "", "text": "y"},
                   {"id": "a", "title": "", "text": "z"}])
    with pytest.raises(CorpusError) as e:
        load_corpus(path, show_progress=False)
    msg = str(e.value)
    assert "'a'" in msg and "dup.jsonl:3" in msg and "dup.jsonl:1" in msg


def test_duplicate_ids_across_files_and_identical_content(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"title": "t", "text": "same"}])
    b = _write(tmp_path / "b.csv", "title,text\nt,same\n")
    with pytest.raises(CorpusError, match=r"b\.csv:2.*a\.jsonl:1.*identical title and text"):
        load_corpus([a, b], show_progress=False)
    # a split chunk id colliding with another document's id is caught too
    c = _jsonl(tmp_path / "c.jsonl", [{"id": "x", "title": "", "text": "p q r"}, {"id": "x-1", "title": "", "text": "s"}])
    with pytest.raises(CorpusError, match=r"'x-1'.*c\.jsonl:2.*c\.jsonl:1"):
        load_corpus(c, words_per_passage=2, show_progress=False)


def test_invalid_json_line(tmp_path):
    path = _write(tmp_path / "j.jsonl", '{"title": "a", "text": "b"}\n{"title": "a", "text": }\n')
    with pytest.raises(CorpusError, match=r"j\.jsonl:2.*invalid JSON"):
        load_corpus(path, show_progress=False)
    path = _write(tmp_path / "k.jsonl", '["title", "text"]\n')
    with pytest.raises(CorpusError, match=r"k\.jsonl:1.*JSON object"):
        load_corpus(path, show_progress=False)


def test_ragged_tsv_row_and_wrong_field_type(tmp_path):
    path = _write(tmp_path / "r.tsv", "title\ttext\na\tb\tc\n")
    with pytest.raises(CorpusError, match=r"r\.tsv:2.*3 fields.*header has 2"):
        load_corpus(path, show_progress=False)
    path = _jsonl(tmp_path / "t.jsonl", [{"title": "a", "text": ["not", "a", "string"]}])
    with pytest.raises(CorpusError, match=r"t\.jsonl:1.*field 'text'.*list"):
        load_corpus(path, show_progress=False)


def test_empty_text_skipped_with_warning_but_all_empty_errors(tmp_path):
    path = _jsonl(tmp_path / "e.jsonl",
                  [{"title": "a", "text": "real words"}, {"title": "b", "text": "  "}, {"title": "c", "text": None}])
    with pytest.warns(EmptyDocumentsWarning, match=r"skipped 2 of 3 .*e\.jsonl:2"):
        passages = load_corpus(path, show_progress=False)
    assert [p.title for p in passages] == ["a"]
    empty = _jsonl(tmp_path / "all.jsonl", [{"title": "a", "text": ""}, {"title": "b", "text": " "}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error replaces the warning
        with pytest.raises(CorpusError, match=r"all\.jsonl: all 2 documents have empty text.*'text'"):
            load_corpus(empty, show_progress=False)


def test_empty_title_allowed_when_field_present(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"title": "", "text": "x"}, {"title": None, "text": "y"}])
    assert [p.title for p in load_corpus(path, show_progress=False)] == ["", ""]


def test_unknown_inputs(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "nope.jsonl", show_progress=False)
    with pytest.raises(CorpusError, match=r"x\.parquet.*--format"):
        load_corpus(_write(tmp_path / "x.parquet", "x"), show_progress=False)
    with pytest.raises(CorpusError, match="unknown corpus format"):
        list(read_documents(FIXTURES / "docs.jsonl", format="xml"))
    with pytest.raises(CorpusError, match="unknown encoding"):
        list(read_documents(FIXTURES / "docs.jsonl", encoding="no-such-codec"))


def test_folder_reads_txt_jsonl_csv_tsv_and_warns_about_other_files(tmp_path):
    from rag.knowledge.documents import SkippedFilesWarning

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("text file")
    (tmp_path / "sub" / "b.jsonl").write_text('{"id": "j", "title": "J", "text": "json line"}\n')
    (tmp_path / "c.csv").write_text("id,title,text\nc,C,csv row\n")
    (tmp_path / "d.tsv").write_text("id\ttitle\ttext\nd\tD\ttsv row\n")
    (tmp_path / "e.pdf").write_bytes(b"%PDF")
    (tmp_path / ".hidden.jsonl").write_text("{broken")
    with pytest.warns(SkippedFilesWarning, match=r"skipped 1 file\(s\) \(e.pdf\)"):
        docs = list(read_documents(tmp_path))
    assert [(d.id, d.text) for d in docs] == [("a.txt", "text file"), ("c", "csv row"), ("d", "tsv row"), ("j", "json line")]
    with pytest.warns(SkippedFilesWarning, match=r"skipped 4 file\(s\).*--format auto also reads"):
        docs = list(read_documents(tmp_path, format="text"))
    assert [d.id for d in docs] == ["a.txt"]
