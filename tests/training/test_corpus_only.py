"""Reading practice from the corpus itself (cloze question-answer pairs, Lewis et al. 2019), its mix ratio, and the
corpus-only recipe: `rag fit` with a knowledge base and no --data.train trains on those pairs alone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import yaml

from rag.cli import main
from rag.cli.train import asks_corpus_only, corpus_only, make_cli
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.training.data import QADataModule
from rag.training.reading_practice import PracticeExample, ReadingPracticeSettings, cloze_practice, fit_to_window
from rag.utils.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
OXYGEN = Passage("elements/oxygen", "Oxygen", "Symbol: O. Atomic number: 8. It is used in high temperature welding, and in "
                 "breathing. It also makes up 20.8% of the Earth's atmosphere. It was discovered by Priestley in 1774.")
PALLADIUM = Passage("elements/palladium", "Palladium", "Soft white ductile transition element. Discovered in 1803 by "
                    "W.H. Wollaston. Used as a catalyst.")


def test_cloze_pairs_ask_about_a_sentences_year_number_name_and_use():
    pairs = {(e.question, e.answer) for e in cloze_practice([OXYGEN, PALLADIUM], 100)}
    assert ("What is Oxygen used in?", "high temperature welding") in pairs
    assert ("Oxygen also makes up what percentage of the Earth's atmosphere?", "20.8%") in pairs
    assert ("Who discovered Oxygen in 1774?", "Priestley") in pairs
    assert ("Oxygen was discovered by Priestley in what year?", "1774") in pairs
    assert ("Palladium was discovered in 1803 by whom?", "W.H. Wollaston") in pairs  # an initial ends no sentence
    assert ("What was Palladium used as?", "a catalyst") in pairs
    assert not any(a in ("8", "O") for _, a in pairs)  # "Atomic number: 8" is a field, not a sentence to ask about
    for e in cloze_practice([OXYGEN, PALLADIUM], 100):
        assert e.answer in e.passage.text and e.answer not in e.question and e.question.endswith("?")


def test_a_name_with_middle_initials_is_asked_whole_and_a_number_glued_to_a_unit_is_not_asked():
    uranium = Passage("u", "Uranium", "Discovered by Martin H. Klaproth in 1789. First produced by Edwin M. McMillan and "
                      "P.H. Abelson in 1940. It melts at 1405K. It has 17 isotopes.")
    pairs = {(e.question, e.answer) for e in cloze_practice([uranium], 100)}
    assert ("Who discovered Uranium in 1789?", "Martin H. Klaproth") in pairs
    assert ("Who first produced Uranium in 1940?", "Edwin M. McMillan and P.H. Abelson") in pairs
    assert ("Uranium has how many isotopes?", "17") in pairs
    answers = {a for _, a in pairs}
    assert not answers & {"Martin", "Edwin", "1405", "140"}  # never a first name alone, nor "how many" of "1405K"


def test_span_cloze_asks_for_the_noun_phrase_after_a_preposition_article_or_copula():
    tungsten = Passage("elements/tungsten", "Tungsten", "White or grey metallic transition element, formerly called "
                       "wolfram. It is used in lamp filaments. Its most stable isotope is W-184.")
    pairs = {(e.question, e.answer) for e in cloze_practice([tungsten], 100)}
    assert ("White or grey metallic transition element, formerly called what?", "wolfram") in pairs
    assert ("Tungsten's most stable isotope is what?", "W-184") in pairs
    assert ("Tungsten is used in what?", "lamp filaments") in pairs
    assert all("tungsten" not in a.lower() and len(a.split()) <= 4 for _, a in pairs)  # never the title
    # a verb after the copula is no noun phrase to ask for ("was identified" -> no "Barium was what ...?")
    barium = Passage("b", "Barium", "Barium was identified in 1774 by Karl Scheele.")
    assert "identified" not in {e.answer for e in cloze_practice([barium], 100)}


def test_a_long_passage_is_read_as_the_sentences_around_the_asked_one():
    filler = [f"Filler sentence number {i} says nothing much at all here." for i in range(12)]
    text = " ".join(filler[:10] + ["It is used in high temperature welding."] + filler[10:])
    asked = [e for e in cloze_practice([Passage("o", "Oxygen", text)], 100) if e.answer == "high temperature welding"]
    assert asked  # "What is Oxygen used in?" and "Oxygen is used in what?"
    for ex in asked:
        assert ex.passage.id == "o" and "used in high temperature welding" in ex.passage.text
        assert ex.passage.text.startswith(filler[8]) and ex.passage.text.endswith(filler[11])  # two before, two after


def test_cloze_pairs_are_deterministic_and_capped():
    a, b = cloze_practice([OXYGEN, PALLADIUM], 3, seed=1), cloze_practice([OXYGEN, PALLADIUM], 3, seed=1)
    assert a == b and len(a) == 3
    assert cloze_practice([Passage("x", "X", "nothing to ask about here at all")], 10) == []


def test_cloze_pairs_are_bounded_by_the_sentence_and_the_pool():
    assert cloze_practice([Passage("x", "X", " ".join(f"it has {i} parts" for i in range(5000)))], 10) == []

    class Counted(list):
        read = 0

        def __getitem__(self, i):
            Counted.read += 1
            return list.__getitem__(self, i)

    corpus = Counted(Passage(f"o{i}", "Oxygen", OXYGEN.text) for i in range(1000))
    assert len(cloze_practice(corpus, 5)) == 5 and Counted.read <= 5  # passages read until 5 pairs are found


def test_the_mix_ratio_sets_practice_examples_per_real_pair():
    assert ReadingPracticeSettings(per_step=4).examples_per_step(8) == 4
    assert ReadingPracticeSettings(mix_ratio=0.5).examples_per_step(4) == 2
    assert ReadingPracticeSettings(mix_ratio=0.1).examples_per_step(4) == 1  # at least one
    with pytest.raises(ConfigError, match="model.reading_practice.mix_ratio"):
        ReadingPracticeSettings(mix_ratio=0)


def _kb(passages, root) -> str:
    emb = np.random.default_rng(0).standard_normal((len(passages), 4)).astype(np.float32)
    encoder = {"name": "synthetic", "dim": 4, "fingerprint": "synthetic-4"}
    return str(KnowledgeBase.from_embeddings(passages, emb, encoder, root / "kb", index="flat", show_progress=False).path)


def test_the_data_of_a_knowledge_base_alone_is_its_cloze_pairs_with_held_out_passages(demo_passages, tmp_path, caplog):
    dm = QADataModule(self_supervised_kb=_kb(demo_passages[:40], tmp_path), batch_size=2, self_supervised_val=8)
    with caplog.at_level(logging.WARNING, logger="rag.training.data"):
        dm.setup("fit")
    train, val = dm.train_pairs, dm._datasets["val"]
    assert len(train) > 0 and 8 <= len(val) < len(train)
    train_ids, val_ids = set(train.passage_ids), {e.where.rsplit(" ", 1)[1] for e in val.examples}
    assert train_ids and val_ids and not train_ids & val_ids  # validation passages are never trained on
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"no --data.train: training on {len(train)} self-supervised cloze pairs")
    assert dm.val_dataloader() is not None


def test_a_knowledge_base_that_yields_no_pair_is_one_line(tmp_path):
    kb = _kb([Passage("a", "A", "nothing to ask about here"), Passage("b", "B", "nor here either")], tmp_path)
    with pytest.raises(ConfigError, match=r"^model.knowledge_base .*: none of its 2 passages .* give question-answer pairs "
                                          r"with --data.train$"):
        QADataModule(self_supervised_kb=kb).setup("fit")


def test_an_empty_knowledge_base_is_one_line(tmp_path, monkeypatch):
    kb = _kb([Passage("a", "A", "x")], tmp_path)
    monkeypatch.setattr(KnowledgeBase, "all_passages", lambda self: [])
    with pytest.raises(ConfigError, match=r"^model.knowledge_base .* holds no passage, .*rag index build --corpus"):
        QADataModule(self_supervised_kb=kb).setup("fit")


def test_rag_fit_reads_a_knowledge_base_without_training_data_as_the_corpus_only_recipe():
    assert asks_corpus_only(["fit", "--config", "c.yaml", "--model.knowledge_base", "KB"])
    assert not asks_corpus_only(["fit", "--model.knowledge_base=KB", "--data.train=t.jsonl"])
    assert not asks_corpus_only(["fit", "--config", "c.yaml"])
    cfg = yaml.safe_load((REPO / "lightning_configs" / "cpu_causal_reader.yaml").read_text())
    cfg["model"]["init_args"]["knowledge_base"] = "KB"
    assert not corpus_only(cfg, asked=False) and cfg["data"]["init_args"]["train"] == "demo:train"
    assert corpus_only(cfg, asked=True)
    assert {k: cfg["data"]["init_args"][k] for k in ("train", "val", "test", "self_supervised_kb")} == \
        {"train": None, "val": None, "test": None, "self_supervised_kb": "KB"}


def test_the_corpus_only_recipe_trains(tmp_path, demo_passages, bpe_tokenizer, build_hybrid_kb):
    """cpu_causal_reader.yaml (sized for a tiny GPT-2) with `--model.knowledge_base KB` and no --data.train: two steps on
    the cloze pairs of KB, validated on its held-out passages' pairs."""
    from rag.generators.tiny import save, tiny_gpt2

    gpt2 = save(tiny_gpt2(bpe_tokenizer, max_positions=512), bpe_tokenizer, tmp_path / "gpt2")
    kb = build_hybrid_kb(40, "corpus_only_kb")
    cfg = yaml.safe_load((REPO / "lightning_configs" / "cpu_causal_reader.yaml").read_text())
    init = cfg["model"]["init_args"]
    init.update(generator=gpt2, question_encoder=None, export_dir=None)
    init["decoding"].update(max_new_tokens=3)
    init["generator_lora"].update(target_modules=["c_attn"], layers=[1])
    init["rag"].update(max_context_length=64)
    cfg["data"]["init_args"].update(max_eval_examples=4, eval_batch_size=4)
    cfg["trainer"].update(max_steps=2, val_check_interval=2, limit_val_batches=1, default_root_dir=str(tmp_path / "run"),
                          enable_progress_bar=False, enable_checkpointing=False, callbacks=[])  # the CSV logger kept:
    # it merges the model's and the data's hyperparameters, which must not share a name with different values
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = make_cli(["fit", "--config", str(path), "--model.knowledge_base", kb])
    assert cli.trainer.global_step == 2 and cli.datamodule.corpus_only
    questions = {q for q, _ in cli.datamodule.train_pairs.pairs}
    assert questions and not questions & {json.loads(x)["question"] for x in
                                          (REPO / "rag" / "demo" / "elements_qa_train.jsonl").read_text().splitlines()}


