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

A span is produced in the tokens the tokenizer gives its text (with or without the space before it: the targets a
reader is trained on), never in another split of the same characters: a search that took ``f`` + ``lame-proofing``
for ``flame-proofing`` would score the answer by a tokenization the model never learnt to write (log p -16 where the
tokenizer's own gives -2.4), and greedy search would spend its one answer on it.

The constraint is a mask over the vocabulary (:attr:`rag.generation.search.SearchSpec.allowed`): scores are the
model's own log-probabilities, unrenormalised, as for every other constraint of the search. Where a span may start
and end is found on the text, so it holds for any tokenizer whose tokens decode to text; a character split over
several byte tokens (rare non-ASCII characters) cannot be produced, and an answer stops before it.
"""

from __future__ import annotations

import re
from itertools import accumulate
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


SPAN_CHARS = 256
"""A span is followed for this many characters of its text (then to the next space), far more than an answer's
``max_new_tokens`` take: where one runs on past it the answer ends there."""


def _piece(text: str, s: int) -> str:
    """`text` from `s`: :data:`SPAN_CHARS` characters, then to the next space (or the end)."""
    cut = text.find(" ", s + SPAN_CHARS)
    return text[s:] if cut < 0 else text[s:cut]


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
        self.text_of = {i: text for text, ids in self.by_text.items() for i in ids}

    def decode(self, ids: Sequence[int]) -> str:
        # as read, with no "clean-up" of spaces before punctuation, so that the text matches the token texts above
        return self.tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)


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
        self._runs: dict[int, dict[int, list[tuple[int, int, tuple[int, ...]]]]] = {}  # per context, built when read

    def __len__(self) -> int:
        return len(self._texts)

    def constraint(self, contexts_of_row: Sequence[Sequence[int]], eos: int) -> Callable[[Tensor, int], Optional[Tensor]]:
        """The :attr:`SearchSpec.allowed` function of a search whose row `r` reads contexts ``contexts_of_row[r]``
        (RAG-Sequence: its own passage; RAG-Token: the question's K passages)."""
        # per row, once: whether one of its contexts read no passage (nothing to take spans from)
        groups = [None if any(self._texts[c] is None for c in cs) else cs for cs in contexts_of_row]

        def allowed(generated: Tensor, vocab: int) -> Optional[Tensor]:
            mask = torch.zeros(generated.shape[0], vocab, dtype=torch.bool)
            for r, row in enumerate(generated.tolist()):
                texts = groups[r]
                if texts is None or eos in row:  # nothing to take spans from, or finished
                    mask[r] = True
                    continue
                ok, can_end = self._next(row, contexts_of_row[r])
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

    def _token_runs(self, context: int) -> dict[int, list[tuple[int, int, tuple[int, ...]]]]:
        """The context's spans as the tokenizer writes them, keyed by their first id as ``(text index, start, ids)``:
        for every start of each text, the ids of the text from there (:data:`SPAN_CHARS` characters, to the next
        space), with and without a space before it; and where the tokenizer joins a word's end to what follows
        (``(243).`` may read ``(243`` + ``).``), the ids of the span up to that end, tokenized alone."""
        if context not in self._runs:
            texts = self._texts[context]
            pieces = [(t, s, _piece(text, s)) for t, (text, starts, _) in enumerate(texts) for s in starts]
            found = self._tokenize(pieces)
            ends_inside = []  # (t, s, the span to a word end that no token of its run ends at)
            for (t, s, piece), (_, bounds) in zip(pieces, found[::2]):
                ends_inside += [(t, s, piece[:e - s]) for e in sorted(texts[t][2]) if s < e <= s + len(piece) and e not in bounds]
            runs: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
            seen = set()
            for (t, s, _), (ids, _) in zip([x for x in pieces + ends_inside for _ in (0, 1)],
                                           found + self._tokenize(ends_inside)):
                if ids and (t, s, ids) not in seen:
                    seen.add((t, s, ids))
                    runs.setdefault(ids[0], []).append((t, s, ids))
            self._runs[context] = runs
        return self._runs[context]

    def _tokenize(self, pieces: Sequence[tuple[int, int, str]]) -> list[tuple[tuple[int, ...], set[int]]]:
        """Each piece's ids without and then with a space before it (up to a special token: a passage's "<|im_end|>" ends
        it), with the text positions where those ids end (a piece at start `s`: `s` + characters decoded)."""
        if not pieces:
            return []
        tokenizer = self.token_texts.tokenizer
        special = set(tokenizer.all_special_ids)
        texts = [pre + piece for _, _, piece in pieces for pre in ("", " ")]
        ids_of = tokenizer(texts, add_special_tokens=False)["input_ids"]
        out = []
        for k, ids in enumerate(ids_of):
            cut = next((n for n, i in enumerate(ids) if i in special), len(ids))
            ids = tuple(ids[:cut])
            s, texts_of = pieces[k // 2][1], [self.token_texts.text_of.get(i) for i in ids]
            if None in texts_of:  # a token that is part of a character: decode every prefix
                bounds = {s + len(self.token_texts.decode(ids[:n]).lstrip()) for n in range(1, len(ids) + 1)}
            else:  # the tokens' texts add up (less the space before the first)
                lead = len(texts_of[0]) - len(texts_of[0].lstrip()) if texts_of else 0
                bounds = {s - lead + n for n in accumulate(map(len, texts_of))}
            out.append((ids, bounds))
        return out

    def _next(self, row: list[int], contexts: Sequence[int]) -> tuple[set[int], bool]:
        """Ids that continue a span of the `contexts`' texts, in the tokenizer's own ids, after the generated `row`, and
        whether the span may end here (where a word ends in the text)."""
        ok: set[int] = set()
        can_end = False
        done = len(self.token_texts.decode(row).lstrip()) if row else 0
        n = len(row)
        for c in contexts:
            runs = self._token_runs(c)
            if not row:
                ok.update(runs)
                continue
            for t, s, ids in runs.get(row[0], ()):
                if len(ids) >= n and list(ids[:n]) == row:
                    can_end |= s + done in self._texts[c][t][2]
                    if len(ids) > n:
                        ok.add(ids[n])
        return ok, can_end
