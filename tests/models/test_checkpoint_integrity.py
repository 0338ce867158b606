"""RagModel checkpoints as input: paths read from rag_config.json stay inside the checkpoint, checksums cover every
file the loaders open, damaged or incomplete files give errors naming the file and the fix (Python API and
`rag generate --model`), and the knowledge base is referenced portably."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rag.models.rag.model import CHECKPOINT_CONFIG, RagModel
from rag.utils.checksums import file_checksums
from rag.utils.errors import ConfigError, IntegrityError


@pytest.fixture(scope="module")
def kb_dir(tmp_path_factory, demo_passages, tiny_dpr_context_dir):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    out = tmp_path_factory.mktemp("ckpt_integrity") / "kb"
    KnowledgeBase.build(demo_passages[:12], TextEncoder(tiny_dpr_context_dir), out, index="flat", show_progress=False)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory, kb_dir, tiny_dpr_question_dir, tiny_bart_dir):
    """A pristine checkpoint, copied by each test that tampers with it."""
    out = tmp_path_factory.mktemp("ckpt_integrity_model") / "ckpt"
    RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kb_dir, n_docs=2).save_pretrained(out)
    return out


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    dst = tmp_path / "work" / "ckpt"
    shutil.copytree(saved, dst)
    return dst


def _edit(ckpt: Path, edit) -> None:
    meta = json.loads((ckpt / CHECKPOINT_CONFIG).read_text())
    edit(meta)
    (ckpt / CHECKPOINT_CONFIG).write_text(json.dumps(meta))


def _rechecksum(ckpt: Path, *rels: str) -> None:
    """Make the records agree with the files' current bytes (a consistent tampering that hashing cannot see)."""
    _edit(ckpt, lambda m: m["files"].update(file_checksums(ckpt, [ckpt / r for r in rels])))


def _cli(capsys, *argv) -> tuple[int, str]:
    from rag.cli import main

    code = main(["generate", *argv, "what is iron?"])
    return code, capsys.readouterr().err


def test_component_dirs_read_from_the_config_stay_inside(ckpt, capsys):
    """generator.dir of ../other/generator (a complete generator copied there, records adjusted) is refused,
    from the Python API and from `rag generate --model`; so are absolute and question-encoder paths."""
    other = ckpt.parent / "other"
    shutil.copytree(ckpt / "generator", other / "generator")
    for key, value in (("generator", "../other/generator"), ("generator", str(other / "generator")),
                       ("question_encoder", "../other/generator")):
        _edit(ckpt, lambda m, key=key, value=value: m[key].update(dir=value))
        with pytest.raises(IntegrityError, match="points outside"):
            RagModel.from_pretrained(ckpt)
        code, err = _cli(capsys, "--model", str(ckpt))
        assert code == 2 and "points outside" in err and "Traceback" not in err
        _edit(ckpt, lambda m, key=key: m[key].update(dir=key))
    assert RagModel.from_pretrained(ckpt) is not None


def test_checksums_cover_every_file_the_loaders_open(ckpt):
    # a record removed for a damaged file
    weights = ckpt / "generator" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    _edit(ckpt, lambda m: m["files"].pop("generator/model.safetensors"))
    for verify in ("full", "size"):
        with pytest.raises(IntegrityError, match=r"records no checksum for \['generator/model.safetensors'\]"):
            RagModel.from_pretrained(ckpt, verify=verify)
    # an unrecorded file a loader would read (transformers prefers a sharded index when one is present)
    _edit(ckpt, lambda m: m["files"].update(file_checksums(ckpt, [weights])))
    (ckpt / "generator" / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(IntegrityError, match="model.safetensors.index.json"):
        RagModel.from_pretrained(ckpt, verify="size")
    # an emptied record list
    _edit(ckpt, lambda m: m.update(files={}))
    with pytest.raises(IntegrityError, match="records no file checksums"):
        RagModel.from_pretrained(ckpt)


def test_garbage_weights_are_an_integrity_error_naming_the_checkpoint(ckpt, capsys):
    """Not safetensors at all (with records made to agree, or verify='none'): no SafetensorError traceback."""
    (ckpt / "generator" / "model.safetensors").write_bytes(b"this is not a safetensors file" * 10)
    _rechecksum(ckpt, "generator/model.safetensors")
    with pytest.raises(IntegrityError, match=f"{ckpt}/generator/model.safetensors: .*cannot be loaded.*SafetensorError.*restore"):
        RagModel.from_pretrained(ckpt)
    code, err = _cli(capsys, "--model", str(ckpt))
    assert code == 2 and "cannot be loaded" in err and "Traceback" not in err


def test_config_without_a_generator_entry_is_a_config_error(ckpt, capsys):
    _edit(ckpt, lambda m: m.pop("generator"))
    with pytest.raises(ConfigError, match=f"{CHECKPOINT_CONFIG}: has no 'generator' entry.*save the model again"):
        RagModel.from_pretrained(ckpt)
    code, err = _cli(capsys, "--model", str(ckpt))
    assert code == 2 and "no 'generator' entry" in err and "Traceback" not in err
    _edit(ckpt, lambda m: m.update(generator=["generator"]))
    with pytest.raises(ConfigError, match="'generator' must be an object"):
        RagModel.from_pretrained(ckpt)


def test_knowledge_base_is_referenced_relative_to_a_checkpoint_near_it(saved, kb_dir, tmp_path, tiny_dpr_question_dir,
                                                                       tiny_bart_dir):
    """Saved next to its knowledge base, a checkpoint records a relative path: the pair moves as one."""
    home = tmp_path / "project"
    shutil.copytree(kb_dir, home / "kb")
    RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, home / "kb", n_docs=2).save_pretrained(home / "models" / "m")
    meta = json.loads((home / "models" / "m" / CHECKPOINT_CONFIG).read_text())
    assert meta["knowledge_base"]["path"] == "../../kb"
    moved = tmp_path / "elsewhere"
    shutil.move(home, moved)
    meta["knowledge_base"].pop("saved_at")  # as on another machine: only the relative path can find it
    (moved / "models" / "m" / CHECKPOINT_CONFIG).write_text(json.dumps(meta))
    model = RagModel.from_pretrained(moved / "models" / "m")
    assert Path(model.knowledge_base.path).resolve() == (moved / "kb").resolve()


