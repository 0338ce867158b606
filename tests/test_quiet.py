"""What `rag` writes on stderr: its own progress (one bar or line per stage) and warnings, never the bars, log records
and warnings of the libraries it calls unless -v; and a count of the reader prompts cut to the model's window, reported
once by the command instead of a warning per call."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tqdm.auto

import rag
from rag.cli import main
from rag.generation.contexts import ContextTruncationWarning
from rag.models.rag.model import RagModel, RagModelConfig
from rag.utils.quiet import one_line_warnings, quiet, quiet_libraries, stage
from rag.utils.truncation import counting_cut_prompts

REPO = Path(__file__).resolve().parents[1]
THIRD_PARTY_BARS = ("Loading weights", "Saving the dataset", "Split strings", "Stem Tokens", "BM25S")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    rows = [{"id": f"d{i}", "title": f"Element {i}", "text": f"element number {i} is a metal with symbol E{i}"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(capsys, corpus, encoder, out, *extra) -> str:
    assert main(["index", "build", "--corpus", str(corpus), "--encoder", encoder, "--out", str(out), "--index", "flat",
                 "--bm25", *extra]) == 0
    return capsys.readouterr().err


def test_index_build_draws_rags_bars_and_no_librarys(tmp_path, capsys, corpus, tiny_bert_dir):
    err = build(capsys, corpus, tiny_bert_dir, tmp_path / "kb")
    assert not [b for b in THIRD_PARTY_BARS if b in err], err
    assert "encode" in err and "index flat" in err  # rag's own stages keep their bar
    assert not re.search(r"Warning|WARNING", err), err


def test_with_verbose_the_librarys_bars_are_shown(tmp_path, capsys, corpus, tiny_bert_dir):
    err = build(capsys, corpus, tiny_bert_dir, tmp_path / "kb", "-v")
    # bm25s' own bar (bm25s draws it; rag only passes show_progress). Not datasets' "Saving the dataset": whether that
    # one draws also depends on huggingface_hub's process-wide progress-bar switch, which other code may have set.
    assert "Split strings" in err, err


def test_settings_are_restored_after_a_command(tmp_path, capsys, corpus, tiny_bert_dir):
    build(capsys, corpus, tiny_bert_dir, tmp_path / "kb")
    out = io.StringIO()
    for _ in tqdm.auto.tqdm(range(3), desc="a library's bar", file=out):
        pass
    assert "a library's bar" in out.getvalue()


def _third_party(code: str, module: str, **names):
    """Run `code` as if it were the module `module` (its globals' ``__name__`` and a file name of its own)."""
    scope = {"__name__": module, **names}
    exec(compile(code, f"/site-packages/{module.replace('.', '/')}.py", "exec"), scope)


def test_only_bars_rag_creates_are_drawn_inside_quiet_libraries():
    mine, theirs = io.StringIO(), io.StringIO()
    with quiet_libraries():
        _third_party("for _ in tqdm(range(2), desc=\"rag's\", file=f): pass", "rag.knowledge.fake", tqdm=tqdm.auto.tqdm, f=mine)
        _third_party("for _ in tqdm(range(2), desc='theirs', file=f): pass", "somelib.progress", tqdm=tqdm.auto.tqdm, f=theirs)
    assert "rag's" in mine.getvalue() and theirs.getvalue() == ""


def test_other_packages_log_only_errors_inside_quiet_libraries():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger().addHandler(handler)
    try:
        with quiet_libraries():
            logging.getLogger("somelib.loader").warning("somelib warns")
            logging.getLogger("somelib.loader").error("somelib fails")
            logging.getLogger("rag.knowledge").warning("rag warns")
        logging.getLogger("somelib.loader").warning("somelib after")
    finally:
        logging.getLogger().removeHandler(handler)
    text = stream.getvalue()
    assert "somelib warns" not in text and "somelib fails" in text and "rag warns" in text and "somelib after" in text


def test_own_warnings_are_one_line_and_other_packages_warnings_hidden():
    err = io.StringIO()
    with one_line_warnings("rag demo", stream=err):
        warnings.simplefilter("always")
        warnings.warn("prompts were cut\n  (second line)", ContextTruncationWarning, stacklevel=1)
        _third_party("warnings.warn('`x` is deprecated', FutureWarning)", "otherlib.models", warnings=warnings)
        _third_party("warnings.warn('library news')", "otherlib.models", warnings=warnings)
    assert err.getvalue() == "rag demo: ContextTruncationWarning: prompts were cut (second line)\n"


def test_rag_quiet_is_a_commands_display_for_a_script():
    """``with rag.quiet():`` around Python API calls: no library bar or warning, rag's own warnings one line each."""
    assert rag.quiet is quiet
    err, theirs = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), rag.quiet("my-script"):
        warnings.simplefilter("always")
        _third_party("for _ in tqdm(range(2), desc='Loading weights', file=f): pass", "somelib.loading",
                     tqdm=tqdm.auto.tqdm, f=theirs)
        _third_party("warnings.warn('`x` is deprecated', FutureWarning)", "otherlib.models", warnings=warnings)
        warnings.warn("prompts were cut", ContextTruncationWarning, stacklevel=1)
    assert theirs.getvalue() == "" and err.getvalue() == "my-script: ContextTruncationWarning: prompts were cut\n"
    shown = io.StringIO()
    with rag.quiet(enabled=False):
        _third_party("for _ in tqdm(range(2), desc='Loading weights', file=f): pass", "somelib.loading",
                     tqdm=tqdm.auto.tqdm, f=shown)
    assert "Loading weights" in shown.getvalue()


