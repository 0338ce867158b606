"""RayRetrievalPool on a local Ray: the same results as local search, surviving a killed actor, clear errors."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rag.knowledge.knowledge_base import KnowledgeBase  # noqa: E402
from rag.knowledge.passages import Passage  # noqa: E402
from rag.knowledge.ray_pool import RayRetrievalPool  # noqa: E402
from rag.utils.errors import RetrievalError  # noqa: E402

pytestmark = pytest.mark.slow  # starting a local Ray takes ~10-20 s on 2 busy cores


@pytest.fixture(scope="module")
def kb_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    passages = [Passage(f"p{i}", f"title {i}", f"text {i}") for i in range(200)]
    out = tmp_path_factory.mktemp("raykb") / "kb"
    KnowledgeBase.from_embeddings(passages, rng.standard_normal((200, 16)).astype(np.float32), {"name": "random", "dim": 16},
                                  out, index="flat", show_progress=False)
    return out


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_pool_matches_local_search_and_survives_a_killed_actor(kb_dir, local_ray):
    kb = KnowledgeBase.open(kb_dir)
    pool = RayRetrievalPool(kb_dir, n_actors=2, timeout=30)
    try:
        assert len(pool) == 2 and pool.version == kb.version
        q = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
        want = kb.search(q, 5)
        for _ in range(2):  # both actors (round-robin)
            got = pool.search(q, 5)
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        pids = pool.actor_pids()
        os.kill(pids[0], signal.SIGKILL)  # one actor dies mid-service
        for _ in range(4):  # queries go on: retried on the live actor while Ray restarts the dead one
            np.testing.assert_array_equal(pool.search(q, 5)[1], want[1])
        # the restarted actor serves again, in a new process. Restarting takes from seconds to minutes on a loaded
        # machine, so the bound only guards against a hang (Ray gave up restarting), never a speed.
        hang_guard = time.monotonic() + 900
        while True:
            try:
                new_pids = pool.actor_pids()
                break
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                assert time.monotonic() < hang_guard, "the killed actor was not restarted within 15 minutes"
                time.sleep(1.0)
        assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
        np.testing.assert_array_equal(pool.search(q, 5)[1], want[1])
        # every actor gone for good: the query is retried once, then fails clearly
        for a in pool.actors:
            ray.kill(a, no_restart=True)
        hang_guard = time.monotonic() + 900
        for a in pool.actors:  # ray.kill is asynchronous (CI once saw a search answered after it): wait until it lands
            while True:
                try:
                    ray.get(a.pid.remote(), timeout=60)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    break
                assert time.monotonic() < hang_guard, "a killed actor kept answering for 15 minutes"
                time.sleep(0.5)
        with pytest.raises(RetrievalError, match="failed on two retrieval actors"):
            pool.search(q, 5)
    finally:
        pool.close()


@pytest.mark.slow
def test_search_errors_of_the_knowledge_base_pass_through(kb_dir, local_ray):
    from rag.utils.errors import KnowledgeBaseError, RagError

    pool = RayRetrievalPool(kb_dir, n_actors=1, timeout=30)
    try:
        with pytest.raises(KnowledgeBaseError, match="dim=16"):
            pool.search(np.zeros((1, 3), np.float32), 2)
        with pytest.raises(RagError, match=r"k \(passages to return; .*\) must be an integer between 1 and \d+, got 500"):
            pool.search(np.zeros((1, 16), np.float32), 500)
    finally:
        pool.close()
    with pytest.raises(RetrievalError, match="could not open the knowledge base"):
        RayRetrievalPool(kb_dir.parent / "missing", n_actors=1, timeout=30)


def test_unreachable_cluster_is_a_clear_error(kb_dir):
    if ray.is_initialized():
        ray.shutdown()
    with socket_free_port() as port:
        with pytest.raises(RetrievalError, match=f"Ray cluster at 127.0.0.1:{port} is not reachable"):
            RayRetrievalPool(kb_dir, address=f"127.0.0.1:{port}", timeout=2)


class socket_free_port:
    """A local TCP port that nothing listens on (bound, then released)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc) -> None:
        return None


@pytest.mark.slow
def test_rag_module_retrieves_through_the_actors_while_training(local_ray, tiny_bart_dir, tiny_dpr_question_dir, tiny_kb_dir,
                                                               tmp_path):
    """model.retrieval_actors: the training retriever's searches are served by the actors (the same results as local
    search), gradients still reach the query encoder, and teardown stops the actors."""
    import pytorch_lightning as pl
    import torch

    from rag.training.data import QADataModule
    from rag.training.modules import RagModule

    module = RagModule(generator=tiny_bart_dir, question_encoder=tiny_dpr_question_dir, knowledge_base=tiny_kb_dir,
                       rag={"n_docs": 2, "max_context_length": 48, "max_target_length": 8, "max_question_length": 16},
                       optimizer={"query_encoder_lr": 1e-3}, evaluation={"recall_at": [1]}, retrieval_actors={"count": 2})
    module.configure_model()
    kb, pool = module.model.knowledge_base, module.search_actors.pool
    assert pool is not None and len(pool) == 2 and kb._pool is pool
    served = []
    search = pool.search
    pool.search = lambda q, k: (served.append(k), search(q, k))[1]
    q = np.random.default_rng(0).standard_normal((3, kb.dim)).astype(np.float32)
    local = KnowledgeBase.open(tiny_kb_dir).search(q, 2)
    np.testing.assert_array_equal(kb.search(q, 2)[1], local[1])
    before = [p.detach().clone() for p in module.model.question_encoder.parameters()]
    trainer = pl.Trainer(max_steps=2, limit_val_batches=0, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=QADataModule(train="demo:train", val="demo:dev", batch_size=2))
    assert len(served) >= 3  # the check above and both training steps' retrieval
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.question_encoder.parameters()))
    assert module.search_actors.pool is None and kb._pool is None  # teardown stopped the actors

