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
