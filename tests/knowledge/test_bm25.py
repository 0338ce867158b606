"""BM25Index / BM25Retriever: lexical ranking, parity with bm25s, persistence, edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rag.knowledge.bm25 import (
    LEGACY_TITLE_WEIGHT,
    LEGACY_TOKEN_PATTERN,
    TITLE_WEIGHT,
    TOKEN_PATTERN,
    BM25Index,
    BM25Retriever,
    passage_text,
    top_k,
)
from rag.knowledge.passages import Passage
from rag.knowledge.types import Retrieved, Retriever
from rag.utils.errors import ConfigError, CorpusError, KnowledgeBaseError, RagError

CORPUS = [
    Passage("p0", "Hydrogen", "The lightest element; stars such as the Sun are made mostly of it."),
    Passage("p1", "Helium", "A noble gas that fills party balloons and airships because it is lighter than air."),
    Passage("p2", "Carbon", "Forms diamond and graphite and is the backbone of organic molecules."),
    Passage("p3", "Oxygen", "Makes up about a fifth of the atmosphere; animals breathe it to live."),
    Passage("p4", "Iron", "The main component of steel; haemoglobin in blood carries oxygen with it."),
    Passage("p5", "Gold", "A soft yellow precious metal prized for jewellery and coins."),
    Passage("p6", "Mercury", "The only metal that is liquid at room temperature, once used in thermometers."),
    Passage("p7", "Uranium", "A radioactive metal whose nuclei are split in nuclear power stations."),
    Passage("p8", "Sodium", "Reacts violently with water; with chlorine it forms table salt."),
    Passage("p9", "Silicon", "The semiconductor from which computer chips and solar panels are manufactured."),
]


@pytest.fixture(scope="module")
def index() -> BM25Index:
    return BM25Index.build(CORPUS, show_progress=False)


def test_lexical_match_ranks_first(index):
    queries = [
        "which metal was used in a thermometer",   # stemming: thermometer ~ thermometers
        "what are microchips and computer chip made of",
        "balloons",
        "table salt and chlorine",
        "diamonds",
        "gold",                                      # title only: the title is indexed too
    ]
    scores, rows = index.search(queries, k=3)
    assert scores.shape == rows.shape == (len(queries), 3)
    assert scores.dtype == np.float32 and rows.dtype == np.int64
    assert rows[:, 0].tolist() == [6, 9, 1, 8, 2, 5]
    assert (np.diff(scores, axis=1) <= 0).all()
    assert (scores[:, 0] > 0).all()


def test_scores_match_bm25s_directly(index):
    import bm25s
    import Stemmer

    stemmer = Stemmer.Stemmer("english")
    ref = bm25s.BM25(k1=0.9, b=0.4)
    ref.index(bm25s.tokenize([passage_text(p) for p in CORPUS], stopwords="en", stemmer=stemmer, token_pattern=TOKEN_PATTERN,
                             show_progress=False), show_progress=False)
    queries = ["radioactive metal in power stations", "the gas animals breathe"]
    q_tok = bm25s.tokenize(queries, stopwords="en", stemmer=stemmer, token_pattern=TOKEN_PATTERN, show_progress=False)
    ref_rows, ref_scores = ref.retrieve(q_tok, k=4, show_progress=False)
    scores, rows = index.search(queries, k=4)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-6)
    assert rows[:, 0].tolist() == ref_rows[:, 0].tolist() == [7, 3]


def test_save_load_round_trip(index, tmp_path):
    queries = ["metal coins", "nuclear power", "zzzz unknownword", "oxygen in blood"]
    before = index.search(queries, k=5)
    index.save(tmp_path / "bm25")
    assert [p.name for p in tmp_path.iterdir()] == ["bm25"]  # no temporary directory left behind
    back = BM25Index.load(tmp_path / "bm25")
    assert len(back) == len(index) == 10
    assert (back.k1, back.b, back.stemmer_name, back.stopwords) == (0.9, 0.4, "english", "en")
    after = back.search(queries, k=5)
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    mm = BM25Index.load(tmp_path / "bm25", mmap=True).search(queries, k=5)
    np.testing.assert_array_equal(before[1], mm[1])
    with pytest.raises(FileExistsError):
        index.save(tmp_path / "bm25")
    index.save(tmp_path / "bm25", overwrite=True)
    with pytest.raises(KnowledgeBaseError, match="rag_bm25.json"):
        BM25Index.load(tmp_path)


def test_one_character_tokens_such_as_numbers_and_symbols_are_indexed(tmp_path):
    """bm25s's default token pattern drops "8" and "K": a question about a bare number matched nothing."""
    passages = [Passage("a", "Oxygen", "Symbol: O. Atomic number: 8."),
                Passage("b", "Potassium", "Symbol: K. Atomic number: 19."),
                Passage("c", "Argon", "Symbol: Ar. Atomic number: 18.")]
    index = BM25Index.build(passages, show_progress=False)
    scores, rows = index.search(["which element is number 8?", "the symbol K"], k=1)
    assert rows[:, 0].tolist() == [0, 1] and (scores > 0).all()
    np.testing.assert_allclose(index.score_rows(["number 8"], np.array([[2, 0, -1]])),
                               [[index.search(["number 8"], 3)[0][0][1], index.search(["number 8"], 3)[0][0][0], 0.0]], rtol=1e-6)


