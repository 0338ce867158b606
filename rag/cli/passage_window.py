"""`rag index build --max-passage-tokens N [--tokenizer DIR]`: passages split at build time so that every reader prompt
made of one of them fits a window of N tokens.

A prompt is the default reader's layout (its prompt template, system prompt and the tokenizer's chat template, as
:func:`rag.generation.prompts.tokenize_prompts` writes it) around the passage's title and text, with room for a question
of :data:`QUESTION_TOKENS` tokens; a passage whose prompt would be longer is cut into consecutive passages at sentence
ends (:func:`rag.knowledge.passages.fit_passages`). The manifest's ``build.passage_tokens`` records the tokenizer, the
window, the longest passage text and prompt in tokens, and the prompt layout's fingerprint
(:func:`rag.generators.base.layout_fingerprint`), so a reader of that layout checks its window against the knowledge
base without measuring it again (:mod:`rag.pipeline.windows`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from rag.demo import load_demo_corpus
from rag.demo.model import demo_checkpoint_dir
from rag.generation.prompts import PromptFormat
from rag.generators.base import QUESTION_TOKENS, layout_fingerprint, prompt_lengths
from rag.generators.causal import prompt_ids
from rag.generators.demo_lm import demo_lm_dir, demo_lm_needs_conversion, prepare_demo_lm
from rag.knowledge.passages import Passage, fit_passages, passage_token_lengths
from rag.models.rag.config import RagModelConfig
from rag.utils.errors import ConfigError, CorpusError
from rag.utils.files import read_json

__all__ = ["QUESTION_TOKENS", "load_tokenizer", "reader_prompt_format", "prompt_overhead", "fit_to_window",
           "reader_window", "demo_reader_window"]

def load_tokenizer(path: Optional[str]):
    """The tokenizer in the directory `path` (None: the default reader's, the demo LM, converted on first use)."""
    from transformers import AutoTokenizer

    if path is None:
        if demo_lm_needs_conversion():
            prepare_demo_lm(show_progress=False)
        path = str(demo_lm_dir())
    if not Path(path).is_dir():
        raise ConfigError(f"--tokenizer {path}: not a directory; give a model or tokenizer directory (tokenizer.json ...)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer {path}: no tokenizer could be read there ({str(e).splitlines()[0][:160]}); "
                          "give the reader's model directory") from None


def reader_prompt_format() -> PromptFormat:
    """The default reader's prompt layout (the bundled default demo model's stored config)."""
    cfg = demo_checkpoint_dir() / "rag_config.json"
    return RagModelConfig.from_dict(read_json(cfg, fix="reinstall rag").get("config") or {}, str(cfg)).prompt_format


def prompt_overhead(tokenizer, fmt: PromptFormat, title: str, question_tokens: int = QUESTION_TOKENS) -> int:
    """Tokens of a reader prompt around a passage titled `title`: the template, title and a question of
    `question_tokens` tokens (everything but the passage's text)."""
    [n] = prompt_lengths(lambda q, ps: prompt_ids(tokenizer, fmt, q, ps), tokenizer, [Passage("probe", title, "")],
                         question_tokens)
    return n


def fit_to_window(passages: Sequence[Passage], window: int, tokenizer, tokenizer_name: str,
                  fmt: Optional[PromptFormat] = None) -> tuple[list[Passage], dict]:
    """`passages` split so each one's prompt fits `window` tokens, and the manifest's ``passage_tokens`` record.

    Raises:
        ConfigError: `window` is not above the prompt template's own tokens (one line naming the option and the fix).
    """
    fmt = fmt or reader_prompt_format()
    count = lambda texts: [len(r) for r in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]  # noqa: E731
    overheads: dict[str, int] = {}

    def budget(p: Passage) -> int:
        if p.title not in overheads:
            overheads[p.title] = prompt_overhead(tokenizer, fmt, p.title)
        return window - overheads[p.title]

    template = prompt_overhead(tokenizer, fmt, "")
    if window <= template:
        raise ConfigError(f"--max-passage-tokens {window} is smaller than the prompt template ({template} tokens of "
                          f"{tokenizer_name} with a {QUESTION_TOKENS}-token question and no passage); raise it above "
                          f"{template} (the reader's max_context_length)")
    for p in passages:
        if budget(p) < 1:
            raise ConfigError(f"--max-passage-tokens {window}: the prompt of passage {p.id!r} is {overheads[p.title]} "
                              f"tokens before its text (a long title); raise it above {overheads[p.title]}")
    fitted = list(fit_passages(passages, budget, count))
    ids = [p.id for p in fitted]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise CorpusError(f"--max-passage-tokens: the split passage id {dup!r} is already a passage's id; rename that "
                          "document's id (ids of split passages end in -0, -1, ...)")
    lengths = passage_token_lengths(fitted, count)
    record = {"tokenizer": tokenizer_name, "max_passage_tokens": window, "question_tokens": QUESTION_TOKENS,
              "longest_text": max(lengths, default=0),
              "longest_prompt": max((n + overheads[p.title] for p, n in zip(fitted, lengths)), default=0),
              "split": len(fitted) - len(passages),
              "layout": layout_fingerprint(lambda q, ps: prompt_ids(tokenizer, fmt, q, ps), tokenizer)}
    return fitted, record


def reader_window(passages: Sequence[Passage], tokenizer, fmt: Optional[PromptFormat] = None, multiple: int = 32) -> int:
    """The smallest window (a multiple of `multiple` tokens) that holds the prompt of every one of `passages` whole,
    with a question of :data:`QUESTION_TOKENS` tokens."""
    _, record = fit_to_window(passages, 1 << 30, tokenizer, "", fmt)
    return -(-record["longest_prompt"] // multiple) * multiple


def demo_reader_window(tokenizer=None) -> int:
    """The default reader's window over the demo corpus (:func:`reader_window` with the demo LM's tokenizer)."""
    return reader_window(load_demo_corpus(), tokenizer if tokenizer is not None else load_tokenizer(None))