def test_verbose_keeps_pythons_display_of_every_warning():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with one_line_warnings("rag demo", enabled=False):
            _third_party("warnings.warn('`x` is deprecated', FutureWarning)", "otherlib.models", warnings=warnings)
    assert [str(w.message) for w in seen] == ["`x` is deprecated"]


def test_a_stage_is_one_line_with_its_seconds():
    out = io.StringIO()
    with stage("building the demo knowledge base", stream=out):
        pass
    assert re.fullmatch(r"building the demo knowledge base \.\.\. \d+\.\d s\n", out.getvalue())
    out = io.StringIO()
    with pytest.raises(ValueError), stage("loading", stream=out):
        raise ValueError("x")
    assert out.getvalue() == "loading ... failed\n"


# ------------------------------------------------------------------------------------- prompts cut to the window


@pytest.fixture(scope="module")
def kb_dir(build_hybrid_kb):
    return build_hybrid_kb(30, "quiet_kb")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer):
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=512), bpe_tokenizer, tmp_path_factory.mktemp("quiet_gpt2"))


@pytest.mark.parametrize("generator", ["causal", "seq2seq"])
def test_cut_prompts_are_counted_instead_of_warned(generator, gpt2_dir, tiny_bart_dir, kb_dir):
    gen = gpt2_dir if generator == "causal" else tiny_bart_dir
    k, window = 3, 40
    model = RagModel.from_components(None, gen, kb_dir, RagModelConfig(n_docs=k, max_context_length=window))
    questions = ["Which element has symbol Na?", "Who discovered oxygen?"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # counted: no per-call warning (the seq2seq contexts' own one `rag` hides)
        warnings.filterwarnings("ignore", message="Some generator contexts are longer than max_length")
        with counting_cut_prompts() as cut:
            inputs = model.prepare_inputs(questions)
    assert cut.prompts == len(questions) * k and cut.cut == inputs.n_truncated > 0
    assert cut.summary().startswith(f"{cut.cut} of {cut.prompts} "
                                    f"reader prompts") and f"max_context_length={window}" in cut.summary()
    wide = RagModel.from_components(None, gen, kb_dir, RagModelConfig(n_docs=k, max_context_length=400))
    with counting_cut_prompts() as none_cut:
        wide.prepare_inputs(questions)
    assert (none_cut.prompts, none_cut.cut, none_cut.summary()) == (len(questions) * k, 0, None)


# ------------------------------------------------------------------------------------- the first `rag demo`


@pytest.mark.slow
def test_the_first_rag_demo_prints_one_line_per_stage_and_nothing_of_the_libraries(tmp_path):
    env = {**os.environ, "RAG_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "rag", "demo"], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    stages = [r"building the demo knowledge base \.\.\. \d+\.\d s", r"converting the demo LM from its GGUF file \.\.\. \d+\.\d s",
              r"loading the demo model \.\.\. \d+\.\d s"]
    assert [bool(re.fullmatch(p, line)) for p, line in zip(stages, lines)] == [True] * 3, run.stderr
    assert all(re.fullmatch(r"rag demo: \d+ of 12 reader prompts .*", line) for line in lines[3:]), run.stderr
    out = run.stdout.splitlines()
    assert out.index("") == 2 and out[3].startswith("Q: ")  # the knowledge base and model lines, then the first answer


def test_rag_generate_reports_the_cut_prompts_once_after_the_answers(tmp_path, capsys, gpt2_dir, kb_dir):
    model = RagModel.from_components(None, gpt2_dir, kb_dir, RagModelConfig(n_docs=3, max_context_length=40))
    model.save_pretrained(tmp_path / "model")
    capsys.readouterr()
    code = main(["generate", "--model", str(tmp_path / "model"), "--json", "--batch-size", "1", "--max-new-tokens", "2",
                 "Which element has symbol Na?", "Who discovered oxygen?"])
    out, err = capsys.readouterr()
    assert code == 0 and len(out.splitlines()) == 2  # stdout: the answers alone
    assert "Warning" not in err and re.fullmatch(r"rag generate: [1-6] of 6 reader prompts \(\d+%\) were longer than "
                                                 r"max_context_length=40 tokens: .*\n", err), err


def test_a_training_run_whose_prompts_are_cut_says_so_before_the_first_step(tmp_path, caplog, tiny_bart_dir,
                                                                             tiny_dpr_question_dir, tiny_kb_dir):
    import pytorch_lightning as pl

    from rag.training.data import QADataModule
    from rag.training.modules import RagModule

    module = RagModule(generator=tiny_bart_dir, question_encoder=tiny_dpr_question_dir, knowledge_base=tiny_kb_dir,
                       rag={"n_docs": 2, "max_context_length": 24, "max_target_length": 8, "max_question_length": 16},
                       decoding={"max_new_tokens": 3})
    data = QADataModule(train="demo:train", val="demo:dev", batch_size=4, eval_batch_size=4, max_eval_examples=4)
    trainer = pl.Trainer(fast_dev_run=True, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    with caplog.at_level(logging.WARNING, logger="rag.training.modules"):
        trainer.fit(module, datamodule=data)
    lines = [r.getMessage() for r in caplog.records if r.name == "rag.training.modules"]
    up_front = [i for i, m in enumerate(lines) if "measured before training on 64 of the" in m]
    per_epoch = [i for i, m in enumerate(lines) if "contexts this epoch" in m]
    assert up_front and per_epoch and up_front[0] < per_epoch[0], lines
    assert re.match(r"train: 128 of 128 reader prompts \(100%\) were longer than max_context_length=24 tokens",
                    lines[up_front[0]])


def test_rag_hotswap_eval_reports_the_cut_prompts_of_every_cell(tmp_path, capsys, tiny_bart_dir, kb_dir):
    model = RagModel.from_components(None, tiny_bart_dir, kb_dir, RagModelConfig(n_docs=2, max_context_length=24))
    model.save_pretrained(tmp_path / "model")
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": q, "answer": ["x"]}) + "\n" for q in ("Who discovered oxygen?", "What is Na?")))
    capsys.readouterr()
    code = main(["hotswap-eval", "--model", str(tmp_path / "model"), "--kb", kb_dir, "--kb", kb_dir, "--data", str(qa),
                 "--max-new-tokens", "2", "--quiet", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["n_questions"] == [2]
    # 2 knowledge bases x 2 questions x 2 passages
    assert re.fullmatch(r"rag hotswap-eval: [1-8] of 8 reader prompts \(\d+%\) were longer than max_context_length=24 .*\n",
                        err), err


def test_measuring_the_cut_prompts_before_training_leaves_the_random_state_alone(caplog, tiny_bart_dir, tiny_dpr_question_dir,
                                                                                 tiny_kb_dir):
    import torch

    from rag.training.modules import RagModule

    module = RagModule(generator=tiny_bart_dir, question_encoder=tiny_dpr_question_dir, knowledge_base=tiny_kb_dir,
                       rag={"n_docs": 2, "max_context_length": 24, "max_target_length": 8, "max_question_length": 16})
    module.configure_model()
    dropouts = [m for m in module.model.modules() if isinstance(m, torch.nn.Dropout)]
    for m in dropouts:  # the tiny models are built without dropout; real ones draw random numbers in training mode
        m.p = 0.1
    assert module.model.training and dropouts
    before = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="rag.training.modules"):
        module._report_cut_prompts_up_front(["Who discovered oxygen?", "What is the symbol of gold?"])
    assert torch.equal(before, torch.get_rng_state())
    assert "train: 4 of 4 reader prompts" in caplog.text


def test_the_demo_knows_from_the_manifests_alone_which_first_run_stages_it_has_to_run(tmp_path, monkeypatch):
    from rag.demo.kb import DEMO_CORPUS, DEMO_KB_BUILD, demo_kb_needs_build
    from rag.generators.demo_lm import MANIFEST, demo_lm_dir, demo_lm_needs_conversion

    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    assert demo_kb_needs_build() and demo_kb_needs_build(tmp_path / "elsewhere") and demo_lm_needs_conversion()
    kb = tmp_path / "kb"
    kb.mkdir()
    for build, needed in ((DEMO_KB_BUILD, False), (DEMO_KB_BUILD - 1, True)):
        (kb / "manifest.json").write_text(json.dumps({"build": {"corpus": DEMO_CORPUS, "demo_kb_build": build}}))
        assert demo_kb_needs_build(kb) is needed
    (kb / "manifest.json").write_text(json.dumps({"build": {"corpus": ["my.jsonl"]}}))  # a user's own: never rebuilt
    assert demo_kb_needs_build(kb) is False
    demo_lm_dir().mkdir(parents=True)
    (demo_lm_dir() / MANIFEST).write_text("{}")
    assert not demo_lm_needs_conversion()  # a damaged one is found (and converted again) when it is verified at load
