"""Sharded knowledge-base builds: encode slice i of N of a corpus on its own process or machine, then merge.

``rag index build --shard i/N --out SHARD_i ...`` encodes the contiguous slice
``passages[i·n/N : (i+1)·n/N]`` of the corpus and writes it as an ordinary knowledge base (flat index, its own
manifest and SHA-256 checksums, written atomically) whose manifest's ``build.shard`` records ``i``, ``N``, the
corpus size and the SHA-256 of the whole corpus's passages, and the index spec asked for. ``rag index merge OUT
SHARD_0 ... SHARD_{N-1}`` verifies every shard (every file's checksum), checks that they are the N slices of one
corpus encoded by one encoder, concatenates them in slice order and writes OUT with the requested index: the
same passages, embeddings and index spec as a one-shot build, hence the same content-addressed version id and
the same manifest guarantees.

Faults: a shard killed mid-build leaves only a hidden temporary directory (nothing :meth:`KnowledgeBase.open`
accepts); re-running its command rebuilds it. A missing shard, a missing or damaged file in one, shards of other
corpora or encoders, or a shard given twice: a clear error before anything is written.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from tqdm.auto import tqdm

from rag.knowledge.build import check_memory
from rag.knowledge.index import IndexSpec, check_fits
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.manifest import is_knowledge_base, passages_digest
from rag.knowledge.vectors import NpyVectors, create_npy, write_rows
from rag.utils.errors import ConfigError, IntegrityError, KnowledgeBaseError
from rag.utils.io import check_output_dir
from rag.utils.validate import is_integer

__all__ = ["ShardSpec", "parse_shard", "shard_passages", "shard_info", "merge_shards", "check_shard_record", "UNVERIFIED_INPUTS"]

_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class ShardSpec:
    """Slice `index` (0-based) of `count` equal contiguous slices of a corpus."""

    index: int
    count: int

    def bounds(self, n: int) -> tuple[int, int]:
        """``[start, stop)`` rows of this slice of `n` passages (slices differ in size by at most one)."""
        return self.index * n // self.count, (self.index + 1) * n // self.count

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str, option: str = "--shard") -> ShardSpec:
    """``"i/N"`` (0 <= i < N) -> ShardSpec; ConfigError naming `option` otherwise."""
    m = _SHARD.match(str(text))
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ConfigError(f"{option} {text!r}: expected i/N with 0 <= i < N (e.g. 0/4 … 3/4 for four shards)")
    return ShardSpec(int(m.group(1)), int(m.group(2)))


def shard_passages(passages: Sequence, shard: ShardSpec) -> list:
    """This shard's slice of `passages`; ConfigError when the corpus has fewer passages than shards."""
    if len(passages) < shard.count:
        raise ConfigError(f"--shard {shard}: the corpus has {len(passages)} passages, fewer than {shard.count} shards; "
                          f"use fewer shards")
    start, stop = shard.bounds(len(passages))
    return list(passages[start:stop])


def shard_info(passages: Sequence, shard: ShardSpec, index: str) -> dict:
    """The manifest's ``build.shard`` record for `shard` of the whole corpus `passages`."""
    start, stop = shard.bounds(len(passages))
    return {"index": shard.index, "count": shard.count, "start": start, "stop": stop, "corpus_passages": len(passages),
            "corpus_digest": passages_digest(passages), "index_spec": index}


