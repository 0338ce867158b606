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
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np
import torch

from rag.knowledge import pagecache
from rag.knowledge.bm25 import BM25Index
from rag.knowledge.build import CHUNK_ROWS, build_from_encoder, write_from_embeddings
from rag.knowledge.gpu import to_gpu
from rag.knowledge.index import IndexSpec, read_index, search_index, write_index
from rag.knowledge.manifest import (
    BM25_DIR,
    EMBEDDINGS,
    INDEX,
    MANIFEST,
    PASSAGES,
    Manifest,
    check_arrow_files,
    check_finite,
    check_version,
    verify_kb_files,
)
from rag.knowledge.pagecache import PREWARM_CHUNK, PREWARM_PAUSE, RELEASE_CHUNK
from rag.knowledge.passages import Passage
from rag.utils.checksums import Verify
from rag.utils.errors import ConfigError, CorpusError, IntegrityError, KnowledgeBaseError, RagError
from rag.utils.files import read_json
from rag.utils.validate import check_choice, check_number, check_positive_int

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
        self._use = threading.Condition(threading.Lock())  # guards _in_use / _closed
        self._in_use = 0
        self._closed = False
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

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        """True once :meth:`close` has freed the index and mappings (reads then raise)."""
        return self._closed

    @property
    def in_flight(self) -> int:
        """Number of reads (and :meth:`in_use` blocks) running on this knowledge base now."""
        return self._in_use

    @contextlib.contextmanager
    def in_use(self) -> Iterator["KnowledgeBase"]:
        """Keep this knowledge base open for the block: :meth:`close` waits until it ends.

        Every read method holds it for its own duration; a caller combining several reads
        (search, then passages and embeddings of the hits) can hold it around all of them.
        Nests. Raises KnowledgeBaseError if the knowledge base is already closed.
        """
        with self._use:
            if self._closed:
                raise KnowledgeBaseError(
                    f"{self.path}: knowledge base {self.version} was closed (swapped out and released); "
                    "read from the one serving now, or open the directory again"
                )
            self._in_use += 1
        try:
            yield self
        finally:
            with self._use:
                self._in_use -= 1
                if self._in_use == 0:
                    self._use.notify_all()

    def mapped_addresses(self) -> list[int]:
        """An address inside each large read-only file mapping this knowledge base owns: the
        memory-mapped embeddings, the passages' Arrow columns and the codes of a memory-mapped
        flat / HNSW / HNSW-SQ8 index (empty once closed, or for in-memory copies)."""
        return pagecache.mapped_addresses(self._embeddings, self._passages, self._index)

    def release_pages(self, *, chunk: int = RELEASE_CHUNK, pause: float = 0.0) -> int:
        """Drop this process's resident pages of the knowledge base's read-only file mappings
        (``madvise(MADV_DONTNEED)``, `chunk` bytes per call, sleeping `pause` s between calls).

        Non-destructive: the data stays in the page cache and a read running meanwhile faults
        it back in and gets the same results. Done before freeing, it leaves faiss's destructor
        (which holds the GIL) almost nothing to unmap; the madvise calls themselves release the
        GIL. Returns the bytes advised (0 off Linux, when closed, or when nothing is mapped).
        """
        if not sys.platform.startswith("linux"):
            return 0
        with self._use:
            if self._closed:
                return 0
            self._in_use += 1  # keeps the mappings alive while we advise them
        try:
            addresses = self.mapped_addresses()
            if not addresses:
                return 0
            return pagecache.madvise_dontneed(addresses, chunk, pause)
        finally:
            with self._use:
                self._in_use -= 1
                if self._in_use == 0:
                    self._use.notify_all()

    def mapped_files(self) -> dict[str, int]:
        """The files of this knowledge base that this process serves from through memory maps, with
        their mapped bytes: ``{path: bytes}`` (Linux; empty elsewhere, when closed, or for in-memory
        copies). With the default ``mmap=True``: the FAISS index, ``embeddings.npy`` and the passages'
        Arrow files — the pages a request reads (graph and vectors, the rows of its hits)."""
        if not sys.platform.startswith("linux"):
            return {}
        out: dict[str, int] = {}
        for name, start, end in self._own_mappings():
            out[name] = out.get(name, 0) + (end - start)
        return out

    def _own_mappings(self) -> list[tuple[str, int, int]]:
        """(path, start, end) of this object's read-only mappings of files in its directory. Where a file
        is mapped more than once (another KnowledgeBase open on the same directory, e.g. the previous
        object kept for swap_back), only the mappings holding this object's data count; a file none of
        whose mappings can be attributed (an index type :meth:`mapped_addresses` does not know) counts
        with all of them, provided this object maps anything at all (an in-memory copy maps nothing,
        and must not claim another object's mappings)."""
        if self._closed:
            return []
        return pagecache.own_mappings(self.path, self.mapped_addresses() + pagecache.arrow_addresses(self._passages))

    def prewarm(self, *, chunk: int = PREWARM_CHUNK, pause: float = PREWARM_PAUSE) -> int:
        """Make every page a request can touch resident and mapped before requests use this knowledge base.

        Requests read the memory-mapped files (:meth:`mapped_files`) at random: an HNSW search visits
        graph nodes and vectors all over the index, then the rows of its hits in the embeddings and
        passages. A page that is not in memory costs a request a disk read (a fresh or just-evicted
        version: hundreds of ms to seconds per request). This walks each mapping in `chunk`-byte steps
        with ``madvise(MADV_POPULATE_READ)`` (a ctypes call, which releases the GIL), so the pages are
        read into the page cache if needed and mapped into this process, and later requests take no
        page fault at all. A step with pages missing from the page cache first asks for all of them at
        once (``MADV_WILLNEED``): populating alone faults them in a page at a time (measured: 130 MB in
        43 s vs 0.3 s). Gently: after a step that found all its pages cached it sleeps `pause`
        seconds; after one that read from the disk (``mincore`` said some pages were missing) it leaves
        the disk idle as long as the read took, so that page faults of the knowledge base serving
        meanwhile are not queued behind it. Off the request path (:class:`~rag.knowledge.hotswap.KnowledgeBaseSlot`
        calls it between verification and the swap).

        Returns the bytes prewarmed (0 off Linux, when closed, or when nothing is mapped). Where
        MADV_POPULATE_READ is unavailable (Linux < 5.14) every page is touched instead.

        Raises:
            KnowledgeBaseError: closed meanwhile (the caller decides whether that matters; the slot
                logs prewarm failures and swaps anyway).
        """
        check_positive_int(chunk, "prewarm chunk (bytes)")
        check_number(pause, "prewarm pause (seconds)", low=0)
        if not sys.platform.startswith("linux"):
            return 0
        with self.in_use():  # keeps the mappings alive while we read them; raises if closed
            regions = [(start, end) for _, start, end in self._own_mappings()]
            return pagecache.populate(regions, int(chunk), float(pause)) if regions else 0

    def close(self, *, timeout: Optional[float] = None, chunk: int = RELEASE_CHUNK, pause: float = 0.0) -> bool:
        """Free the index, embeddings, passages and BM25 index once no read is running.

        Waits up to `timeout` seconds (None: forever) for a moment when no read or :meth:`in_use`
        block is running, then refuses new ones (KnowledgeBaseError naming the version) and frees.
        Mapped pages are released first (as :meth:`release_pages`) so that freeing stalls no
        other thread. Returns False, closing nothing, if reads were still running at the timeout.
        Idempotent. Never call it inside an :meth:`in_use` block of the same knowledge base.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._use:
            while self._in_use:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._use.wait(left)
            if self._closed:
                return True
            self._closed = True  # from here on no read can start, and none is running
        if sys.platform.startswith("linux"):
            addresses = self.mapped_addresses()
            if addresses:
                pagecache.madvise_dontneed(addresses, chunk, pause)
        # freed here (unless a caller kept, e.g., the embeddings array)
        self._index = self._embeddings = self._passages = self._bm25 = self._gpu = self._pool = None
        logger.debug("closed knowledge base %s (%s)", self.path, self.version)
        return True

    def __len__(self) -> int:
        return self.manifest.count

    def __repr__(self) -> str:
        closed = ", closed" if self._closed else ""
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
        import datasets

        path = Path(path)
        if path.exists() and not path.is_dir():
            raise KnowledgeBaseError(f"{path} is a file, not a knowledge-base directory; give the directory `rag index "
                                     f"build --out` wrote")
        if not path.is_dir():
            raise KnowledgeBaseError(f"{path}: no such knowledge-base directory; build one with `rag index build "
                                     f"--out {path} ...`")
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise KnowledgeBaseError(f"{mpath}: missing; {path} is not a (complete) knowledge base — rebuild it with "
                                     f"`rag index build`")
        manifest = Manifest.from_dict(read_json(mpath, fix="the file is damaged — rebuild the knowledge base"), mpath)
        verify_kb_files(path, manifest, verify, hash_nice=hash_nice)
        check_arrow_files(path / PASSAGES)
        try:
            passages = datasets.load_from_disk(str(path / PASSAGES), keep_in_memory=not mmap)
        except Exception as e:  # datasets raises several types for damaged dirs
            raise IntegrityError(f"{path / PASSAGES}: cannot be read ({e}); rebuild the knowledge base") from e
        try:
            embeddings = np.load(path / EMBEDDINGS, mmap_mode="r" if mmap else None, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise IntegrityError(f"{path / EMBEDDINGS}: cannot be read ({e}); rebuild the knowledge base") from e
        index = read_index(path / INDEX, mmap=mmap)
        n = manifest.count
        if len(passages) != n or embeddings.shape != (n, manifest.dim) or index.ntotal != n or index.d < manifest.dim:
            raise IntegrityError(
                f"{path}: sizes disagree (manifest count={n}, dim={manifest.dim}; passages={len(passages)}, "
                f"embeddings={tuple(embeddings.shape)}, index ntotal={index.ntotal}); rebuild the knowledge base"
            )
        if verify != "none":
            check_finite(embeddings, path / EMBEDDINGS)
        if verify == "full":  # the id is recomputed from the verified content, never read from the manifest
            check_version(path, manifest, passages)
        bm25 = None
        if (path / BM25_DIR).is_dir():
            bm25 = BM25Index.load(path / BM25_DIR)
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
        """Top-k search: `(B, D)` query vectors -> scores `(B, k)` float32, rows `(B, k)` int64."""
        if isinstance(query_embeds, torch.Tensor):
            query_embeds = query_embeds.detach().to("cpu", torch.float32).numpy()
        q = np.ascontiguousarray(query_embeds, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise KnowledgeBaseError(
                f"{self.path}: query vectors have shape {tuple(q.shape)} but this knowledge base holds dim={self.dim} vectors "
                f"from {self.encoder.get('name')}; use a query encoder of dimension {self.dim}"
            )
        check_number(k, f"k (passages to return; {self.path} holds {len(self)})", integer=True, low=1, high=len(self))
        pool = self._pool
        if pool is not None:
            return pool.search(q, int(k))
        with self.in_use():
            gpu = self._gpu
            if gpu is not None:
                return gpu.search(q, int(k))
            return search_index(self._index, q, int(k), self._spec)

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
