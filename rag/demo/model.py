"""Where the bundled demo RAG models live, which one is the default, and the knowledge base they answer from."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rag.demo.kb import ensure_demo_kb
from rag.utils.errors import ConfigError

CHECKPOINTS_DIR = Path(__file__).parent / "checkpoints"
"""The repository's `checkpoints/` as the package sees it: a link to it in a clone, a copy of the bundled
checkpoints in an installed wheel (setup.cfg's package_data), so `rag demo` works either way."""

DEMO_MODELS = {
    "demo_causal": "RAG-Sequence over SmolLM2-135M-Instruct with a LoRA adapter (checkpoints/make_demo_causal.py)",
    "demo": "RAG-Sequence over a warm-started seq2seq reader with a copy head (checkpoints/make_demo.py)",
}
"""The demo models by directory name, the default first. The causal reader is the default because it answers better
on held-out and on naturally phrased questions, measured side by side (checkpoints/README.md,
benchmarks/demo_readers.py); ``rag.load("demo-seq2seq")`` / ``--model demo-seq2seq`` still load the other."""
DEFAULT_DEMO = "demo_causal"


def demo_checkpoint_dir(name: Optional[str] = None) -> Path:
    """A bundled demo RAG model (None: :data:`DEFAULT_DEMO`, what `rag demo`, `rag generate` and `rag.load("demo")` use)."""
    name = DEFAULT_DEMO if name is None else name
    if name not in DEMO_MODELS:
        raise ConfigError(f"unknown demo model {name!r}; the bundled ones are {sorted(DEMO_MODELS)}")
    path = CHECKPOINTS_DIR / name
    if not (path / "rag_config.json").is_file():
        raise ConfigError(
            f"{path}: the demo checkpoint is missing. It ships with the package (checkpoints/{name} of the repository); "
            f"reinstall rag (`pip install .` from a clone), or remake it ({DEMO_MODELS[name].rsplit('(', 1)[1].rstrip(')')})"
        )
    return path


def ensure_demo_kb_for_model():
    """The demo knowledge base (built on first use from the bundled corpus and encoder)."""
    return ensure_demo_kb()
