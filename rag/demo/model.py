"""Where the bundled demo RAG model lives, and the knowledge base it answers from."""

from __future__ import annotations

from pathlib import Path

from rag.utils.errors import ConfigError

CHECKPOINTS_DIR = Path(__file__).parent / "checkpoints"
"""The repository's `checkpoints/` as the package sees it: a link to it in a clone, a copy of the bundled
checkpoints in an installed wheel (setup.cfg's package_data), so `rag demo` works either way."""


def demo_checkpoint_dir() -> Path:
    """The bundled demo RAG model (`checkpoints/demo`, made by `python checkpoints/make_demo.py`)."""
    path = CHECKPOINTS_DIR / "demo"
    if not (path / "rag_config.json").is_file():
        raise ConfigError(
            f"{path}: the demo checkpoint is missing. It ships with the package (checkpoints/demo of the repository); "
            f"reinstall rag (`pip install .` from a clone), or remake it with `python checkpoints/make_demo.py`"
        )
    return path


def ensure_demo_kb_for_model():
    """The demo knowledge base (built on first use from the bundled corpus and encoder)."""
    from rag.demo.kb import ensure_demo_kb

    return ensure_demo_kb()
