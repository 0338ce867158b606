"""Training-time index refresh: schedule parsing, the background build, the hot swap during training,
failed / killed builds, document-encoder gradients and stale-index re-ranking."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from rag.knowledge.encoders import TextEncoder, weights_fingerprint
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.models.rag.model import RagModel, RagModelConfig
from rag.training.callbacks import IndexRefresh, parse_schedule
from rag.utils.errors import ConfigError, KnowledgeBaseError

QUESTIONS = ["Who discovered oxygen?", "What is the atomic number of iron?", "Which element has the symbol Na?"]
CONFIG_DIR = Path(__file__).resolve().parents[2] / "lightning_configs"


# ---------------------------------------------------------------------------- schedule


def test_schedule_every_n_and_piecewise():
    s = parse_schedule(3)
    assert [t for t in range(10) if s.due(t)] == [3, 6, 9]
    assert parse_schedule(" 3 ").ranges == s.ranges
    p = parse_schedule("0-1000:500,1000-:2000")
    assert [t for t in range(0, 6001, 250) if p.due(t)] == [500, 1000, 3000, 5000]
    assert p.interval_at(999) == 500 and p.interval_at(1000) == 2000
    assert p.next_after(0) == 500 and p.next_after(500) == 1000 and p.next_after(1000) == 3000
    gap = parse_schedule("10-20:5, 100-:50")  # no refreshes between 20 and 100
    assert [t for t in range(300) if gap.due(t)] == [10, 15, 100, 150, 200, 250]
    assert gap.next_after(15) == 100 and parse_schedule("0-10:5").next_after(5) is None


@pytest.mark.parametrize(
    "spec, match",
    [
        (0, "positive"),
        (True, "bool"),
        (2.5, "float"),
        ("", "empty"),
        ("every 5", "part 'every 5'"),
        ("0-1000:500,,1000-:10", "part ''"),
        ("0-1000:0", "part '0-1000:0'.*positive"),
        ("500-100:10", "part '500-100:10'.*ends at or before"),
        ("0-:10,100-:20", "part '100-:20'.*only the last range"),
        ("0-1000:10,500-:20", "part '500-:20'.*overlap"),
        ("0-1000:x", "part '0-1000:x'"),
    ],
)
def test_schedule_errors_name_the_bad_part(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_schedule(spec)


def test_callback_validates_its_arguments():
    with pytest.raises(ConfigError, match="worker_nice"):
        IndexRefresh(every=5, worker_nice=25)
    with pytest.raises(ConfigError, match="at_train_end"):
        IndexRefresh(every=5, at_train_end="later")
    with pytest.raises(ConfigError, match="worker_command"):
        IndexRefresh(every=5, worker_command="python -m x")
    with pytest.raises(ConfigError, match="part 'x'"):
        IndexRefresh(every="x")
    with pytest.raises(ConfigError, match="ray_workers"):
        IndexRefresh(every=5, ray_address="auto", ray_workers=0)


def test_an_unreachable_ray_address_fails_at_fit_start_and_in_the_worker_naming_it(tmp_path, capsys):
    import socket

    from rag.knowledge import refresh as refresh_worker

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConfigError, match=rf"IndexRefresh.ray_address: Ray cluster at 127.0.0.1:{port} is not reachable"):
        IndexRefresh(every=5, ray_address=f"127.0.0.1:{port}").on_fit_start(None, None)
    argv = ["--knowledge-base", str(tmp_path / "kb"), "--encoder", str(tmp_path / "enc"), "--out", str(tmp_path / "out")]
    assert refresh_worker.main([*argv, "--ray", f"127.0.0.1:{port}", "--workers", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--ray: Ray cluster at 127.0.0.1:{port} is not reachable" in err[0]
    assert refresh_worker.main([*argv, "--workers", "2"]) == 1
    assert "--workers 2: only means something with --ray" in capsys.readouterr().err


def test_yaml_example_parses_with_the_callback(tmp_path, monkeypatch):
    from rag.cli.train import make_cli

    monkeypatch.chdir(tmp_path)
    cli = make_cli(["--config", str(CONFIG_DIR / "tiny_cpu_refresh.yaml")], run=False)
    refresh = [c for c in cli.trainer.callbacks if isinstance(c, IndexRefresh)]
    assert len(refresh) == 1 and refresh[0].schedule.due(refresh[0].schedule.next_after(0))
    assert cli.model.rag_config.train_doc_encoder and cli.model.model is None


# ---------------------------------------------------------------------------- model: doc encoder


def _perturb(encoder: TextEncoder, std: float, seed: int) -> None:
    """Redraw an encoder's matrices at a larger std, so that its vectors (and rankings) differ clearly."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(encoder.model.named_parameters()):
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture
def make_model(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir):
    def make(**cfg) -> RagModel:
        torch.manual_seed(0)
        base = dict(n_docs=3, max_context_length=48, max_target_length=8, max_question_length=16)
        return RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir, RagModelConfig(**{**base, **cfg}))

    return make


