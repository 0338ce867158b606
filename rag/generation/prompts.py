"""Prompts of a causal (decoder-only) RAG generator: one retrieved passage and the question in one prompt, tokenized.

For a decoder-only reader p(y | x, z) is the LM's likelihood of the answer tokens after a prompt built from passage z
and question x (RAG §2.3 joins them by concatenation; a causal LM needs them in front of the answer). The prompt is
the :class:`PromptFormat`'s template with ``{title}``, ``{passage}`` and ``{question}`` filled in, put into the
tokenizer's chat template as the user's message when the tokenizer has one (instruction-tuned LMs such as
SmolLM2-135M-Instruct answer in the format they were tuned on), else used as it is::

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{title}\\n{passage}\\n\\nQuestion:
    {question}\\nAnswer:<|im_end|>\\n <|im_start|>assistant\\n  ── the answer tokens and EOS follow; only they are scored

Each prompt is tokenized in three parts — the text before the passage, the passage, the text after it — so that an
over-long prompt loses passage tokens, never the question or the answer header (``truncation="keep_question"``, as
for seq2seq contexts in :mod:`rag.generation.contexts`; a question too long on its own is cut from its start so the
prompt still ends with the answer header). Every prompt of one question therefore ends with the same tokens, which
RAG-Token decoding relies on (the K prompts start their shared search from the same last token).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor

from rag.generation.contexts import _special_layout
from rag.utils.errors import ConfigError, RagError

__all__ = ["DEFAULT_PROMPT_TEMPLATE", "DEFAULT_CLOSED_BOOK_TEMPLATE", "PromptFormat", "TokenizedPrompts", "check_template",
           "tokenize_prompts", "tokenize_answers", "left_pad", "segmented_pad"]

DEFAULT_PROMPT_TEMPLATE = "{title}\n{passage}\n\nQuestion: {question}\nAnswer:"
"""The default user message: the passage (with its title) first, then the question."""
DEFAULT_CLOSED_BOOK_TEMPLATE = "Question: {question}\nAnswer:"
"""The prompt without a passage (the closed-book baseline, RetRobust's no-retrieval answers)."""

_PLACEHOLDER = re.compile(r"\{(title|passage|question)\}")
# Private-use code points mark where the title and the passage go in a rendered chat template; removed from inputs.
_TITLE_MARK, _PASSAGE_MARK = "\ue000T\ue000", "\ue000P\ue000"
_PRIVATE = re.compile("[\ue000\ue001]")


class _TitledText(Protocol):
    title: str
    text: str


def check_template(template: object, field: str, required: Sequence[str]) -> str:
    """`template` unchanged when it is a string holding each of `required` placeholders once (``passage``,
    ``question``); ConfigError naming `field` otherwise. Other braces are literal text."""
    if not isinstance(template, str):
        raise ConfigError(f"{field} must be a string with {', '.join('{' + r + '}' for r in required)}, got {template!r}")
    found = _PLACEHOLDER.findall(template)
    for name in required:
        if found.count(name) != 1:
            raise ConfigError(f"{field}={template!r} must contain {{{name}}} exactly once (it holds {found.count(name)}); "
                              f"e.g. {DEFAULT_PROMPT_TEMPLATE!r}")
    return template


def _fill(template: str, **values: str) -> str:
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), ""), template)


