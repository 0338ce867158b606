"""Extractive decoding: every answer is a word-aligned span of a passage the reader read.

A RAG reader asked for "a few words taken from the passage" still answers from its parametric memory at times
("Who is credited with discovering tellurium?" -> a famous name that no passage holds). With ``extractive`` decoding
each search row may only continue a span of its passages' text (title and text): the first token starts at a word
(or at the bracket or quote opening it), every later token continues the text exactly, and EOS is allowed only where a
word ends (or after the bracket, quote or % closing it), so "144." cannot stop inside "144.24" and "(243)" is whole.
Words are the tokens of :data:`rag.knowledge.bm25.TOKEN_PATTERN` (a number keeps its decimals).

A hyphenated compound is one word to end at: "Au-198" cannot stop at "Au", nor "greenish-yellow" at "greenish".

Given the question, a span does not start at a word the question holds (case-insensitive): a reader that read "Oxygen
/ ... Discovered in 1774 by Joseph Priestley." must not answer "Who discovered oxygen?" with ``Oxygen``, nor "which
element has the symbol Y?" with ``Y``, unless the word opens a hyphenated compound, which the span then holds whole
("Which isotope of carbon ...?" -> ``Carbon-14``). A span may still contain question words after its first. The price:
an answer that starts with a word of the question (a choice question, "gold or silver?") cannot be given
extractively.

The constraint is a mask over the vocabulary (:attr:`rag.generation.search.SearchSpec.allowed`): scores are the
model's own log-probabilities, unrenormalised, as for every other constraint of the search. Matching is on text, so
it holds for any tokenizer whose tokens decode to text; a character split over several byte tokens (rare non-ASCII
characters) cannot be produced, and an answer stops before it.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from rag.knowledge.bm25 import TOKEN_PATTERN

__all__ = ["TokenTexts", "PassageSpans"]

_WORD = re.compile(TOKEN_PATTERN)
_OPEN, _CLOSE = "([{\"'‘“", ")]}\"'’”%"


def _words(text: str) -> set[str]:
    """The words of `text`, lower-cased."""
    return {w.lower() for w in _WORD.findall(text)}


def _bounds(text: str, banned: frozenset[str] = frozenset()) -> tuple[str, list[int], set[int]]:
    """`text`, where a span may start (a word not in `banned`, or the first part of a hyphenated compound, banned or
    not: "Carbon-14"; or a bracket or quote right before one: "(243)") and where it may end (a word's end, or the
    closing bracket, quote or % right after it; not inside a hyphenated compound: "Au" of "Au-198")."""
    starts, ends = [], set()
    for m in _WORD.finditer(text):
        s, e = m.span()
        joined = text.startswith("-", e) and e + 1 < len(text) and text[e + 1].isalnum()
        compound_head = joined and (s == 0 or text[s - 1] != "-")
        if m.group().lower() not in banned or compound_head:
            if s > 0 and text[s - 1] in _OPEN:
                starts.append(s - 1)
            starts.append(s)
        if not joined:
            ends.add(e)
        if e < len(text) and text[e] in _CLOSE:
            ends.add(e + 1)
    return text, starts, ends


class TokenTexts:
    """Every vocabulary id's text as it reads inside a sequence (with its leading space, if any), and the reverse map.

    Built once per tokenizer (a vocabulary of 50k takes about a second): each id is decoded after a fixed one-letter
    token and the letter cut off, which keeps the leading space that SentencePiece and byte-level BPE tokenizers both
    drop when a token is decoded alone.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        anchor = tokenizer.convert_tokens_to_ids("a")
        if not isinstance(anchor, int) or anchor == getattr(tokenizer, "unk_token_id", None):
            anchor = tokenizer("a", add_special_tokens=False)["input_ids"][-1]
        head = tokenizer.decode([anchor], clean_up_tokenization_spaces=False)
        special = set(tokenizer.all_special_ids)
        self.by_text: dict[str, list[int]] = {}
        for i in range(len(tokenizer)):
            if i in special:
                continue
            text = tokenizer.decode([anchor, i], clean_up_tokenization_spaces=False)
            if text.startswith(head) and len(text) > len(head) and "\ufffd" not in text:
                self.by_text.setdefault(text[len(head):], []).append(i)
        self.max_len = max(map(len, self.by_text), default=1)

    def decode(self, ids: Sequence[int]) -> str:
        # as read, with no "clean-up" of spaces before punctuation, so that the text matches the token texts above
        return self.tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)

    def continuing(self, text: str) -> set[int]:
        """Ids whose text is a prefix of `text` (non-empty)."""
        found: set[int] = set()
        for j in range(1, min(len(text), self.max_len) + 1):
            found.update(self.by_text.get(text[:j], ()))
        return found


