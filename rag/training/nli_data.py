"""NLI training data: question-answer statements, QA-derived pairs over the Elements corpus, and the NLI DataModule.

Sources a split may name (one string, or a list whose pairs are concatenated):

* ``snli:train`` / ``snli:test``: the SNLI pairs of :mod:`rag.training.snli` (fetched into the cache on first use);
* ``elements:train`` / ``elements:dev`` / ``elements:test``: pairs built from the bundled Elements QA split
  (:func:`elements_nli_pairs`): the element's own passage entails the question-answer statement, a random other
  passage of the same split's elements is neutral to it, and the own passage with another element's answer
  contradicts it;
* a path to an SNLI-format ``.jsonl`` file (``sentence1``, ``sentence2``, ``gold_label``).
"""

from __future__ import annotations

import random
from typing import Optional, Sequence, Union

import pytorch_lightning as pl
from torch.utils.data import DataLoader

from rag.demo import load_demo_corpus, load_demo_qa
from rag.retrobust.nli import nli_premise, qa_statement
from rag.training.snli import LABELS, NLIPair, fetch_snli, load_snli, parse_snli_lines
from rag.utils.errors import ConfigError

__all__ = ["elements_nli_pairs", "read_nli_source", "NLIDataModule"]

ENTAILMENT, NEUTRAL, CONTRADICTION = (LABELS.index(n) for n in ("entailment", "neutral", "contradiction"))

def elements_nli_pairs(split: str, *, kinds: Sequence[str] = ("entailment", "neutral", "contradiction"),
                       seed: int = 0, style: str = "statement") -> list[NLIPair]:
    """NLI pairs from the Elements QA `split` (train / dev / test), premises drawn from that split's elements only.

    Per question (answer `a`, element `e`): ``entailment`` = (passage of `e`, statement with `a`); ``neutral`` =
    (passage of a random other element of the split, statement with `a`); ``contradiction`` = (passage of `e`,
    statement with the answer of a random same-type question about another element). `style`: see
    :func:`qa_statement`. Seeded.
    """
    unknown = set(kinds) - set(LABELS)
    if unknown:
        raise ConfigError(f"elements_nli_pairs kinds {sorted(unknown)} are not labels; choose from {', '.join(LABELS)}")
    rng = random.Random(seed)
    passages = {p.title: nli_premise(p.title, p.text) for p in load_demo_corpus()}
    rows = load_demo_qa(split)
    elements = sorted({r["element"] for r in rows})
    by_type: dict[str, list[dict]] = {}
    for r in rows:
        by_type.setdefault(r["type"], []).append(r)
    pairs = []
    for r in rows:
        own = passages[r["element"]]
        statement = qa_statement(r["question"], r["answers"][0], r["type"], style=style)
        if "entailment" in kinds:
            pairs.append(NLIPair(own, statement, ENTAILMENT))
        if "neutral" in kinds:
            other = rng.choice([e for e in elements if e != r["element"]])
            pairs.append(NLIPair(passages[other], statement, NEUTRAL))
        if "contradiction" in kinds:
            wrong = [o["answers"][0] for o in by_type[r["type"]] if o["element"] != r["element"]
                     and o["answers"][0] != r["answers"][0]]
            if wrong:
                pairs.append(NLIPair(own, qa_statement(r["question"], rng.choice(wrong), r["type"], style=style), CONTRADICTION))
    return pairs


def read_nli_source(source: str, *, seed: int = 0) -> list[NLIPair]:
    """The pairs a source string names (see the module docstring)."""
    if source.startswith("snli:"):
        fetch_snli()
        return load_snli(source.split(":", 1)[1])
    if source.startswith("elements:"):
        split = source.split(":", 1)[1]
        if split not in ("train", "dev", "test"):
            raise ConfigError(f"NLI source {source!r}: choose elements:train, elements:dev or elements:test")
        return elements_nli_pairs(split, seed=seed)
    if source.endswith(".jsonl"):
        try:
            with open(source, encoding="utf-8") as f:
                return parse_snli_lines(f, source)[0]
        except FileNotFoundError:
            raise ConfigError(f"NLI source {source}: no such file") from None
    raise ConfigError(f"NLI source {source!r}: use snli:train, snli:test, elements:SPLIT or a path to an SNLI-format .jsonl file")


Sources = Union[str, list[str], None]


def _collate(batch: list[NLIPair]) -> dict:
    import torch

    return {"premises": [p.premise for p in batch], "hypotheses": [p.hypothesis for p in batch],
            "labels": torch.tensor([p.label for p in batch], dtype=torch.long)}


class NLIDataModule(pl.LightningDataModule):
    """Premise / hypothesis / label batches (``{"premises": [...], "hypotheses": [...], "labels": (B,)}``).

    `val_from_train` pairs are held out of `train` (seeded) for validation when `val` is None. `extra_train` (e.g.
    ``elements:train``, the QA-derived pairs) is added to the training pairs `extra_train_repeat` times, so a short
    run over a large `train` still sees it. `max_train_pairs` / `max_eval_pairs` cap the splits (seeded sample).
    """

    def __init__(self, train: Sources = "snli:train", val: Sources = None, test: Sources = "snli:test",
                 val_from_train: int = 1000, extra_train: Sources = None, extra_train_repeat: int = 1,
                 max_train_pairs: Optional[int] = None, max_eval_pairs: Optional[int] = None,
                 batch_size: int = 32, eval_batch_size: int = 128, num_workers: int = 0, seed: int = 0):
        super().__init__()
        if extra_train_repeat < 1:
            raise ConfigError(f"data.extra_train_repeat must be >= 1, got {extra_train_repeat}")
        if batch_size < 1 or eval_batch_size < 1:
            raise ConfigError("data.batch_size and data.eval_batch_size must be >= 1")
        self.save_hyperparameters()
        self.splits: dict[str, list[NLIPair]] = {}

    def _read(self, sources: Sources) -> list[NLIPair]:
        if sources is None:
            return []
        return [p for s in ([sources] if isinstance(sources, str) else sources)
                for p in read_nli_source(s, seed=self.hparams.seed)]

    def setup(self, stage: Optional[str] = None) -> None:
        if self.splits:
            return
        h = self.hparams
        rng = random.Random(h.seed)
        train = self._read(h.train)
        val = self._read(h.val)
        if h.val is None and h.val_from_train and train:
            order = list(range(len(train)))
            rng.shuffle(order)
            held = set(order[:h.val_from_train])
            val = [train[i] for i in sorted(held)]
            train = [p for i, p in enumerate(train) if i not in held]
        if h.max_train_pairs is not None and len(train) > h.max_train_pairs:
            train = rng.sample(train, h.max_train_pairs)
        train = train + self._read(h.extra_train) * h.extra_train_repeat
        test = self._read(h.test)
        if h.max_eval_pairs is not None:
            val, test = (rng.sample(s, h.max_eval_pairs) if len(s) > h.max_eval_pairs else s for s in (val, test))
        self.splits = {"train": train, "val": val, "test": test}

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        pairs = self.splits.get(split)
        if not pairs:
            raise ConfigError(f"the NLI data module has no {split} pairs; set data.{split} in the config")
        size = self.hparams.batch_size if split == "train" else self.hparams.eval_batch_size
        return DataLoader(pairs, batch_size=size, shuffle=shuffle, collate_fn=_collate, num_workers=self.hparams.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)
