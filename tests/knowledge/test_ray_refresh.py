"""The training-time refresh re-encoding on a local Ray with 2 CPU workers: the local refresh's output, a dead worker
retried, IndexRefresh's command joining a Ray cluster by its address."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rag.knowledge.encoders import TextEncoder  # noqa: E402
from rag.knowledge.knowledge_base import KnowledgeBase  # noqa: E402
from rag.knowledge.refresh import build_refreshed_kb, encode_on_ray  # noqa: E402
from rag.training.callbacks import IndexRefresh  # noqa: E402
from rag.utils.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray and a refresh process that joins it: ~30-60 s on 2 busy cores


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_ray_refresh_equals_the_local_refresh_and_retries_a_dead_worker(local_ray, tiny_kb_dir, tiny_dpr_context_dir,
                                                                        tiny_dpr_question_dir, tmp_path):
    snapshot = tmp_path / "doc_encoder"
    TextEncoder(tiny_dpr_context_dir, role="context").save_pretrained(snapshot)
    local = KnowledgeBase.open(build_refreshed_kb(tiny_kb_dir, snapshot, tmp_path / "local", device="cpu")["path"])
    # IndexRefresh's own command and environment: a separate refresh process joining this Ray at its address
    refresh = IndexRefresh(every=1, ray_address=local_ray, ray_workers=2, worker_nice=0)
    argv = refresh._worker_argv(tmp_path / "ray", snapshot, tiny_kb_dir, step=7)
    assert argv[-4:] == ["--ray", local_ray, "--workers", "2"]
    proc = subprocess.run(argv, env=refresh._worker_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    kb = KnowledgeBase.open(summary["path"], verify="full")
    assert kb.manifest.build["ray_workers"] == 2 and kb.manifest.build["refresh_step"] == 7
    assert kb.all_passages() == local.all_passages() and kb.manifest.parent == local.manifest.parent
    assert kb.encoder["fingerprint"] == local.encoder["fingerprint"]
    assert kb.index_spec == local.index_spec and set(kb.manifest.files) == set(local.manifest.files)
    # each worker batches its own slice by length, so the vectors equal the local refresh's up to float rounding
    np.testing.assert_allclose(kb.embeddings(), local.embeddings(), rtol=1e-5, atol=1e-6)
    q = TextEncoder(tiny_dpr_question_dir, role="question").encode(
        [p.title for p in local.all_passages()[::7]], show_progress=False)
    s1, r1 = local.search(q, 5)
    s2, r2 = kb.search(q, 5)
    np.testing.assert_array_equal(r2, r1)
    np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-5)

    marker = tmp_path / "crashed"

    def crash_once():  # the first worker to load the snapshot dies (its process exits); Ray retries its task
        if not marker.exists():
            marker.write_text("x")
            os._exit(1)
        return TextEncoder.from_pretrained(snapshot)

    passages = local.all_passages()
    vectors = encode_on_ray(passages, crash_once, local.encoder["fingerprint"], address=None, workers=2, device="cpu",
                            max_retries=2)
    assert marker.exists()  # a worker did die, and the encoding still finished
    np.testing.assert_allclose(vectors, local.embeddings(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match=rf"--workers 1000: the knowledge base has {len(passages)} passages, fewer than"):
        encode_on_ray(passages, crash_once, local.encoder["fingerprint"], address=None, workers=1000)
    assert Path(summary["path"]).name == "ray"
