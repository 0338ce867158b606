"""`rag index build | info | search` end to end, with the real MiniLM encoder on the demo corpus."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rag.cli import main
from rag.demo import CORPUS_PATH

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def demo_kb(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "elements"
    assert main(["index", "build", "--corpus", str(CORPUS_PATH), "--encoder", "minilm", "--out", str(out), "--bm25", "--quiet",
                 "--words-per-passage", "0"]) == 0
    return out


def test_info_prints_verified_manifest(demo_kb, capsys):
    assert main(["index", "info", str(demo_kb)]) == 0
    out = capsys.readouterr().out
    assert "passages        137" in out and "checksums verified" in out and "hnsw" in out
    assert main(["index", "info", str(demo_kb), "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["count"] == 137 and m["dim"] == 384 and m["encoder"]["pooling"] == "mean" and m["encoder"]["normalize"] is True


def test_search_paraphrases_with_real_minilm(demo_kb, capsys):
    queries = ["which element did Henry Cavendish discover?", "what element is essential for bones and teeth?"]
    assert main(["index", "search", str(demo_kb), *queries, "-k", "3", "--json"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [ln["query"] for ln in lines] == queries
    assert lines[0]["passages"][0]["title"] == "Hydrogen"
    assert lines[1]["passages"][0]["title"] == "Calcium"
    assert all(set(p) == {"id", "title", "text", "score"} for ln in lines for p in ln["passages"])
    scores = [p["score"] for p in lines[0]["passages"]]
    assert scores == sorted(scores, reverse=True)


def test_search_reads_stdin_and_file(demo_kb, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("atomic number of argon\n\nsymbol of gold\n"))
    assert main(["index", "search", str(demo_kb), "-k", "1", "--json"]) == 0
    got = [json.loads(ln)["passages"][0]["title"] for ln in capsys.readouterr().out.splitlines()]
    assert got == ["Argon", "Gold"]
    f = tmp_path / "q.txt"
    f.write_text("atomic number of argon\n")
    assert main(["index", "search", str(demo_kb), "--file", str(f), "-k", "2"]) == 0
    text = capsys.readouterr().out
    assert "query: atomic number of argon" in text and "  1. " in text and "Argon" in text


def test_bm25_search_ranks_the_lexical_match_first(demo_kb, capsys):
    assert main(["index", "search", str(demo_kb), "fractional distillation of liquid air", "--bm25", "-k", "2", "--json"]) == 0
    hit = json.loads(capsys.readouterr().out)["passages"]
    assert hit[0]["title"] in {"Nitrogen", "Oxygen"}


def test_errors_are_one_line_with_exit_code_2(tmp_path, demo_kb, capsys):
    assert main(["index", "info", str(tmp_path / "missing")]) == 2
    assert "no such knowledge-base directory" in capsys.readouterr().err
    assert main(["index", "search", str(demo_kb), "x", "-k", "1000"]) == 2
    assert "137" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["index", "build", "--corpus", str(empty), "--encoder", "minilm", "--out", str(tmp_path / "kb"), "--quiet"]) == 2
    assert "empty.jsonl" in capsys.readouterr().err and not (tmp_path / "kb").exists()


def test_console_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "rag", "index", "--help"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "build" in r.stdout and "search" in r.stdout


def _tree(path: Path) -> dict:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))
            if f.is_file()} if path.is_dir() else {".": path.read_bytes()}


def test_overwrite_never_destroys_an_input_or_other_data(tmp_path, tiny_bert_dir, capsys):
    """`--overwrite` replaces a knowledge base, and only that: not the corpus file or folder, not another directory."""
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"title": f"t{i}", "text": f"text {i} about metals"}) + "\n" for i in range(5)))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("a document about gold")
    other = tmp_path / "photos"
    other.mkdir()
    (other / "me.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    build = ["index", "build", "--encoder", tiny_bert_dir, "--index", "flat", "--quiet", "--overwrite"]
    for src, out, expected in [(corpus, corpus, "destroy the input"), (folder, folder, "destroy the input"),
                               (corpus, folder, "not a knowledge base"), (corpus, other, "not a knowledge base"),
                               (folder, folder / "kb", "inside the corpus folder"),
                               (folder / "a.txt", folder, "destroy the input")]:
        before = {p: _tree(p) for p in (corpus, folder, other)}
        assert main([*build, "--corpus", str(src), "--out", str(out)]) == 2
        assert expected in capsys.readouterr().err
        assert {p: _tree(p) for p in (corpus, folder, other)} == before
    kb = tmp_path / "kb"
    assert main([*build, "--corpus", str(corpus), "--out", str(kb)]) == 0
    assert main([*build, "--corpus", str(folder), "--out", str(kb)]) == 0  # a knowledge base is replaced
    capsys.readouterr()
    assert main(["index", "info", str(kb), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 1


def test_corpus_folder_reads_its_data_files_and_names_what_it_skips(tmp_path, tiny_bert_dir, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("a plain text document about iron")
    (folder / "b.jsonl").write_text(json.dumps({"id": "j1", "title": "Gold", "text": "gold is a metal"}) + "\n")
    (folder / "c.csv").write_text("id,title,text\nc1,Neon,neon is a gas\n")
    (folder / "notes.md").write_text("# not read")
    out = tmp_path / "kb"
    assert main(["index", "build", "--corpus", str(folder), "--encoder", tiny_bert_dir, "--out", str(out), "--index", "flat",
                 "--quiet"]) == 0
    assert "notes.md" in capsys.readouterr().err
    assert main(["index", "search", str(out), "metal", "-k", "3", "--json"]) == 0
    assert {p["id"] for p in json.loads(capsys.readouterr().out)["passages"]} == {"a.txt", "j1", "c1"}
