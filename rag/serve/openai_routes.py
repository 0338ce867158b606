"""OpenAI-compatible routes of `rag serve`: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Generation runs exactly as ``POST /generate`` does (retrieval + generation, the same limits, queue, deadline and fair
turns of :class:`~rag.serve.requests.RequestRunner`); the request's fields map onto the generation-options schema
(:mod:`rag.serve.openai_schema`). Every response carries the answers' provenance in one extra field, ``rag``, which
plain OpenAI clients ignore::

    "rag": {"kb_version": "kb-…", "choices": [{"index": 0, "passages": [{"id", "title", "text", "score", "prior",
             "posterior"}, …], "answered_with": …, "tokens": …, "token_doc_posterior": …, …}]}

(each choice's entry is the ``Answer`` of ``/generate``). ``stream: true`` answers with server-sent events in OpenAI's
chunk format: token by token for a causal reader (greedy or sampled, one answer, no NLI back-off), else each finished
answer in word-sized chunks; the last chunk of a choice carries its ``finish_reason`` and the stream's last chunk the
``rag`` field. A streaming client that disconnects stops its work at the next unit boundary and frees its slot.

For a causal reader, ``/v1/completions`` with ``max_tokens: 0, echo: true, logprobs: N`` scores the prompt instead: the
log-prob of every prompt token given the ones before it, with ``text_offset`` (what REPLUG's black-box scorer reads,
:class:`~rag.models.replug.lm_scorer.CompletionsLMScorer`). A text prompt is read after the LM's BOS (else EOS) token,
as rag's local scorers read it, so its first token has a log-prob too; a token-id prompt is read as given (its first
token's log-prob is null).

Errors are OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status (400 where
``/generate`` answers 422).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Callable, Optional, Sequence, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from rag.generation.search import GenerationConfig, config_token_id, unit_hook
from rag.models.ralm.generate import continuation_text
from rag.serve.auth import api_key_check
from rag.serve.openai_schema import ChatRequest, CompletionRequest, Plan, check_fields, plan_generation, question_of
from rag.serve.requests import UNIT_ROWS, RequestRefused, RequestRunner, RequestWork, generate_one_version, step_rows
from rag.serve.responses import SafeJSONResponse, json_safe
from rag.serve.scoring import prepare_prompt, score_prompt
from rag.serve.state import ServerState
from rag.utils.errors import RagError

logger = logging.getLogger(__name__)

__all__ = ["OpenAIRoutes", "openai_router", "openai_error", "ERROR_TYPES"]

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "invalid_request_error", 422: "invalid_request_error", 499: "client_disconnected",
               503: "service_unavailable_error", 504: "timeout_error"}


def openai_error(message: str, status: int, *, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None) -> SafeJSONResponse:
    """OpenAI's error object with `status` (validation errors, which ``/generate`` answers with 422, are 400 here)."""
    status = 400 if status == 422 else status
    body = {"error": {"message": message,
                      "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
                      "param": param, "code": code}}
    return SafeJSONResponse(body, status_code=status, headers=headers)