def test_rag_fit_corpus_only_with_a_knowledge_base_of_no_pair_is_one_line(tmp_path, capsys):
    kb = _kb([Passage("a", "A", "nothing to ask about here")], tmp_path)
    capsys.readouterr()  # building it shows its own bars
    status = main(["fit", "--config", str(REPO / "lightning_configs" / "cpu_causal_reader.yaml"), "--model.knowledge_base", kb,
                   "--trainer.default_root_dir", str(tmp_path / "run"), "--model.question_encoder", "null"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "give question-answer pairs with --data.train" in err[0], err


def test_rag_fit_corpus_only_with_an_empty_knowledge_base_is_one_line(tmp_path, capsys, monkeypatch):
    kb = _kb([Passage("a", "A", "x")], tmp_path)
    monkeypatch.setattr(KnowledgeBase, "all_passages", lambda self: [])  # no build writes an empty one: as if it held none
    capsys.readouterr()
    status = main(["fit", "--config", str(REPO / "lightning_configs" / "cpu_causal_reader.yaml"), "--model.knowledge_base", kb,
                   "--trainer.default_root_dir", str(tmp_path / "run"), "--model.question_encoder", "null"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "holds no passage" in err[0] and "rag index build --corpus" in err[0], err


def test_rag_fit_building_its_knowledge_base_from_an_empty_corpus_names_the_option(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    build = ["--model.build_knowledge_base.corpus", str(empty), "--model.build_knowledge_base.encoder", "minilm"]
    status = main(["fit", "--config", str(REPO / "lightning_configs" / "cpu_causal_reader.yaml"), "--model.knowledge_base",
                   str(tmp_path / "kb"), *build, "--data.train", "null",
                   "--trainer.default_root_dir", str(tmp_path / "run"), "--model.question_encoder", "null"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert status == 2 and len(err) == 1, err
    assert f"model.build_knowledge_base.corpus {empty}: " in err[0] and "contains no documents" in err[0]
    assert not (tmp_path / "kb").exists()


def test_subject_cloze_asks_for_the_noun_phrase_a_sentence_opens_with():
    gold = Passage("elements/gold", "Gold", "Gold is gold colored. Au-198 is used in treating cancer and some other "
                   "medical conditions. It is the most malleable metal known. La-139 which is stable is common.")
    pairs = {(e.question, e.answer) for e in cloze_practice([gold], 100)}
    assert ("What is used in treating cancer and some other medical conditions?", "Au-198") in pairs
    answers = {a for _, a in pairs}
    assert "Gold" not in answers and "It" not in answers  # the title itself and a pronoun are no subject to ask for
    assert not any("which" in a for a in answers)  # a relative clause is cut off no subject


def _words_length(e) -> int:
    return len(e.question.split()) + len(e.passage.text.split())


def test_practice_passages_are_fitted_to_the_window_so_no_answer_is_cut():
    sentences = [f"Sentence {i} says little." for i in range(8)]
    text = " ".join(sentences[:5] + ["Its answer is welding."] + sentences[5:])
    long = PracticeExample("What is it?", "welding", Passage("p", "P", text))
    short = PracticeExample("What is it?", "welding", Passage("q", "Q", "Its answer is welding."))
    lost = PracticeExample("What is it?", "welding", Passage("r", "R", "A sentence far too long " * 20 + "welding."))
    fitted, shortened, dropped = fit_to_window([long, short, lost], _words_length, 20)
    assert (shortened, dropped) == (1, 1) and fitted[1] == short  # what fits is kept as it is
    cut = fitted[0]
    assert "Its answer is welding." in cut.passage.text and _words_length(cut) <= 20
    assert cut.passage.text != text and cut.passage.id == "p"
    # grown around the answer while it fits: one sentence more (of 4 words) would not
    assert _words_length(cut) + 4 > 20


def test_a_definition_and_a_sentence_without_its_subject_are_asked_about_the_title():
    selenium = Passage("elements/selenium", "Selenium", "Symbol: Se. Atomic number: 34. Blue-grey metalloid element, "
                       "belongs to group 16 of the periodic table. Multiple allotropic forms exist. Chemically resembles "
                       "sulphur. Forms a number of complexes.")
    pairs = {(e.question, e.answer) for e in cloze_practice([selenium], 100)}
    assert ("What is Selenium?", "Blue-grey metalloid element") in pairs  # the first sentence that is not a field
    assert ("What kind of element is Selenium?", "Blue-grey metalloid") in pairs
    assert ("What does Selenium chemically resemble?", "sulphur") in pairs  # the unsaid subject named, asked with "does"
    assert ("What does Selenium belong to group 16 of?", "periodic table") in pairs  # the clause after the definition
    # "forms a number of complexes": the head of "a number of" is no object to ask for
    assert not any(q.startswith("What does Selenium form") and a == "number" for q, a in pairs)
    assert not any(q.startswith("What kind of exist") or a == "Multiple allotropic forms exist" for q, a in pairs)
    # only the passage's first sentence is its definition: a noun phrase later on is not asked "What is Selenium?"
    later = Passage("x", "Xenon", "It is a noble gas. Colourless heavy gas.")
    assert "Colourless heavy gas" not in {a for _, a in cloze_practice([later], 100)}


def test_questions_asked_in_place_are_also_asked_wh_word_first():
    tungsten = Passage("elements/tungsten", "Tungsten", "It is used in lamp filaments. It has many isotopes. It reaches "
                       "the stratosphere.")
    pairs = {(e.question, e.answer) for e in cloze_practice([tungsten], 100)}
    assert {("Tungsten is used in what?", "lamp filaments"), ("What is Tungsten used in?", "lamp filaments")} <= pairs
    assert ("What does Tungsten reach?", "stratosphere") in pairs  # the verb's base form after "does"
    gold = {(e.question, e.answer) for e in cloze_practice([Passage("g", "Gold", "It has been proposed as a catalyst.")], 9)}
    assert ("What has Gold been proposed as?", "catalyst") in gold  # "has been": an auxiliary, not "What does Gold have"
    # a plural noun opening a sentence is no verb: "Examples include ..." is not asked as "What does X example?"
    lists = cloze_practice([Passage("c", "container", "Examples include arrays, lists and stacks.")], 9)
    assert not any(e.question.startswith("What does") for e in lists)
    for e in cloze_practice([tungsten], 100):
        assert e.answer in e.passage.text and e.answer not in e.question and e.question.endswith("?")
