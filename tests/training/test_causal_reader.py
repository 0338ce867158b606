"""The decoder-only reader's fine-tuning module (rag.training.causal_reader): the training layout is the one RalmReader
generates with, the loss equals transformers' on the same text, mixed-context training makes the reader robust on a
toy task, Self-Ask chains join every step, and `rag fit` trains and exports a reader that `rag generate` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rag.knowledge.passages import Passage
from rag.training.causal_reader import DEFAULT_PROMPT, CausalReaderModule, answer_nll, reading_windows
from rag.utils.errors import ConfigError

CONFIG = Path(__file__).resolve().parents[2] / "lightning_configs" / "retrobust_reader_tiny.yaml"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer) -> str:
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=128), bpe_tokenizer, tmp_path_factory.mktemp("reader"))


@pytest.fixture
def module(gpt2_dir, tiny_kb_dir):
    m = CausalReaderModule(lm=gpt2_dir, knowledge_base=tiny_kb_dir, doc_max_length=24)
    m.configure_model()
    return m


GOLD = Passage(id="gold", title="Gold", text="Symbol: Au. Atomic number: 79. Gold is a soft yellow metal.")


def test_window_is_the_generation_layout(module):
    """doc tokens, then [ctx] + prompt, then " answer" + EOS: the window RalmReader decodes the answer in."""
    s, tok = module.scorer, module.tokenizer
    prompt = DEFAULT_PROMPT.format(question="what is the symbol of gold?")
    (window, n), (alone, m) = reading_windows(s, [prompt, prompt], ["Au", "Au"], [GOLD, None])
    doc = tok("Gold\n" + GOLD.text, add_special_tokens=False)["input_ids"][:24]
    answer = tok(" Au", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    stream = [s.ctx_id] + tok(prompt, add_special_tokens=False)["input_ids"]
    assert window == doc + stream + answer and n == len(answer)
    assert alone == stream + answer and m == n


def test_long_prompt_is_cut_from_the_left_keeping_the_answer(gpt2_dir, tiny_kb_dir):
    m = CausalReaderModule(lm=gpt2_dir, knowledge_base=tiny_kb_dir, doc_max_length=24, max_length=40)
    m.configure_model()
    prompt = DEFAULT_PROMPT.format(question="which element " * 30 + "is yellow?")
    ((window, n),) = reading_windows(m.scorer, [prompt], ["gold"], [GOLD])
    answer = m.tokenizer(" gold", add_special_tokens=False)["input_ids"] + [m.tokenizer.eos_token_id]
    assert len(window) == 40 and window[-n:] == answer
    assert window[:24] == m.tokenizer("Gold\n" + GOLD.text, add_special_tokens=False)["input_ids"][:24]


def test_loss_equals_transformers_on_the_same_text(module):
    """Summed answer NLL per example == transformers' mean label loss x answer tokens, computed on the text a user reads
    (passage, BOS, prompt, answer: BOS separates the passage from the prompt, as In-Context RALM's [ctx] token)."""
    tok, lm = module.tokenizer, module.lm
    lm.eval()
    qs, answers = ["what is the symbol of gold?", "which element is number 79?"], ["Au", "Gold"]
    prompts = module.prompts(qs)
    nll = answer_nll(module.scorer, reading_windows(module.scorer, prompts, answers, [GOLD, None]))
    for i, (prompt, answer, passage) in enumerate(zip(prompts, answers, [GOLD, None])):
        head = (tok("Gold\n" + passage.text, add_special_tokens=False)["input_ids"][:24] if passage else []) + [tok.bos_token_id]
        ids = head + tok(prompt, add_special_tokens=False)["input_ids"]
        target = tok(" " + answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        x = torch.tensor([ids + target])
        labels = torch.tensor([[-100] * len(ids) + target])
        with torch.no_grad():
            ref = lm(input_ids=x, labels=labels).loss * len(target)
        torch.testing.assert_close(nll[i].detach(), ref, rtol=1e-5, atol=1e-5)


def test_training_steps_lower_the_loss_and_touch_only_the_lm(gpt2_dir, tiny_kb_dir):
    """The module's own configure_optimizers (under a real Trainer, for its step schedule) optimizes exactly the LM's
    trainable parameters: 30 of its steps (of a 300-step schedule) lower the loss, and a parameter frozen beforehand never
    moves."""
    import pytorch_lightning as pl

    module = CausalReaderModule(lm=gpt2_dir, knowledge_base=tiny_kb_dir, doc_max_length=24,
                                optimizer={"lr": 3e-3, "warmup_ratio": 0.0})
    module.configure_model()
    frozen = dict(module.lm.named_parameters())["transformer.wpe.weight"]  # positions (the token embeddings are the head)
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    module.trainer = pl.Trainer(max_steps=300, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, accelerator="cpu")
    config = module.configure_optimizers()
    opt, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    optimized = [p for group in opt.param_groups for p in group["params"]]
    trainable = [p for p in module.lm.parameters() if p.requires_grad]
    assert len(optimized) == len({id(p) for p in optimized}) == len(trainable)
    assert {id(p) for p in optimized} == {id(p) for p in trainable}  # all of the LM's trainable ones, nothing else
    assert {id(p) for p in module.parameters()} - {id(p) for p in module.lm.parameters()} == set()  # it owns no others
    assert all(group["lr"] == 3e-3 for group in opt.param_groups)
    batch = {"questions": ["what is the symbol of gold?"] * 4, "targets": ["Au"] * 4, "contexts": [GOLD] * 4}
    module.lm.train()
    first = None
    for _ in range(30):
        loss = module.loss(module.prompts(batch["questions"]), batch["targets"], batch["contexts"])
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in trainable)
        opt.step()
        scheduler.step()
    assert float(loss) < first / 4, (first, float(loss))
    assert torch.equal(frozen, before)


def test_answer_under_a_given_passage_equals_ralm_reader_generation(module):
    """The reader's greedy answer after a chosen passage is RalmReader's answer when that passage is the one it retrieved
    (stride >= answer length: one retrieval), and the no-passage answer is its no-retrieval one. The random LM is first
    taught to say a passage's title, so that answers are real words that depend on the passage."""
    from rag.models.ralm.model import RalmConfig
    from rag.pipeline.readers import RalmReader
    from rag.training.causal_reader import first_line

    kb = module._knowledge_base()
    passages = kb.all_passages()[:8]
    qs = [f"name the element: {p.text.split('.')[0]}" for p in passages]
    opt = torch.optim.AdamW(module.lm.parameters(), lr=3e-3)
    module.lm.train()
    for _ in range(40):
        loss = module.loss(module.prompts(qs), [p.title for p in passages], passages)
        opt.zero_grad()
        loss.backward()
        opt.step()
    reader = RalmReader(module.lm, module.tokenizer, kb,
                        RalmConfig(stride=6, doc_max_length=24, max_length=module.scorer.max_length),
                        retrieval="dense")
    with_r, without = reader.generate_with_and_without_retrieval(module.prompts(qs), max_new_tokens=6)
    expected = [first_line(a.text) for a in with_r]
    assert len(set(expected)) > 2, expected  # real answers that differ with the passage
    assert module.answer(qs, [a.passages[0] for a in with_r], max_new_tokens=6) == expected
    assert module.answer(qs, max_new_tokens=6) == [first_line(a.text) for a in without]


def test_selfask_chains_join_every_training_step(gpt2_dir, tiny_kb_dir, monkeypatch):
    m = CausalReaderModule(lm=gpt2_dir, knowledge_base=tiny_kb_dir, doc_max_length=24, selfask="demo", selfask_batch=3)
    m.configure_model()
    assert m._chains and all(line.startswith(("Follow up:", "So the final answer is:")) for _, line in m._chains)
    seen = {}

    def spy(prompts, answers, passages=None):
        seen.update(prompts=list(prompts), answers=list(answers), passages=list(passages))
        return torch.zeros((), requires_grad=True)

    monkeypatch.setattr(m, "loss", spy)
    monkeypatch.setattr(m, "log", lambda *a, **k: None)
    m.training_step({"questions": ["q1", "q2"], "targets": ["a1", "a2"], "contexts": [GOLD, GOLD]}, 0)
    assert seen["answers"][:2] == ["a1", "a2"] and len(seen["answers"]) == 5
    assert all(a.startswith(("Follow up:", "So the final answer is:")) for a in seen["answers"][2:])
    assert seen["passages"] == [GOLD, GOLD, None, None, None]
    assert all(p.startswith("Question:") and "Are follow up questions needed here: Yes." in p for p in seen["prompts"][2:])


@pytest.mark.slow
def test_reader_trained_on_mixed_contexts_is_less_hurt_by_random_ones(tmp_path):
    """RetRobust's claim (§2.2) on a toy task, for the decoder-only reader: 12 entities with a code each, one passage per
    entity. Trained on its own passage only, a tiny GPT-2 learns to copy the code from whatever it reads; trained on
    contexts from the RetRobust sampler it must also know the codes, and a random passage hurts it far less."""
    from rag.generators.load import load_generator
    from rag.generators.tiny import save, tiny_gpt2, train_bpe_tokenizer
    from rag.models.ralm.model import CausalScorer
    from rag.training.context_mixing import ContextMixing, sample_context_choices

    names = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"]
    codes = ["red", "blue", "green", "black", "white", "pink", "gray", "brown", "gold", "cyan", "lime", "navy"]
    passages = [Passage(id=n, title=n, text=f"{n} code is {c}") for n, c in zip(names, codes)]
    prompts = [DEFAULT_PROMPT.format(question=f"code of {n}?") for n in names]
    tok = train_bpe_tokenizer([f"{p} {q.title} {q.text}" for p, q in zip(prompts, passages)] * 20, vocab_size=300)
    path = save(tiny_gpt2(tok, d_model=64, layers=2, max_positions=64), tok, tmp_path / "lm")
    top_rows = [[i, (i + 1) % 12] for i in range(12)]  # an oracle retriever: own passage first, a neighbour second

    def train(mixing: ContextMixing, steps: int = 300) -> CausalScorer:
        torch.manual_seed(0)
        lm, t, _ = load_generator(path, kind="causal")
        scorer = CausalScorer(lm, t, doc_max_length=16)
        lm.train()
        opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
        for step in range(steps):  # a fresh draw of contexts per step, as epochs of a mixed DataModule would give
            mixing.seed = step
            rows = [c.row for c in sample_context_choices(top_rows, mixing)]
            windows = reading_windows(scorer, prompts, codes, [passages[r] for r in rows])
            loss = answer_nll(scorer, windows).sum() / sum(n for _, n in windows)
            opt.zero_grad()
            loss.backward()
            opt.step()
        lm.eval()
        return scorer

    def nll(scorer: CausalScorer, shift: int) -> float:  # mean NLL of the right code (+ EOS) with passage (i + shift) % 12
        with torch.no_grad():
            return float(answer_nll(scorer,
                                    reading_windows(scorer, prompts, codes,
                                                    [passages[(i + shift) % 12] for i in range(12)])).mean())

    top1_only = train(ContextMixing(top_k=2, p_top1=1.0, p_low=0.0, p_random=0.0))
    mixed = train(ContextMixing(top_k=2, low_rank_start=1))
    own = nll(top1_only, 0), nll(mixed, 0)
    random_ctx = nll(top1_only, 5), nll(mixed, 5)
    assert own[0] < 1.0 and own[1] < 1.0, own  # both read their own passage well
    assert random_ctx[0] > 3.0, random_ctx  # the top-1 reader copies the wrong code
    assert random_ctx[1] < random_ctx[0] / 3, random_ctx  # the RetRobust reader is far less hurt


@pytest.mark.parametrize("kw, option", [
    ({"prompt": "no placeholder"}, "model.prompt"),
    ({"doc_max_length": 0}, "model.doc_max_length"),
    ({"optimizer": {"lr": 0}}, "model.optimizer.lr"),
    ({"optimizer": {"warmup_ratio": 1.0}}, "model.optimizer.warmup_ratio"),
    ({"retrieval": "sparse"}, "model.retrieval"),
])
def test_bad_options_name_the_option(kw, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        CausalReaderModule(**kw)


def test_bad_selfask_file_names_the_line(tmp_path, gpt2_dir, tiny_kb_dir):
    bad = tmp_path / "chains.jsonl"
    good = {"question": "q?", "answers": ["a"], "follow_ups": [{"question": "f?", "answer": "b"}]}
    bad.write_text(json.dumps(good) + "\n" + json.dumps({"question": "q2?", "answers": ["a"]}) + "\n")
    m = CausalReaderModule(lm=gpt2_dir, knowledge_base=tiny_kb_dir, selfask=str(bad))
    with pytest.raises(ConfigError, match=r"chains\.jsonl:2"):
        m.configure_model()
    m = CausalReaderModule(lm=gpt2_dir, knowledge_base=tiny_kb_dir, selfask=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="no such file"):
        m.configure_model()


@pytest.mark.parametrize("name", ["retrobust_reader_tiny.yaml", "retrobust_reader_smollm2.yaml"])
def test_config_parses_lazily(name, tmp_path, monkeypatch):
    from rag.cli.train import make_cli
    from rag.training.data import QADataModule

    monkeypatch.chdir(tmp_path)
    cli = make_cli(["--config", str(CONFIG.with_name(name))], run=False)
    assert isinstance(cli.model, CausalReaderModule) and isinstance(cli.datamodule, QADataModule)
    assert cli.model.lm is None  # lazy: parsing loads no model
    mix = cli.datamodule.context_mixing
    assert mix.top_k == 10 and abs(sum(mix.probabilities) - 1) < 1e-6 and min(mix.probabilities) > 0.33
    assert cli.model.hparams.selfask == "demo"


@pytest.mark.slow
def test_rag_fit_trains_and_exports_a_reader_rag_generate_reads(tmp_path, monkeypatch, capsys):
    """`rag fit` on the tiny RetRobust config (mixed contexts through the DataModule, Self-Ask chains) for 4 steps,
    validation with and without retrieval, then the exported reader answers through `rag generate`."""
    import csv

    from rag.cli import main
    from rag.demo.kb import ensure_demo_kb

    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(CONFIG), "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
          "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"])
    run = tmp_path / "runs" / "retrobust_reader_tiny"
    rows = list(csv.DictReader(open(next(run.rglob("metrics.csv")))))
    assert any(r.get("val/em") not in (None, "") for r in rows) and any(r.get("val/em_no_retrieval") not in (None, "")
                                                                        for r in rows)
    assert (run / "reader" / "config.json").is_file()
    capsys.readouterr()
    kb = ensure_demo_kb(show_progress=False)
    assert main(["generate", "--model", str(run / "reader"), "--kb", str(kb.path), "--doc-max-length", "64", "--stride", "8",
                 "--max-new-tokens", "3", "--retrieval", "dense", "--json",
                 "Question: what is the symbol of gold?\nAnswer:"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["passages"] and out["kb_version"]
