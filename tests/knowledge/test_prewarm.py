"""KnowledgeBase.prewarm and the slot's pre-warming of a new version before its swap.

Residency is read from /proc/self/smaps: the resident bytes of each of this process's file
mappings (pages mapped into the process, so a request reading them takes no page fault).
``release_pages`` first drops them (``MADV_DONTNEED``), so every test starts from mappings
with nothing resident and can fail.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import rag.knowledge.pagecache as pagecache
import rag.utils.checksums as checksums
from rag.knowledge.hotswap import KnowledgeBaseSlot
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.knowledge.retriever import DenseRetriever
from rag.utils.errors import ConfigError, IntegrityError, KnowledgeBaseError, RagError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prewarm reads /proc/self/maps (Linux)")

N, DIM = 3000, 32
ENCODER = {"name": "random", "dim": DIM, "fingerprint": "random32"}


def _passages(tag: str) -> list[Passage]:
    return [Passage(f"p{i}", f"Title {i}", f"[{tag}] passage {i} " + "word " * (i % 17)) for i in range(N)]


@pytest.fixture(scope="module")
def kb_dirs(tmp_path_factory) -> dict[str, str]:
    """Two HNSW knowledge bases over the same vectors, texts tagged [A] / [B], and a damaged copy of B."""
    root = tmp_path_factory.mktemp("prewarm_kbs")
    vecs = np.random.default_rng(0).standard_normal((N, DIM)).astype(np.float32)
    out = {}
    for tag in "AB":
        KnowledgeBase.from_embeddings(_passages(tag), vecs, ENCODER, root / tag, index="hnsw:m=8,ef_construction=16",
                                      show_progress=False)
        out[tag] = str(root / tag)
    bad = root / "B_corrupt"
    import shutil

    shutil.copytree(root / "B", bad)
    data = bytearray((bad / "embeddings.npy").read_bytes())
    data[-5] ^= 0xFF
    (bad / "embeddings.npy").write_bytes(bytes(data))
    out["corrupt"] = str(bad)
    return out


def _rss() -> dict[tuple[int, int], int]:
    """Resident bytes of each mapping of this process, by (start, end) address."""
    out, cur = {}, None
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                cur = (int(m.group(1), 16), int(m.group(2), 16))
            elif line.startswith("Rss:") and cur is not None:
                out[cur] = int(line.split()[1]) * 1024
    return out


def _residency(kb: KnowledgeBase) -> dict[str, tuple[int, int]]:
    """{file name: (resident bytes, mapped bytes)} over the knowledge base's own mappings."""
    rss = _rss()
    out: dict[str, tuple[int, int]] = {}
    for name, start, end in kb._own_mappings():
        r, size = out.get(name, (0, 0))
        out[name] = (r + rss.get((start, end), 0), size + end - start)
    return out


def _served_files(path: str) -> set[str]:
    p = Path(path).resolve()
    return {str(p / "index.faiss"), str(p / "embeddings.npy")} | {str(f) for f in (p / "passages").glob("*.arrow")}


def _cold(path: str) -> KnowledgeBase:
    """Open a knowledge base and drop whatever opening it mapped in."""
    kb = KnowledgeBase.open(path, verify="none")
    kb.release_pages()
    return kb


# ---------------------------------------------------------------------------------------- KnowledgeBase.prewarm


def test_prewarm_maps_every_page_of_every_served_file(kb_dirs):
    kb = _cold(kb_dirs["A"])
    before = _residency(kb)
    assert set(before) == _served_files(kb_dirs["A"])  # the index, the embeddings and every Arrow shard
    assert all(r == 0 for r, _ in before.values()), before  # nothing resident: the test can fail
    done = kb.prewarm()
    after = _residency(kb)
    assert done == sum(size for _, size in after.values()) == sum(kb.mapped_files().values()) > 0
    assert all(r == size for r, size in after.values()), after
    # ... and searching afterwards still returns the same results as a fresh, unwarmed object
    q = np.random.default_rng(1).standard_normal((4, DIM)).astype(np.float32)
    fresh = KnowledgeBase.open(kb_dirs["A"], verify="none")
    np.testing.assert_array_equal(kb.search(q, 5)[1], fresh.search(q, 5)[1])
    torch.testing.assert_close(kb.get_embeddings(np.arange(7)), fresh.get_embeddings(np.arange(7)))


def test_prewarm_without_populate_support_touches_every_page(kb_dirs, monkeypatch):
    """Kernels before 5.14 reject MADV_POPULATE_READ (EINVAL): every page is then read by touching it."""
    monkeypatch.setattr(pagecache, "_MADV_POPULATE_READ", 12345)  # an advice no kernel knows -> EINVAL
    kb = _cold(kb_dirs["A"])
    assert all(r == 0 for r, _ in _residency(kb).values())
    kb.prewarm(chunk=1 << 16, pause=0)
    assert all(r == size for r, size in _residency(kb).values())


