"""The Python generation API: questions in, answers with provenance out.

    import rag
    pipe = rag.load("demo")                      # or a checkpoint directory
    [answer] = pipe.generate(["what is the atomic number of argon?"], num_beams=4)
    answer.text, answer.kb_version, answer.passages[0].posterior
    [hits] = pipe.retrieve(["who discovered oxygen?"], k=5)
    hits.kb_version, hits.passages[0].title, hits.passages[0].prior

Each answer carries the passages it was generated from with their prior p(z|x) and
posterior p(z|x,y), the version of the knowledge base that answered, and for
RAG-Token the per-token document posterior (the paper's Figure 2), which
:func:`plot_token_posterior` draws as a heatmap.

A causal LM (a directory, or the demo LM ``"smollm2"``) with a knowledge base reads with
In-Context RALM (Ram et al. 2023) through the same API::

    pipe = rag.load("smollm2", knowledge_base="kb/")
    [a] = pipe.generate(["The capital of France is"], stride=4, query_length=32, retrieval="bm25")
    a.text, a.segments[0].title, a.segments[0].start, a.segments[0].end   # which document for which tokens

or with a REPLUG ensemble (Shi et al. 2023): K documents read separately, their next-token distributions mixed::

    [a] = pipe.generate(["The capital of France is"], ensemble=4, retrieval_temperature=1.0)
    [(p.title, p.prior) for p in a.passages]                                 # the K documents and their weights λ

The pipeline holds a :class:`Reader`: :class:`RagReader` (a seq2seq :class:`~rag.models.rag.model.RagModel`)
or :class:`RalmReader` (a frozen causal LM, re-retrieving every ``stride`` generated tokens).
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Sequence, Union

import torch

from rag.utils.errors import ConfigError, OutputExistsError, RagError
from rag.utils.io import process_umask

if TYPE_CHECKING:  # pragma: no cover
    from rag.knowledge.knowledge_base import KnowledgeBase
from rag.demo.model import demo_checkpoint_dir, ensure_demo_kb_for_model
from rag.generation.answers import Answer, PassageProvenance, Retrieval, check_k, retrievals  # noqa: F401  (public names)
from rag.generation.options import GenerationOptions, option_specs
from rag.generators.load import is_causal_lm_checkpoint, is_seq2seq_checkpoint
from rag.knowledge.rerank import rerank_stage
from rag.models.rag.checkpoint import is_hf_rag_checkpoint, is_lightning_checkpoint
from rag.models.rag.hf_compat import load_hf_rag
from rag.models.rag.model import RagModel
from rag.pipeline.exports import is_reader_export, load_reader
from rag.pipeline.readers import READER_OPTIONS, READS, RagReader, RalmReader, Reader  # noqa: F401  (public names)
from rag.pipeline.windows import warn_cut_passages
from rag.retrobust.backoff import generate_with_backoff, resolve_nli
from rag.retrobust.nli import NLIScorer, validate_threshold
from rag.utils.devices import without_cudnn_attention

DEMO_NAMES = {"demo": None, "demo-causal": "demo_causal", "demo-seq2seq": "demo"}
"""Names of the bundled demo models: ``demo`` is the default (rag.demo.model.DEFAULT_DEMO), the others name one."""


class RagPipeline:
    """Questions (or prompts) in, answers with provenance out, through one :class:`Reader`.

    ``RagPipeline(rag_model)`` wraps a :class:`~rag.models.rag.model.RagModel` in a :class:`RagReader`;
    ``RagPipeline(reader)`` takes any :class:`Reader` (:class:`RalmReader` for a causal LM). Thread-safe with respect
    to knowledge-base swaps: every answer (or retrieval) of a call comes from one version, named in ``kb_version``.
    """

    def __init__(self, reader: Union[Reader, "RagModel"]):
        self.reader = reader if isinstance(reader, Reader) else RagReader(reader)
        self._nli_cache = None  # (name, NLIScorer) of the last NLI model loaded by name

    @property
    def method(self) -> str:
        """The reader's method: ``"rag"`` (RAG-Sequence / RAG-Token, REPLUG's ensemble) or ``"ralm"`` (In-Context RALM,
        REPLUG over a causal LM)."""
        return self.reader.method

    @property
    def generator_kind(self) -> str:
        """The reader's generator family: ``"seq2seq"`` or ``"causal"``."""
        return self.reader.generator_kind

    @property
    def model(self):
        """The reader's model (a RagModel, or the causal LM)."""
        return self.reader.model

    @property
    def retriever(self):
        """What a :class:`~rag.knowledge.hotswap.KnowledgeBaseSlot` swaps."""
        return self.reader.retriever

    @property
    def knowledge_base(self) -> "KnowledgeBase":
        return self.reader.retriever.knowledge_base

    @property
    def kb_version(self) -> str:
        return self.reader.kb_version

    def _check_options(self, options: dict) -> None:
        """Validate the schema's options (:class:`~rag.generation.options.GenerationOptions`) and refuse those of the
        other method, naming the flag."""
        specs = option_specs()
        GenerationOptions(**{n: v for n, v in options.items() if n in specs and v is not None})
        for method, names in READER_OPTIONS.items():
            if method == self.method:
                continue
            for name, flag in names.items():
                if options.get(name) is not None:
                    raise ConfigError(f"{name}= ({flag}) applies to {READS[method]}, but this pipeline reads with "
                                      f"{READS[self.method]}; drop {flag}, or load {READS[method].split(' (')[0]}")

    @without_cudnn_attention
    def retrieve(self, questions: Sequence[str], k: int = 5, **options) -> list[Retrieval]:
        """Top-k passages per question with scores and priors (no generation), one :class:`Retrieval` each, all from one
        knowledge-base version. `options`: ``retrieval="bm25"|"dense"`` for a causal reader."""
        self._check_options(options)
        return self.reader.retrieve(questions, k=k, **{n: v for n, v in options.items() if v is not None})

    @without_cudnn_attention
    def generate(self, questions: Sequence[str], *, nli=None, nli_threshold: float = 0.5, retrieval=None,
                 **options) -> list[Answer]:
        """Answer questions (seq2seq: :meth:`RagReader.generate`) or continue prompts (causal:
        :meth:`RalmReader.generate`); B * ``num_return_sequences`` answers, best first per input.

        ``retrieval=False``: nothing is retrieved; the generator answers the bare questions (the closed-book baseline of
        Lewis et al. 2020, Table 1), each answer with no passages and ``answered_with="no_retrieval"``. A causal reader
        also takes ``retrieval="bm25"|"dense"`` (which retriever to use).

        ``nli``: the RetRobust back-off (Yoran et al. 2024, §2.1; :mod:`rag.retrobust.backoff`): an
        :class:`~rag.retrobust.nli.NLIScorer`, an NLI model directory / hub id (loaded once and kept by this pipeline), or
        True for the default model (``rag nli prepare``). The reader then generates with and without retrieval in one
        batch and keeps each retrieval answer only if P(entailment | evidence, question + answer) >= ``nli_threshold``
        (in [0, 1]); each answer records ``nli_entailment`` and ``answered_with``.
        """
        if retrieval is False:
            if nli is not None and nli is not False:
                raise ConfigError("retrieval=False (--no-retrieval) answers without passages, and the NLI back-off "
                                  "(--nli) chooses "
                                  "between answers with and without them: drop one")
            self._check_options(options)
            return self.reader.generate_without_retrieval(questions, **options)
        if retrieval is not None and retrieval is not True:
            options["retrieval"] = retrieval
        self._check_options(options)
        nli_threshold = validate_threshold(nli_threshold)
        if nli is None or nli is False:
            return self.reader.generate(questions, **options)

        return generate_with_backoff(self.reader, questions, self._nli_scorer(nli), nli_threshold, **options)

    def _nli_scorer(self, nli):
        """`nli` as a scorer; a model named by path (or True) is loaded once per pipeline."""
        if isinstance(nli, NLIScorer):
            return nli
        key = True if nli is True else os.fspath(nli) if isinstance(nli, (str, os.PathLike)) else None
        if key is not None and self._nli_cache is not None and self._nli_cache[0] == key:
            return self._nli_cache[1]
        scorer = resolve_nli(nli)
        self._nli_cache = (key, scorer)
        return scorer


