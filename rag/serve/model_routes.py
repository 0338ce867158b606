"""`rag serve`'s own model routes, behind the API key: ``GET /health``, ``POST /generate``, ``POST /retrieve``.

Both model routes run through the shared :class:`~rag.serve.requests.RequestRunner` (limits, queue, deadline, fair
turns); ``/generate`` answers every question from one knowledge-base version
(:func:`~rag.serve.requests.generate_one_version`).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from rag.serve.auth import api_key_check
from rag.serve.bodies import GenerateRequest, RetrieveRequest
from rag.serve.requests import generate_one_version, step_rows
from rag.serve.responses import SafeJSONResponse
from rag.serve.state import ServerState

__all__ = ["model_router", "retrieve_passages", "reader_description"]


def reader_description(pipeline) -> dict:
    """What ``/health`` says the server reads with: ``method`` (``rag-sequence`` / ``rag-token`` as the model's stored
    marginalization, ``in-context-ralm``, ``replug``), ``generator_kind`` (``seq2seq`` / ``causal``) and
    ``extractive`` (the stored setting of a RAG model); ``reader`` (the option family, kept for older clients)."""
    return pipeline.reader.description()


def retrieve_passages(pipeline, questions: list[str], k: int) -> dict:
    """Top-k passages with scores and priors, plus the one knowledge-base version they came from
    (:meth:`rag.pipeline.api.RagPipeline.retrieve`: one call reads the knowledge base once)."""
    hits = pipeline.retrieve(questions, k=k)
    versions = {h.kb_version for h in hits}
    if len(versions) != 1:  # cannot happen: one retrieval call reads one knowledge base
        raise RuntimeError(f"one retrieval call returned passages from several knowledge bases: {sorted(versions)}")
    return {"kb_version": hits[0].kb_version, "results": [[p.__dict__ for p in h.passages] for h in hits]}


def model_router(state: ServerState) -> APIRouter:
    """``/health``, ``/generate`` and ``/retrieve`` over `state`'s pipeline."""
    router = APIRouter(dependencies=[Depends(api_key_check(state))])
    pipeline, slot, runner = state.pipeline, state.slot, state.runner

    @router.get("/health")
    async def health() -> dict:
        kb = slot.current
        return {"status": "ok", "kb_version": kb.served_version, "kb_passages": len(kb), "swaps": slot.swap_count,
                "history": [h["version"] for h in slot.history], **reader_description(pipeline), "model": state.model_name,
                "nli": state.nli is not None, "admin": bool(state.admin_token), "requests": runner.counters.snapshot()}

    @router.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> SafeJSONResponse:
        kw = req.options()  # unset: the model's stored defaults
        runner.check_generation(kw, len(req.questions), step_rows(pipeline, kw))
        # closed-book answers read no passages: the server's default NLI back-off does not apply (asking for it: 400)
        kw.update(state.nli_options(False if req.closed_book and req.nli is None else req.nli, req.nli_threshold))
        answers = await runner.run(request.receive,
                                   lambda work: generate_one_version(pipeline, req.questions, kw, work, runner.counters))
        # All answers come from one knowledge-base version (see generate_one_version).
        return SafeJSONResponse({"kb_version": answers[0].kb_version if answers else slot.version,
                                 "answers": [a.to_dict() for a in answers]})

    @router.post("/retrieve")
    async def retrieve(req: RetrieveRequest, request: Request) -> SafeJSONResponse:
        runner.check_within("max_batch", len(req.questions), "len(questions)")
        runner.check_within("max_n_docs", req.k, "k")
        return SafeJSONResponse(await runner.run(request.receive, lambda work: retrieve_passages(pipeline, req.questions, req.k)))

    return router
