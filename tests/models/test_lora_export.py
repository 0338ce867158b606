"""A LoRA-adapted causal RAG model exports as its adapter plus a manifest naming the base; loading rebuilds it exactly,
checks every file it opens, and refuses an adapter for another base naming both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rag.models.rag.model import CHECKPOINT_CONFIG, RagModel, RagModelConfig
from rag.utils.errors import IntegrityError

QUESTIONS = ["What is the atomic number of iron?", "Who discovered oxygen?"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, bpe_tokenizer):
    from rag.generators.tiny import save, tiny_gpt2

    return save(tiny_gpt2(bpe_tokenizer, max_positions=512, seed=3), bpe_tokenizer, tmp_path_factory.mktemp("lora") / "base")


@pytest.fixture(scope="module")
def kb_dir(build_hybrid_kb):
    return build_hybrid_kb(20, "lora_kb")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, base_dir, kb_dir):
    """A model whose adapters were given non-zero weights (as training does), exported; and the model itself."""
    from rag.generators.lora import LoraSettings, apply_lora

    model = RagModel.from_components(None, base_dir, kb_dir, RagModelConfig(n_docs=2, max_context_length=80, retrieval="hybrid"))
    model.generator = apply_lora(model.generator, LoraSettings(r=4, alpha=8, target_modules=["c_attn"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.generator.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.eval()
    out = tmp_path_factory.mktemp("lora_export") / "model"
    model.save_pretrained(out)
    return out, model


def test_the_export_holds_the_adapter_and_names_the_base_with_its_checksums(exported, base_dir):
    out, _ = exported
    gen_files = sorted(p.name for p in (out / "generator").iterdir())
    assert gen_files == ["adapter_config.json", "adapter_model.safetensors"]  # no copy of the base weights
    meta = json.loads((out / CHECKPOINT_CONFIG).read_text())
    base = meta["generator"]["adapter"]["base"]
    assert base["name"] == str(base_dir) and base["model_type"] == "gpt2"
    from rag.utils.checksums import sha256_file

    assert base["files"]["model.safetensors"]["sha256"] == sha256_file(f"{base_dir}/model.safetensors")
    assert {"config.json", "tokenizer.json"} <= set(base["files"])
    assert set(meta["files"]) >= {"generator/adapter_config.json", "generator/adapter_model.safetensors"}
    assert meta["config"]["retrieval"] == "hybrid"


def test_the_adapter_config_lists_its_modules_sorted(tmp_path):
    """peft writes target_modules from a set, so the same adapter exported twice gave two checksums."""
    from rag.models.rag.checkpoint import _sort_adapter_modules

    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps({"target_modules": ["v_proj", "q_proj", "o_proj", "k_proj"], "r": 8}))
    _sort_adapter_modules(config)
    assert json.loads(config.read_text()) == {"target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"], "r": 8}


def test_export_and_load_give_identical_answers_and_log_likelihoods(exported):
    from rag.pipeline.api import RagPipeline, load

    out, model = exported
    before = RagPipeline(model).generate(QUESTIONS, max_new_tokens=5, num_beams=2)
    loaded = load(out)
    after = loaded.generate(QUESTIONS, max_new_tokens=5, num_beams=2)
    assert [a.text for a in after] == [b.text for b in before]
    assert [a.token_ids for a in after] == [b.token_ids for b in before]
    for a, b in zip(after, before):
        assert a.score == pytest.approx(b.score, abs=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(QUESTIONS, ["26", "Priestley"]).loss, model(QUESTIONS, ["26", "Priestley"]).loss)


def test_an_altered_adapter_file_is_refused_naming_it(exported, tmp_path):
    out, _ = exported
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with open(copy / "generator" / "adapter_model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\1")
    with pytest.raises(IntegrityError, match="adapter_model.safetensors"):
        RagModel.from_pretrained(copy)


def test_an_adapter_for_another_base_is_refused_naming_both(exported, base_dir, tmp_path, bpe_tokenizer):
    from rag.generators.tiny import save, tiny_gpt2

    out, _ = exported
    other = save(tiny_gpt2(bpe_tokenizer, max_positions=512, seed=9), bpe_tokenizer, tmp_path / "other")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    meta = json.loads((copy / CHECKPOINT_CONFIG).read_text())
    recorded = meta["generator"]["adapter"]["base"]["files"]["model.safetensors"]["sha256"]
    meta["generator"]["adapter"]["base"]["name"] = str(base_dir)
    shutil.copytree(base_dir, tmp_path / "moved_base")
    shutil.copy(f"{other}/model.safetensors", f"{tmp_path}/moved_base/model.safetensors")  # same name, other weights
    meta["generator"]["adapter"]["base"]["name"] = str(tmp_path / "moved_base")
    (copy / CHECKPOINT_CONFIG).write_text(json.dumps(meta))
    with pytest.raises(IntegrityError) as e:
        RagModel.from_pretrained(copy, verify="size")  # the checkpoint's own files are unchanged in size
    msg = str(e.value)
    assert recorded[:16] in msg and str(tmp_path / "moved_base") in msg and "model.safetensors" in msg


def _with_base(out, base, tmp_path, edit):
    """A copy of the export `out` whose base is a copy of `base` with its config.json edited by `edit`."""
    moved, copy = tmp_path / "base_copy", tmp_path / "export_copy"
    shutil.copytree(base, moved)
    shutil.copytree(out, copy)
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps(edit(config), indent=4))
    meta = json.loads((copy / CHECKPOINT_CONFIG).read_text())
    meta["generator"]["adapter"]["base"]["name"] = str(moved)
    (copy / CHECKPOINT_CONFIG).write_text(json.dumps(meta))
    return copy


def test_a_base_written_by_another_transformers_release_is_the_same_base(exported, base_dir, tmp_path):
    """A fresh install may bring another transformers release, which writes its version into the base's config.json
    (the demo LM converted by 5.25 instead of 5.24): the same base, so the adapter loads; any other change to the
    config is another base, refused naming the file."""
    out, model = exported
    recorded = json.loads((out / CHECKPOINT_CONFIG).read_text())["generator"]["adapter"]["base"]["files"]["config.json"]
    assert "file_sha256" in recorded and recorded["sha256"] != recorded["file_sha256"]  # canonical, and the file's own
    newer = _with_base(out, base_dir, tmp_path / "a", lambda c: {**c, "transformers_version": "99.0.0"})
    loaded = RagModel.from_pretrained(newer, verify="size")
    with torch.no_grad():
        torch.testing.assert_close(loaded(QUESTIONS, ["26", "Priestley"]).loss, model(QUESTIONS, ["26", "Priestley"]).loss)
    other = _with_base(out, base_dir, tmp_path / "b", lambda c: {**c, "layer_norm_epsilon": 1e-3})
    with pytest.raises(IntegrityError, match="config.json"):
        RagModel.from_pretrained(other, verify="size")


def test_an_adapter_recorded_with_its_base_files_own_checksums_still_loads(exported, base_dir, tmp_path):
    """An export made before JSON configs were read canonically records config.json's file SHA-256: still its base."""
    from rag.utils.checksums import sha256_file

    out, _ = exported
    copy = tmp_path / "old"
    shutil.copytree(out, copy)
    meta = json.loads((copy / CHECKPOINT_CONFIG).read_text())
    files = meta["generator"]["adapter"]["base"]["files"]
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        if name in files:
            files[name] = {"sha256": sha256_file(Path(base_dir) / name), "bytes": (Path(base_dir) / name).stat().st_size}
    (copy / CHECKPOINT_CONFIG).write_text(json.dumps(meta))
    RagModel.from_pretrained(copy, verify="size")


def test_rag_generate_and_serve_take_the_exported_directory(exported, capsys):
    from rag.cli import main

    out, _ = exported
    assert main(["generate", "--model", str(out), "--json", "--max-new-tokens", "3", QUESTIONS[0]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and len(lines[0]["passages"]) == 2
    from rag.serve.app import background_server, create_app

    pytest.importorskip("fastapi")
    import httpx

    from rag.pipeline.api import load

    with background_server(create_app(load(out))) as url:
        r = httpx.post(f"{url}/generate", json={"questions": [QUESTIONS[1]], "max_new_tokens": 3, "retrieval": "dense"},
                       timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["answers"][0]["passages"]) == 2
