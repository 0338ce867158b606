"""Where the bundled demo RAG models live, which one is the default, and the knowledge base they answer from."""

from __future__ import annotations

from pathlib import Path

from rag.utils.errors import ConfigError

CHECKPOINTS_DIR = Path(__file__).parent / "checkpoints"
"""The repository's `checkpoints/` as the package sees it: a link to it in a clone, a copy of the bundled
checkpoints in an installed wheel (setup.cfg's package_data), so `rag demo` works either way."""

DEMO_MODELS = {
    "demo": "RAG-Sequence over a warm-started seq2seq reader with a copy head (checkpoints/make_demo.py)",
    "demo_causal": "RAG-Sequence over SmolLM2-135M-Instruct with a LoRA adapter (checkpoints/make_demo_causal.py)",
}
"""The demo models by directory name, the default first. `demo_causal` is made by checkpoints/make_demo_causal.py; it is
not bundled yet (its measured comparison with `demo` has not been made), so the seq2seq reader stays the default."""
DEFAULT_DEMO = "demo"


def demo_checkpoint_dir(name: str = DEFAULT_DEMO) -> Path:
    """A bundled demo RAG model (default: :data:`DEFAULT_DEMO`, what `rag demo`, `rag generate` and `rag.load("demo")` use)."""
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
    from rag.demo.kb import ensure_demo_kb

    return ensure_demo_kb()
