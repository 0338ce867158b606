"""A training run's reading windows measured on its own data before the first step (rag.training.windows): the report
of cut training prompts names the window that holds 99% of them, and ``model.windows: {max_context_length: auto,
max_new_tokens: auto}`` sets them from the training prompts and answers."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
import pytorch_lightning as pl

from rag.generators.tiny import save, tiny_gpt2
from rag.training.data import QADataModule
from rag.training.modules import RagModule
from rag.training.windows import DataWindows, answer_window, measure_training_prompts, quantile_window
from rag.utils.errors import ConfigError

QA = [("Who discovered oxygen?", "Joseph Priestley"), ("What is the symbol of gold?", "Au"),
      ("What is the atomic number of iron?", "26"), ("Which element has symbol Na?", "Sodium"),
      ("What is mercury used in?", "thermometers, barometers and other scientific instruments"),
      ("When was argon discovered?", "1894")]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer):
    return save(tiny_gpt2(bpe_tokenizer, max_positions=512), bpe_tokenizer, tmp_path_factory.mktemp("windows_gpt2"))


def _module(gpt2_dir, question_dir, kb, window=64, **kw):
    return RagModule(generator=gpt2_dir, question_encoder=question_dir, knowledge_base=kb,
                     rag={"n_docs": 2, "max_context_length": window, "max_target_length": 8, "max_question_length": 16},
                     decoding={"max_new_tokens": 3}, **kw)


def test_quantile_window_and_the_settings():
    assert quantile_window([10, 20, 30, 40], 0.5) == 20 and quantile_window([10, 20, 30, 40], 0.99) == 40
    assert quantile_window([10, 20, 30, 41], 1.0, multiple=8) == 48 and quantile_window([], 0.99) == 0
    with pytest.raises(ConfigError, match="model.windows.max_context_length='big'; give auto"):
        DataWindows(max_context_length="big")
    with pytest.raises(ConfigError, match="model.windows.share"):
        DataWindows(share=0.0)


def test_the_answer_window_holds_the_longest_training_answer(bpe_tokenizer):
    """Decoding stops at the end token, so the window is the longest answer (plus the end), not a quantile: one long
    answer among a hundred short ones (an address among cloze numbers) is not cut."""
    answers = ["26"] * 99 + ["192.168.1.1 on the local network"]
    longest = len(bpe_tokenizer(answers[-1], add_special_tokens=False)["input_ids"])
    assert longest > len(bpe_tokenizer("26", add_special_tokens=False)["input_ids"]) + 1
    assert answer_window(bpe_tokenizer, answers, cap=64) == (longest + 1, longest)
    assert answer_window(bpe_tokenizer, answers, cap=4) == (4, longest)  # at most rag.max_target_length
    with pytest.raises(ConfigError, match="needs training answers"):
        answer_window(bpe_tokenizer, ["", "  "], cap=8)


def test_the_up_front_report_names_the_window_that_holds_99_percent(gpt2_dir, tiny_dpr_question_dir, tiny_kb_dir, caplog):
    module = _module(gpt2_dir, tiny_dpr_question_dir, tiny_kb_dir, window=40)  # the prompts here are 39-47 tokens
    module.configure_model()
    questions = [q for q, _ in QA]
    with caplog.at_level(logging.WARNING, logger="rag.training.modules"):
        module._report_cut_prompts_up_front(questions)
    [line] = [r.getMessage() for r in caplog.records if r.name == "rag.training.modules"]
    assert re.match(r"train: \d+ of 12 reader prompts \(\d+%\) were longer than max_context_length=40 tokens", line)
    held = int(re.search(r"; (\d+) tokens hold 99% of them whole", line).group(1))
    model = module.model
    found = measure_training_prompts(model, questions)
    assert found.cut.cut == sum(n > 40 for n in found.lengths) > 0  # the whole lengths agree with what the model cuts
    model.config = dataclasses.replace(model.config, max_context_length=held)
    assert measure_training_prompts(model, questions).cut.cut == 0 and held % 8 == 0  # 12 prompts: 99% is all of them


def test_auto_windows_are_chosen_from_the_training_data_reported_and_kept(gpt2_dir, tiny_dpr_question_dir, tiny_kb_dir,
                                                                         tmp_path, caplog):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": q, "answers": [a]}) + "\n" for q, a in QA))
    module = _module(gpt2_dir, tiny_dpr_question_dir, tiny_kb_dir,
                     windows={"max_context_length": "auto", "max_new_tokens": "auto"})
    data = QADataModule(train=str(train), val=str(train), batch_size=2, eval_batch_size=2, max_eval_examples=2)
    trainer = pl.Trainer(fast_dev_run=True, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    with caplog.at_level(logging.WARNING, logger="rag.training.modules"):
        trainer.fit(module, datamodule=data)
    lines = [r.getMessage() for r in caplog.records if r.name == "rag.training.modules"]
    tok = module.model.generator_tokenizer
    answer_tokens = [len(tok(a, add_special_tokens=False)["input_ids"]) for _, a in QA]
    assert module.decoding.max_new_tokens == min(max(answer_tokens) + 1, 8)  # the longest answer and its end; cap 8
    window = module.model.config.max_context_length
    assert window == module.rag_config.max_context_length != 64
    found = measure_training_prompts(module.model, [q for q, _ in QA])
    assert found.cut.cut == 0 and window == -(-max(found.lengths) // 8) * 8  # the smallest multiple of 8 holding all
    assert any(ln.startswith(f"model.windows.max_context_length=auto: rag.max_context_length={window} ") for ln in lines)
    assert any(ln.startswith(f"model.windows.max_new_tokens=auto: decoding.max_new_tokens={module.decoding.max_new_tokens} ")
               for ln in lines)
    assert not any(ln.startswith("train: ") for ln in lines)  # nothing cut at the chosen window: no warning
    saved: dict = {"state_dict": {}}
    module.on_save_checkpoint(saved)
    assert saved["rag"]["windows"] == {"max_context_length": window, "max_new_tokens": module.decoding.max_new_tokens}
    resumed = _module(gpt2_dir, tiny_dpr_question_dir, tiny_kb_dir,
                      windows={"max_context_length": "auto", "max_new_tokens": "auto"})
    resumed.on_load_checkpoint(saved)  # a resumed (or tested) run reads with the windows the first one chose
    assert (resumed.rag_config.max_context_length, resumed.decoding.max_new_tokens) == (window, module.decoding.max_new_tokens)