def test_missing_knowledge_base_says_to_pass_kb(ckpt, capsys):
    _edit(ckpt, lambda m: m["knowledge_base"].update(path="/nonexistent/developer/tmp/demo_kb", saved_at="/nonexistent/too"))
    with pytest.raises(ConfigError, match=r"not on this machine.*--kb <directory>.*knowledge_base=<directory>"):
        RagModel.from_pretrained(ckpt)
    code, err = _cli(capsys, "--model", str(ckpt))
    assert code == 2 and "--kb" in err and "rag index build" not in err
    _edit(ckpt, lambda m: m["knowledge_base"].update(path=None, name="wikipedia"))
    with pytest.raises(ConfigError, match="names knowledge base 'wikipedia'"):
        RagModel.from_pretrained(ckpt)


def test_demo_knowledge_base_is_referenced_by_name(monkeypatch, tmp_path):
    from rag.demo.kb import demo_kb_path
    from rag.models.rag.checkpoint import knowledge_base_reference

    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    assert knowledge_base_reference(demo_kb_path(), tmp_path / "anywhere" / "ckpt") == {"name": "demo", "path": None}
    assert knowledge_base_reference(tmp_path / "far" / "a" / "b" / "kb", tmp_path / "x" / "y" / "ckpt") == {
        "path": str((tmp_path / "far" / "a" / "b" / "kb").resolve())}


@pytest.mark.parametrize("name", ["demo_causal", "demo"])
def test_bundled_demo_checkpoint_references_no_machine_path(name):
    from rag.demo.model import demo_checkpoint_dir

    text = (demo_checkpoint_dir(name) / CHECKPOINT_CONFIG).read_text()
    ref = json.loads(text)["knowledge_base"]
    assert ref["name"] == "demo" and ref["path"] is None
    assert "/root" not in text and "/home" not in text and "/tmp" not in text and ".cache" not in text


def test_a_rebuild_of_the_same_passages_is_not_warned_about_another_knowledge_base_is(
        saved, kb_dir, tmp_path, demo_passages, caplog):
    """Embeddings (so versions) differ by float rounding between machines; the passages and the encoder decide."""
    import logging

    import numpy as np

    from rag.knowledge.knowledge_base import KnowledgeBase

    kb = KnowledgeBase.open(kb_dir)
    emb = np.load(kb_dir / "embeddings.npy")
    rebuilt = KnowledgeBase.from_embeddings(demo_passages[:12], emb * (1 + 1e-6), kb.encoder, tmp_path / "rebuilt",
                                            index="flat", show_progress=False)
    other = KnowledgeBase.from_embeddings(demo_passages[1:13], emb, kb.encoder, tmp_path / "other", index="flat",
                                          show_progress=False)
    assert rebuilt.version != kb.version and rebuilt.manifest.passages_digest == kb.manifest.passages_digest
    with caplog.at_level(logging.INFO, logger="rag.models.rag.checkpoint"):
        RagModel.from_pretrained(saved, knowledge_base=rebuilt.path)
    assert "a rebuild of the one the model was saved with" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rag.models.rag.checkpoint"):
        RagModel.from_pretrained(saved, knowledge_base=other.path)
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "the model was saved with" in r.message]


@pytest.mark.parametrize("name", ["demo_causal", "demo"])
def test_the_bundled_demo_checkpoint_knows_the_demo_passages(name):
    """`rag demo` rebuilds the demo knowledge base on the user's machine: its passages must match the recorded digest."""
    from rag.demo import load_demo_corpus
    from rag.demo.model import demo_checkpoint_dir
    from rag.knowledge.manifest import passages_digest

    ref = json.loads((demo_checkpoint_dir(name) / CHECKPOINT_CONFIG).read_text())["knowledge_base"]
    assert ref["passages_digest"] == passages_digest(load_demo_corpus())


def test_a_forged_knowledge_base_is_refused_by_load_and_generate_kb(saved, kb_dir, tmp_path, capsys):
    """`rag serve --kb` and `rag generate --kb` open through rag.load: a copy of the knowledge base with one passage
    edited and its Arrow file's SHA-256 written into the manifest is refused, naming the recorded and recomputed ids."""
    from rag.pipeline.api import load

    forged = tmp_path / "forged"
    shutil.copytree(kb_dir, forged)
    [arrow] = (forged / "passages").glob("*.arrow")
    data = arrow.read_bytes()
    old = next(w for w in (b"oxygen", b"Oxygen", b"iron", b"the") if data.count(w))
    arrow.write_bytes(data.replace(old, old.upper(), 1))
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["files"].update(file_checksums(forged, [arrow]))
    (forged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match=f"records version {manifest['version']} but its content gives kb-"):
        load(saved, knowledge_base=str(forged))
    code, err = _cli(capsys, "--model", str(saved), "--kb", str(forged))
    assert code == 2 and f"records version {manifest['version']}" in err.strip().splitlines()[-1]
