"""How a :class:`~rag.training.modules.RagModule` reads, chosen once when the module is built: :class:`Retrieving`
(every step retrieves ``n_docs`` passages and trains on the RAG marginal, Lewis et al. 2020 Eq. 1/2) or
:class:`ClosedBook` (the generator on the bare question, the paper's Table 1 baseline: nothing retrieved, the
retrieval side not trained). The module's steps call the mode; none of them tests which mode it is.

Decoding for validation, test and predict goes through :func:`generate_answers`, the pipeline's answer path
(:func:`rag.models.rag.generate.generate_for_questions`) with the run's ``model.decoding`` settings.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from rag.generation.detokenize import decode_answer
from rag.generation.options import GenerationConfig, resolve_generation
from rag.models.rag.config import RagModelConfig
from rag.models.rag.generate import generate_closed_book, generate_for_questions
from rag.utils.errors import ConfigError

__all__ = ["Retrieving", "ClosedBook", "generate_answers", "generation_config"]


def generation_config(model, *, num_beams: Optional[int] = None, max_new_tokens: Optional[int] = None,
                      length_penalty: Optional[float] = None) -> GenerationConfig:
    """The search settings of `model`'s answers: those given, else the generation options' defaults
    (:func:`~rag.generation.options.resolve_generation`); of the model's stored settings only its
    ``no_repeat_ngram_size`` applies (a run decodes with its own ``model.decoding``)."""
    stored = {k: v for k, v in (model.config.generation or {}).items() if k == "no_repeat_ngram_size"}
    given = {"num_beams": num_beams, "max_new_tokens": max_new_tokens,
             "length_penalty": None if length_penalty is None else float(length_penalty)}
    return resolve_generation(given, stored, trained=not model.config.hf_compat)


def _texts(model, sequences: torch.Tensor) -> list[str]:
    return [decode_answer(model.generator_tokenizer, row[1:]) for row in sequences.tolist()]  # after the start token


def generate_answers(model, questions: Sequence[str], *, num_beams: Optional[int] = None, max_new_tokens: Optional[int] = None,
                     sequence_decoding: Optional[str] = None, length_penalty: Optional[float] = None):
    """Answer strings for B questions, plus the :class:`Retrieved` passages used and the truncated-context count.

    Decodes through :func:`rag.models.rag.generate.generate_for_questions` (the pipeline's path too) with the model's
    marginalization (RAG-Token: greedy/beam over the marginal; RAG-Sequence: per-passage search + ``fast`` or
    ``thorough`` rescoring, §2.5). An option left None takes the generation options' default.
    """
    cfg = generation_config(model, num_beams=num_beams, max_new_tokens=max_new_tokens, length_penalty=length_penalty)
    found = generate_for_questions(model, questions, cfg, decoding=sequence_decoding)
    return _texts(model, found.output.sequences), found.inputs.retrieved, found.inputs.n_truncated


class Retrieving:
    """Every step retrieves: the loss is the RAG marginal NLL, answers are decoded over the retrieved passages."""

    retrieves = True

    def loss(self, model, questions: Sequence[str], targets: Sequence[str], contexts: Optional[Sequence] = None):
        """``(loss, RagOutput)``; with `contexts` (RetRobust context mixing: one given passage per question) the generator
        reads that passage alone and nothing is retrieved (``(loss, None)``)."""
        if contexts is not None:
            return model.generator_loss(list(questions), list(targets), list(contexts)), None
        out = model(list(questions), list(targets))
        return out.loss, out

    def answer(self, model, questions: Sequence[str], decoding: dict):
        """``(answers, Retrieved)`` under `decoding` (:meth:`rag.training.settings.Decoding.resolved`)."""
        texts, retrieved, _ = generate_answers(model, list(questions), **decoding)
        return texts, retrieved

    def learning_rates(self, lrs: dict) -> dict:
        return lrs

    def trained_groups(self, rag: RagModelConfig) -> frozenset:
        """The parameter groups a retrieving step trains."""
        groups = {"generator"}
        if not (rag.freeze_query_encoder or rag.retrieval == "bm25"):
            groups.add("query_encoder")
        if rag.train_doc_encoder:
            groups.add("doc_encoder")
        if rag.learn_retrieval_temperature:
            groups.add("retrieval_temperature")
        return frozenset(groups)


class ClosedBook:
    """The closed-book baseline: the generator is trained and evaluated on the questions alone
    (``RagModel.generator_loss`` without passages); nothing is retrieved and only the generator learns."""

    retrieves = False

    def loss(self, model, questions: Sequence[str], targets: Sequence[str], contexts: Optional[Sequence] = None):
        if contexts is not None:
            raise ConfigError("model.closed_book trains on the questions alone, but the data gives each question a passage "
                              "(data.context_mixing): drop one of them")
        return model.generator_loss(list(questions), list(targets)), None

    def answer(self, model, questions: Sequence[str], decoding: dict):
        """``(answers, None)``: the generator's answers to the bare questions."""
        cfg = generation_config(model, num_beams=decoding["num_beams"], max_new_tokens=decoding["max_new_tokens"],
                                length_penalty=decoding["length_penalty"])
        with torch.no_grad():
            out = generate_closed_book(model, list(questions), cfg)
        return _texts(model, out.sequences), None

    def learning_rates(self, lrs: dict) -> dict:
        return {"generator": lrs["generator"]}

    def trained_groups(self, rag: RagModelConfig) -> frozenset:
        return frozenset({"generator"})
