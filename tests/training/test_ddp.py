"""DDP over gloo on CPU (`rag fit --trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu`): two ranks, each
retrieving for its own half of the batch, end with the parameters of one process trained on the whole batch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
PER_RANK_BATCH = 4


def _config(tmp_path: Path, name: str, *, batch_size: int, generator: str, question_encoder: str, kb: str,
            rag: dict | None = None, callbacks: list | None = None, doc_encoder_lr: float = 1e-5, **model) -> Path:
    cfg = {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": STEPS, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0,
            "default_root_dir": str(tmp_path / name),
            # the dump last: its on_train_end then sees what IndexRefresh swapped in at train end
            "callbacks": [*(callbacks or []),
                          {"class_path": "ddp_dump.DumpParameters", "init_args": {"out_dir": str(tmp_path / name / "params")}}],
        },
        "model": {"class_path": "rag.training.modules.RagModule", "init_args": {
            "generator": generator, "question_encoder": question_encoder, "knowledge_base": kb,
            "rag": {"n_docs": 2, "max_context_length": 48, "max_target_length": 8, "max_question_length": 16, **(rag or {})},
            # adam_epsilon 1: AdamW's update becomes ~ lr × gradient, so gradients are compared, not amplified float noise
            # (with eps 1e-8 an element whose gradient is ~0 moves by ±lr with the sign of its rounding error)
            "optimizer": {"query_encoder_lr": 0.1, "lr": 0.1, "adam_epsilon": 1.0, "warmup_steps": 0, "schedule": "constant",
                          "doc_encoder_lr": doc_encoder_lr},
            "decoding": {"max_new_tokens": 3, "sequence_decoding": "fast"},
            **model,
        }},
        "data": {"class_path": "rag.training.data.QADataModule", "init_args": {
            "train": "demo:train", "batch_size": batch_size, "shuffle": False}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit(config: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)]), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "rag", "fit", "--config", str(config), *extra], cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.slow  # ~21 s on 2 busy cores: three processes start torch + Lightning
def test_ddp_two_ranks_equal_one_process_on_the_global_batch(tmp_path, tiny_bart_dir, tiny_dpr_question_dir, tiny_kb_dir):
    import torch

    common = dict(generator=tiny_bart_dir, question_encoder=tiny_dpr_question_dir, kb=tiny_kb_dir)
    ddp = _fit(_config(tmp_path, "ddp", batch_size=PER_RANK_BATCH, **common),
               "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")
    assert ddp.returncode == 0, ddp.stderr[-4000:]
    one = _fit(_config(tmp_path, "one", batch_size=2 * PER_RANK_BATCH, **common))
    assert one.returncode == 0, one.stderr[-4000:]

    # each rank retrieved for its own half of every global batch
    batches = {r: (tmp_path / "ddp" / "params" / f"batches-rank{r}.txt").read_text().splitlines() for r in (0, 1)}
    whole = (tmp_path / "one" / "params" / "batches-rank0.txt").read_text().splitlines()
    assert len(whole) == len(batches[0]) == len(batches[1]) == STEPS
    for s in range(STEPS):
        halves = [ast.literal_eval(batches[r][s]) for r in (0, 1)]
        assert not set(halves[0]) & set(halves[1])
        assert sorted(halves[0] + halves[1]) == sorted(ast.literal_eval(whole[s]))

    start = _load(tmp_path / "ddp" / "params" / "start-rank0.safetensors")
    ranks = [_load(tmp_path / "ddp" / "params" / f"end-rank{r}.safetensors") for r in (0, 1)]
    single = _load(tmp_path / "one" / "params" / "end-rank0.safetensors")
    q_names = [n for n in start if ".question_encoder." in n or n.startswith("model.question_encoder")]
    assert q_names, sorted(start)[:5]
    # the query encoder trained (its gradient flows through the doc scores of each rank's own retrieval) ...
    assert any(not torch.equal(start[n], ranks[0][n]) for n in q_names)
    # ... identically on both ranks, and as one process on the global batch
    assert set(ranks[0]) == set(ranks[1]) == set(single)
    for n in single:
        torch.testing.assert_close(ranks[1][n], ranks[0][n], rtol=0, atol=0, msg=n)
        torch.testing.assert_close(ranks[0][n], single[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.slow  # ~25 s: two ranks train, rank 0 spawns the re-encoding build
def test_ddp_index_refresh_builds_on_rank_0_and_every_rank_swaps_at_the_same_step(tmp_path, tiny_bart_dir,
                                                                                   tiny_dpr_question_dir, tiny_kb_dir):
    from rag.knowledge.knowledge_base import KnowledgeBase

    old = KnowledgeBase.open(tiny_kb_dir)
    refresh = {"class_path": "rag.training.callbacks.IndexRefresh",
               "init_args": {"every": "0-2:1", "output_dir": str(tmp_path / "refresh"), "worker_nice": 0, "at_train_end": "wait"}}
    cfg = _config(tmp_path, "refresh", batch_size=PER_RANK_BATCH, generator=tiny_bart_dir, question_encoder=tiny_dpr_question_dir,
                  kb=tiny_kb_dir, rag={"train_doc_encoder": True}, callbacks=[refresh], doc_encoder_lr=0.05)
    run = _fit(cfg, "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")
    assert run.returncode == 0, run.stderr[-4000:]
    versions = [(tmp_path / "refresh" / "params" / f"versions-rank{r}.txt").read_text().split("\n") for r in (0, 1)]
    assert versions[0] == versions[1]  # the same version at every step on both ranks
    steps = dict(line.split() for line in versions[0] if line)
    assert steps["step0"] == steps["step1"] == old.version
    built = sorted((tmp_path / "refresh").glob("step-*/kb"))
    assert [b.parent.name for b in built] == ["step-00000001"]  # one build, by rank 0 (rank 1 started none)
    new = KnowledgeBase.open(built[0])
    assert steps["end"] == new.version != old.version and new.manifest.parent == old.version


class _Strategy:
    root_device = "cpu"

    def __init__(self, versions):
        self.versions = versions

    def all_gather(self, tensor):
        import torch

        from rag.training.distributed import version_code

        return torch.tensor([[version_code(v)] for v in self.versions])


class _Trainer:
    """What check_same_knowledge_base reads of a Trainer: world_size, global_rank and the strategy's all_gather."""

    def __init__(self, versions, rank=0):
        self.world_size, self.global_rank, self.strategy = len(versions), rank, _Strategy(versions)