def test_decimal_numbers_are_one_token(tmp_path):
    """ "39" of "atomic number 39?" matched Argon's atomic weight "39.948" when the point split it."""
    passages = [Passage("a", "Argon", "Atomic number: 18. Atomic weight: 39.948."),
                Passage("b", "Yttrium", "Atomic number: 39. Atomic weight: 88.906."),
                Passage("c", "Copper", "About 1,000 tonnes; version 3.11 of the table.")]
    index = BM25Index.build(passages, show_progress=False)
    scores, rows = index.search(["atomic number 39", "weight 39.948", "1,000 tonnes", "3.11"], k=3)
    assert rows[:, 0].tolist() == [1, 0, 2, 2]
    assert index.score_rows(["39"], np.array([[0]]))[0, 0] == 0.0  # "39.948" holds no term "39"
    assert index.score_rows(["948"], np.array([[0]]))[0, 0] == 0.0


def test_an_index_saved_without_a_token_pattern_keeps_the_pattern_it_was_built_with(tmp_path):
    import json

    passages = [Passage("a", "Oxygen", "Atomic number: 8."), Passage("b", "Argon", "Atomic number: 18.")]
    BM25Index.build(passages, token_pattern=LEGACY_TOKEN_PATTERN, show_progress=False).save(tmp_path / "bm25")
    settings = tmp_path / "bm25" / "rag_bm25.json"
    data = json.loads(settings.read_text())
    del data["token_pattern"]  # as written before the setting existed
    settings.write_text(json.dumps(data))
    back = BM25Index.load(tmp_path / "bm25")
    assert back.token_pattern == LEGACY_TOKEN_PATTERN
    assert (back.search(["number 8"], 2)[0][0] == back.search(["number"], 2)[0][0]).all()  # "8" is no term of it
    with pytest.raises(ConfigError, match="token_pattern"):
        BM25Index.build(passages, token_pattern="(", show_progress=False)


def test_a_title_counts_title_weight_times_and_is_kept_with_the_index(tmp_path):
    import json

    passages = [Passage("k", "Potassium", "Symbol: K. Softer than sodium, and it reacts with water faster than sodium does."),
                Passage("n", "Sodium", "Symbol: Na. A soft metal that reacts with water; with chlorine it forms table salt.")]
    assert passage_text(passages[1], 2) == "Sodium Sodium " + passages[1].text and passage_text(passages[1],
                                                                                                0) == passages[1].text
    assert passage_text(Passage("u", "", "no title"), 3) == "no title"
    query = ["What's the chemical symbol for sodium?"]
    # the text of Potassium mentions sodium twice: without the title's weight it wins, with it the passage about sodium does
    assert BM25Index.build(passages, title_weight=0, show_progress=False).search(query, 1)[1][0, 0] == 0
    index = BM25Index.build(passages, show_progress=False)
    assert index.title_weight == TITLE_WEIGHT and index.search(query, 1)[1][0, 0] == 1
    index.save(tmp_path / "bm25")
    back = BM25Index.load(tmp_path / "bm25")
    assert back.title_weight == TITLE_WEIGHT and (back.search(query, 2)[0] == index.search(query, 2)[0]).all()
    settings = tmp_path / "bm25" / "rag_bm25.json"
    data = json.loads(settings.read_text())
    del data["title_weight"]  # as written before the setting existed: the title counted once
    settings.write_text(json.dumps(data))
    assert BM25Index.load(tmp_path / "bm25").title_weight == LEGACY_TITLE_WEIGHT
    settings.write_text(json.dumps({**data, "title_weight": -2}))
    with pytest.raises(KnowledgeBaseError, match="rag_bm25.json: title_weight"):
        BM25Index.load(tmp_path / "bm25")
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="title_weight"):
            BM25Index.build(passages, title_weight=bad, show_progress=False)