@dataclass(frozen=True)
class PromptFormat:
    """How a causal generator's prompts are written (:class:`~rag.models.rag.config.RagModelConfig` holds the fields)."""

    template: str = DEFAULT_PROMPT_TEMPLATE
    """The user message with ``{passage}`` and ``{question}`` (and optionally ``{title}``)."""
    closed_book: str = DEFAULT_CLOSED_BOOK_TEMPLATE
    """The user message without a passage, with ``{question}``."""
    system: Optional[str] = None
    """A system message for the chat template (None: the template's own default, if any)."""
    chat: bool = True
    """Use the tokenizer's chat template when it has one."""

    def __post_init__(self) -> None:
        check_template(self.template, "RagModelConfig.prompt_template", ("passage", "question"))
        check_template(self.closed_book, "RagModelConfig.closed_book_template", ("question",))
        if "{passage}" in self.closed_book:
            raise ConfigError(f"RagModelConfig.closed_book_template={self.closed_book!r} is the prompt without a passage; "
                              "remove {passage}")

    def uses_chat(self, tokenizer) -> bool:
        return self.chat and bool(getattr(tokenizer, "chat_template", None))

    def render(self, tokenizer, user: str) -> str:
        """The whole prompt text for the user message `user` (chat template with the generation prompt, or `user`)."""
        if not self.uses_chat(tokenizer):
            return user
        messages = ([{"role": "system", "content": self.system}] if self.system is not None
                    else []) + [{"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    @property
    def passage_first(self) -> bool:
        """True when the passage comes before the question: the prompt up to the passage's end is question-independent."""
        return self.template.index("{passage}") < self.template.index("{question}")

    def split(self, tokenizer, question: str) -> tuple[str, str]:
        """The prompt for `question` as the text before and after the passage (the title still marked)."""
        text = self.render(tokenizer, _fill(self.template, title=_TITLE_MARK, passage=_PASSAGE_MARK, question=question))
        head, sep, tail = text.partition(_PASSAGE_MARK)
        if not sep or _PASSAGE_MARK in tail:
            raise ConfigError("the chat template dropped or repeated the passage of RagModelConfig.prompt_template; "
                              "set RagModelConfig.chat_template: false")
        return head, tail


@dataclass
class TokenizedPrompts:
    """Token ids of ``N`` prompts and what truncation did to them."""

    ids: list[list[int]]
    truncated: list[bool]
    strings: list[str]
    answer_prefix: str = ""
    """What goes before the answer text: a space when the prompt ends with a visible character (``Answer:``)."""
    prefix_lengths: list[int] = field(default_factory=list)
    """Per prompt, how many of its first tokens do not depend on the question (the header, title and passage when the
    template puts the passage first): their KV cache can serve every question that reads this passage. 0: none."""


def _special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (BOS of Llama-style tokenizers), for prompts without a chat
    template (a chat template writes its own)."""
    return list(_special_layout(tokenizer)[0])


def tokenize_prompts(tokenizer, fmt: PromptFormat, questions: Sequence[str],
                     passages: Optional[Sequence[Sequence[_TitledText]]], max_length: int) -> TokenizedPrompts:
    """Token ids of the ``B·K`` prompts (row ``b·K + k``: question b with its k-th passage), or of the B closed-book
    prompts when `passages` is None, each at most `max_length` tokens.

    An over-long prompt loses tokens from the end of its passage; when the prompt without the passage is still too
    long, the text before the question's end is cut from the left, so the prompt keeps ending with the answer header.
    """
    if max_length < 2:
        raise ConfigError(f"RagModelConfig.max_context_length={max_length} leaves no room for a prompt; raise it")
    questions = [_PRIVATE.sub("", q) for q in questions]
    special = [] if fmt.uses_chat(tokenizer) else _special_prefix(tokenizer)
    enc = lambda texts: tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []  # noqa: E731
    if passages is None:
        texts = [fmt.render(tokenizer, _fill(fmt.closed_book, question=q)) for q in questions]
        ids, truncated = [], []
        for row in enc(texts):
            row = special + list(row)
            truncated.append(len(row) > max_length)
            ids.append(row[len(row) - max_length:] if len(row) > max_length else row)
        return TokenizedPrompts(ids, truncated, texts, _answer_prefix(texts[0] if texts else ""))
    if len(passages) != len(questions):
        raise RagError(f"got {len(questions)} questions but {len(passages)} lists of passages; pass one list per question")
    splits = [fmt.split(tokenizer, q) for q in questions]
    heads, bodies, tails, strings = [], [], [], []
    for (head, tail), docs in zip(splits, passages):
        for doc in docs:
            title = _PRIVATE.sub("", doc.title)
            heads.append(head.replace(_TITLE_MARK, title))
            tails.append(tail.replace(_TITLE_MARK, title))
            bodies.append(_PRIVATE.sub("", doc.text))
            strings.append(heads[-1] + bodies[-1] + tails[-1])
    head_ids, body_ids, tail_ids = enc(heads), enc(bodies), enc(tails)
    ids, truncated, prefix = [], [], []
    shareable = fmt.passage_first
    for h, p, t in zip(head_ids, body_ids, tail_ids):
        fixed = special + list(h)
        room = max_length - len(fixed) - len(t)
        if room >= len(p):
            ids.append(fixed + list(p) + list(t))
            truncated.append(False)
            prefix.append(len(fixed) + len(p) if shareable else 0)
            continue
        truncated.append(True)
        row = fixed + list(p[:max(room, 0)]) + list(t)
        cut = len(row) - max_length if len(row) > max_length else 0  # only when even the passage-free prompt is too long
        ids.append(row[cut:])
        prefix.append(len(fixed) + max(room, 0) if shareable and not cut else 0)
    return TokenizedPrompts(ids, truncated, strings, _answer_prefix(tails[0] if tails else ""), prefix)


def _answer_prefix(prompt_end: str) -> str:
    return " " if prompt_end and not prompt_end[-1].isspace() else ""


def tokenize_answers(tokenizer, answers: Sequence[str], prefix: str, max_length: int) -> tuple[Tensor, Tensor]:
    """The scored targets of a causal generator: each answer's tokens (after `prefix`) and EOS, right-padded
    ``(B, T)`` with their mask ``(B, T)`` bool; an answer longer than `max_length` tokens keeps its first tokens and EOS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the causal generator's tokenizer has no EOS token, which ends every answer; set tokenizer.eos_token "
                          "and save it again")
    rows = [list(r)[:max_length - 1] + [int(eos)]
            for r in tokenizer([prefix + a.strip() for a in answers], add_special_tokens=False)["input_ids"]]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos),
                     dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[r, :len(row)] = True
    return ids, mask


