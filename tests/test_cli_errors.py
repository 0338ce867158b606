"""Every user-facing failure of the `rag` command is one line naming the file/option and the fix, exit status 2,
checked before the expensive work; a traceback only with -v. Driven as a user drives it: `rag.cli.main([...])`
with the real parser, stdin and files (and `python -m rag` where the process's own output matters)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rag.cli import describe_error, main

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and lines, err
    assert lines[-1].startswith("rag ") and ": error: " in lines[-1], err
    return lines[-1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    path = d / "docs.jsonl"
    rows = [{"id": f"d{i}", "title": f"Element {i}", "text": f"element number {i} is a metal with symbol E{i}"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def kb(tmp_path_factory, corpus, tiny_bert_dir) -> Path:
    out = tmp_path_factory.mktemp("kb") / "kb"
    assert main(["index", "build", "--corpus", str(corpus), "--encoder", tiny_bert_dir, "--out", str(out), "--index", "flat",
                 "--quiet"]) == 0
    return out


# ------------------------------------------------------------------------------------- validation before the work


@pytest.mark.parametrize("extra, expected", [
    (["--index", "bogus"], "index spec 'bogus'"),
    (["--batch-size", "0"], "--batch-size 0"),
    (["--max-length", "0"], "--max-length 0"),
    (["--words-per-passage", "-1"], "--words-per-passage -1"),
    (["--device", "cuda:7"], "--device cuda:7"),
    (["--device", "gpu"], "--device 'gpu' is not a device"),
])
def test_build_options_are_checked_before_the_corpus_and_encoder(tmp_path, capsys, extra, expected):
    # The corpus and encoder do not exist: an error about them would mean the option was checked too late.
    code, _, err = run(capsys, "index", "build", "--corpus", str(tmp_path / "no-corpus.jsonl"), "--encoder",
                       str(tmp_path / "no-encoder"),
                       "--out", str(tmp_path / "kb"), "--quiet", *extra)
    assert code == 2 and expected in one_line_error(err)


def test_existing_out_is_refused_before_encoding(tmp_path, capsys, kb):
    code, _, err = run(capsys, "index", "build", "--corpus", str(tmp_path / "no-corpus.jsonl"), "--encoder",
                       str(tmp_path / "no-encoder"),
                       "--out", str(kb), "--quiet")
    assert code == 2 and "already exists" in one_line_error(err) and "--overwrite" in err


def test_unwritable_out_is_refused_before_encoding(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    code, _, err = run(capsys, "index", "build", "--corpus", str(tmp_path / "no-corpus.jsonl"), "--encoder", "x", "--out",
                       str(f / "kb"))
    assert code == 2 and "no directory can be created" in one_line_error(err)


@pytest.mark.parametrize("argv, expected", [
    (["index", "search", "{missing}", "q", "-k", "0"], "-k 0"),
    (["index", "search", "{missing}", "q", "--batch-size", "0"], "--batch-size 0"),
    (["generate", "--model", "{missing}", "q", "--num-beams", "0"], "--num-beams 0"),
    (["generate", "--model", "{missing}", "q", "--n-docs", "0"], "--n-docs 0"),
    (["serve", "--model", "{missing}", "--max-concurrency", "0"], "--max-concurrency 0"),
    (["serve", "--model", "{missing}", "--kb-root", "{missing}/root"], "--kb-root"),
    (["serve", "--model", "{missing}", "--device", "cuda:7"], "--device cuda:7"),
    (["demo", "--kb", "{missing}", "-k", "0"], "-k 0"),
    (["hotswap-eval", "--model", "{missing}", "--kb", "{missing}", "--data", "{missing}/qa.jsonl"], "--data"),
    (["hotswap-eval", "--model", "{missing}", "--kb", "{missing}", "--data", "{file}", "--device", "cuda:7"], "--device cuda:7"),
    (["hotswap-eval", "--model", "{missing}", "--kb", "{missing}", "--data", "{file}", "--limit", "0"], "--limit 0"),
    (["generate", "--model", "{missing}", "q", "--heatmap-dir", "{file}"], "--heatmap-dir"),
    (["generate", "--model", "{missing}", "q", "--nli-threshold", "1.5", "--nli", "{missing}"], "--nli-threshold"),
    (["serve", "--model", "{missing}", "--nli-threshold", "-0.5", "--nli", "{missing}"], "--nli-threshold"),
    (["hotswap-eval", "--model", "{missing}", "--kb", "{missing}", "--data", "{file}", "--nli-threshold", "2", "--nli"],
     "--nli-threshold"),
])
def test_options_are_checked_before_anything_is_loaded(tmp_path, capsys, argv, expected):
    missing = str(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, *(a.replace("{missing}", missing).replace("{file}", str(tmp_path / "file")) for a in argv))
    line = one_line_error(err)
    assert code == 2 and expected in line and not (tmp_path / "missing").exists()


@pytest.mark.parametrize("argv", [["demo", "--retrieve-only", "--k", "3"], ["index", "search", "{missing}", "q", "--k", "2"],
                                  ["generate", "--model", "{missing}", "q", "--num-beam", "2"]])
def test_an_abbreviated_option_is_refused_not_taken_for_another(tmp_path, capsys, monkeypatch, argv):
    """`rag demo --k 3` once meant `--kb 3` and built a knowledge base in ./3."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([a.replace("{missing}", str(tmp_path / "missing")) for a in argv])
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- queries


