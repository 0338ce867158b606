"""Token ids -> answer text, undoing what a WordPiece tokenizer's decode leaves split.

BART's byte-level BPE decodes to the exact string. A WordPiece (BERT) tokenizer splits at every
punctuation mark and decodes with a space after it: "28.088" comes back as "28. 088" and "(209)"
as "( 209 )", which then fails exact match. :func:`decode_answer` rejoins those.
"""

from __future__ import annotations

import re
from typing import Sequence

_NUMBER_PUNCT = re.compile(r"(?<=\d) ?([.,:/]) ?(?=\d)")
_OPEN = re.compile(r"([(\[]) ")
_CLOSE = re.compile(r" ([)\]])")


def lowercases(tokenizer) -> bool:
    """True when the tokenizer lower-cases its input (uncased BERT-family vocabularies)."""
    if getattr(tokenizer, "do_lower_case", False):
        return True
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return "lowercase" in repr(normalizer).lower()


def restore_case(text: str, sources: Sequence[str]) -> str:
    """The casing `text` has in the first of `sources` that contains it as whole words (case-insensitively);
    `text` unchanged when none does. An uncased generator answers "fe"; its passage says "Fe"."""
    if not text:
        return text
    pattern = re.compile(r"(?<!\w)" + re.escape(text) + r"(?!\w)", re.IGNORECASE)
    for source in sources:
        found = pattern.search(source)
        if found:
            return found.group(0)
    return text


def is_wordpiece(tokenizer) -> bool:
    """True for a tokenizer whose model is WordPiece (BERT-family)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    return type(model).__name__ == "WordPiece"


def decode_answer(tokenizer, ids: Sequence[int]) -> str:
    """Decode generated `ids` (special tokens dropped) to text; for WordPiece tokenizers, rejoin numbers
    split at '.', ',', ':' or '/' and brackets split from their contents."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True).strip()
    if is_wordpiece(tokenizer):
        text = _CLOSE.sub(r"\1", _OPEN.sub(r"\1", _NUMBER_PUNCT.sub(r"\1", text)))
    return text