def test_queries_without_known_terms_return_k_zero_rows(index):
    scores, rows = index.search(["xylophone quasar", "", "the of and is", "!!!"], k=4)
    assert scores.shape == (4, 4)
    assert (scores == 0).all()
    assert (rows == np.arange(4)).all()  # ties broken by row
    s, r = index.search([], k=2)
    assert s.shape == r.shape == (0, 2)


def test_ties_are_broken_by_row():
    dup = [Passage("a", "", "copper wire"), Passage("b", "", "zinc"), Passage("c", "", "copper wire")]
    scores, rows = BM25Index.build(dup, show_progress=False).search(["copper"], k=3)
    assert rows[0].tolist() == [0, 2, 1] and scores[0, 0] == scores[0, 1] > scores[0, 2] == 0


def test_top_k_against_argsort():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, size=200).astype(np.float32)  # many ties
    for k in (1, 7, 200):
        vals, rows = top_k(s, k)
        ref = np.lexsort((np.arange(200), -s))[:k]
        assert rows.tolist() == ref.tolist() and np.array_equal(vals, s[ref])


def test_bad_arguments(index):
    for k in (0, -1, 11, 2.0, True, None):
        with pytest.raises(RagError, match=r"k \(at most the number of indexed passages, .*\) must be an integer"):
            index.search(["gold"], k=k)
    _, rows = index.search(["gold"], k=10)
    assert sorted(rows[0].tolist()) == list(range(10))
    with pytest.raises(RagError, match="single string"):
        index.search("gold", k=1)
    with pytest.raises(RagError, match=r"queries\[1\]"):
        index.search(["gold", 3], k=1)
    with pytest.raises(CorpusError, match="empty"):
        BM25Index.build([], show_progress=False)
    with pytest.raises(ConfigError, match="stemmer"):
        BM25Index.build(CORPUS, stemmer="klingon", show_progress=False)
    with pytest.raises(ConfigError, match="stopwords"):
        BM25Index.build(CORPUS, stopwords="klingon", show_progress=False)


def test_retriever_returns_retrieved_with_aligned_passages(index):
    r = BM25Retriever(index, CORPUS, kb_version="v1")
    out = r.retrieve(["liquid metal", "solar panels"], k=2)
    assert isinstance(out, Retrieved)
    assert out.rows.dtype == torch.int64 and out.scores.dtype == torch.float32
    assert (out.batch_size, out.k) == (2, 2)
    assert out.doc_embeds is None and out.kb_version == "v1"
    assert [[p.id for p in row] for row in out.passages] == [[f"p{int(i)}" for i in row] for row in out.rows]
    assert out.passages[0][0].title == "Mercury" and out.passages[1][0].title == "Silicon"


def test_retriever_with_callable_lookup_and_from_passages(index):
    seen = []

    def lookup(rows: np.ndarray):
        seen.append(rows.shape)
        return [[CORPUS[i] for i in row] for row in rows]

    a = BM25Retriever(index, lookup).retrieve(["steel"], k=3)
    b = BM25Retriever.from_passages(CORPUS, show_progress=False).retrieve(["steel"], k=3)
    assert seen == [(1, 3)]
    assert torch.equal(a.rows, b.rows) and a.passages == b.passages and a.passages[0][0].title == "Iron"
    assert isinstance(BM25Retriever(index, lookup), Retriever)  # the protocol RagModel and the pipeline take
    with pytest.raises(KnowledgeBaseError, match="same order"):
        BM25Retriever(index, CORPUS[:5])
    with pytest.raises(KnowledgeBaseError, match="B lists of K"):
        BM25Retriever(index, lambda rows: [[CORPUS[0]]]).retrieve(["steel"], k=3)