def test_config_checks_for_doc_encoder_options():
    with pytest.raises(ConfigError, match="rerank_candidates=2 is smaller than n_docs=3"):
        RagModelConfig(n_docs=3, rerank_candidates=2)
    with pytest.raises(ConfigError, match="dense retrieval"):
        RagModelConfig(retrieval="bm25", train_doc_encoder=True)
    with pytest.raises(ConfigError, match="train_doc_encoder"):
        RagModelConfig(train_doc_encoder="yes")
    assert not RagModelConfig().uses_doc_encoder and RagModelConfig(rerank_candidates=5).uses_doc_encoder


def test_train_doc_encoder_scores_fresh_embeddings_and_gives_doc_encoder_grads(make_model, tiny_kb_dir):
    m = make_model(train_doc_encoder=True)
    assert "doc_encoder" in m.parameter_groups() and m.doc_encoder is not None
    assert m.doc_encoder.identity()["fingerprint"] == KnowledgeBase.open(tiny_kb_dir).encoder["fingerprint"]
    _perturb(m.doc_encoder, 0.2, seed=3)  # the stored vectors are now stale
    m.eval()  # no dropout: fresh vectors must equal encode_passages exactly
    out = m(QUESTIONS, ["Priestley", "26", "Sodium"])
    out.loss.backward()
    grads = [p.grad for p in m.doc_encoder.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    r = out.retrieved
    fresh = m.doc_encoder.encode_passages([p for ps in r.passages for p in ps], show_progress=False)
    torch.testing.assert_close(r.doc_embeds, torch.from_numpy(fresh).view(r.doc_embeds.shape), rtol=1e-4, atol=1e-5)
    stored = m.knowledge_base.get_embeddings(r.rows)
    assert not torch.allclose(r.doc_embeds, stored, atol=1e-3)  # scored with fresh, not stored, vectors
    q = m.question_encoder(**m._tokenize_questions(QUESTIONS))
    torch.testing.assert_close(out.doc_scores, torch.einsum("bd,bkd->bk", q, r.doc_embeds), rtol=1e-4, atol=1e-5)


def test_doc_encoder_is_frozen_without_train_doc_encoder(make_model):
    m = make_model(rerank_candidates=6).train()
    assert "doc_encoder" not in m.parameter_groups()
    assert not m.doc_encoder.training and not any(p.requires_grad for p in m.doc_encoder.parameters())
    assert make_model().doc_encoder is None  # the default model has no document encoder


@pytest.mark.parametrize("train_doc_encoder", [False, True])
def test_rerank_keeps_top_k_of_l_by_fresh_scores(make_model, train_doc_encoder):
    L, K = 8, 3
    m = make_model(rerank_candidates=L, train_doc_encoder=train_doc_encoder).eval()
    _perturb(m.doc_encoder, 0.2, seed=5)
    _perturb(m.question_encoder, 0.2, seed=6)
    with torch.set_grad_enabled(train_doc_encoder):
        retrieved, doc_scores = m.retrieve(QUESTIONS)
    if train_doc_encoder:  # the k kept passages are re-encoded with gradients
        doc_scores.sum().backward()
        assert sum(float(p.grad.abs().sum()) for p in m.doc_encoder.parameters() if p.grad is not None) > 0
        doc_scores = doc_scores.detach()
    with torch.no_grad():
        q = m.question_encoder(**m._tokenize_questions(QUESTIONS))  # (B, D)
    kb = m.knowledge_base
    _, stale_rows = kb.search(q, L)  # (B, L) candidates from the stale index
    cand = kb.get_passages(stale_rows)
    fresh = torch.from_numpy(m.doc_encoder.encode_passages([p for ps in cand for p in ps],
                                                           show_progress=False)).view(len(QUESTIONS), L, -1)
    fresh_scores = torch.einsum("bd,bld->bl", q, fresh)
    expected = np.take_along_axis(stale_rows, fresh_scores.argsort(dim=1, descending=True)[:, :K].numpy(), axis=1)
    assert retrieved.rows.tolist() == expected.tolist()
    assert [[p.id for p in ps] for ps in retrieved.passages] == [[p.id for p in ps] for ps in kb.get_passages(expected)]
    assert (retrieved.rows.numpy() != stale_rows[:, :K]).any(), "re-ranking changed nothing: the test cannot tell"
    torch.testing.assert_close(retrieved.scores, doc_scores, rtol=1e-4, atol=1e-5)  # fresh scores, best first
    assert bool((retrieved.scores[:, :-1] >= retrieved.scores[:, 1:]).all())


def test_checkpoint_keeps_the_trained_doc_encoder(make_model, tmp_path):
    m = make_model(train_doc_encoder=True)
    _perturb(m.doc_encoder, 0.1, seed=7)
    m.save_pretrained(tmp_path / "ckpt")
    back = RagModel.from_pretrained(tmp_path / "ckpt")
    assert back.doc_encoder is not None and back.config.train_doc_encoder
    assert weights_fingerprint(back.doc_encoder.model) == weights_fingerprint(m.doc_encoder.model)


def test_manifest_encoder_with_other_weights_is_refused(tmp_path, tiny_dpr_context_dir, demo_passages):
    from rag.knowledge.refresh import load_document_encoder

    enc = TextEncoder(tiny_dpr_context_dir, role="context")
    enc.save_pretrained(tmp_path / "enc")
    kb = KnowledgeBase.build(demo_passages[:10], TextEncoder(str(tmp_path / "enc")), tmp_path / "kb", index="flat",
                             show_progress=False)
    changed = TextEncoder(str(tmp_path / "enc"))
    _perturb(changed, 0.1, seed=1)
    changed.save_pretrained(tmp_path / "enc")  # the name now loads other weights than built the index
    with pytest.raises(KnowledgeBaseError, match="other weights"):
        load_document_encoder(kb)


# ---------------------------------------------------------------------------- the worker


def test_build_that_crashes_mid_write_leaves_nothing(tmp_path, tiny_kb_dir, tiny_dpr_context_dir, monkeypatch):
    import rag.knowledge.knowledge_base as kbm
    from rag.knowledge.refresh import build_refreshed_kb

    TextEncoder(tiny_dpr_context_dir, role="context").save_pretrained(tmp_path / "snap")
    seen = []

    def boom(index, path):
        seen.extend(p.name for p in Path(path).parent.iterdir())  # inside the half-written temporary directory
        raise RuntimeError("injected failure while writing the index")

    monkeypatch.setattr(kbm, "write_index", boom)
    with pytest.raises(RuntimeError, match="injected"):
        build_refreshed_kb(tiny_kb_dir, tmp_path / "snap", tmp_path / "new")
    assert "embeddings.npy" in seen  # it did die half-way
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".new.tmp-*"))


