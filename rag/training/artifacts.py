"""What a :class:`~rag.training.modules.RagModule` trains over, built outside the module: the knowledge base (the
bundled demo, or built from a corpus when the directory is missing), the generator (``tiny:*`` / ``warm:*`` ones built
and cached), the :class:`~rag.models.rag.model.RagModel` with its tokenizers and LoRA adapters, and the Ray actors
serving the search.

:class:`RagComponents` holds the typed names and options; :meth:`RagComponents.prepare` builds what is missing (Lightning
runs it once per node, in ``prepare_data``, before every rank's setup) and :meth:`RagComponents.build_model` opens
everything into a RagModel. :class:`SearchActors` owns the Ray actors of one knowledge base version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rag.demo.kb import KNOWLEDGE_BASE_NAMES, resolve_knowledge_base
from rag.generators.lora import LoraSettings, apply_lora
from rag.generators.tiny_generator import TinyGenerator, WarmStartGenerator, resolve_generator
from rag.knowledge.ray_pool import RayRetrievalPool
from rag.models.rag.config import RagModelConfig
from rag.models.rag.model import RagModel
from rag.training.ensure_kb import ensure_knowledge_base
from rag.training.settings import KnowledgeBaseBuild, RetrievalActors
from rag.utils.errors import ConfigError

__all__ = ["RagComponents", "SearchActors"]


@dataclass(frozen=True)
class RagComponents:
    """The components of a RAG run, by name, and how to build the ones that are missing.

    ``generator`` / ``question_encoder`` / ``document_encoder`` / ``knowledge_base`` are as RagModule's arguments of
    those names; ``build`` builds the knowledge base when its directory is missing; ``tiny`` / ``warm_start`` size a
    ``tiny:*`` / ``warm:*`` generator; ``lora`` puts adapters on a causal generator.
    """

    generator: str
    question_encoder: Optional[str]
    knowledge_base: str
    rag: RagModelConfig
    document_encoder: Optional[str] = None
    build: Optional[KnowledgeBaseBuild] = None
    tiny: TinyGenerator = field(default_factory=TinyGenerator)
    warm_start: WarmStartGenerator = field(default_factory=WarmStartGenerator)
    lora: Optional[LoraSettings] = None

    def prepare(self) -> tuple[str, str]:
        """Build what is missing (idempotent): the demo or ``build`` knowledge base, a ``tiny:*`` / ``warm:*`` generator.
        Returns ``(knowledge-base directory, generator name or directory)``."""
        kb = self.knowledge_base
        if kb in KNOWLEDGE_BASE_NAMES:  # "demo": the bundled Elements knowledge base (dense + BM25), built on first use
            kb = str(resolve_knowledge_base(kb).path)
        elif self.build is not None:
            enc = self.build.encoder or self.question_encoder
            if enc is None:
                raise ConfigError("model.build_knowledge_base needs model.build_knowledge_base.encoder or model.question_encoder")
            ensure_knowledge_base(kb, self.build.corpus, enc, index=self.build.index,
                                  query_encoder=self.question_encoder if self.build.encoder else None,
                                  bm25=self.rag.retrieval != "dense")
        return kb, resolve_generator(self.generator, self.tiny, kb, self.warm_start)

    def build_model(self, *, train_retrieval: bool) -> RagModel:
        """The RagModel over the prepared components (in eval mode, as ``from_pretrained`` leaves it). Without `train_retrieval`
        (no step retrieves: the closed-book baseline, or given contexts) the retrieval side is frozen, before DDP wraps the model
        (which would otherwise wait for gradients that never come). Raises a clear error for a knowledge base / query-encoder
        dimension mismatch."""
        kb, gen = self.prepare()
        model = RagModel.from_components(self.question_encoder, gen, kb, self.rag, document_encoder=self.document_encoder)
        if self.lora is not None:  # only the adapters train; the export holds them alone
            model.generator = apply_lora(model.generator, self.lora)
        if not train_retrieval:
            model.question_encoder.requires_grad_(False)
            for extra in (model.doc_encoder, getattr(model, "log_retrieval_temperature", None)):
                if extra is not None:
                    extra.requires_grad_(False)
        return model


class SearchActors:
    """``settings.count`` Ray actors serving one knowledge base's search (:class:`RayRetrievalPool`), or none."""

    def __init__(self, settings: RetrievalActors) -> None:
        self.settings = settings
        self.pool: Optional[RayRetrievalPool] = None

    def serve(self, kb) -> None:
        """Start actors over `kb` (after a swap: over the new version) and have `kb` search through them."""
        if not self.settings.count:
            return
        self.close()
        self.pool = RayRetrievalPool(kb.path, self.settings.count, address=self.settings.ray_address)
        kb.use_search_pool(self.pool)

    def stop(self, kb) -> None:
        """`kb` searches in this process again; the actors stop (the Ray cluster itself keeps running)."""
        if self.pool is not None and kb is not None:
            kb.use_search_pool(None)
        self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