def test_blank_queries_are_refused_everywhere_with_one_message(tmp_path, capsys, kb):
    messages = []
    for argv in (["index", "search", str(kb), "ok", "  "], ["generate", "--model", str(tmp_path / "missing"), "ok", "  "]):
        code, _, err = run(capsys, *argv)
        assert code == 2
        messages.append(one_line_error(err).split(": error: ")[1])
    assert messages[0] == messages[1] and messages[0].startswith("questions[1] is empty")


def test_query_file_errors(tmp_path, capsys, kb):
    code, _, err = run(capsys, "index", "search", str(kb), "--file", str(tmp_path / "nope.txt"))
    assert code == 2 and "--file" in one_line_error(err) and "nope.txt: no such file" in err
    latin = tmp_path / "latin.txt"
    latin.write_bytes("first query\ncaf\xe9 au lait\n".encode("latin-1"))
    code, out, err = run(capsys, "index", "search", str(kb), "--file", str(latin), "-k", "1")
    assert code == 2 and out == "" and "latin.txt: line 2 is not UTF-8" in one_line_error(err) and "iconv" in err
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "missing"), "--file", str(latin))
    assert code == 2 and "line 2 is not UTF-8" in one_line_error(err)  # before the (missing) model is loaded


class _BinaryStdin(io.TextIOWrapper):
    def isatty(self) -> bool:
        return False


def test_binary_stdin_is_refused_with_a_message(capsys, kb, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _BinaryStdin(io.BytesIO(b"a fine query\n\x7fELF\x02\x01\x01\x00\x00\xd0\xfe\n")))
    code, _, err = run(capsys, "index", "search", str(kb), "-k", "1")
    assert code == 2 and "stdin: line 2 is not UTF-8" in one_line_error(err)
    monkeypatch.setattr(sys, "stdin", _BinaryStdin(io.BytesIO(b"ok\n\x00\x01\x02\n")))
    code, _, err = run(capsys, "index", "search", str(kb), "-k", "1")
    assert code == 2 and "stdin: line 2 contains a NUL byte" in one_line_error(err)