def test_build_refreshed_kb_reencodes_with_the_snapshot(tmp_path, tiny_kb_dir, tiny_dpr_context_dir):
    from rag.knowledge.refresh import build_refreshed_kb

    enc = TextEncoder(tiny_dpr_context_dir, role="context")
    _perturb(enc, 0.2, seed=2)
    enc.save_pretrained(tmp_path / "snap")
    summary = build_refreshed_kb(tiny_kb_dir, tmp_path / "snap", tmp_path / "new", build_info={"refresh_step": 7})
    old, new = KnowledgeBase.open(tiny_kb_dir), KnowledgeBase.open(tmp_path / "new")
    assert summary["version"] == new.version != old.version and new.manifest.parent == old.version
    assert new.encoder["fingerprint"] == enc.identity()["fingerprint"] == summary["fingerprint"]
    assert Path(new.encoder["name"]) == tmp_path / "snap" and new.manifest.build["refresh_step"] == 7
    assert new.index_spec == old.index_spec and new.manifest.query_encoder == old.manifest.query_encoder
    assert [p.id for p in new.all_passages()] == [p.id for p in old.all_passages()]  # rows keep their meaning
    np.testing.assert_allclose(new.embeddings(), enc.encode_passages(old.all_passages(), show_progress=False), rtol=1e-5,
                               atol=1e-6)


