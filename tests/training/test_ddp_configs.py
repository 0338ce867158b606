"""Every shipped config that trains with retrieval runs under DDP on 2 CPU processes, as a user runs it (issue #31.1):
`rag fit --config lightning_configs/NAME.yaml --trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu`,
through the CLI entry point, for a few steps.

The tiny configs run as shipped (only the step count, validation and the run folder are set); the others are shrunk
on the command line to models and data this machine has (the paper's configs need a model hub, a GPU and Wikipedia;
the SmolLM2 ones the converted demo LM and the demos' files). tiny_cpu_refresh.yaml failed at its first step with
"parameters that were not used in producing the loss": MiniLM's BERT pooler, which mean pooling never runs, required
a gradient (rag.knowledge.encoders.TextEncoder now freezes it). Plain `ddp` (no unused-parameter search) is what every
config is run with here: see docs/training.md for which runs need the search.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "lightning_configs"
STEPS = 3

_PAPER = ["--model.generator", "tiny:bart", "--model.question_encoder", "minilm", "--model.knowledge_base", ".cache/demo_kb",
          "--model.build_knowledge_base.corpus", "demo", "--model.build_knowledge_base.index", "flat", "--trainer.precision",
          "32-true",
          "--trainer.accumulate_grad_batches", "1", "--data.num_workers", "0", "--data.train", "demo:train", "--data.val",
          "demo:dev", "--data.test", "demo:test", "--data.batch_size", "4", "--data.eval_batch_size", "8",
          "--data.max_eval_examples", "8", "--model.rag.max_context_length", "64", "--model.decoding.num_beams", "1"]
SHRUNK = {
    # the paper's setups with the tiny BART and MiniLM over the demo knowledge base (no hub, no GPU, no Wikipedia)
    "rag_sequence_bart.yaml": _PAPER,
    "rag_token_bart.yaml": _PAPER,
    "rag_t5.yaml": [*_PAPER, "--model.generator", "tiny:t5", "--data.data_dir", "null"],
    # the CPU recipe with a smaller practice pool (building 4,000 practice examples is not what is tested here)
    "cpu_reader.yaml": ["--model.reading_practice.pool", "64", "--data.max_eval_examples", "8"],
    # the SmolLM2 configs with the tiny random GPT-2 and the demo data instead of the demos' files
    "ralm_reranker_smollm2.yaml": ["--data.lm", "tiny:gpt2", "--data.texts", "demo", "--data.knowledge_base", "demo",
                                   "--data.stride", "4", "--data.max_length", "128", "--data.doc_max_length", "64"],
    "replug_lsr_smollm2.yaml": ["--model.lm", "tiny:gpt2", "--model.knowledge_base", ".cache/demo_kb",
                                "--model.build_knowledge_base.corpus", "demo", "--model.k", "4", "--data.train", "demo:train",
                                "--data.val", "demo:dev", "--data.max_eval_examples", "8"],
    "retrobust_reader_smollm2.yaml": ["--model.lm", "tiny:gpt2", "--trainer.accelerator", "cpu"],
    # the causal CPU recipe (SmolLM2 with LoRA on layers 16-29) with a tiny random GPT-2, LoRA on its two layers
    "cpu_causal_reader.yaml": ["--model.generator", "{tiny_gpt2}", "--model.generator_lora.target_modules", "[c_attn,c_proj]",
                               "--model.generator_lora.layers", "[0,1]", "--data.max_eval_examples", "8"],
}
AS_SHIPPED = ("tiny_cpu.yaml", "tiny_cpu_refresh.yaml", "replug_lsr_tiny.yaml", "ralm_reranker_tiny.yaml",
              "retrobust_reader_tiny.yaml")
WITHOUT_RETRIEVAL = ("nli_tiny.yaml", "nli_minilm.yaml", "nli_minilm_qa.yaml")  # NLI: sentence pairs, nothing retrieved
NOT_YET: dict[str, str] = {
    "reranker_demo.yaml": "distils the SmolLM2 demo reader's posteriors into a cross-encoder: the teacher alone is a "
                          "minutes-long pass on 2 CPU processes; test_cli.py parses and instantiates it, "
                          "test_rerank_stage.py trains the module",
}
"""Configs that train with retrieval but have no DDP run here yet, each with the reason (listed, so a new one fails)."""


def test_every_shipped_config_is_covered():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted([*AS_SHIPPED, *SHRUNK, *WITHOUT_RETRIEVAL, *NOT_YET])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, bpe_tokenizer) -> Path:
    """One working directory for all runs: the demo knowledge base the configs build in .cache/ is built once; and a
    tiny random GPT-2 (``tiny_gpt2/``) for the causal recipe."""
    from rag.generators.tiny import save, tiny_gpt2

    root = tmp_path_factory.mktemp("ddp_configs")
    save(tiny_gpt2(bpe_tokenizer, max_positions=512), bpe_tokenizer, root / "tiny_gpt2")
    return root


@pytest.mark.slow  # each config: two processes start torch + Lightning, load their models and take 3 steps
@pytest.mark.parametrize("name", [*AS_SHIPPED, *SHRUNK])
def test_config_trains_under_ddp_on_two_cpu_processes(workdir, name):
    root = workdir / "runs" / name.removesuffix(".yaml")
    argv = [sys.executable, "-m", "rag", "fit", "--config", str(CONFIGS / name), "--trainer.strategy", "ddp",
            "--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.max_steps", str(STEPS),
            "--trainer.max_epochs", "1", "--trainer.num_sanity_val_steps", "0", "--trainer.limit_val_batches", "1",
            "--trainer.val_check_interval", str(STEPS), "--trainer.check_val_every_n_epoch", "null",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(root),
            *(a.replace("{tiny_gpt2}", str(workdir / "tiny_gpt2")) for a in SHRUNK.get(name, []))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-6000:]
    assert "not used in producing the loss" not in run.stderr
    # the run's outputs are in its folder (issue #28.16): the log of the 3 steps from rank 0 (CSV, or TensorBoard for
    # the paper's configs) and, where the config checkpoints, the step-3 checkpoint
    cfg = yaml.safe_load((CONFIGS / name).read_text())["trainer"]
    logged = root / cfg["logger"]["init_args"]["name"] / "version_0"
    assert logged.is_dir(), sorted(str(p.relative_to(root)) for p in root.rglob("*"))[:20]
    if (logged / "metrics.csv").is_file():
        with open(logged / "metrics.csv", newline="") as f:
            steps = {int(row["step"]) for row in csv.DictReader(f) if row.get("step")}
        assert max(steps) >= STEPS - 1
    else:
        assert list(logged.glob("events.out.tfevents.*"))
    if any("ModelCheckpoint" in cb["class_path"] for cb in cfg.get("callbacks") or []):
        assert (root / "checkpoints" / "last.ckpt").is_file()
