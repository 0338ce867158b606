"""Issue #28's classes of hostile input, as a user meets them through `rag`: each is refused (exit 2, one line naming
the file / field / option and the fix) or handled, never an 'unexpected' error, an exhausted machine or a file of the
user's overwritten. (Swap-back integrity, merges and shard records: tests/knowledge/test_hotswap.py and
test_shards.py; the sliding window: tests/ralm/test_ralm.py; run folders: tests/training/test_run_dir.py.)"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rag.cli import main
from rag.knowledge.documents import SkippedFilesWarning, read_documents
from rag.utils.errors import ConfigError, CorpusError, IntegrityError, RagError

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv: str) -> str:
    """Run `rag argv...`; it must exit 2 with one 'rag ...: error:' line (no traceback, not 'unexpected'); returns it."""
    code, _, err = run(capsys, *argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and lines and "Traceback" not in err, err
    assert lines[-1].startswith("rag ") and ": error: " in lines[-1] and "unexpected" not in lines[-1], err
    return lines[-1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir) -> Path:
    """A small RAG checkpoint (tiny DPR + tiny BART over the tiny knowledge base)."""
    from rag.models.rag.model import RagModel

    out = tmp_path_factory.mktemp("ckpt") / "model"
    RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir, n_docs=2).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory, bpe_tokenizer) -> Path:
    from rag.generators.tiny import save, tiny_gpt2

    return Path(save(tiny_gpt2(bpe_tokenizer, max_positions=128), bpe_tokenizer, tmp_path_factory.mktemp("gpt2")))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _deep(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


# ------------------------------------------------------------------- 5: resource bounds on corpora


def test_a_device_or_a_pipe_is_never_read_as_a_corpus(tmp_path, capsys):
    line = refused(capsys, "index", "build", "--corpus", "/dev/zero", "--format", "text", "--encoder", "x", "--out",
                   str(tmp_path / "kb"), "--quiet")
    assert "/dev/zero" in line and "character device, not a regular file" in line
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came, then read without end
    with pytest.raises(CorpusError, match=r"corpus\.txt: is a pipe \(FIFO\), not a regular file"):
        list(read_documents(fifo))


def test_a_document_longer_than_the_bound_is_refused_without_reading_it_whole(tmp_path, capsys, tiny_bert_dir):
    long_line = tmp_path / "one.jsonl"
    long_line.write_text('{"title": "t", "text": "' + "x" * 5000 + '"}\n')
    with pytest.raises(CorpusError, match=r"one\.jsonl:1: a line longer than 1,000 characters.*--max-document-chars"):
        list(read_documents(long_line, max_document_chars=1000))
    text = tmp_path / "book.txt"
    text.write_text("word " * 3000)  # no line break at all, as /dev/zero or a binary blob
    with pytest.raises(CorpusError, match=r"book\.txt: a document, line or row longer than 1,000 characters"):
        list(read_documents(text, max_document_chars=1000))
    csv = tmp_path / "rows.csv"
    csv.write_text('title,text\na,"' + "multi\nline " * 400 + '"\n')  # one quoted field over many lines
    with pytest.raises(CorpusError, match=r"rows\.csv:2: a document, line or row longer than 1,000 characters"):
        list(read_documents(csv, max_document_chars=1000))
    assert len(list(read_documents(long_line, max_document_chars=6000))) == 1  # the limit is the user's
    line = refused(capsys, "index", "build", "--corpus", str(long_line), "--encoder", tiny_bert_dir, "--out",
                   str(tmp_path / "kb"), "--max-document-chars", "100", "--quiet")
    assert "one.jsonl:1" in line and "100 characters" in line


# ------------------------------------------------------------------- 6: symbolic links out of a corpus folder


def test_symlinks_leaving_a_corpus_folder_are_skipped_and_named(tmp_path):
    folder, outside = tmp_path / "corpus", tmp_path / "secret.txt"
    folder.mkdir()
    (folder / "a.txt").write_text("an ordinary document")
    outside.write_text("a system file that must not become a passage")
    (folder / "link.txt").symlink_to(outside)
    (folder / "inner.txt").symlink_to(folder / "a.txt")  # a link that stays inside is read
    with pytest.warns(SkippedFilesWarning, match=r"skipped 1 file\(s\) \(link\.txt\): symbolic links to files outside"):
        docs = list(read_documents(folder))
    assert sorted(d.id for d in docs) == ["a.txt", "inner.txt"] and not any("system file" in d.text for d in docs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedFilesWarning)
        followed = list(read_documents(folder, follow_symlinks=True))
    assert any("system file" in d.text for d in followed)


# ------------------------------------------------------------------- 8: deeply nested JSON


def test_deeply_nested_json_is_refused_naming_the_file(tmp_path, capsys, tiny_kb_dir, checkpoint, causal_lm):
    kb = _copy(Path(tiny_kb_dir), tmp_path / "kb")
    (kb / "manifest.json").write_text(_deep(100_000))
    line = refused(capsys, "index", "info", str(kb))
    assert "manifest.json" in line and "nested more than 64 levels" in line

    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    (ckpt / "rag_config.json").write_text(_deep(5_000))
    line = refused(capsys, "generate", "--model", str(ckpt), "q")
    assert "rag_config.json" in line and "nested" in line

    lm = _copy(causal_lm, tmp_path / "lm")
    (lm / "config.json").write_text(_deep(100_000))
    data = tmp_path / "text.txt"
    data.write_text("some text to score " * 20)
    line = refused(capsys, "lm-eval", "--model", str(lm), "--data", str(data), "--retrieval", "none")
    assert "lm/config.json" in line and "nested" in line
    (lm / "config.json").write_text((causal_lm / "config.json").read_text())
    (lm / "tokenizer_config.json").write_text(_deep(70))  # one transformers reads itself: checked first all the same
    line = refused(capsys, "lm-eval", "--model", str(lm), "--data", str(data), "--retrieval", "none")
    assert "tokenizer_config.json" in line and "nested more than 64 levels" in line


# ------------------------------------------------------------------- 10: LightningCLI errors


@pytest.mark.parametrize("option, value, message", [
    ("--model.rag.n_docs", "0", "--model.rag.n_docs must be a positive integer, got 0"),
    ("--model.rag.retrieval_temperature", "-1", "--model.rag.retrieval_temperature"),
    ("--model.tiny.d_model", "0", "model.tiny.d_model must be a positive integer, got 0"),
])
def test_lightning_cli_errors_are_one_line_naming_the_option(tmp_path, capsys, option, value, message):
    line = refused(capsys, "fit", "--config", str(REPO / "lightning_configs" / "tiny_cpu.yaml"), option, value,
                   "--trainer.default_root_dir", str(tmp_path / "run"))
    assert line.startswith("rag fit: error: ") and message in line


# ------------------------------------------------------------------- 11: tiny retrieval temperatures


def test_a_tiny_retrieval_temperature_gives_finite_weights():
    from rag.generation.marginalize import doc_log_prior

    scores = torch.tensor([[0.5, 0.3, 0.5], [0.1, 0.2, 0.3]])
    for tau in (1e-300, 5e-324, 1e-8):
        prior = doc_log_prior(scores, temperature=tau)
        assert not torch.isnan(prior).any()
        torch.testing.assert_close(prior.exp(), torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 1.0]]))  # ties split evenly


def test_json_output_is_never_non_finite():
    from rag.utils.io import to_json

    text = to_json({"score": float("nan"), "scores": [float("-inf"), 1.5], "t": "\ud800"})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == {
        "score": None, "scores": [None, 1.5], "t": "\\ud800"}


# ------------------------------------------------------------------- 12: heatmaps never overwrite


def test_heatmaps_never_overwrite_a_file(tmp_path, capsys, checkpoint):
    hm = tmp_path / "hm"
    hm.mkdir()
    (hm / "answer_0001.png").write_bytes(b"the user's own data")
    code, out, err = run(capsys, "generate", "--model", str(checkpoint), "--marginalization", "token", "--heatmap-dir", str(hm),
                         "--max-new-tokens", "4", "--min-new-tokens", "4", "who discovered oxygen?", "what is iron?")
    assert code == 0, err
    assert (hm / "answer_0001.png").read_bytes() == b"the user's own data"
    written = sorted(p.name for p in hm.glob("*.png"))
    assert written == ["answer_0001.png", "answer_0002.png", "answer_0003.png"] and str(hm / "answer_0003.png") in out
    assert (hm / "answer_0002.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------- 13: options of the other reader, missing devices


def test_a_causal_only_option_with_a_rag_model_is_one_line(tmp_path, capsys, checkpoint):
    line = refused(capsys, "generate", "--model", str(checkpoint), "--seed", "3", "who discovered oxygen?")
    assert "seed= (--seed) applies to a causal LM" in line and "drop --seed" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_missing_device_is_named_before_loading(tmp_path, capsys):
    data = tmp_path / "t.txt"
    data.write_text("text")
    line = refused(capsys, "lm-eval", "--model", str(tmp_path / "no-model"), "--data", str(data), "--retrieval", "none",
                   "--device", "cuda")
    assert "--device cuda" in line and "no CUDA GPU" in line


# ------------------------------------------------------------------- 14: damaged model directories


def test_damaged_model_directories_name_the_file(tmp_path, capsys, causal_lm, checkpoint, tiny_bert_dir):
    from rag.models.rag.model import RagModel
    from rag.models.ralm.rerank import PredictiveReranker

    lm = _copy(causal_lm, tmp_path / "lm")
    (lm / "model.safetensors").write_bytes(b"\xff" * 64)  # a header length of ~1.8e19 bytes: 'header too large'
    data = tmp_path / "t.txt"
    data.write_text("some text to score " * 20)
    line = refused(capsys, "lm-eval", "--model", str(lm), "--data", str(data), "--retrieval", "none")
    assert f"{lm / 'model.safetensors'}:" in line and "SafetensorError" in line and "restore" in line

    reranker = tmp_path / "reranker"
    PredictiveReranker(tiny_bert_dir, max_length=32, query_tokens=8).save(reranker)
    settings = json.loads((reranker / "rag_reranker.json").read_text())
    del settings["max_length"]
    (reranker / "rag_reranker.json").write_text(json.dumps(settings))
    with pytest.raises(IntegrityError, match=r"rag_reranker\.json: field 'max_length' is missing"):
        PredictiveReranker.load(reranker)

    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    meta = json.loads((ckpt / "rag_config.json").read_text())
    meta["config"]["n_docs"] = 0
    (ckpt / "rag_config.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=rf"{ckpt / 'rag_config.json'}: RagModelConfig.n_docs must be a positive integer"):
        RagModel.from_pretrained(ckpt)


# ------------------------------------------------------------------- 15: the rest of the 'unexpected' ones


def test_queries_may_follow_the_options(capsys, tiny_kb_dir):
    code, out, err = run(capsys, "index", "search", tiny_kb_dir, "-k", "2", "oxygen", "--json", "iron")
    assert code == 0, err
    assert [json.loads(line)["query"] for line in out.splitlines()] == ["oxygen", "iron"]
    with pytest.raises(SystemExit) as e:  # an unknown option is still argparse's usage error
        main(["index", "search", tiny_kb_dir, "-k", "2", "oxygen", "--bogus"])
    assert e.value.code == 2 and capsys.readouterr().err.endswith("rag: error: unrecognized arguments: --bogus\n")


@pytest.mark.parametrize("extra, message", [
    (["--limit", "0"], "--limit 0: must be a positive integer"),
    (["--limit", "-1"], "--limit -1: must be a positive integer"),
    (["--seed", "-1"], "--seed -1: must be an integer >= 0"),
    (["--window-step", "0"], "--window-step 0"),
])
def test_lm_eval_numbers_are_checked_before_loading(tmp_path, capsys, extra, message):
    data = tmp_path / "t.txt"
    data.write_text("text")
    line = refused(capsys, "lm-eval", "--model", str(tmp_path / "no-model"), "--data", str(data), "--retrieval", "none", *extra)
    assert message in line


def test_an_unterminated_csv_quote_is_an_error_not_a_merged_row(tmp_path):
    csv = tmp_path / "c.csv"
    csv.write_text('id,title,text\n1,a,"hello\n2,b,world\n3,c,x\n')
    with pytest.raises(CorpusError, match=r"c\.csv:2: a quote opened in this row is never closed"):
        list(read_documents(csv))


def test_a_lone_surrogate_is_refused_where_it_is_read(tmp_path, capsys, tiny_bert_dir):
    corpus = tmp_path / "s.jsonl"
    corpus.write_text('{"title": "t", "text": "bad \\ud800 escape"}\n')
    line = refused(capsys, "index", "build", "--corpus", str(corpus), "--encoder", tiny_bert_dir, "--out", str(tmp_path / "kb"),
                   "--index", "flat", "--quiet")
    assert "s.jsonl:1" in line and "lone UTF-16 surrogate" in line and not (tmp_path / "kb").exists()


def test_messages_are_one_line_and_memory_advice_names_only_real_options():
    from rag.cli import describe_error

    assert describe_error(RagError("first\nsecond"))[0] == "first second"
    assert "--batch-size" not in describe_error(MemoryError())[0]
    assert "lower --batch-size" in describe_error(MemoryError(), batch_option="--batch-size")[0]
    assert describe_error(TypeError("a bug"))[1] == 1  # genuine bugs stay 'unexpected', exit 1


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("uses /dev/zero and FIFOs")


# ------------------------------------------------------------------------------------- issue #46, outside the server


def test_a_pickle_in_place_of_lm_weights_is_refused_as_a_pickle(tmp_path, capsys, causal_lm, tiny_kb_dir):
    """pytorch_model.bin holding a pickled call (it would print if run): exit 2, one line naming the file and saying
    pickles are never loaded beyond tensors; nothing of it ran."""
    import pickle

    class Call:
        def __reduce__(self):
            return (print, ("PICKLE RAN",))

    d = _copy(causal_lm, tmp_path / "lm")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"transformer.wte.weight": Call()}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on the pickle protocol
        code, out, err = run(capsys, "generate", "--model", str(d), "--kb", tiny_kb_dir, "The oxygen")
    line = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert code == 2 and "Traceback" not in err and "PICKLE RAN" not in out + err, err
    assert line.startswith("rag generate: error: ") and str(d / "pytorch_model.bin") in line
    assert "pickles are never loaded" in line and "weights_only=False" not in line


def test_generate_file_must_be_a_regular_file_read_in_bounded_lines(tmp_path, capsys, monkeypatch):
    import rag.cli.index as cli_index

    line = refused(capsys, "generate", "--file", "/dev/zero")
    assert "/dev/zero: is a character device, not a regular file" in line and "no such file" not in line
    assert "no such file" in refused(capsys, "generate", "--file", str(tmp_path / "missing.txt"))
    long = tmp_path / "long.txt"
    long.write_text("who " * 100 + "\nsecond question\n")
    monkeypatch.setattr(cli_index, "MAX_QUERY_CHARS", 64)  # the line is never read past the bound
    assert f"--file {long}: line 1 is longer than 64 characters" in refused(capsys, "generate", "--file", str(long))


@pytest.mark.parametrize("value", ["-1", "-5"])
def test_show_passages_must_not_be_negative(capsys, value):
    assert f"--show-passages {value}: must be 0" in refused(capsys, "generate", "--show-passages", value, "q")


def test_a_failed_allocation_blames_no_intact_file(tmp_path, monkeypatch):
    """A loader's RuntimeError while memory is short (e.g. an allocation of gigabytes failed) must not be reported as
    a damaged file that the blame scan merely could not read for want of memory (it named an intact eval.json)."""
    import rag.utils.files as files

    d = tmp_path / "model"
    d.mkdir()
    (d / "eval.json").write_text('{"dev": {"em": 99.0}}')
    real = files.read_json

    def short_of_memory(path, **kw):
        if Path(path).name == "eval.json":
            raise MemoryError
        return real(path, **kw)

    monkeypatch.setattr(files, "read_json", short_of_memory)
    with pytest.raises(IntegrityError) as e:
        with files.readable_model_files(d, "the generator", "restore it"):
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 26843545600 bytes")
    assert str(e.value).startswith(f"{d}: the generator cannot be loaded") and "eval.json" not in str(e.value)
