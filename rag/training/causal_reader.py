"""Fine-tune a decoder-only reader on QA pairs with ``rag fit``: each answer is learnt after its training passage, laid
out exactly as :class:`~rag.pipeline.readers.RalmReader` generates (``doc ∘ [ctx] ∘ prompt``), or after the prompt alone.

With :class:`~rag.training.data.QADataModule` ``context_mixing`` (RetRobust, Yoran et al. 2024 §2.2) the passage is
the question's top-1, a low-ranked or a random one, so the reader learns to use relevant passages and ignore
irrelevant ones; without it the reader sees no passage (the paper's NoRet / closed-book reader). ``selfask`` adds
Self-Ask chains (§3: ``Follow up:`` / ``So the final answer is:`` lines of decomposed multi-hop questions) to every
step. Validation generates with the same layout: greedy answers with the top-1 retrieved passage (``val/em``,
``val/f1``) and without a passage (``val/em_no_retrieval``, ``val/f1_no_retrieval``), one batch for both.

The loss is the mean negative log-likelihood of the answer tokens and EOS (:func:`answer_nll`); the LM head runs
only at those positions. ``export_dir`` writes the trained reader (the LM and its In-Context RALM settings,
:mod:`rag.pipeline.exports`) at the end of ``fit``: ``rag generate --model DIR --kb KB`` and ``rag.load(DIR,
knowledge_base=KB)`` read it.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Optional, Sequence

import pytorch_lightning as pl
import torch

from rag.demo.multihop import load_multihop
from rag.eval.metrics import ExactMatch, TokenF1
from rag.generators.load import as_generator, load_generator
from rag.knowledge.passages import Passage
from rag.models.ralm.model import CausalScorer, RalmConfig, window_ids, window_start
from rag.pipeline.exports import export_causal_reader
from rag.pipeline.readers import RalmReader
from rag.retrobust.selfask import chain_training_examples
from rag.training.context_mixing import open_knowledge_base
from rag.training.data import batch_contexts
from rag.training.reranker import ensure_tiny_gpt2
from rag.training.settings import Optimizer, settings_dict
from rag.utils.devices import without_cudnn_attention
from rag.utils.errors import ConfigError
from rag.utils.files import parse_json
from rag.utils.validate import check_number, check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PROMPT", "reading_windows", "prompt_windows", "answer_nll", "CausalReaderModule"]

DEFAULT_PROMPT = "Question: {question}\nAnswer:"
_DEFAULT_OPTIMIZER = Optimizer(lr=2e-5, weight_decay=0.0, warmup_ratio=0.05)


def reading_windows(scorer: CausalScorer, prompts: Sequence[str], answers: Sequence[str],
                    passages: Optional[Sequence[Optional[Passage]]] = None) -> list[tuple[list[int], int]]:
    """Per example ``(window, n)``: ``doc ∘ [ctx] ∘ prompt ∘ answer ∘ EOS`` with the answer and EOS as the last ``n``
    tokens — the window :func:`~rag.models.ralm.generate.ralm_generate` decodes the answer in (the document cut to
    ``scorer.doc_max_length`` tokens, the prompt cut from the left when the window would exceed ``scorer.max_length``).
    A passage of None (or no `passages`) gives the prompt alone. The answer is read with a leading space."""
    eos = scorer.tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the reader's tokenizer has no EOS token: set tokenizer.eos_token and save it again")
    passages = list(passages) if passages is not None else [None] * len(prompts)
    if not (len(prompts) == len(answers) == len(passages)):
        raise ConfigError(f"{len(prompts)} prompts, {len(answers)} answers and {len(passages)} passages: give one of "
                          f"each per example")
    docs = scorer.doc_tokens([p for p in passages if p is not None])
    out, d = [], 0
    for prompt, answer, passage in zip(prompts, answers, passages):
        doc = []
        if passage is not None:
            doc, d = docs[d], d + 1
        stream = scorer.stream(prompt)
        target = list(scorer.tokenizer(" " + answer.strip(), add_special_tokens=False)["input_ids"]) + [int(eos)]
        out.append((window_ids(stream + target, len(stream), len(stream) + len(target), doc, scorer.max_length), len(target)))
    return out


def first_line(text: str) -> str:
    """The answer in a generated continuation: its first non-empty line (a reader may go on with a next "Question:")."""
    return text.strip().split("\n")[0].strip()


def prompt_windows(scorer: CausalScorer, prompts: Sequence[str], passages: Optional[Sequence[Optional[Passage]]],
                   max_new_tokens: int) -> list[list[int]]:
    """Per prompt ``doc ∘ [ctx] ∘ prompt``, the prompt cut from the left so that `max_new_tokens` more fit the window: what
    :class:`~rag.pipeline.readers.RalmReader` decodes an answer from when the stride covers the answer (one retrieval)."""
    passages = list(passages) if passages is not None else [None] * len(prompts)
    docs = iter(scorer.doc_tokens([p for p in passages if p is not None]))
    out = []
    for prompt, passage in zip(prompts, passages, strict=True):
        doc, stream = (next(docs) if passage is not None else []), scorer.stream(prompt)
        out.append(doc + stream[window_start(len(stream), len(stream) + max_new_tokens, len(doc), scorer.max_length):])
    return out


def answer_nll(scorer: CausalScorer, windows: Sequence[tuple[list[int], int]]) -> torch.Tensor:
    """``(B,)`` summed negative log-likelihood of each window's last ``n`` tokens, with gradients into the LM: one pass of
    the scoring In-Context RALM evaluates with (:meth:`CausalScorer.positions_logprobs`)."""
    for r, (w, n) in enumerate(windows):
        if not 1 <= n < len(w):
            raise ConfigError(f"example {r}: {n} answer tokens in a window of {len(w)}; the answer needs at least one "
                              f"token before it")
    lp, rows = scorer.positions_logprobs([w for w, _ in windows], [range(len(w) - n, len(w)) for w, n in windows])
    return -torch.zeros(len(windows), dtype=lp.dtype, device=lp.device).index_add(0, rows, lp)


class CausalReaderModule(pl.LightningModule):
    """A decoder-only reader (In-Context RALM / REPLUG / RetRobust) fine-tuned on QA pairs, read after their passage.

    Args:
        lm: the causal LM to fine-tune: a directory, a demo alias (``smollm2``), or ``tiny:gpt2`` (random, tokenizer
            trained on the knowledge base's passages; no hub).
        knowledge_base: knowledge-base directory, or ``demo`` (the bundled Elements KB): validation retrieves the top-1
            passage from it (and ``tiny:gpt2`` trains its tokenizer on it).
        retrieval: validation retrieval, ``dense`` | ``bm25`` (None: BM25 when the knowledge base has it).
        prompt: the prompt template, with ``{question}``; generate with the same prompt.
        doc_max_length: passage tokens read (as ``RalmConfig.doc_max_length``).
        max_length: the window in tokens (None: min(the LM's positions, 1024)).
        optimizer: AdamW over every LM weight and its schedule (:class:`~rag.training.settings.Optimizer`; default
            linear warm-up over 5% of the steps, then linear decay).
        selfask: Self-Ask chains added to every step: ``demo`` (the bundled two-hop Elements decompositions, training
            split) or a JSONL file of ``{"question", "answers", "follow_ups": [{"question", "answer"}]}``.
        selfask_batch: chain examples per step.
        max_new_tokens: answer tokens generated in validation and test.
        export_dir: where the trained LM and tokenizer are written at the end of ``fit``.
        seed: seed of the Self-Ask example draws.
    """

    def __init__(self, lm: str = "tiny:gpt2", knowledge_base: str = "demo", retrieval: Optional[str] = "dense",
                 prompt: str = DEFAULT_PROMPT, doc_max_length: int = 128, max_length: Optional[int] = None,
                 optimizer: Optimizer = _DEFAULT_OPTIMIZER,
                 selfask: Optional[str] = None, selfask_batch: int = 4, max_new_tokens: int = 16,
                 export_dir: Optional[str] = None, seed: int = 0):
        super().__init__()
        if "{question}" not in prompt:
            raise ConfigError(f"model.prompt={prompt!r} must contain {{question}} (e.g. {DEFAULT_PROMPT!r})")
        for name, v in (("doc_max_length", doc_max_length), ("selfask_batch", selfask_batch), ("max_new_tokens", max_new_tokens)):
            check_positive_int(v, f"model.{name}", error=ConfigError)
        optimizer = settings_dict(optimizer, Optimizer, "optimizer")  # a plain dict in the hyperparameters
        self.optimizer_settings = Optimizer(**optimizer)
        check_number(self.optimizer_settings.lr, "model.optimizer.lr", above=0, error=ConfigError)
        if retrieval not in (None, "dense", "bm25"):
            raise ConfigError(f"model.retrieval={retrieval!r}: choose dense or bm25 (or null: BM25 when the "
                              f"knowledge base has it)")
        self.save_hyperparameters()
        self.lm = None  # built in configure_model()
        self.tokenizer = None
        self.generator = None
        self.scorer: Optional[CausalScorer] = None
        self._kb = None
        self._ralm_reader = None
        self._chains: list[tuple[str, str]] = []
        self._rng = random.Random(seed)
        self.metrics = torch.nn.ModuleDict({f"{stage}_{m}{s}": cls() for stage in ("val", "test")
                                            for m, cls in (("em", ExactMatch), ("f1", TokenF1))
                                            for s in ("", "_no_retrieval")})

    # ------------------------------------------------------------------ construction
    def _knowledge_base(self):
        if self._kb is None:
            self._kb = open_knowledge_base(self.hparams.knowledge_base)
        return self._kb

    def configure_model(self) -> None:
        if self.lm is not None:
            return

        h = self.hparams
        path = h.lm
        if path == "tiny:gpt2":
            path = ensure_tiny_gpt2([p.text for p in self._knowledge_base().all_passages()])
        lm, self.tokenizer, _ = load_generator(path, kind="causal")
        self.lm = lm
        self.generator = as_generator(lm, self.tokenizer)  # the causal Generator In-Context RALM and RAG read with
        self.scorer = CausalScorer(self.generator, max_length=h.max_length, doc_max_length=h.doc_max_length)
        self.lm.train(self.training)  # CausalScorer puts its model in eval mode
        if h.selfask is not None:
            self._chains = self._load_chains(h.selfask)

    @staticmethod
    def _load_chains(spec: str) -> list[tuple[str, str]]:
        if spec == "demo":
            records = load_multihop("train")
        else:
            path = Path(spec)
            if not path.is_file():
                raise ConfigError(f"model.selfask={spec!r}: no such file; give a JSONL of decomposed questions or 'demo'")
            records = []
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    r = parse_json(line, f"{path}:{n}", fix="fix the line", error=ConfigError)
                    try:
                        if not (isinstance(r["question"], str) and r["answers"] and isinstance(r["follow_ups"], list)
                                and all(isinstance(s["question"], str) and isinstance(s["answer"], str)
                                        for s in r["follow_ups"])):
                            raise ValueError
                    except (ValueError, KeyError, TypeError, IndexError):
                        raise ConfigError(f"{path}:{n}: expected {{\"question\": str, \"answers\": [str, ...], \"follow_ups\": "
                                          f"[{{\"question\": str, \"answer\": str}}, ...]}}") from None
                    records.append(r)
        chains = chain_training_examples(records)
        if not chains:
            raise ConfigError(f"model.selfask={spec!r} holds no decomposed questions")
        return chains

    def _require(self) -> CausalScorer:
        if self.scorer is None:
            self.configure_model()
        return self.scorer

    def prompts(self, questions: Sequence[str]) -> list[str]:
        """The prompt of each question (``model.prompt``)."""
        return [self.hparams.prompt.format(question=q) for q in questions]

    # ------------------------------------------------------------------ steps
    def loss(self, prompts: Sequence[str], answers: Sequence[str],
             passages: Optional[Sequence[Optional[Passage]]] = None) -> torch.Tensor:
        """Mean NLL per answer token (answer + EOS) of `answers` read after `passages` (None: no passage) and `prompts`."""
        scorer = self._require()
        windows = reading_windows(scorer, prompts, answers, passages)
        return answer_nll(scorer, windows).sum() / sum(n for _, n in windows)

    @without_cudnn_attention
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self._require()
        prompts, answers = self.prompts(batch["questions"]), list(batch["targets"])
        passages = batch_contexts(batch) or [None] * len(prompts)  # RetRobust context mixing, else no passage
        if self._chains:  # Self-Ask step writing: the chain so far is the prompt, the next line the answer
            for chain, line in self._rng.sample(self._chains, min(self.hparams.selfask_batch, len(self._chains))):
                prompts.append(chain.rstrip("\n"))
                answers.append(line)
                passages.append(None)
        loss = self.loss(prompts, answers, passages)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["questions"]))
        return loss

    @torch.no_grad()
    def answer(self, questions: Sequence[str], passages: Optional[Sequence[Optional[Passage]]] = None, *,
               raw_prompts: bool = False, max_new_tokens: Optional[int] = None) -> list[str]:
        """Greedy answers (the first generated line) of `questions` (formatted with ``model.prompt`` unless `raw_prompts`),
        each read after its given passage (None: alone): the reader under chosen contexts, e.g. RetRobust's
        low-ranked or random ones. The same tokens as :meth:`RalmReader.generate <rag.pipeline.readers.RalmReader.generate>`
        gives when it retrieved that passage."""
        scorer = self._require()
        new = self.hparams.max_new_tokens if max_new_tokens is None else max_new_tokens
        windows = prompt_windows(scorer, list(questions) if raw_prompts else self.prompts(questions), passages, new)
        was_training = self.lm.training
        self.lm.eval()
        width = max(map(len, windows))
        ids = torch.full((len(windows), width), scorer.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, w in enumerate(windows):  # left-padded: every row's next token comes at the same column
            ids[r, width - len(w):], mask[r, width - len(w):] = torch.as_tensor(w), 1
        out = self.lm.generate(input_ids=ids.to(scorer.device), attention_mask=mask.to(scorer.device), max_new_tokens=new,
                               do_sample=False, num_beams=1, pad_token_id=scorer.pad_id, eos_token_id=self.tokenizer.eos_token_id)
        self.lm.train(was_training)
        texts = self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        return [first_line(t) for t in texts]

    def _reading_config(self) -> RalmConfig:
        """How validation reads, and how the export is read: one retrieval per answer (stride = max_new_tokens)."""
        h = self.hparams
        return RalmConfig(stride=h.max_new_tokens, max_length=h.max_length, doc_max_length=h.doc_max_length)

    def _reader(self):
        """The :class:`~rag.pipeline.readers.RalmReader` over this module's LM (built once; it reads the weights being
        trained)."""
        if self._ralm_reader is None:
            h = self.hparams
            self._ralm_reader = RalmReader(self.generator, None, self._knowledge_base(), self._reading_config(),
                                           retrieval=h.retrieval)
        return self._ralm_reader

    def _eval_step(self, batch: dict, stage: str) -> None:
        self._require()
        questions, golds = batch["questions"], batch["answers"]
        was_training = self.lm.training
        with torch.no_grad():
            self.log(f"{stage}/loss", self.loss(self.prompts(questions), batch["targets"]), batch_size=len(questions))
            with_r, without = self._reader().generate_with_and_without_retrieval(
                self.prompts(questions), max_new_tokens=self.hparams.max_new_tokens)
        self.lm.train(was_training)
        for suffix, answers in (("", with_r), ("_no_retrieval", without)):
            preds = [first_line(a.text) for a in answers]
            self.metrics[f"{stage}_em{suffix}"].update(preds, golds)
            self.metrics[f"{stage}_f1{suffix}"].update(preds, golds)

    @without_cudnn_attention
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    @without_cudnn_attention
    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _log_eval(self, stage: str) -> None:
        for name, metric in self.metrics.items():
            if name.startswith(stage + "_") and int(metric.count) > 0:
                self.log(f"{stage}/{name[len(stage) + 1:]}", metric.compute(), prog_bar=name == f"{stage}_em")
                metric.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    # ------------------------------------------------------------------ optimisation and export
    def configure_optimizers(self) -> dict:
        self._require()
        return self.optimizer_settings.build(self, [p for p in self.lm.parameters() if p.requires_grad])

    def on_train_end(self) -> None:
        if self.hparams.export_dir and self.trainer.is_global_zero:
            self.export(self.hparams.export_dir)

    def export(self, directory: str | os.PathLike, *, overwrite: bool = True) -> Path:
        """Write the trained reader as a reader export (:func:`rag.pipeline.exports.export_reader`: the LM, its
        tokenizer and the In-Context RALM settings it was validated with), atomically; with `overwrite` only a
        directory that holds a saved model (``config.json``) is replaced."""
        out = export_causal_reader(self._require().generator, self._reading_config(), self.hparams.retrieval, directory,
                                   overwrite=overwrite)
        logger.info("trained reader written to %s", directory)
        return out