# ---------------------------------------------------------------------------- training with refreshes


def _train(make_module, make_data, trainer_kw, refresh, *, steps, callbacks=(), lr=0.05):
    module = make_module(rag={"n_docs": 2, "max_context_length": 32, "max_target_length": 6, "max_question_length": 16,
                              "train_doc_encoder": True},
                         optimizer={"query_encoder_lr": 1e-3, "lr": 2e-3, "doc_encoder_lr": lr},
                         evaluation={"recall_at": [1, 3], "generate_on_validation": False})
    trainer = pl.Trainer(fast_dev_run=steps, callbacks=[*callbacks, refresh], **trainer_kw)
    trainer.fit(module, datamodule=make_data())
    return module, trainer


class _AtStep(pl.Callback):
    """Test helper: run `fn(refresh)` once, at the end of optimizer step `step` (before IndexRefresh polls),
    and record which knowledge-base version every training batch retrieved from."""

    def __init__(self, step: int, refresh: IndexRefresh, fn):
        self.step, self.refresh, self.fn, self.versions = step, refresh, fn, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.versions.append(pl_module.model.knowledge_base.version)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.fn(self.refresh)


def _wait_for_build(refresh: IndexRefresh) -> None:
    assert refresh.in_flight, "no refresh was started"
    concurrent.futures.wait([refresh._job.future], timeout=300)