def _sse(obj) -> str:
    return "data: " + json.dumps(json_safe(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n\n"


def _pieces(text: str) -> list[str]:
    """A finished answer cut into word-sized stream chunks (each word with the spaces before it)."""
    return re.findall(r"\s*\S+|\s+$", text) or ([text] if text else [])


class _TokenText:
    """The text of the tokens a causal reader has generated so far, as it will continue the prompt; hands each new piece
    to `emit`. A text ending in U+FFFD may be a character whose UTF-8 bytes are split over tokens: it is held back until
    the next token completes it, at most 4 tokens (a character has at most 4 bytes; after that the bytes are invalid
    for good and are sent as they decode)."""

    HOLD = 4

    def __init__(self, tokenizer, prompt: str, emit: Callable[[str], None]):
        self.tok, self.emit, self.text_of = tokenizer, emit, continuation_text
        self.stream = [0] + list(tokenizer(prompt, add_special_tokens=False)["input_ids"])  # continuation_text skips [0]
        self.sent, self.count, self.held_since = "", 0, None

    def update(self, generated) -> None:
        if generated is None or generated.shape[0] != 1 or generated.shape[1] == self.count:
            return
        ids = generated[0].tolist()
        self.count = len(ids)
        text = self.text_of(self.tok, self.stream, ids)
        if text.endswith("\ufffd"):
            self.held_since = self.count if self.held_since is None else self.held_since
            if self.count - self.held_since < self.HOLD:
                return
        self.held_since = None
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self.emit(text[len(self.sent):])
            self.sent = text


class OpenAIRoutes:
    """The OpenAI-compatible routes over one pipeline, sharing `runner` (limits, queue, turns) with ``/generate``.

    `model_name`: the model id clients send (``GET /v1/models`` lists it; another id is 404). `nli_options(requested,
    threshold)`: the NLI back-off options of a request, as ``/generate`` resolves them.
    """

    def __init__(self, pipeline, runner: RequestRunner, *, model_name: str,
                 nli_options: Callable[[Optional[bool], Optional[float]], dict]):
        self.pipeline, self.runner, self.model_name, self.nli_options = pipeline, runner, model_name, nli_options
        self.created = int(time.time())

    # ------------------------------------------------------------------ helpers
    @property
    def tokenizer(self):
        return self.pipeline.reader.generator.tokenizer

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestRefused(f"model {name!r} is not served here; this server serves {self.model_name!r} (GET /v1/models)",
                                 404, param="model")

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rag",
                "rag": {"method": self.pipeline.method, "generator_kind": self.pipeline.generator_kind,
                        "kb_version": self.pipeline.kb_version}}

    def model(self, model_id: str) -> dict:
        self._check_model(model_id)
        return self.model_card()

    def _max_new_tokens(self, req, allow_zero: bool) -> Optional[int]:
        values = {name: getattr(req, name, None) for name in ("max_tokens", "max_completion_tokens")}
        given = {k: v for k, v in values.items() if v is not None}
        if len(set(given.values())) > 1:
            raise RequestRefused("max_tokens and max_completion_tokens differ; send one of them", 400, param="max_tokens")
        value = next(iter(given.values()), None)
        if value == 0 and not allow_zero:
            raise RequestRefused("max_tokens=0 generates nothing; ask for at least 1 token", 400, param="max_tokens")
        return value or None

    def _prepare(self, req, prompts: int, max_new_tokens: Optional[int]) -> tuple[Plan, dict]:
        check_fields(req)
        self._check_model(req.model)
        plan = plan_generation(req, max_new_tokens)
        self.runner.check_generation(plan.kw, prompts * plan.copies, step_rows(self.pipeline, plan.kw))
        self.runner.check_within("max_beams", req.n, "n")
        return plan, {**plan.kw, **self.nli_options(plan.nli, plan.nli_threshold)}

    @property
    def eos_id(self) -> Optional[int]:
        """The generator's end-of-sequence id as decoding uses it: its generation config, its config, its tokenizer."""
        eos = config_token_id(GenerationConfig(), self.pipeline.reader.generator.model, "eos_token_id", False)
        return self.tokenizer.eos_token_id if eos is None else eos

    def _finish_reason(self, answer) -> str:
        """"stop" when the answer ends with the end-of-sequence token, else "length" (cut at the token limit)."""
        tok, eos = self.tokenizer, self.eos_id
        if answer.token_ids:
            return "stop" if answer.token_ids[-1] == eos else "length"
        if answer.tokens:
            return "stop" if eos is not None and answer.tokens[-1] == tok.convert_ids_to_tokens(eos) else "length"
        return "stop"

    def _completion_tokens(self, answer) -> int:
        if answer.token_ids:
            return max(0, len(answer.token_ids) - 1)  # the decoder start token is not generated
        return len(answer.tokens or [])

    def _prompt_tokens(self, texts: Sequence[str]) -> int:
        return sum(len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"])

    @staticmethod
    def _provenance(answers) -> dict:
        """The ``rag`` extra field: the knowledge-base version and each choice's ``Answer.to_dict()`` (passages with
        prior and posterior, ``citations`` and the ``[n]``-marked ``cited_text`` included)."""
        return {"kb_version": answers[0].kb_version if answers else None,
                "choices": [{"index": i, **a.to_dict()} for i, a in enumerate(answers)]}

    def _usage(self, prompts: Sequence[str], answers) -> dict:
        p, c = self._prompt_tokens(prompts), sum(self._completion_tokens(a) for a in answers)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _work(self, questions: list[str], plan: Plan, kw: dict) -> Callable[[RequestWork], list]:
        questions = [q for q in questions for _ in range(plan.copies)]
        per_copy = None if plan.per_copy is None else plan.per_copy * (len(questions) // plan.copies)
        return lambda work: generate_one_version(self.pipeline, questions, kw, work, self.runner.counters, per_copy)

    # ------------------------------------------------------------------ chat
    async def chat(self, req: ChatRequest, request: Request):
        question = question_of(req)
        plan, kw = self._prepare(req, 1, self._max_new_tokens(req, allow_zero=False))
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": ident, "created": created, "model": self.model_name}
        if req.stream:
            def chunk(index: int, delta: dict, finish: Optional[str] = None) -> dict:
                return {**head, "object": "chat.completion.chunk",
                        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

            return await self._stream(request, [question], plan, kw, req,
                                      first=lambda i: chunk(i, {"role": "assistant", "content": ""}),
                                piece=lambda i, text: chunk(i, {"content": text}), last=lambda i, finish: chunk(i, {}, finish),
                                usage={**head, "object": "chat.completion.chunk", "choices": []})
        answers = await self.runner.run(request.receive, self._work([question], plan, kw))
        choices = [{"index": i, "message": {"role": "assistant", "content": a.text}, "logprobs": None,
                    "finish_reason": self._finish_reason(a)} for i, a in enumerate(answers)]
        return SafeJSONResponse({**head, "object": "chat.completion", "choices": choices,
                                 "usage": self._usage([question], answers), "rag": self._provenance(answers)})

    # ------------------------------------------------------------------ completions
    async def completions(self, req: CompletionRequest, request: Request):
        prompts = self._prompts(req.prompt)
        scoring = req.max_tokens == 0
        if scoring:
            return await self._score(req, request, prompts)
        if any(not isinstance(p, str) for p in prompts):
            raise RequestRefused("token-id prompts are only scored (max_tokens 0 with echo); send text to generate", 400,
                                 param="prompt")
        if req.logprobs is not None:
            raise RequestRefused("logprobs of generated tokens are not computed; use max_tokens 0 with echo to score a text, "
                                 "or drop logprobs", 400, param="logprobs")
        for i, p in enumerate(prompts):
            if not p.strip():
                raise RequestRefused(f"prompt {i} is empty; give it text", 400, param="prompt")
        plan, kw = self._prepare(req, len(prompts), self._max_new_tokens(req, allow_zero=False))
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": ident, "created": created, "model": self.model_name}
        if req.stream:
            if req.echo:
                raise RequestRefused("echo with stream is not supported; drop one of them", 400, param="echo")

            def chunk(index: int, text: str, finish: Optional[str] = None) -> dict:
                return {**head, "object": "text_completion",
                        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}

            return await self._stream(request, prompts, plan, kw, req, first=None, piece=chunk,
                                      last=lambda i, finish: chunk(i, "", finish),
                                usage={**head, "object": "text_completion", "choices": []})
        answers = await self.runner.run(request.receive, self._work(prompts, plan, kw))
        per_prompt = len(answers) // len(prompts)
        choices = [{"index": i, "text": (prompts[i // per_prompt] if req.echo else "") + a.text, "logprobs": None,
                    "finish_reason": self._finish_reason(a)} for i, a in enumerate(answers)]
        return SafeJSONResponse({**head, "object": "text_completion", "choices": choices,
                                 "usage": self._usage(prompts, answers), "rag": self._provenance(answers)})

    @staticmethod
    def _prompts(prompt) -> list[Union[str, list[int]]]:
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        if not prompt:
            raise RequestRefused("prompt is an empty list; give at least one prompt", 400, param="prompt")
        return list(prompt)

    async def _score(self, req: CompletionRequest, request: Request, prompts: list) -> SafeJSONResponse:
        check_fields(req)
        self._check_model(req.model)
        if not self.pipeline.reader.continues_prompts:
            raise RequestRefused("max_tokens=0 scores the prompt's tokens, which needs a causal LM; this server reads with a "
                                 "seq2seq RAG model: ask for at least 1 token", 400, param="max_tokens")
        if req.stream:
            raise RequestRefused("scoring (max_tokens 0) is not streamed; drop stream", 400, param="stream")
        n = req.n or 1
        self.runner.check_within("max_batch", len(prompts), "len(prompt)")
        self.runner.check_within("max_beams", n, "n")
        reader = self.pipeline.reader
        top = req.logprobs

        def work(w: RequestWork) -> list[dict]:
            w.unit()
            prepared = [prepare_prompt(reader.model, reader.tokenizer, p) for p in prompts]
            self.runner.check_within("max_prompt_tokens", sum(len(p.ids) for p in prepared), "prompt tokens",
                                     param="prompt")
            out = []
            for p in prepared:
                w.unit()
                out.append(score_prompt(reader.model, reader.tokenizer, p, top=top or 0, unit=w.unit))
            return out

        scored = await self.runner.run(request.receive, work)
        choices = []
        for s in scored:
            logprobs = None
            if top is not None:
                keep = req.echo
                logprobs = {"tokens": s["tokens"] if keep else [], "token_logprobs": s["token_logprobs"] if keep else [],
                            "top_logprobs": (s["top_logprobs"] if keep else []) if top else None,
                            "text_offset": s["text_offset"] if keep else []}
            for _ in range(n):
                choices.append({"index": len(choices), "text": s["text"] if req.echo else "", "logprobs": logprobs,
                                "finish_reason": "length"})
        tokens = sum(len(s["tokens"]) for s in scored)
        return SafeJSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                                 "model": self.model_name, "choices": choices,
                                 "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}})

    # ------------------------------------------------------------------ streaming
    def _token_streaming(self, plan: Plan, kw: dict, prompts: int, n: int) -> bool:
        """Whether the answer can be streamed token by token: one causal answer, greedy or sampled, no NLI back-off
        (which picks between two answers only once both are done)."""
        return (self.pipeline.reader.continues_prompts and prompts == 1 and n == 1 and plan.copies == 1
                and kw.get("num_beams") in (None, 1) and "nli" not in kw)

    async def _stream(self, request: Request, prompts: list[str], plan: Plan, kw: dict, req, *, first, piece, last, usage: dict):
        runner = self.runner
        work = runner.admit()  # 503 before the stream starts
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        n = req.n or 1
        generate = self._work(prompts, plan, kw)
        decoding = asyncio.Event()  # set at the first unit boundary inside the model's work: options checked, passages read
        streamer = None
        if self._token_streaming(plan, kw, len(prompts), n):
            def emit(text: str) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, ("piece", 0, text))

            streamer = _TokenText(self.tokenizer, prompts[0], emit)

        def fn(w: RequestWork) -> list:
            def hook(generated) -> None:
                if not decoding.is_set():
                    loop.call_soon_threadsafe(decoding.set)
                w.unit()
                if streamer is not None:
                    streamer.update(generated)

            with unit_hook(hook, max_rows=UNIT_ROWS):
                return generate(w)

        task = asyncio.ensure_future(runner.run(request.receive, fn, work=work))
        task.add_done_callback(lambda t: (t.cancelled() or t.exception(), queue.put_nowait(("done", 0, ""))))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # The stream starts (HTTP 200) only once decoding has begun: an option the model refuses, a knowledge base too
        # small for n_docs, a full queue or the deadline while waiting answer with their 4xx / 5xx status, as unstreamed.
        started = asyncio.ensure_future(decoding.wait())
        try:
            await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if task.done() and task.exception() is not None:
            raise task.exception()

        async def events():
            sent: dict[int, str] = {}
            try:
                if first is not None:
                    yield _sse(first(0))
                while True:
                    kind, index, text = await queue.get()
                    if kind == "done":
                        break
                    sent[index] = sent.get(index, "") + text
                    yield _sse(piece(index, text))
                try:
                    answers = task.result()
                except RagError as e:  # a deadline (504), a swap storm (503), a bad option the model refused (400)
                    status = getattr(e, "status", 400)
                    yield _sse(json.loads(openai_error(str(e), status, param=getattr(e, "param", None)).body))
                    return
                except Exception as e:  # noqa: BLE001 - a bug: logged; the client gets an error event, not a hang
                    logger.exception("streamed generation failed")
                    yield _sse({"error": {"message": f"internal error ({type(e).__name__}); see the server log",
                                          "type": "server_error", "param": None, "code": None}})
                    return
                for i, a in enumerate(answers):
                    if i and first is not None:
                        yield _sse(first(i))
                    done = sent.get(i, "")
                    rest = a.text[len(done):] if a.text.startswith(done) else ""
                    for p in _pieces(rest):
                        yield _sse(piece(i, p))
                    final = last(i, self._finish_reason(a))
                    if i == len(answers) - 1:
                        final["rag"] = self._provenance(answers)
                    yield _sse(final)
                if include_usage:
                    yield _sse({**usage, "usage": self._usage(prompts, answers)})
                yield "data: [DONE]\n\n"
            finally:
                if not task.done():  # the client went away: stop the work at its next unit boundary
                    if work.reason is None:
                        runner.counters.add("disconnected")
                    work.stop("disconnect")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def openai_router(state: ServerState) -> APIRouter:
    """``/v1/models``, ``/v1/models/{model_id}``, ``/v1/chat/completions`` and ``/v1/completions`` behind the API key."""
    v1 = OpenAIRoutes(state.pipeline, state.runner, model_name=state.model_name, nli_options=state.nli_options)
    router = APIRouter(dependencies=[Depends(api_key_check(state))])
    router.get("/v1/models")(v1.models)
    router.get("/v1/models/{model_id}")(v1.model)
    router.post("/v1/chat/completions")(v1.chat)
    router.post("/v1/completions")(v1.completions)
    return router