_SHARD_FIELDS = ("index", "count", "start", "stop", "corpus_passages", "corpus_digest", "index_spec")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def check_shard_record(info: object, manifest: Path) -> dict:
    """The ``build.shard`` record of the shard whose manifest is `manifest`, checked field by field before any of it is
    used (types, ranges, and rows that are exactly slice ``index`` of ``count`` of ``corpus_passages``); IntegrityError
    naming the field otherwise."""
    def bad(what: str) -> IntegrityError:
        return IntegrityError(f"{manifest}: build.shard.{what}; the shard's manifest is damaged — rebuild the shard with "
                              "`rag index build --shard i/N`")

    missing = [k for k in _SHARD_FIELDS if k not in info]
    if missing:
        raise bad(f"{missing[0]} is missing (a shard record holds {', '.join(_SHARD_FIELDS)})")
    for key in ("index", "start", "stop", "corpus_passages"):
        if not is_integer(info[key]) or info[key] < 0:
            raise bad(f"{key} is {info[key]!r}, not an integer >= 0")
    count, n = info["count"], info["corpus_passages"]
    if not is_integer(count) or not 1 <= count <= max(1, n):
        raise bad(f"count is {count!r}, not an integer between 1 and corpus_passages ({n!r})")
    if info["index"] >= count:
        raise bad(f"index is {info['index']}, not below count ({count})")
    if (info["start"], info["stop"]) != ShardSpec(info["index"], count).bounds(n):
        raise bad(f"start/stop are {info['start']}/{info['stop']}, but slice {info['index']}/{count} of {n} passages is rows "
                  f"{ShardSpec(info['index'], count).bounds(n)}")
    if not isinstance(info["corpus_digest"], str) or not _HEX64.match(info["corpus_digest"]):
        raise bad(f"corpus_digest is {str(info['corpus_digest'])[:80]!r}, not a SHA-256 (64 hex digits)")
    if not isinstance(info["index_spec"], str):
        raise bad(f"index_spec is {info['index_spec']!r}, not an index spec string")
    return info


def _open_shards(dirs: Sequence[str | os.PathLike], verify: str) -> list:
    """Open and verify the shard knowledge bases, ordered by slice; KnowledgeBaseError unless they are exactly the N
    slices of one corpus encoded by one encoder."""
    if not dirs:
        raise ConfigError("rag index merge: give the shard directories that `rag index build --shard i/N` wrote")
    shards = []
    for d in dirs:
        kb = KnowledgeBase.open(d, verify=verify)  # a missing or damaged file: IntegrityError naming it
        info = kb.manifest.build.get("shard")
        if not isinstance(info, dict):
            raise KnowledgeBaseError(f"{d}: is a knowledge base but not a shard (its manifest has no build.shard record); "
                                     "give the directories written by `rag index build --shard i/N`")
        shards.append((check_shard_record(info, Path(d) / "manifest.json"), kb))
    first_info, first = shards[0]
    n_shards = first_info["count"]
    for info, kb in shards:
        for key, what in (("count", "number of shards"), ("corpus_digest", "corpus"), ("corpus_passages", "corpus size"),
                          ("index_spec", "index spec")):
            if info.get(key) != first_info.get(key):
                raise KnowledgeBaseError(f"{kb.path}: its {what} ({info.get(key)}) differs from {first.path}'s "
                                         f"({first_info.get(key)}); all shards must come from one `rag index build --shard i/N` "
                                         "command line, varying only i")
        if (kb.encoder.get("fingerprint") != first.encoder.get("fingerprint")
                or kb.manifest.query_encoder != first.manifest.query_encoder):
            raise KnowledgeBaseError(f"{kb.path}: was encoded by {kb.encoder.get('name')} (fingerprint "
                                     f"{str(kb.encoder.get('fingerprint'))[:12]}), {first.path} by {first.encoder.get('name')} "
                                     f"({str(first.encoder.get('fingerprint'))[:12]}); rebuild the shards with one encoder")
    by_index: dict[int, object] = {}
    for info, kb in shards:
        if info["index"] in by_index:
            raise KnowledgeBaseError(f"shard {info['index']}/{n_shards} is given twice: "
                                     f"{by_index[info['index']].path} and {kb.path}")
        by_index[info["index"]] = kb
    if len(by_index) < n_shards:  # name a few of the missing ones (never a list of count items: count comes from a file)
        missing = list(itertools.islice((i for i in range(n_shards) if i not in by_index), 5))
        more = ", ..." if n_shards - len(by_index) > len(missing) else ""
        raise KnowledgeBaseError(f"shard(s) {', '.join(f'{i}/{n_shards}' for i in missing)}{more} missing: got {len(shards)} of "
                                 f"{n_shards}; build them with `rag index build --shard i/{n_shards}` (same options) "
                                 f"and pass every "
                                 "shard directory to `rag index merge`")
    ordered = [by_index[i] for i in range(n_shards)]
    for kb in ordered:
        info = kb.manifest.build["shard"]
        if info["stop"] - info["start"] != len(kb):
            raise KnowledgeBaseError(f"{kb.path}: holds {len(kb)} passages but its shard record says rows "
                                     f"{info['start']}–{info['stop']}")
    return ordered