def plot_token_posterior(answer: Answer, path: str | os.PathLike, *, max_title: int = 40) -> Path:
    """Draw a RAG-Token answer's per-token document posterior (paper Fig. 2) as a heatmap PNG at `path`.

    Never replaces a file: an existing `path` (a file, a link, anything) is an :class:`OutputExistsError`, and the PNG is
    linked into place only if nothing appeared there meanwhile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not answer.token_doc_posterior or not answer.tokens:
        raise RagError("this answer has no per-token document posterior; generate with marginalization='token'")
    import numpy as np

    grid = np.asarray(answer.token_doc_posterior).T  # (K, T)
    labels = [p.title[:max_title] or p.id for p in answer.passages]
    tokens = [t.replace("Ġ", " ").replace("▁", " ") for t in answer.tokens]
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * len(tokens) + 2), max(2, 0.45 * len(labels) + 1.2)))
    im = ax.imshow(grid, aspect="auto", cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(tokens)), tokens, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), [f"{i + 1}. {t}" for i, t in enumerate(labels)])
    ax.set_title(f"p(z | x, y_t): {answer.question[:60]}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    path = Path(path)
    if path.exists() or path.is_symlink():
        plt.close(fig)
        raise OutputExistsError(f"{path} exists; a heatmap never replaces a file — choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.chmod(tmp, 0o666 & ~process_umask())
        try:
            os.link(tmp, path)  # fails, replacing nothing, if path appeared meanwhile
        except FileExistsError:
            raise OutputExistsError(f"{path} exists; a heatmap never replaces a file — choose another path") from None
    finally:
        plt.close(fig)
        os.unlink(tmp)
    return path


def _refuse_lightning_checkpoint(path, knowledge_base, device, overrides) -> RagPipeline:
    raise ConfigError(f"{path}: is a Lightning checkpoint of `rag fit`, not a model directory; export it first: "
                      f"rag export {path} DIR, then --model DIR (rag.load(DIR))")


def _load_export(path, knowledge_base, device, overrides) -> RagPipeline:
    return RagPipeline(load_reader(path, knowledge_base, device=device, **overrides))


def _is_hf_rag(path) -> bool:
    return Path(path).is_dir() and not (Path(path) / "rag_config.json").is_file() and is_hf_rag_checkpoint(path)


def _load_hf_rag(path, knowledge_base, device, overrides) -> RagPipeline:
    if knowledge_base is None:
        raise ConfigError(f"{path}: a transformers RAG checkpoint carries no knowledge base; pass knowledge_base=<directory>")
    model = load_hf_rag(path, knowledge_base, **overrides)
    return RagPipeline(model.to(device) if device else model)


def _load_causal_lm(path, knowledge_base, device, overrides) -> RagPipeline:
    return RagPipeline(RalmReader.load(path, knowledge_base, device=device, **overrides))


def _refuse_seq2seq(path, knowledge_base, device, overrides) -> RagPipeline:
    raise ConfigError(f"{path}: is a seq2seq generator (such as BART or T5), not a RAG checkpoint; --model / rag.load take a "
                      "RagModel checkpoint, a transformers RAG checkpoint, or a causal LM (In-Context RALM). Build a RAG model "
                      "around it (`rag fit --model.generator DIR`, or RagModel.from_components) and save that")


def _is_missing_path(path) -> bool:
    name = os.fspath(path)
    return not Path(path).exists() and (os.sep in name or name.startswith("."))


def _refuse_missing(path, knowledge_base, device, overrides) -> RagPipeline:
    raise RagError(f"{os.fspath(path)}: no such checkpoint directory; check the path (or use 'demo' for the bundled model)")


def _load_rag_model(path, knowledge_base, device, overrides) -> RagPipeline:
    model = RagModel.from_pretrained(path, knowledge_base=knowledge_base, **overrides)
    return RagPipeline(model.to(device) if device is not None else model)


LOADERS = (
    (is_lightning_checkpoint, _refuse_lightning_checkpoint),
    (is_reader_export, _load_export),  # reader.json: RAG (seq2seq or causal), In-Context RALM, REPLUG
    (_is_hf_rag, _load_hf_rag),  # a transformers RAG checkpoint, imported with exact transformers behaviour
    (is_causal_lm_checkpoint, _load_causal_lm),  # a plain causal LM or demo LM name: In-Context RALM
    (is_seq2seq_checkpoint, _refuse_seq2seq),
    (_is_missing_path, _refuse_missing),
    (lambda path: True, _load_rag_model),  # a RagModel directory (before reader.json) or a hub id
)
"""``rag.load``'s (probe, loader) pairs, tried in order: the first probe that holds for the path loads it."""