def test_query_encoder_of_another_identity_is_refused_unless_allowed(tmp_path, capsys, kb, tiny_bert_dir, wordpiece_tokenizer):
    from rag.generators.tiny import save, tiny_bert

    other = save(tiny_bert(wordpiece_tokenizer, seed=7), wordpiece_tokenizer, tmp_path / "other")  # same dimension, other weights
    code, _, err = run(capsys, "index", "search", str(kb), "element", "-k", "1", "--query-encoder", str(other))
    assert code == 2 and "is not the query encoder this knowledge base was built for" in one_line_error(err)
    assert "--allow-encoder-change" in err
    code, out, _ = run(capsys, "index", "search", str(kb), "element", "-k", "1", "--query-encoder", str(other),
                       "--allow-encoder-change", "--json")
    assert code == 0 and len(json.loads(out)["passages"]) == 1
    copy = tmp_path / "copy"
    shutil.copytree(tiny_bert_dir, copy)  # the same encoder at another path: same identity, accepted
    code, out, _ = run(capsys, "index", "search", str(kb), "element", "-k", "1", "--query-encoder", str(copy), "--json")
    assert code == 0 and len(json.loads(out)["passages"]) == 1


# ------------------------------------------------------------------------------------- damaged manifests


@pytest.mark.parametrize("mutate, field", [
    (lambda m: m.pop("dim"), "['dim']"),
    (lambda m: m.update(dim="384"), "'dim'"),
    (lambda m: m.update(count=True), "'count'"),
    (lambda m: m.update(encoder=None), "'encoder'"),
    (lambda m: m.update(files=[]), "'files'"),
    (lambda m: m["files"].update({"embeddings.npy": 5}), "files['embeddings.npy']"),
    (lambda m: m["files"]["index.faiss"].pop("sha256"), "files['index.faiss']"),
    (lambda m: m.update(index={"kind": 3}), "'index'"),
    (lambda m: m.update(index={"kind": "flat", "bogus": 1}), "'index'"),
    (lambda m: m.update(query_encoder="minilm"), "'query_encoder'"),
    (lambda m: m.update(build=[]), "'build'"),
    (lambda m: m.update(dim=0), "dim=0"),
])
@pytest.mark.parametrize("verify", ["full", "none"])
def test_malformed_manifest_fields_are_named(tmp_path, capsys, kb, mutate, field, verify):
    bad = tmp_path / "bad"
    shutil.copytree(kb, bad)
    m = json.loads((bad / "manifest.json").read_text())
    mutate(m)
    (bad / "manifest.json").write_text(json.dumps(m))
    for argv in (["index", "info", str(bad), "--verify", verify], ["index", "search", str(bad), "q", "--verify", verify]):
        code, _, err = run(capsys, *argv)
        line = one_line_error(err)
        assert code == 2 and "manifest.json" in line and field in line and "rebuild" in line


def test_a_forged_knowledge_base_is_refused_naming_both_ids(tmp_path, capsys, kb):
    """A copy with one passage edited in its Arrow file and that file's SHA-256 written into the manifest: `rag index
    search` recomputes the id from the verified content and refuses, naming the recorded and the recomputed id."""
    from rag.utils.checksums import file_checksums

    bad = tmp_path / "forged"
    shutil.copytree(kb, bad)
    [arrow] = (bad / "passages").glob("*.arrow")
    data = arrow.read_bytes()
    assert data.count(b"symbol E3") == 1
    arrow.write_bytes(data.replace(b"symbol E3", b"symbol X3"))
    m = json.loads((bad / "manifest.json").read_text())
    m["files"].update(file_checksums(bad, [arrow]))
    (bad / "manifest.json").write_text(json.dumps(m))
    code, out, err = run(capsys, "index", "search", str(bad), "metal E3")
    line = one_line_error(err)
    assert code == 2 and out == "" and f"records version {m['version']} but its content gives kb-" in line
    assert str(bad / "manifest.json") in line and "rebuild" in line


@pytest.mark.parametrize("content", ["[1, 2]", '"a string"', "null", "{not json"])
def test_manifest_that_is_not_an_object(tmp_path, capsys, kb, content):
    bad = tmp_path / "bad"
    shutil.copytree(kb, bad)
    (bad / "manifest.json").write_text(content)
    code, _, err = run(capsys, "index", "info", str(bad))
    assert code == 2 and "manifest.json" in one_line_error(err)


# ------------------------------------------------------------------------------------- the handler itself