def left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Left-padded ``(N, S)`` ids and their attention mask (1 on real tokens), the layout causal decoding takes."""
    if not rows or min(map(len, rows)) < 1:
        raise RagError("every prompt needs at least one token")
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.as_tensor(list(row), dtype=torch.long)
        mask[r, width - len(row):] = 1
    return ids, mask


def segmented_pad(rows: Sequence[Sequence[int]], prefix_lengths: Sequence[int], pad: int) -> tuple[Tensor, Tensor, int]:
    """Rows laid out in two left-padded segments: each row's first `prefix_lengths[i]` tokens right-aligned in the first
    ``P`` columns, the rest right-aligned after them. Returns ids and attention mask ``(N, P + T)`` and ``P``; positions
    are ``cumsum(mask) - 1`` as for plain left padding, so the LM reads the same sequence. ``P = 0`` when no row has a
    prefix (plain :func:`left_pad`)."""
    if not any(prefix_lengths):
        ids, mask = left_pad(rows, pad)
        return ids, mask, 0
    heads = [list(r[:n]) for r, n in zip(rows, prefix_lengths)]
    tails = [list(r[n:]) for r, n in zip(rows, prefix_lengths)]
    width = max(map(len, heads))
    head_ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    head_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, h in enumerate(heads):
        if h:
            head_ids[r, width - len(h):] = torch.as_tensor(h, dtype=torch.long)
            head_mask[r, width - len(h):] = 1
    tail_ids, tail_mask = left_pad(tails, pad)
    return torch.cat([head_ids, tail_ids], 1), torch.cat([head_mask, tail_mask], 1), width
