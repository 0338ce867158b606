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
    assert main(["index", "build", "--corpus", str(CORPUS_PATH), "--encoder", "minilm", "--out", str(out), "--bm25", "--quiet", "--words-per-passage", "0"]) == 0
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