def test_ranks_disagreeing_on_the_knowledge_base_refuse_to_step():
    from types import SimpleNamespace

    from rag.training.distributed import check_same_knowledge_base, version_code
    from rag.utils.errors import KnowledgeBaseError

    kb = SimpleNamespace(version="kb-aaaaaaaaaaaa", path="/kbs/a")
    check_same_knowledge_base(_Trainer(["kb-aaaaaaaaaaaa"] * 2), kb)
    check_same_knowledge_base(_Trainer(["kb-aaaaaaaaaaaa"]), kb)  # one process: nothing to compare
    with pytest.raises(KnowledgeBaseError, match=r"disagree at step 7: ranks \[0, 2\].*refusing to step"):
        check_same_knowledge_base(_Trainer(["kb-aaaaaaaaaaaa", "kb-bbbbbbbbbbbb", "kb-aaaaaaaaaaaa"], rank=1), kb, 7)
    assert version_code(None) == 0 and 0 < version_code("kb-aaaaaaaaaaaa") < 2**62
    assert version_code("kb-aaaaaaaaaaaa") != version_code("kb-bbbbbbbbbbbb")


def test_reranker_ranks_with_examples_from_different_knowledge_bases_refuse_to_train(tiny_bert_dir):
    """The reranker's examples are retrieved by each rank's data module at setup: they must come from one version."""
    from types import SimpleNamespace

    from rag.training.reranker import PredictiveRerankerModule
    from rag.utils.errors import KnowledgeBaseError

    module = PredictiveRerankerModule(encoder=tiny_bert_dir, pair_max_length=48, query_tokens=8)
    data = SimpleNamespace(knowledge_base=SimpleNamespace(version="kb-aaaaaaaaaaaa", path="/kbs/a"))
    for versions, fails in ((["kb-aaaaaaaaaaaa"] * 2, False), (["kb-aaaaaaaaaaaa", "kb-bbbbbbbbbbbb"], True)):
        trainer = _Trainer(versions)
        trainer.datamodule = data
        module.trainer = trainer  # LightningModule.trainer accepts any object here
        if fails:
            with pytest.raises(KnowledgeBaseError, match="refusing to step"):
                module.on_fit_start()
        else:
            module.on_fit_start()