def _worker_script(tmp_path: Path, body: str) -> list[str]:
    """A refresh worker that runs the real `rag.knowledge.refresh.main` with `write_index` replaced by `body`
    (called inside the half-written temporary knowledge-base directory)."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "import rag.knowledge.knowledge_base as kbm\n"
        "OUT = Path(sys.argv[sys.argv.index('--out') + 1])\n"
        f"def write_index(index, path):\n{body}\n"
        "kbm.write_index = write_index\n"
        "from rag.knowledge.refresh import main\n"
        "sys.exit(main(sys.argv[1:]))\n",
        encoding="utf-8",
    )
    return [sys.executable, str(script)]


def _assert_nothing_half_built(job_dir: Path) -> None:
    assert not (job_dir / "kb").exists()
    assert not list(job_dir.glob(".kb.tmp-*")), "the partial build was not cleaned up"
    assert not (job_dir / "doc_encoder").exists() and (job_dir / "refresh.log").is_file()


def _fake_worker(tmp_path: Path, body: str) -> list[str]:
    """A stand-in worker (no torch import, starts fast) running `body` with `out` = its --out directory."""
    fake = tmp_path / "fake_worker.py"
    fake.write_text("import sys, time\nfrom pathlib import Path\nout = Path(sys.argv[sys.argv.index('--out') + 1])\n" + body,
                    encoding="utf-8")
    return [sys.executable, str(fake)]


@pytest.mark.slow
def test_refresh_swaps_in_a_new_index_during_training(make_module, make_data, trainer_kw, tmp_path, tiny_kb_dir):
    """Refresh at step 1 (background build), swapped in after step 2; step 3 trains on the new index, whose
    ids for a fixed query are the exact top-k under the document encoder as it was at step 1."""
    old = KnowledgeBase.open(tiny_kb_dir)
    refresh = IndexRefresh(every="0-2:1", output_dir=str(tmp_path / "refresh"), worker_nice=0)
    probe = _AtStep(2, refresh, _wait_for_build)  # let the build finish before the step-2 poll (deterministic)
    module, trainer = _train(make_module, make_data, trainer_kw, refresh, steps=3, callbacks=[probe])
    assert trainer.global_step == 3 and refresh.failures == 0 and refresh.swaps == 1
    model = module.model
    new = model.knowledge_base
    assert probe.versions == [old.version, old.version, new.version]  # swapped between steps 2 and 3
    assert new.version != old.version and new.manifest.parent == old.version
    job_dir = tmp_path / "refresh" / "step-00000001"
    assert Path(new.path) == job_dir / "kb" and new.manifest.build["refresh_step"] == 1
    snapshot = TextEncoder.from_pretrained(job_dir / "doc_encoder")  # the doc encoder after step 1
    assert new.encoder["fingerprint"] == weights_fingerprint(snapshot.model) != old.encoder["fingerprint"]
    assert weights_fingerprint(model.doc_encoder.model) != new.encoder["fingerprint"]  # it trained on
    assert model.retriever.space == new.encoder["fingerprint"]
    assert refresh.history[-1]["ok"] and refresh.history[-1]["parent"] == old.version
    # The retrieved ids for a fixed query follow the new index: the exact top-k by the step-1 encoder.
    model.eval()
    with torch.no_grad():
        q = model.question_encoder(**model._tokenize_questions(QUESTIONS))
        retrieved, _ = model.retrieve(QUESTIONS, n_docs=5)
    fresh = snapshot.encode_passages(old.all_passages(), show_progress=False)
    expected = np.argsort(-(q.numpy() @ fresh.T), axis=1, kind="stable")[:, :5]
    assert retrieved.rows.tolist() == expected.tolist() and retrieved.kb_version == new.version
    _, old_rows = old.search(q, 5)
    assert old_rows.tolist() != expected.tolist(), "the update did not change the rankings: the test cannot tell"


def test_at_train_end_waits_for_or_cancels_the_running_build(make_module, make_data, trainer_kw, tmp_path, caplog):
    slow_fail = _fake_worker(tmp_path, "time.sleep(1)\nprint('finished late', file=sys.stderr)\nsys.exit(4)\n")
    refresh = IndexRefresh(every="0-2:1", output_dir=str(tmp_path / "wait"), worker_command=slow_fail, at_train_end="wait")
    with caplog.at_level(logging.ERROR, logger="rag.training.callbacks"):
        _train(make_module, make_data, trainer_kw, refresh, steps=1)
    assert refresh.failures == 1 and not refresh.in_flight and "finished late" in caplog.text  # it waited

    hang = _fake_worker(tmp_path, "time.sleep(600)\n")
    refresh = IndexRefresh(every="0-2:1", output_dir=str(tmp_path / "cancel"), worker_command=hang, at_train_end="cancel")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rag.training.callbacks"):
        _train(make_module, make_data, trainer_kw, refresh, steps=1)
    assert refresh.failures == 0 and refresh.swaps == 0 and not refresh.in_flight and "cancelled" in caplog.text
    pid = int(re.search(r"worker pid (\d+)", caplog.text).group(1))
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(pid, 0)


@pytest.mark.parametrize("exit_code", [3, 0], ids=["crash", "exit0-without-manifest"])
def test_failed_build_is_logged_and_training_goes_on_with_the_old_index(make_module, make_data, trainer_kw, tmp_path,
                                                                        tiny_kb_dir, caplog, exit_code):
    """A worker that leaves a half-written, non-atomic `kb/` behind and crashes (or even exits 0): the
    callback logs the failure, never swaps it in, removes it, and training goes on with the old index."""
    old = KnowledgeBase.open(tiny_kb_dir)
    fake = _fake_worker(tmp_path, "(out / 'passages').mkdir(parents=True)\n(out / 'embeddings.npy').write_bytes(b'half')\n"
                              f"print('injected failure while writing the index', file=sys.stderr)\nsys.exit({exit_code})\n")
    refresh = IndexRefresh(every="0-2:1", output_dir=str(tmp_path / "refresh"), worker_command=fake)
    probe = _AtStep(2, refresh, _wait_for_build)  # make the failure land mid-run, deterministically
    with caplog.at_level(logging.ERROR, logger="rag.training.callbacks"):
        module, trainer = _train(make_module, make_data, trainer_kw, refresh, steps=3, callbacks=[probe])
    assert trainer.global_step == 3 and refresh.swaps == 0 and refresh.failures == 1
    assert module.model.knowledge_base.version == old.version and probe.versions == [old.version] * 3
    assert "index refresh from step 1 failed" in caplog.text and f"training continues on {old.version}" in caplog.text
    assert ("exit status 3" in caplog.text
            and "injected failure" in caplog.text) if exit_code else "no complete knowledge base" in caplog.text
    _assert_nothing_half_built(tmp_path / "refresh" / "step-00000001")


@pytest.mark.slow
def test_killed_build_is_logged_and_never_swapped_in(make_module, make_data, trainer_kw, tmp_path, tiny_kb_dir, caplog):
    old = KnowledgeBase.open(tiny_kb_dir)
    hang = _worker_script(tmp_path, "    (OUT.parent / 'inside-build').write_text('1')\n    time.sleep(600)")

    def kill_mid_build(refresh: IndexRefresh) -> None:
        marker = Path(refresh._job.dir) / "inside-build"
        deadline = time.monotonic() + 300
        while not marker.exists() and refresh._job.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the worker never reached the index write"
        assert list(refresh._job.dir.glob(".kb.tmp-*")), "expected a half-written temporary directory"
        os.kill(refresh.worker_pid, signal.SIGKILL)
        _wait_for_build(refresh)

    refresh = IndexRefresh(every="0-2:1", output_dir=str(tmp_path / "refresh"), worker_command=hang, worker_nice=0)
    probe = _AtStep(2, refresh, kill_mid_build)
    with caplog.at_level(logging.ERROR, logger="rag.training.callbacks"):
        module, trainer = _train(make_module, make_data, trainer_kw, refresh, steps=3, callbacks=[probe])
    assert trainer.global_step == 3 and refresh.swaps == 0 and refresh.failures == 1
    assert module.model.knowledge_base.version == old.version and probe.versions == [old.version] * 3
    assert "killed by SIGKILL" in caplog.text and "index refresh from step 1 failed" in caplog.text
    _assert_nothing_half_built(tmp_path / "refresh" / "step-00000001")


def test_refresh_needs_a_document_encoder(make_module, make_data, trainer_kw, tmp_path):
    module = make_module()
    trainer = pl.Trainer(fast_dev_run=1, callbacks=[IndexRefresh(every=1, output_dir=str(tmp_path))], **trainer_kw)
    with pytest.raises(ConfigError, match="train_doc_encoder: true"):
        trainer.fit(module, datamodule=make_data())


def test_resume_serves_the_refreshed_index_recorded_in_the_checkpoint(make_module, make_data, trainer_kw, tmp_path,
                                                                      tiny_kb_dir, tiny_dpr_context_dir):
    from rag.knowledge.refresh import build_refreshed_kb

    enc = TextEncoder(tiny_dpr_context_dir, role="context")
    _perturb(enc, 0.2, seed=4)
    enc.save_pretrained(tmp_path / "snap")
    refreshed = build_refreshed_kb(tiny_kb_dir, tmp_path / "snap", tmp_path / "refreshed")
    saved = IndexRefresh(every=100)
    saved.load_state_dict({"serving_path": refreshed["path"], "serving_version": refreshed["version"], "serving_step": 7,
                           "swaps": 1, "failures": 0})
    state = saved.state_dict()  # before fit: what a checkpoint written now would hold
    assert state["serving_step"] == 7 and state["swaps"] == 1
    module, _ = _train(make_module, make_data, trainer_kw, saved, steps=1)
    assert module.model.knowledge_base.version == refreshed["version"] != KnowledgeBase.open(tiny_kb_dir).version
    assert module.model.retriever.space == refreshed["fingerprint"]
    assert saved.state_dict()["serving_path"] == refreshed["path"]