UNVERIFIED_INPUTS = "unverified_inputs"
"""The manifest ``build`` field of a knowledge base made from inputs whose checksums were not all verified (``rag index
merge --verify size|none``): it serves as ``<version>+unverified`` (:attr:`KnowledgeBase.served_version`), since its
files are what its manifest records but what they hold was never proven to be what the shards recorded."""


def merge_shards(
    out: str | os.PathLike,
    shard_dirs: Sequence[str | os.PathLike],
    *,
    index: Optional[str] = None,
    bm25: bool = False,
    verify: str = "full",
    show_progress: bool = True,
    overwrite: bool = False,
    max_memory: Optional[int | str] = None,
):
    """Merge the shard knowledge bases `shard_dirs` (any order) into one knowledge base at `out`.

    The embeddings are concatenated block by block into a temporary file beside `out` (never into RAM) and the index is
    built from that file in blocks, so the merge needs the disk of the result twice over but memory only for the
    passages' text, the index and one block; `max_memory` as for :meth:`KnowledgeBase.build`. `index` overrides
    the spec recorded in the shards. `verify` other than ``"full"`` marks the result (``build.unverified_inputs``, so it
    serves as ``<version>+unverified``): a shard altered in place would otherwise come out with fresh checksums.
    Returns the opened :class:`~rag.knowledge.knowledge_base.KnowledgeBase`.
    """
    out = Path(out)
    check_output_dir(out, overwrite, replaces=is_knowledge_base, kind="knowledge base")
    shards = _open_shards(shard_dirs, verify)
    first = shards[0]
    info = first.manifest.build["shard"]
    spec = IndexSpec.parse(index or info["index_spec"])
    n = sum(len(kb) for kb in shards)
    check_fits(spec, n, first.dim)
    check_memory(spec, n, first.dim, max_memory, chunk_rows=0)  # before any passage is read
    passages = [p for kb in shards for p in kb.all_passages()]
    if len(passages) != info["corpus_passages"] or passages_digest(passages) != info["corpus_digest"]:
        raise KnowledgeBaseError(f"the {len(shards)} shards hold {len(passages)} passages whose digest differs from the corpus "
                                 f"they record ({info['corpus_passages']} passages); rebuild the shards")
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.merge-", dir=out.parent))
    try:
        merged_file = scratch / "embeddings.npy"
        offset, row = create_npy(merged_file, (n, first.dim)), 0
        fd = os.open(merged_file, os.O_WRONLY)
        try:  # block by block through one buffer: no shard's vectors are ever held whole
            with tqdm(total=n, desc="merge embeddings", unit="vec", disable=not show_progress, leave=False) as bar:
                for kb in shards:
                    for start, block in NpyVectors(Path(kb.path) / "embeddings.npy").blocks(1 << 16):
                        write_rows(fd, offset, row + start, block)
                        bar.update(block.shape[0])
                    row += len(kb)
            os.fsync(fd)
        finally:
            os.close(fd)
        build = {k: v for k, v in first.manifest.build.items() if k not in ("shard", "index_seconds", "bytes_per_vector")}
        build["merged_shards"] = [{"path": str(Path(kb.path).resolve()), "version": kb.version} for kb in shards]
        build["encode_seconds"] = round(sum(float(kb.manifest.build.get("encode_seconds", 0.0)) for kb in shards), 3)
        if verify != "full" or any(kb.unverified_inputs for kb in shards):
            build[UNVERIFIED_INPUTS] = {"verify": verify, "shards": [str(Path(kb.path).resolve()) for kb in shards]}
        merged = KnowledgeBase.from_embeddings(
            passages, merged_file, first.encoder, out, index=spec, query_encoder=first.manifest.query_encoder, bm25=bm25,
            show_progress=show_progress, overwrite=overwrite, build_info=build, max_memory=max_memory, link_file=True,
        )
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(scratch)
    return merged
