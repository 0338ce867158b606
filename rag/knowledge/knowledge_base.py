"""A knowledge base: passages + their embeddings + a FAISS index, as one immutable directory.

Layout of a knowledge-base directory::

    manifest.json     format version, version id, encoder identity, dim, metric, count,
                      index spec, build parameters, per-file SHA-256 checksums
    passages/         the passages (id, title, text) as Arrow via `datasets`, memory-mapped
    embeddings.npy    (N, D) stored passage embeddings, memory-mapped; RAG recomputes its
                      doc scores from these so the query encoder gets gradients
    index.faiss       the FAISS index over the embeddings
    bm25/             optional sparse index over the same passages

A directory is built in a hidden temporary sibling and renamed into place, so a
killed build leaves nothing that :meth:`KnowledgeBase.open` accepts. A written
knowledge base is never modified: :meth:`KnowledgeBase.add` writes a new version
whose manifest names its parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np
import torch

from rag.knowledge.build import CHUNK_ROWS, build_from_encoder, write_from_embeddings
from rag.knowledge.directory import read_directory
from rag.knowledge.gpu import to_gpu
from rag.knowledge.index import IndexSpec, search_index, write_index
from rag.knowledge.lifetime import Lifetime
from rag.knowledge.manifest import (
    PASSAGES,
    Manifest,
    check_arrow_files,
    check_version,
    verify_kb_files,
)
from rag.knowledge.pagecache import PREWARM_CHUNK, PREWARM_PAUSE, RELEASE_CHUNK, MappedPages
from rag.knowledge.passages import Passage
from rag.knowledge.rescore import rescore_candidates
from rag.utils.checksums import Verify
from rag.utils.errors import ConfigError, CorpusError, KnowledgeBaseError, RagError
from rag.utils.validate import check_choice, check_number

if TYPE_CHECKING:  # pragma: no cover
    from rag.knowledge.encoders import TextEncoder

logger = logging.getLogger(__name__)

class KnowledgeBase:
    """An opened, verified knowledge-base directory. Thread-safe for concurrent reads.

    Build one with :meth:`build` (passages + encoder) or :meth:`from_embeddings`
    (precomputed vectors); open one with :meth:`open`. :meth:`close` frees its index and
    mappings once no read is running; a call that spans several reads holds :meth:`in_use`.
    """

    def __init__(self, path: Path, manifest: Manifest, passages, embeddings: np.ndarray, index, bm25=None):
        self.path = path
        self.manifest = manifest
        self._passages = passages
        self._embeddings = embeddings
        self._index = index
        self._bm25 = bm25
        self._gpu = None  # a faiss GPU copy of the index (use_gpu), searched instead of it
        self._pool = None  # Ray actors serving this version's search (use_search_pool), asked instead of the index
        self._spec = IndexSpec.from_dict(manifest.index)
        self.lifetime = Lifetime(f"{path}: knowledge base {manifest.version}")
        """The reference-counted lifetime: reads hold it, :meth:`close` waits for them."""
        self.pages = MappedPages(path, self, attrgetter("_embeddings", "_passages", "_index"), self.lifetime)
        """The page-cache part: its memory-mapped files' pages released, prewarmed, listed."""
        self.verified: Verify = "full"
        """How its files were checked when opened: "full" (every SHA-256), "size" or "none" (see :meth:`open`)."""

    # ------------------------------------------------------------------ properties
    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def served_version(self) -> str:
        """The version id to report with answers: :attr:`version` when every file was checked against its
        SHA-256 (``verified == "full"``) and it was made from verified inputs (:attr:`unverified_inputs`), else
        ``"<version>+unverified"`` — content opened with ``verify="size"``/``"none"``, or merged from shards that were,
        may differ from what the version id names."""
        return self.version if self.verified == "full" and not self.unverified_inputs else f"{self.version}+unverified"

    @property
    def unverified_inputs(self) -> bool:
        """True when this knowledge base was made from inputs whose checksums were not all verified (``rag index merge
        --verify size|none``, or :meth:`add` to such a one): its manifest's ``build.unverified_inputs``."""
        return bool(self.manifest.build.get("unverified_inputs"))

    @property
    def dim(self) -> int:
        return self.manifest.dim

    @property
    def metric(self) -> str:
        return self.manifest.metric

    @property
    def encoder(self) -> dict:
        """Identity of the document encoder that produced the embeddings (name, fingerprint, pooling, …)."""
        return self.manifest.encoder

    @property
    def index_spec(self) -> IndexSpec:
        return self._spec

    @property
    def bm25(self):
        """The BM25 index stored with this knowledge base, or None."""
        with self.in_use():
            return self._bm25

    # ------------------------------------------------------------------ lifetime (rag.knowledge.lifetime)
    @property
    def closed(self) -> bool:
        """True once :meth:`close` has freed the index and mappings (reads then raise)."""
        return self.lifetime.closed

    @property
    def in_flight(self) -> int:
        """Number of reads (and :meth:`in_use` blocks) running on this knowledge base now."""
        return self.lifetime.in_flight

    @contextlib.contextmanager
    def in_use(self) -> Iterator["KnowledgeBase"]:
        """Keep this knowledge base open for the block: :meth:`close` waits until it ends. Every read holds it for its
        own duration; a caller combining several reads (search, then the hits' passages) holds it around all of them.
        Nests. Raises KnowledgeBaseError if the knowledge base is already closed."""
        with self.lifetime.hold():
            yield self

    def close(self, *, timeout: Optional[float] = None, chunk: int = RELEASE_CHUNK, pause: float = 0.0) -> bool:
        """Free the index, embeddings, passages and BM25 index once no read is running.

        Waits up to `timeout` seconds (None: forever) for a moment when no read or :meth:`in_use` block is running,
        then refuses new ones (KnowledgeBaseError naming the version) and frees. Mapped pages are released first (as
        :meth:`release_pages`) so that freeing stalls no other thread. Returns False, closing nothing, if reads were
        still running at the timeout. Idempotent. Never call it inside an :meth:`in_use` block of the same knowledge base.
        """
        closed = self.lifetime.close(timeout)
        if closed is False:
            return False
        if closed:
            self.pages.drop(chunk=chunk, pause=pause)
            # freed here (unless a caller kept, e.g., the embeddings array)
            self._index = self._embeddings = self._passages = self._bm25 = self._gpu = self._pool = None
            logger.debug("closed knowledge base %s (%s)", self.path, self.version)
        return True

    # ------------------------------------------------------------------ page cache (rag.knowledge.pagecache)
    def mapped_addresses(self) -> list[int]:
        """:meth:`MappedPages.addresses <rag.knowledge.pagecache.MappedPages.addresses>`."""
        return self.pages.addresses()

    def release_pages(self, *, chunk: int = RELEASE_CHUNK, pause: float = 0.0) -> int:
        """Drop this process's resident pages of the read-only file mappings (:meth:`MappedPages.release
        <rag.knowledge.pagecache.MappedPages.release>`); returns the bytes advised."""
        return self.pages.release(chunk=chunk, pause=pause)

    def mapped_files(self) -> dict[str, int]:
        """``{path: mapped bytes}`` of the files served through memory maps (:meth:`MappedPages.files
        <rag.knowledge.pagecache.MappedPages.files>`)."""
        return self.pages.files()

    def _own_mappings(self) -> list[tuple[str, int, int]]:
        return self.pages.own_mappings()

    def prewarm(self, *, chunk: int = PREWARM_CHUNK, pause: float = PREWARM_PAUSE) -> int:
        """Make every page a request can touch resident and mapped before requests use this knowledge base
        (:meth:`MappedPages.prewarm <rag.knowledge.pagecache.MappedPages.prewarm>`; off the request path: the hot-swap
        slot calls it between verification and the swap); returns the bytes prewarmed."""
        return self.pages.prewarm(chunk=chunk, pause=pause)

    def __len__(self) -> int:
        return self.manifest.count

    def __repr__(self) -> str:
        closed = ", closed" if self.closed else ""
        return (f"KnowledgeBase({str(self.path)!r}, version={self.version}, count={len(self)}, dim={self.dim}, "
                f"index={self._spec.kind}{closed})")

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        passages: Sequence[Passage],
        encoder: "TextEncoder",
        out: str | os.PathLike,
        *,
        index: IndexSpec | str = "hnsw",
        batch_size: int = 64,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        query_encoder: Optional[str] = None,
        bm25: bool = False,
        show_progress: bool = True,
        overwrite: bool = False,
        build_info: Optional[dict] = None,
        max_memory: Optional[int | str] = None,
        chunk_rows: int = CHUNK_ROWS,
    ) -> "KnowledgeBase":
        """Encode `passages` with `encoder`, index them, and write a knowledge base to `out`.

        `query_encoder` optionally names the encoder that queries should use by
        default (DPR pairs a question encoder with the context encoder that built
        the index); without it queries use `encoder` itself. An ``ivf_pq`` index is
        trained on a GPU when faiss sees one, unless `device` is the CPU.
        Bounded memory (:mod:`rag.knowledge.build`): `chunk_rows` passages are encoded
        at a time into a staging file the index is then built from in blocks; a killed
        build resumes from its finished chunks; a spec whose estimated peak exceeds
        `max_memory` (bytes or "16G"; None: 80% of RAM) is refused before encoding.
        """
        manifest = build_from_encoder(passages, encoder, Path(out), index, batch_size=batch_size, device=device, dtype=dtype,
                                      query_encoder=query_encoder, bm25=bm25, show_progress=show_progress, overwrite=overwrite,
                                      build_info=build_info, max_memory=max_memory, chunk_rows=chunk_rows,
                                      index_writer=write_index)
        return cls._written(Path(out), manifest)

    @classmethod
    def _written(cls, out: Path, manifest) -> "KnowledgeBase":
        logger.info("wrote knowledge base %s (%s, %d passages)", out, manifest.version, manifest.count)
        kb = cls.open(out, verify="none")
        kb.verified = "full"  # written and checksummed by this process from embeddings checked finite
        return kb

    @classmethod
    def from_embeddings(
        cls,
        passages: Sequence[Passage],
        embeddings: np.ndarray | str | os.PathLike,
        encoder: dict,
        out: str | os.PathLike,
        *,
        index: IndexSpec | str = "hnsw",
        query_encoder: Optional[dict] = None,
        parent: Optional[str] = None,
        bm25: bool = False,
        show_progress: bool = True,
        overwrite: bool = False,
        build_info: Optional[dict] = None,
        gpu: Optional[bool] = None,
        max_memory: Optional[int | str] = None,
        link_file: bool = False,
    ) -> "KnowledgeBase":
        """Write a knowledge base from passages and their precomputed `(N, D)` embeddings.

        `encoder` is the identity dict of the encoder that produced `embeddings`
        (:meth:`TextEncoder.identity`). Used by :meth:`build`, :meth:`add`, and the
        training-time index refresh, which re-encodes with a fine-tuned encoder.
        `embeddings` is an array, or the path of a ``.npy`` file read in blocks (never
        loaded whole; copied into the directory, or with `link_file` hard-linked: the caller
        then never modifies that file again). `max_memory` as for
        :meth:`build` (the index and a block count against it, not a file's vectors).
        `gpu`: where an ``ivf_pq`` index is trained (:func:`rag.knowledge.index.build_index`;
        None: on a GPU when faiss sees one). The stored index is a CPU index either way.
        """
        out = Path(out)
        manifest = write_from_embeddings(out, passages, embeddings, encoder, index, query_encoder=query_encoder, parent=parent,
                                         bm25=bm25, show_progress=show_progress, overwrite=overwrite, build_info=build_info,
                                         gpu=gpu, max_memory=max_memory, index_writer=write_index,
                                         link=link_file)
        return cls._written(out, manifest)

    def add(
        self,
        passages: Sequence[Passage],
        encoder: "TextEncoder",
        out: str | os.PathLike,
        *,
        batch_size: int = 64,
        show_progress: bool = True,
        overwrite: bool = False,
    ) -> "KnowledgeBase":
        """Write a NEW knowledge base at `out`: this one's passages plus `passages`.

        This knowledge base is left untouched. `encoder` must be the one that built
        it (same weights fingerprint), otherwise old and new vectors would live in
        different spaces: rebuild with :meth:`build` instead.
        """
        ident = encoder.identity()
        if ident.get("fingerprint") != self.encoder.get("fingerprint"):
            raise KnowledgeBaseError(
                f"{self.path}: the encoder given to add() ({ident.get('name')}, fingerprint "
                f"{ident.get('fingerprint', '?')[:12]}) "
                f"is not the one that built this knowledge base ({self.encoder.get('name')}, fingerprint "
                f"{self.encoder.get('fingerprint', '?')[:12]}); use that encoder, or rebuild everything with KnowledgeBase.build"
            )
        new = list(passages)
        with self.in_use():
            old_ids = set(self._passages["id"])
            old_passages = self.all_passages()
            old_vectors = np.array(self._embeddings)
            has_bm25 = self._bm25 is not None
        clash = [p.id for p in new if p.id in old_ids]
        if clash:
            raise CorpusError(f"{self.path}: {len(clash)} new passage id(s) already exist, e.g. {clash[0]!r}; give new "
                              f"passages unique ids")
        vectors = encoder.encode_passages(new, batch_size=batch_size,
                                          show_progress=show_progress) if new else np.zeros((0, self.dim), np.float32)
        return KnowledgeBase.from_embeddings(
            old_passages + new,
            np.concatenate([old_vectors, vectors]),
            self.encoder,
            out,
            index=self._spec,
            query_encoder=self.manifest.query_encoder,
            parent=self.version,
            bm25=has_bm25,
            show_progress=show_progress,
            overwrite=overwrite,
            build_info={"added": len(new), **({} if self.served_version == self.version else  # an unverified parent: so is this
                                               {"unverified_inputs": {"verify": self.verified, "parent": str(self.path)}})},
        )

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | os.PathLike, *, verify: Verify = "full", mmap: bool = True,
             hash_nice: Optional[int] = None) -> "KnowledgeBase":
        """Open and verify a knowledge-base directory.

        `verify="full"` checks every file's SHA-256 against the manifest (reads every
        byte once); `"size"` checks presence and sizes only (for very large
        knowledge bases); `"none"` trusts the directory. `"full"` also recomputes the version id from the verified
        content, refusing a differing recorded id (:func:`~rag.knowledge.manifest.check_version`). Either check refuses a manifest
        that lacks a record for a file this method reads, and embeddings holding NaN/inf
        (:func:`check_finite`). The result's :attr:`verified` says which check ran; only
        ``"full"`` reports its version id plain (:attr:`served_version`). `hash_nice`: hash in a child
        process at this lower priority (see :func:`rag.utils.checksums.sha256_files`), e.g. while the same
        process serves requests from another knowledge base.
        """
        path = Path(path)
        manifest, passages, embeddings, index, bm25 = read_directory(path, verify, mmap=mmap, hash_nice=hash_nice)
        kb = cls(path, manifest, passages, embeddings, index, bm25)
        kb.verified = verify
        return kb

    def recheck(self, verify: Verify = "full", *, hash_nice: Optional[int] = None) -> None:
        """Check this open knowledge base's files against its manifest again, as :meth:`open` did (`verify`: "full"
        hashes every file and recomputes the id; `hash_nice` as in :meth:`open`), and record it in :attr:`verified`.

        Its files are memory-mapped: an edit made in place after opening changes what it serves without changing
        anything in memory, so a version kept open (e.g. for :meth:`KnowledgeBaseSlot.swap_back
        <rag.knowledge.hotswap.KnowledgeBaseSlot.swap_back>`) is re-checked before it serves again.

        Raises:
            IntegrityError: a file no longer matches its recorded checksum (or size), naming it.
        """
        check_choice(verify, "verify", ("full", "size", "none"), error=ConfigError)
        with self.in_use():
            verify_kb_files(self.path, self.manifest, verify, hash_nice=hash_nice)
            check_arrow_files(self.path / PASSAGES)
            if verify == "full" and self.verified != "full":  # opened unverified: its id was never recomputed
                check_version(self.path, self.manifest, self._passages)
        self.verified = verify

    # ------------------------------------------------------------------ reading
    def search(self, query_embeds: np.ndarray | torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k search: `(B, D)` query vectors -> scores `(B, k)` float32, rows `(B, k)` int64. An ``ivf_pq`` index's
        top ``spec.rescore`` candidates are ranked again by their exact score on the stored vectors
        (:func:`~rag.knowledge.rescore.rescore_candidates`)."""
        if isinstance(query_embeds, torch.Tensor):
            query_embeds = query_embeds.detach().to("cpu", torch.float32).numpy()
        q = np.ascontiguousarray(query_embeds, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise KnowledgeBaseError(
                f"{self.path}: query vectors have shape {tuple(q.shape)} but this knowledge base holds dim={self.dim} vectors "
                f"from {self.encoder.get('name')}; use a query encoder of dimension {self.dim}"
            )
        check_number(k, f"k (passages to return; {self.path} holds {len(self)})", integer=True, low=1, high=len(self))
        k = int(k)
        spec = self._spec
        wide = min(len(self), max(k, spec.rescore)) if spec.kind == "ivf_pq" and spec.rescore else k
        pool = self._pool
        if pool is not None:  # the actors search knowledge bases of this version, which re-rank their own candidates
            return pool.search(q, k)
        with self.in_use():
            gpu = self._gpu
            found = gpu.search(q, wide) if gpu is not None else search_index(self._index, q, wide, spec)
            if wide == k or q.shape[0] == 0:
                return found
            return rescore_candidates(q, found[1], self._embeddings, k, spec.metric)  # the PQ's top `wide`, exactly

    def use_search_pool(self, pool) -> None:
        """Answer :meth:`search` through `pool` from now on (a :class:`~rag.knowledge.ray_pool.RayRetrievalPool` over
        this same version, e.g. actors on other machines of a cluster); None searches locally again. Passages,
        embeddings and BM25 are still read here.

        Raises:
            KnowledgeBaseError: the pool serves another version.
        """
        if pool is not None and getattr(pool, "version", None) != self.version:
            raise KnowledgeBaseError(f"{self.path}: the search pool serves knowledge base {getattr(pool, 'version', None)}, "
                                     f"this one is {self.version}; build the pool over this directory")
        self._pool = pool

    def use_gpu(self, devices="all", *, shard: bool = False, fp16: bool = False) -> bool:
        """Search on GPUs from now on (:func:`rag.knowledge.gpu.to_gpu`: ``devices`` "all", an id or a list; ``shard``
        the vectors over them instead of replicating; ``fp16`` storage). True when it did; False, with a warning, when
        search stays on the CPU (faiss without GPU support, no CUDA device, or an HNSW index)."""
        with self.in_use():
            self._gpu = to_gpu(self._index, self._spec, devices, shard=shard, fp16=fp16)
        return self._gpu is not None

    def get_embeddings(self, rows: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Stored embeddings of `rows` (any shape S) as a float32 tensor of shape `(*S, D)`."""
        r = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        flat = r.reshape(-1).astype(np.int64)
        order = np.argsort(flat, kind="stable")  # sorted reads are kinder to a memory map
        out = np.empty((flat.size, self.dim), dtype=np.float32)
        with self.in_use():
            out[order] = self._embeddings[flat[order]]
        return torch.from_numpy(out).view(*r.shape, self.dim)

    def get_passages(self, rows: torch.Tensor | np.ndarray) -> list[list[Passage]]:
        """Passages of a `(B, K)` row array, as B lists of K."""
        r = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        if r.ndim != 2:
            raise RagError(f"rows must be a (batch, k) array, got shape {r.shape}")
        flat = r.reshape(-1).tolist()
        with self.in_use():
            cols = self._passages[flat] if flat else {"id": [], "title": [], "text": []}
        ps = [Passage(i, t, x) for i, t, x in zip(cols["id"], cols["title"], cols["text"])]
        k = r.shape[1]
        return [ps[b * k : (b + 1) * k] for b in range(r.shape[0])]

    def all_passages(self) -> list[Passage]:
        """Every passage, in row order (loads all text into memory)."""
        with self.in_use():
            cols = self._passages[:]
        return [Passage(i, t, x) for i, t, x in zip(cols["id"], cols["title"], cols["text"])]

    def embeddings(self) -> np.ndarray:
        """The `(N, D)` stored embeddings (a read-only memory map; it stays valid while referenced,
        even after :meth:`close`)."""
        with self.in_use():
            return self._embeddings

    def describe(self) -> dict[str, Any]:
        """The manifest plus the path, for `rag index info`."""
        return {"path": str(self.path.resolve()), **self.manifest.to_dict()}