def test_prewarm_warms_only_its_own_mappings(kb_dirs):
    """A second object open on the same directory (the slot keeps the previous one for swap_back) maps
    the same files again; prewarming one must not spend time and memory on the other's mappings."""
    a1, a2 = _cold(kb_dirs["A"]), _cold(kb_dirs["A"])
    assert a1.prewarm() == sum(size for _, size in _residency(a1).values())
    assert all(r == size for r, size in _residency(a1).values())
    assert all(r == 0 for r, _ in _residency(a2).values())


def test_prewarm_pauses_between_steps(kb_dirs, monkeypatch):
    """It yields after every step (the requests of the version serving meanwhile come first): `pause` seconds after a
    step that found its pages in the page cache, as long as the step took after one that read the disk. The clock and
    the sleep are this module's stand-ins, so the pauses are compared exactly, with no timing assertion."""
    kb = _cold(kb_dirs["A"])
    sleeps, ticks = [], []
    real_sleep, real_clock, me = pagecache.time.sleep, pagecache.time.monotonic, threading.get_ident()
    step_seconds = 0.25  # every step "takes" a quarter second on the stand-in clock

    def clock():
        if threading.get_ident() != me:
            return real_clock()
        ticks.append(step_seconds * len(ticks))
        return ticks[-1]

    # time.sleep / time.monotonic are the module's: other threads (a previous test's background release worker) use
    # them too, so stand in for this thread's calls only and let the others really sleep.
    monkeypatch.setattr(pagecache.time, "sleep", lambda s: sleeps.append(s) if threading.get_ident() == me else real_sleep(s))
    monkeypatch.setattr(pagecache.time, "monotonic", clock)
    chunk, pause = 1 << 16, 0.002
    steps = sum(-(-size // chunk) for size in kb.mapped_files().values())
    assert steps > 1
    kb.prewarm(chunk=chunk, pause=pause)  # cold: a step reading the disk leaves it idle for as long as it took
    assert len(sleeps) == steps and set(sleeps) <= {pause, step_seconds}, sorted(set(sleeps))
    assert len(ticks) == 2 * steps  # one clock reading before and one after each step
    sleeps.clear()
    kb.prewarm(chunk=chunk, pause=pause)  # every page cached now: exactly `pause` after each step
    assert sleeps == [pause] * steps


def test_prewarm_in_memory_closed_and_bad_arguments(kb_dirs):
    mapped = KnowledgeBase.open(kb_dirs["A"], verify="none")  # maps the same files: not the in-memory copy's
    mem = KnowledgeBase.open(kb_dirs["A"], verify="none", mmap=False)
    assert mapped.mapped_files() and mem.mapped_files() == {} and mem.prewarm() == 0  # nothing mapped: nothing to do
    kb = KnowledgeBase.open(kb_dirs["A"], verify="none")
    with pytest.raises(RagError, match="chunk"):
        kb.prewarm(chunk=0)
    with pytest.raises(RagError, match="pause"):
        kb.prewarm(pause=-1)
    assert kb.close()
    with pytest.raises(KnowledgeBaseError, match="closed"):
        kb.prewarm()


# ---------------------------------------------------------------------------------------- the slot


class _Recording(DenseRetriever):
    """A dense retriever that records, at each commit (under the slot's lock), the new version and
    how much of its mapped files was resident at that moment."""

    def __init__(self, kb):
        super().__init__(kb, types.SimpleNamespace(dim=DIM))
        self.commits: list[tuple[str, dict]] = []

    def set_knowledge_base(self, kb, **kw):
        self.commits.append((kb.served_version, _residency(kb)))  # as the slot and answers report it
        super().set_knowledge_base(kb, **kw)


def test_swap_prewarms_the_new_version_before_the_commit(kb_dirs):
    r = _Recording(KnowledgeBase.open(kb_dirs["A"], verify="none"))
    slot = KnowledgeBaseSlot(r, background_release=False)
    res = slot.swap(kb_dirs["B"])
    version, resident = r.commits[-1]
    assert version == res.new_version == slot.version
    assert set(resident) == _served_files(kb_dirs["B"])
    assert all(rb == size for rb, size in resident.values()), resident
    assert res.prewarmed_bytes == sum(size for _, size in resident.values()) > 0
    assert 0 <= res.prewarm_seconds <= res.seconds


def test_swap_without_prewarm_leaves_pages_to_the_first_requests(kb_dirs):
    r = _Recording(KnowledgeBase.open(kb_dirs["A"], verify="none"))
    slot = KnowledgeBaseSlot(r, prewarm=False, background_release=False)
    res = slot.swap(kb_dirs["B"])
    _, resident = r.commits[-1]
    assert res.prewarmed_bytes == 0 and res.prewarm_seconds == 0
    emb = str(Path(kb_dirs["B"]).resolve() / "embeddings.npy")
    assert resident[emb][0] < resident[emb][1]  # opening touched the header at most
    res2 = slot.swap(kb_dirs["A"], prewarm=True)  # per-call override
    assert res2.prewarmed_bytes > 0 and all(rb == size for rb, size in r.commits[-1][1].values())


def test_swap_back_prewarms_the_version_it_returns_to(kb_dirs):
    r = _Recording(KnowledgeBase.open(kb_dirs["A"], verify="none"))
    slot = KnowledgeBaseSlot(r, keep_loaded=1, background_release=False)
    va = slot.version
    slot.swap(kb_dirs["B"])
    old = slot._history[-1].kb
    old.release_pages()  # e.g. reclaimed while B served
    assert all(rb == 0 for rb, _ in _residency(old).values())
    del old
    back = slot.swap_back(verify="none")  # (verify="full" would read every file to hash it again)
    version, resident = r.commits[-1]
    assert back.new_version == version == va and back.load_seconds == 0.0  # still open, and nothing verified
    assert back.prewarmed_bytes > 0 and all(rb == size for rb, size in resident.values())


def test_prewarm_failure_does_not_fail_the_swap(kb_dirs, monkeypatch, caplog):
    def broken(self, **kw):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(KnowledgeBase, "prewarm", broken)
    r = _Recording(KnowledgeBase.open(kb_dirs["A"], verify="none"))
    slot = KnowledgeBaseSlot(r, background_release=False)
    with caplog.at_level(logging.WARNING, logger="rag.knowledge.hotswap"):
        res = slot.swap(kb_dirs["B"])
    assert slot.version == res.new_version != res.old_version and res.prewarmed_bytes == 0
    assert any("pre-warm" in rec.getMessage() and "Input/output error" in rec.getMessage() for rec in caplog.records)
    q = torch.from_numpy(np.random.default_rng(2).standard_normal((2, DIM)).astype(np.float32))
    assert {p.text[1] for ps in r.search(q, 3).passages for p in ps} == {"B"}


def test_prewarm_runs_after_verification_and_a_refused_swap_prewarms_nothing(kb_dirs, monkeypatch):
    events = []
    hash_files, prewarm = checksums.sha256_files, KnowledgeBase.prewarm

    def hashing(paths, **kw):
        events.append("verify")
        return hash_files(paths, **kw)

    def warming(self, **kw):
        events.append("prewarm")
        return prewarm(self, **kw)

    monkeypatch.setattr(checksums, "sha256_files", hashing)
    monkeypatch.setattr(KnowledgeBase, "prewarm", warming)
    r = _Recording(KnowledgeBase.open(kb_dirs["A"], verify="none"))
    slot = KnowledgeBaseSlot(r, verify_nice=None, background_release=False)
    va = slot.version
    with pytest.raises(IntegrityError, match="SHA-256"):
        slot.swap(kb_dirs["corrupt"])
    assert events == ["verify"] and slot.version == va and r.commits == []
    slot.swap(kb_dirs["B"])
    assert events == ["verify", "verify", "prewarm"] and len(r.commits) == 1


def test_concurrent_swaps_with_prewarm_stay_serialised_and_consistent(kb_dirs):
    """Two admin threads swapping while two request threads retrieve: every swap commits exactly once,
    in a chain (each one's old version is the previous one's new version), and no request mixes versions."""
    kb_a = KnowledgeBase.open(kb_dirs["A"], verify="none")
    tags = {kb_a.version: "A", KnowledgeBase.open(kb_dirs["B"], verify="none").version: "B"}
    r = DenseRetriever(kb_a, types.SimpleNamespace(dim=DIM))
    del kb_a
    slot = KnowledgeBaseSlot(r, keep_loaded=1)
    stop = threading.Event()
    bad: list[str] = []
    served = [0]
    results, errors = [], []

    def request(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            q = torch.from_numpy(rng.standard_normal((2, DIM)).astype(np.float32))
            try:
                out = r.search(q, 4)
            except Exception as e:  # noqa: BLE001 - counted
                bad.append(repr(e))
                continue
            got = {p.text[1] for ps in out.passages for p in ps}
            if got != {tags[out.kb_version.removesuffix("+unverified")]}:  # size-verified swaps are reported unverified
                bad.append(f"{out.kb_version}: {got}")
            served[0] += 1

    def admin(order):
        try:
            for tag in order:
                results.append(slot.swap(kb_dirs[tag], verify="size"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    readers = [threading.Thread(target=request, args=(s,)) for s in range(2)]
    admins = [threading.Thread(target=admin, args=(order,)) for order in ("BAB", "ABA")]
    for t in readers + admins:
        t.start()
    for t in admins:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert errors == [] and bad == [] and served[0] > 0
    chain = sorted(results, key=lambda res: res.seq)
    assert [res.seq for res in chain] == list(range(1, 7)) and slot.swap_count == 6
    assert all(prev.new_version == nxt.old_version for prev, nxt in zip(chain, chain[1:]))
    assert chain[-1].new_version == slot.version and all(res.prewarmed_bytes > 0 for res in chain)
    assert slot.wait_released(timeout=30)


def test_slot_rejects_bad_prewarm_settings():
    r = types.SimpleNamespace(knowledge_base=None, set_knowledge_base=lambda kb, **kw: None)
    with pytest.raises(ConfigError, match="prewarm"):
        KnowledgeBaseSlot(r, prewarm="yes")
    with pytest.raises(ConfigError, match="prewarm_chunk"):
        KnowledgeBaseSlot(r, prewarm_chunk=0)
    with pytest.raises(ConfigError, match="prewarm_pause"):
        KnowledgeBaseSlot(r, prewarm_pause=-0.5)