def _reranking(load_pipeline):
    """`load` with ``rerank=K, reranker=DIR`` (``--rerank K --reranker DIR``): every retrieval of the pipeline's reader
    rescores its top K with that cross-encoder (:mod:`rag.knowledge.rerank`) and reads the best k."""
    @functools.wraps(load_pipeline)
    def load(path_or_name, knowledge_base=None, *, device=None, rerank=None, reranker=None, **config_overrides):
        stage = rerank_stage(rerank, reranker, device=device)  # refused before the model loads
        pipe = load_pipeline(path_or_name, knowledge_base, device=device, **config_overrides)
        if stage is not None:  # a RAG model's retrieval scorer, or a causal reader's knowledge-base retrievers
            holder = getattr(pipe.reader.model, "scoring", pipe.retriever)
            stage.candidates_for(getattr(getattr(holder, "settings", None), "n_docs", 1))  # K >= the passages read
            holder.use_rerank(stage)
        return pipe
    return load


@_reranking
def load(path_or_name: str | os.PathLike, knowledge_base: str | os.PathLike | KnowledgeBase | None = None, *,
         device: str | torch.device | None = None, **config_overrides) -> RagPipeline:
    """Load a model directory (any reader's export, :mod:`rag.pipeline.exports`), a causal LM with In-Context RALM, or
    a transformers RAG checkpoint as a :class:`RagPipeline` (:data:`LOADERS`).

    `path_or_name`: a model directory (``rag export``, :func:`~rag.pipeline.exports.export_reader`,
    ``RagModel.save_pretrained``), a transformers RAG checkpoint directory (imported with exact transformers behaviour),
    a hub id where a hub is reachable, or "demo" for the bundled demo model (its knowledge base is built on first use;
    "demo-causal" and "demo-seq2seq" name one of the two bundled models); or a causal LM directory (``save_pretrained``)
    or demo LM name (``"smollm2"``), read with :class:`RalmReader` over `knowledge_base` (required). `knowledge_base`
    overrides the knowledge base the checkpoint references. `config_overrides` replace
    :class:`~rag.models.rag.config.RagModelConfig` fields (e.g. ``n_docs=2``) of a RAG model, or are
    :class:`~rag.models.ralm.model.RalmConfig` fields and ``retrieval`` for a causal LM; unknown names raise ConfigError
    with the valid list. ``rerank=K, reranker=DIR`` adds a rerank stage (:func:`_reranking`).

    A RAG reader's window is measured against its knowledge base once here (:mod:`rag.pipeline.windows`): when some
    passages do not fit ``max_context_length``, one :class:`~rag.pipeline.windows.PassageWindowWarning` says how many
    and what to do.
    """
    name = str(path_or_name)
    if name in DEMO_NAMES:
        path_or_name = demo_checkpoint_dir(*([DEMO_NAMES[name]] if DEMO_NAMES[name] else []))
        if knowledge_base is None:
            knowledge_base = ensure_demo_kb_for_model()
    loader = next(loader for probe, loader in LOADERS if probe(path_or_name))
    pipe = loader(path_or_name, knowledge_base, device, config_overrides)
    if isinstance(pipe.reader, RagReader):
        warn_cut_passages(pipe.reader.model)
    return pipe
