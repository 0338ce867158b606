"""build_on_ray on a local Ray with 2 CPU workers: the one-shot build's rows and search results, a dead worker retried."""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rag.cli import main  # noqa: E402
from rag.demo import CORPUS_PATH  # noqa: E402
from rag.knowledge.encoders import TextEncoder  # noqa: E402
from rag.knowledge.knowledge_base import KnowledgeBase  # noqa: E402
from rag.knowledge.passages import load_corpus  # noqa: E402
from rag.knowledge.ray_build import build_on_ray, ray_shards_dir  # noqa: E402
from rag.utils.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.slow  # starting a local Ray takes ~10-20 s on 2 busy cores


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_build_equals_the_one_shot_build_and_retries_a_dead_worker(local_ray, tiny_dpr_context_dir,
                                                                       tiny_dpr_question_dir, tmp_path, capsys):
    corpus = load_corpus(str(CORPUS_PATH), show_progress=False)
    encoder = TextEncoder(tiny_dpr_context_dir, role="context")
    one = KnowledgeBase.build(corpus, encoder, tmp_path / "one", index="flat", show_progress=False)
    marker = tmp_path / "crashed"

    def crash_once():  # the first worker to load the encoder dies (its process exits); Ray retries its task
        import os

        if not marker.exists():
            marker.write_text("x")
            os._exit(1)
        return TextEncoder(tiny_dpr_context_dir, role="context")

    kb = build_on_ray(corpus, encoder, tmp_path / "ray", workers=2, index="flat", worker_encoder=crash_once,
                      show_progress=False, max_retries=2)
    assert marker.exists()  # a worker did die, and the build still finished
    assert kb.verified == "full" and KnowledgeBase.open(tmp_path / "ray").version == kb.version
    assert kb.all_passages() == one.all_passages()  # the same rows in the same order
    assert kb.manifest.passages_digest == one.manifest.passages_digest and set(kb.manifest.files) == set(one.manifest.files)
    # each worker batches its own shard by length, so the vectors equal the one-shot build's up to float rounding
    np.testing.assert_allclose(kb.embeddings(), one.embeddings(), rtol=1e-5, atol=1e-6)
    q = TextEncoder(tiny_dpr_question_dir, role="question").encode(
        [p.title for p in corpus[::5]], show_progress=False)
    s1, r1 = one.search(q, 5)
    s2, r2 = kb.search(q, 5)
    np.testing.assert_array_equal(r2, r1)  # exact search over the same rows
    np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-5)
    assert [m["version"] for m in kb.manifest.build["merged_shards"]] and kb.manifest.build["ray_workers"] == 2
    assert not ray_shards_dir(tmp_path / "ray").exists()  # the shards were merged and removed
    # the command line does the same (the driver's encoder shipped to the workers): the same version
    assert main(["index", "build", "--corpus", str(CORPUS_PATH), "--encoder", tiny_dpr_context_dir, "--out",
                 str(tmp_path / "cli"), "--index", "flat", "--ray", "--workers", "2", "--device", "cpu", "--quiet"]) == 0
    assert f"({kb.version}) on 2 Ray workers: 150 passages" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"--workers 1000: the corpus has 150 passages, fewer than 1000 workers"):
        build_on_ray(corpus, encoder, tmp_path / "big", workers=1000, index="flat", show_progress=False)


def test_a_worker_that_dies_mid_encoding_is_retried_from_its_finished_chunks(local_ray, tiny_dpr_context_dir,
                                                                             tiny_dpr_question_dir, tmp_path):
    corpus = load_corpus(str(CORPUS_PATH), show_progress=False)
    encoder = TextEncoder(tiny_dpr_context_dir, role="context")
    one = KnowledgeBase.build(corpus, encoder, tmp_path / "one", index="flat", show_progress=False)
    marker, calls = tmp_path / "crashed", tmp_path / "calls"

    def dies_at_its_second_chunk():  # the first worker to start its shard's second chunk exits there, once
        import os

        enc = TextEncoder(tiny_dpr_context_dir, role="context")
        encode, seen = enc.encode_passages, []

        def encode_passages(passages, **kw):
            seen.append(passages[0].id)
            with open(calls, "a") as f:
                f.write(f"{os.getpid()} {passages[0].id}\n")
            if len(seen) == 2:
                try:
                    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one worker only, even if both get here
                except FileExistsError:
                    return encode(passages, **kw)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os._exit(1)  # after its first chunk was encoded and recorded
            return encode(passages, **kw)

        enc.encode_passages = encode_passages
        return enc

    # 75 passages per shard, encoded 16 at a time: five chunks each
    kb = build_on_ray(corpus, encoder, tmp_path / "ray", workers=2, index="flat", worker_encoder=dies_at_its_second_chunk,
                      chunk_rows=16, show_progress=False, max_retries=2)
    lines = [ln.split() for ln in calls.read_text().splitlines()]
    first, second = [i for pid, i in lines if pid == marker.read_text()]  # the chunks the dead worker started
    ids = [i for _, i in lines]
    assert ids.count(second) == 2  # the chunk the worker died in was encoded again, by the retry ...
    assert ids.count(first) == 1  # ... which resumed after the chunk the dead worker had finished
    assert len(ids) == 2 * 5 + 1  # every other chunk of both shards once
    assert kb.verified == "full" and kb.all_passages() == one.all_passages()
    assert kb.manifest.passages_digest == one.manifest.passages_digest
    np.testing.assert_allclose(kb.embeddings(), one.embeddings(), rtol=1e-5, atol=1e-6)  # batched per chunk: rounding
    q = TextEncoder(tiny_dpr_question_dir, role="question").encode([p.title for p in corpus[::5]], show_progress=False)
    s1, r1 = one.search(q, 5)
    s2, r2 = kb.search(q, 5)
    np.testing.assert_array_equal(r2, r1)
    np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-5)
    assert not ray_shards_dir(tmp_path / "ray").exists()  # the shards and their staged chunks were removed