class PassageSpans:
    """The spans the answers of one decoding may take: the passage texts of each of its `N` contexts.

    Args:
        token_texts: the generator tokenizer's :class:`TokenTexts`.
        passages: per context, the texts it may answer from (e.g. ``(title, text)``); None: unconstrained (a
            closed-book row).
        questions: per context, the question it answers (its words start no span); None: no such rule.
    """

    def __init__(self, token_texts: TokenTexts, passages: Sequence[Optional[Sequence[str]]],
                 questions: Optional[Sequence[str]] = None):
        if questions is not None and len(questions) != len(passages):
            raise ValueError(f"PassageSpans: {len(questions)} questions for {len(passages)} contexts; give one per context")
        self.token_texts = token_texts
        self._texts = []
        for c, texts in enumerate(passages):
            if texts is None:
                self._texts.append(None)
                continue
            banned = frozenset(_words(questions[c])) if questions is not None else frozenset()
            self._texts.append([_bounds(t, banned) for t in texts])

    def __len__(self) -> int:
        return len(self._texts)

    def constraint(self, contexts_of_row: Sequence[Sequence[int]], eos: int) -> Callable[[Tensor, int], Optional[Tensor]]:
        """The :attr:`SearchSpec.allowed` function of a search whose row `r` reads contexts ``contexts_of_row[r]``
        (RAG-Sequence: its own passage; RAG-Token: the question's K passages)."""
        # per row, once: the texts it reads, or None when one of its contexts read no passage (nothing to take spans from)
        groups = [None if any(self._texts[c] is None for c in cs) else [t for c in cs for t in self._texts[c]]
                  for cs in contexts_of_row]

        def allowed(generated: Tensor, vocab: int) -> Optional[Tensor]:
            mask = torch.zeros(generated.shape[0], vocab, dtype=torch.bool)
            for r, row in enumerate(generated.tolist()):
                texts = groups[r]
                if texts is None or eos in row:  # nothing to take spans from, or finished
                    mask[r] = True
                    continue
                ok, can_end = self._next(row, texts)
                if ok:
                    mask[r, [i for i in ok if i < vocab]] = True
                if can_end or not ok:  # an answer with no continuation left ends rather than taking a banned token
                    mask[r, eos] = True
            return mask.to(generated.device)

        return allowed

    def holds(self, context: int, ids: Sequence[int], skip: Sequence[int] = ()) -> bool:
        """Whether the answer `ids` (the tokens in `skip`, e.g. EOS and pad, left out) is a span this context's search
        could give: it starts where a span may start in one of its texts, continues it exactly and ends where a span
        may end. A context without passages holds every answer."""
        texts = self._texts[context]
        if texts is None:
            return True
        skip = set(skip)
        answer = self.token_texts.decode([i for i in ids if i not in skip]).strip()
        return bool(answer) and any(text.startswith(answer, s) and s + len(answer) in ends
                                    for text, starts, ends in texts for s in starts)

    def _next(self, row: list[int], texts) -> tuple[set[int], bool]:
        """Ids that continue a span of `texts` after the generated `row`, and whether the span may end here."""
        tt = self.token_texts
        done = tt.decode(row).lstrip() if row else ""
        ok: set[int] = set()
        can_end = False
        for text, starts, ends in texts:
            for s in starts:
                if not text.startswith(done, s):
                    continue
                e = s + len(done)
                rest = text[e:e + tt.max_len]
                if done:
                    can_end |= e in ends
                    ok |= tt.continuing(rest)
                else:  # the first token: its text without leading spaces starts at a word
                    for j in range(1, len(rest) + 1):
                        for key in (rest[:j], " " + rest[:j]):
                            ok.update(tt.by_text.get(key, ()))
        return ok, can_end