def test_tracebacks_only_with_verbose(tmp_path, capsys):
    code, _, err = run(capsys, "index", "info", str(tmp_path / "missing"))
    assert code == 2 and "no such knowledge-base directory" in one_line_error(err)
    for argv in (["-v", "index", "info", str(tmp_path / "missing")], ["index", "info", str(tmp_path / "missing"), "-v"]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("rag index info: error:")


def test_exception_classes_become_messages(tmp_path):
    msg, code = describe_error(FileNotFoundError(2, "No such file or directory", str(tmp_path / "x.txt")))
    assert code == 2 and msg.startswith(f"{tmp_path / 'x.txt'}: No such file or directory; check the path")
    msg, code = describe_error(PermissionError(13, "Permission denied", "/root/out"))
    assert code == 2 and "/root/out" in msg and "permissions" in msg
    try:
        b"caf\xe9".decode("utf-8")
    except UnicodeDecodeError as e:
        msg, code = describe_error(e)
    assert code == 2 and "not valid utf-8" in msg and "iconv" in msg
    msg, code = describe_error(OSError(28, "No space left on device"))
    assert code == 2 and "disk is full" in msg
    msg, code = describe_error(FileExistsError(f"{tmp_path} exists and is not empty; choose another directory or pass "
                                               f"overwrite=True"))
    assert code == 2 and msg.startswith(f"{tmp_path} exists and is not empty")
    msg, code = describe_error(TypeError("unsupported operand"))  # a bug, not the user's input
    assert code == 1 and "TypeError" in msg and "-v" in msg


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_process_output_is_one_line_and_quiet_is_quiet(tmp_path, corpus, tiny_bert_dir):
    """As a process: --quiet prints no progress bar and no DEBUG line (bm25s sets its own logger to DEBUG on import)."""
    out = tmp_path / "kb"
    r = subprocess.run([sys.executable, "-m", "rag", "index", "build", "--corpus", str(corpus), "--encoder", tiny_bert_dir,
                        "--out", str(out),
                        "--index", "flat", "--bm25", "--quiet"], capture_output=True, text=True, cwd=REPO, env=_env())
    assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("built ")
    r = subprocess.run([sys.executable, "-m", "rag", "index", "build", "--corpus", str(corpus), "--encoder", tiny_bert_dir,
                        "--out", str(corpus),
                        "--overwrite"], capture_output=True, text=True, cwd=REPO, env=_env())
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "destroy the input" in r.stderr
    assert corpus.read_text().startswith('{"id": "d0"')


def test_no_queries_at_all_is_an_error_before_loading(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    code, _, err = run(capsys, "index", "search", str(tmp_path / "missing-kb"), "--file", str(empty))
    assert code == 2 and "no queries: --file" in one_line_error(err)
    monkeypatch.setattr(sys, "stdin", _BinaryStdin(io.BytesIO(b"")))
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "missing"))
    assert code == 2 and "no queries: stdin holds no non-blank line" in one_line_error(err)


def test_a_file_given_as_a_knowledge_base(tmp_path, capsys, corpus):
    code, _, err = run(capsys, "index", "info", str(corpus))
    assert code == 2 and "is a file, not a knowledge-base directory" in one_line_error(err)


def test_build_refuses_a_query_encoder_of_another_dimension_before_reading_the_corpus(tmp_path, capsys, tiny_bert_dir,
                                                                                      wordpiece_tokenizer):
    from rag.generators.tiny import save, tiny_bert

    wide = save(tiny_bert(wordpiece_tokenizer, d_model=48), wordpiece_tokenizer, tmp_path / "wide")
    unread = tmp_path / "corpus.jsonl"
    unread.write_text("not JSON: reading it would be an error of its own\n")
    code, _, err = run(capsys, "index", "build", "--corpus", str(unread), "--encoder", tiny_bert_dir,
                       "--query-encoder", str(wide), "--out", str(tmp_path / "kb"), "--quiet")
    assert code == 2 and "dimension 48" in one_line_error(err) and "32" in err
