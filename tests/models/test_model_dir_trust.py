"""A model directory is read, not obeyed: a name it records resolves locally only (no network call, one line naming the
field and file), and a crafted adapter config is refused from the files' headers before anything is allocated."""

from __future__ import annotations

import json
import shutil
import socket
import struct

import pytest
import torch

from rag.models.rag.model import CHECKPOINT_CONFIG, RagModel, RagModelConfig
from rag.utils.checksums import file_checksums
from rag.utils.errors import ConfigError, IntegrityError

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, bpe_tokenizer):
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=512, seed=3), bpe_tokenizer, tmp_path_factory.mktemp("trust") / "base")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, base_dir, build_hybrid_kb):
    """A LoRA-adapted causal RAG model (rank 4 on c_attn), exported."""
    from rag.generators.lora import LoraSettings, apply_lora

    kb_dir = build_hybrid_kb(20, "trust_kb")
    model = RagModel.from_components(None, base_dir, kb_dir, RagModelConfig(n_docs=2, max_context_length=80, retrieval="hybrid"))
    model.generator = apply_lora(model.generator, LoraSettings(r=4, alpha=8, target_modules=["c_attn"]))
    out = tmp_path_factory.mktemp("trust_export") / "model"
    model.eval().save_pretrained(out)
    return out


@pytest.fixture
def no_network(monkeypatch):
    """Every attempt to resolve a host or open a connection is recorded and fails."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return attempts


def _edit_config(copy, edit) -> None:
    meta = json.loads((copy / CHECKPOINT_CONFIG).read_text())
    edit(meta)
    (copy / CHECKPOINT_CONFIG).write_text(json.dumps(meta))


def _rechecksum(copy, rel: str) -> None:
    _edit_config(copy, lambda m: m["files"].update(file_checksums(copy, [copy / rel])))


# ----------------------------------------------------------------------------- names resolve locally only


def test_a_hub_id_as_the_adapter_base_fails_at_once_without_the_network(exported, tmp_path, no_network, capsys):
    from rag.cli import main

    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    _edit_config(copy, lambda m: m["generator"]["adapter"]["base"].update(name=HUB_ID))
    with pytest.raises(ConfigError) as e:
        RagModel.from_pretrained(copy)
    msg = str(e.value)
    assert "generator.adapter.base.name" in msg and str(copy / CHECKPOINT_CONFIG) in msg and HUB_ID in msg
    assert "HF_HUB_OFFLINE=0" in msg and "\n" not in msg
    assert main(["generate", "--model", str(copy), "who discovered oxygen?"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("rag generate: error: ")
    assert "generator.adapter.base.name" in last and CHECKPOINT_CONFIG in last
    assert no_network == []


def test_a_hub_id_as_the_referenced_query_encoder_fails_at_once_without_the_network(tmp_path, no_network,
                                                                                   tiny_dpr_question_dir, tiny_bart_dir,
                                                                                   tiny_kb_dir):
    model = RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, tiny_kb_dir, n_docs=2)
    model.save_pretrained(tmp_path / "m")
    _edit_config(tmp_path / "m", lambda m: m["question_encoder"].update(
        reference=True, name="facebook/dpr-question_encoder-single-nq-base", fingerprint="0" * 64, pooling="cls",
        normalize=False, max_length=64))
    with pytest.raises(ConfigError, match="field question_encoder.name names 'facebook/dpr-question_encoder-single-nq-base'"):
        RagModel.from_pretrained(tmp_path / "m")
    assert no_network == []


def test_the_hub_is_used_only_when_opted_into(monkeypatch, tmp_path):
    from rag.utils.hub import hub_opted_in, resolve_recorded_name

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert not hub_opted_in()
    with pytest.raises(ConfigError, match=f"field f names '{HUB_ID}'"):
        resolve_recorded_name(HUB_ID, "f", tmp_path / "x.json")
    assert resolve_recorded_name(str(tmp_path), "f", tmp_path / "x.json") == str(tmp_path)
    for value in ("0", "false", "OFF"):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert hub_opted_in() and resolve_recorded_name(HUB_ID, "f", "x.json") == HUB_ID  # the loader may fetch it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not hub_opted_in()


# ----------------------------------------------------------------------------- adapter shapes before allocation


def _adapter_copy(exported, tmp_path, edit):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    cfg = copy / "generator" / "adapter_config.json"
    data = json.loads(cfg.read_text())
    edit(data)
    cfg.write_text(json.dumps(data))
    _rechecksum(copy, "generator/adapter_config.json")
    return copy


@pytest.mark.parametrize("edit, what", [
    (lambda c: c.update(r=100000), "r=100000"),
    (lambda c: c.update(rank_pattern={"c_attn": 64}), "rank 64"),
    (lambda c: c.update(target_modules=["c_attn", "c_fc"]), "c_fc"),
])
def test_a_crafted_adapter_config_is_refused_before_allocating(exported, tmp_path, edit, what, monkeypatch):
    """The adapter config disagrees with the tensors its file holds: refused naming adapter_config.json, before peft
    builds a single LoRA layer (peft's layer constructor is made to fail if reached)."""
    import peft.tuners.lora.layer as lora_layer

    def never(*args, **kwargs):
        raise AssertionError("a LoRA layer was allocated before the shapes were checked")

    monkeypatch.setattr(lora_layer.LoraLayer, "update_layer", never)
    copy = _adapter_copy(exported, tmp_path, edit)
    with pytest.raises(IntegrityError) as e:
        RagModel.from_pretrained(copy)
    msg = str(e.value)
    assert str(copy / "generator" / "adapter_config.json") in msg and what in msg and "\n" not in msg
    assert "eval.json" not in msg


def test_adapter_tensors_that_do_not_fit_the_base_are_refused_naming_the_file(exported, tmp_path):
    """A rank-4 adapter file whose c_attn tensors were rewritten to another width (header and data consistent,
    checksum updated): refused from the safetensors header, naming adapter_model.safetensors and the base's width."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    weights = copy / "generator" / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 8)
    save_file(tensors, weights)
    _rechecksum(copy, "generator/adapter_model.safetensors")
    with pytest.raises(IntegrityError) as e:
        RagModel.from_pretrained(copy)
    msg = str(e.value)
    assert str(weights) in msg and name in msg and "\n" not in msg


def test_a_crafted_safetensors_header_is_refused_naming_the_file(exported, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    weights = copy / "generator" / "adapter_model.safetensors"
    header = json.dumps({"x.lora_A.weight": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 4]}}).encode()
    weights.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    _rechecksum(copy, "generator/adapter_model.safetensors")
    with pytest.raises(IntegrityError, match="adapter_model.safetensors"):
        RagModel.from_pretrained(copy)


def test_the_genuine_export_still_loads_without_the_network(exported, no_network):
    model = RagModel.from_pretrained(exported)
    assert any("lora_A" in n for n, _ in model.generator.named_parameters())
    assert no_network == []
