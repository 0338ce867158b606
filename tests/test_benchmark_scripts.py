"""The side-by-side benchmark scripts measure what they say: decode_bench discards one call per side at each
configuration's shapes before timing, and gpu_bench exits non-zero when a measurement fails (after writing the ones
that worked). The scripts' workers are stood in for, so nothing here is timed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    sys.path.insert(0, str(BENCHMARKS))  # the scripts import benchmarks/_proc.py as a top-level module
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return mod


def test_decode_bench_discards_a_warm_up_call_on_both_sides_before_timing(monkeypatch):
    """Each side's first call at a configuration's shapes "takes" 100 s (a cold call), the later ones 1 s (ours) and 2 s
    (transformers): the timed rounds and the ratio see only the later ones, and the warm-up is reported apart."""
    bench = load("decode_bench")
    calls = []

    class FakeSide:
        def __init__(self, impl, threads, batch, context_len):
            self.impl, self.seen = impl, set()

        def ready(self):
            return "checksum"

        def run(self, cfg):
            cold = cfg.name not in self.seen
            self.seen.add(cfg.name)
            calls.append((cfg.name, self.impl, cold))
            seconds = 100.0 if cold else (1.0 if self.impl == "ours" else 2.0)
            return seconds, None, torch.tensor([[2, 5, 2]]), 3

        def close(self):
            pass

    monkeypatch.setattr(bench, "Side", FakeSide)
    configs = bench.CONFIGS[:2]
    results = bench.benchmark(configs, {c.name: 1 for c in configs}, 1, 1, 8)
    for cfg, row in zip(configs, results):
        assert [c for c in calls if c[0] == cfg.name] == [(cfg.name, "ours", True), (cfg.name, "transformers", True),
                                                          (cfg.name, "ours", False), (cfg.name, "transformers", False)]
        assert row["ours_s"] == [1.0] and row["transformers_s"] == [2.0] and row["ratio"] == 2.0
        assert row["ours_warmup_s"] == row["transformers_warmup_s"] == 100.0


def test_gpu_bench_exits_non_zero_when_a_measurement_fails(monkeypatch, tmp_path, capsys):
    bench = load("gpu_bench")
    out = tmp_path / "gpu_bench.json"

    def broken(args, root, gpus):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(bench, "bench_encode", broken)
    monkeypatch.setattr(bench, "bench_train", lambda args, root, gpus: {"cpu_fp32_steps_per_s": 1.0})
    argv = ["--sections", "encode,train", "--threads", "1", "--out", str(out)]
    assert bench.main(argv) == 1
    written = json.loads(out.read_text())
    assert list(written["errors"]) == ["encode"] and written["train"] == {"cpu_fp32_steps_per_s": 1.0}  # the rest ran
    assert "1 measurement(s) failed: encode" in capsys.readouterr().err
    monkeypatch.setattr(bench, "bench_encode", lambda args, root, gpus: {"cpu_fp32_passages_per_s": 1.0})
    assert bench.main(argv) == 0
    assert "errors" not in json.loads(out.read_text())


def test_freeform_readers_base_model_is_the_pipeline_with_its_lora_update_zeroed(monkeypatch):
    """``base:DIR`` switches the adapter off exactly (every lora_B zero: W + B·A = W), the rest of the model untouched;
    a model without an adapter is refused rather than reported as its own zero-shot base."""
    bench = load("freeform_readers")

    class Reader:
        def __init__(self, names):
            self.model = torch.nn.Module()
            for n in names:
                self.model.register_parameter(n, torch.nn.Parameter(torch.ones(2, 2)))

    class Pipe:
        def __init__(self, names):
            self.reader = Reader(names)

    loaded = []
    monkeypatch.setattr(bench.rag, "load", lambda path, knowledge_base=None: loaded.append(path) or Pipe(["lora_B", "w"]))
    pipe = bench.open_model("base:some/dir")
    assert loaded == ["some/dir"]
    assert pipe.reader.model.lora_B.abs().sum() == 0 and pipe.reader.model.w.sum() == 4
    assert bench.open_model("some/dir").reader.model.lora_B.sum() == 4  # a plain model is loaded as it is
    monkeypatch.setattr(bench.rag, "load", lambda path, knowledge_base=None: Pipe(["w"]))
    with pytest.raises(SystemExit, match="no LoRA adapter"):  # not accepted as its own zero-shot base
        bench.open_model("base:plain")
