"""Device checks: GPUs a command or a Trainer asks for that the machine lacks are one clear error, named by option."""

from __future__ import annotations

import pytest
import torch

from rag.cli import main
from rag.utils.devices import check_device, check_trainer_devices
from rag.utils.errors import ConfigError

REPO_CONFIG = "lightning_configs/tiny_cpu.yaml"


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize("accelerator, devices", [("cpu", 8), ("auto", "auto"), ("gpu", 2), ("cuda", "0,1"), ("gpu", -1),
                                                  ("gpu", "auto"), ("gpu", [1])])
def test_what_the_machine_has_passes(monkeypatch, accelerator, devices):
    _gpus(monkeypatch, 2)
    check_trainer_devices(accelerator, devices)


@pytest.mark.parametrize("devices, expected", [(4, "has 2 GPUs"), ("0,3", "has 2 GPUs"), ([2], "has 2 GPUs"),
                                               ("two", "give a count")])
def test_more_gpus_than_present_names_the_count(monkeypatch, devices, expected):
    _gpus(monkeypatch, 2)
    with pytest.raises(ConfigError, match=f"--trainer.devices.*{expected}"):
        check_trainer_devices("gpu", devices)


def test_no_gpu_at_all(monkeypatch):
    _gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="--trainer.accelerator gpu: .*no CUDA GPU; use --trainer.accelerator cpu"):
        check_trainer_devices("gpu", 1)
    with pytest.raises(ConfigError, match="--device cuda:0: .*no CUDA GPU"):
        check_device("cuda:0")


def test_rag_fit_says_it_in_one_line(monkeypatch, capsys):
    """Lightning itself ends a traceback with 'No supported gpu backend found!'."""
    _gpus(monkeypatch, 0)
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / REPO_CONFIG)
    assert main(["fit", "--config", config, "--trainer.accelerator", "gpu", "--trainer.devices", "2"]) == 2
    err = capsys.readouterr().err
    assert "--trainer.accelerator gpu" in err and "Traceback" not in err


def test_trainer_options_lightning_rejects_are_one_line(capsys):
    """FSDP needs a GPU in Lightning: it raised a ValueError traceback from deep in Trainer()."""
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / REPO_CONFIG)
    assert main(["fit", "--config", config, "--trainer.strategy", "fsdp", "--trainer.accelerator", "cpu",
                 "--trainer.devices", "2"]) == 2
    err = capsys.readouterr().err
    assert "trainer options:" in err and "fsdp" in err and "Traceback" not in err


def test_without_cudnn_attention_turns_cudnn_attention_off_inside_and_restores_it():
    from rag.utils.devices import without_cudnn_attention

    seen = []
    f = without_cudnn_attention(lambda x: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or x + 1)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert f(6) == 7 and seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_passage_encoding_runs_attention_without_cudnn(monkeypatch, tiny_dpr_context_dir):
    """The shape-dependent cuDNN attention plans cost 10x on GPUs in half precision
    (rag.utils.devices.without_cudnn_attention)."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.passages import Passage

    sdpa = torch.nn.functional.scaled_dot_product_attention
    flags = []

    def spy(*args, **kwargs):
        flags.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    enc = TextEncoder(tiny_dpr_context_dir)
    enc.encode_passages([Passage("a", "T", "some text"), Passage("b", "U", "more text here")], show_progress=False)
    assert flags and not any(flags)


@pytest.mark.parametrize("module, methods", [
    ("rag.training.modules:RagModule", ["training_step", "validation_step", "test_step", "predict_step"]),
    ("rag.training.reranker:PredictiveRerankerModule", ["training_step", "validation_step"]),
    ("rag.training.nli:NLIModule", ["training_step", "validation_step", "test_step"]),
    ("rag.training.causal_reader:CausalReaderModule", ["training_step", "validation_step", "test_step"]),
    ("rag.training.replug_lsr:ReplugLSRModule", ["training_step", "validation_step"]),
    ("rag.pipeline.api:RagPipeline", ["generate", "retrieve"]),
])
def test_every_lightning_step_and_the_pipeline_run_without_cudnn_attention(module, methods):
    import importlib

    mod, cls = module.split(":")
    klass = getattr(importlib.import_module(mod), cls)
    for name in methods:
        assert getattr(klass, name).__qualname__.endswith(f"{cls}.{name}")
        assert "sdpa_kernel" in getattr(klass, name).__code__.co_names, f"{cls}.{name} is not wrapped by without_cudnn_attention"
