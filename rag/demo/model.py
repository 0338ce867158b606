"""Where the bundled demo RAG model lives, and the knowledge base it answers from."""

from __future__ import annotations

from pathlib import Path

from rag.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


def demo_checkpoint_dir() -> Path:
    """`checkpoints/demo` of this repository (made by `python checkpoints/make_demo.py`)."""
    path = REPO_ROOT / "checkpoints" / "demo"
    if not (path / "rag_config.json").is_file():
        raise ConfigError(
            f"{path}: the demo checkpoint is missing. It ships with the repository (install with `pip install -e .` "
            f"from a clone); to remake it run `python checkpoints/make_demo.py`"
        )
    return path


def ensure_demo_kb_for_model():
    """The demo knowledge base (built on first use from the bundled corpus and encoder)."""
    from rag.demo.kb import ensure_demo_kb

    return ensure_demo_kb()
