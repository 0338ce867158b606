"""Citations drawn from an answer's passage probabilities (rag.generation.answers.cite): the covering-set rule, the
numbering in the order the reader used the passages, each passage cited once, and the rendered ``[n]`` markers."""

from __future__ import annotations

import json

import pytest

from rag.generation.answers import CITE_MASS, Answer, PassageProvenance, SegmentProvenance, cite, cited_text, covering
from rag.utils.errors import RagError


def _passages(posteriors, priors=None):
    priors = priors or [1.0 / len(posteriors)] * len(posteriors)
    return [PassageProvenance(f"p{i}", f"T{i}", f"text {i}", 0.0, pr, po)
            for i, (pr, po) in enumerate(zip(priors, posteriors))]


def test_covering_takes_the_fewest_top_passages_reaching_the_mass():
    assert covering([0.05, 0.9, 0.05]) == [1]  # 0.9 >= CITE_MASS alone
    assert covering([0.3, 0.5, 0.2]) == [1, 0, 2]  # 0.5, 0.8 < 0.9, then 1.0
    assert covering([0.2] * 5) == [0, 1, 2, 3, 4]  # uniform: every passage carries the answer
    assert covering([0.85, 0.08, 0.07]) == [0]  # the rest is below the 0.1 floor
    assert covering([0.04] * 25) == [0]  # nothing stands out: the top one alone
    assert covering([float("nan"), 0.6, 0.4]) == [1, 2]
    assert covering([]) == []
    assert covering([0.5, 0.5], mass=0.5) == [0]
    assert covering([0.3, 0.6, 0.1]) == [1, 0]  # 0.6 + 0.3 is 0.8999999999999999 in floats: the mass is reached


def test_rag_sequence_citations_follow_the_posterior_by_rank():
    a = Answer("q?", "Au", -1.0, "v1", _passages([0.15, 0.55, 0.3]))
    cites = a.citations
    assert [(c.number, c.passage, c.id, c.first_token) for c in cites] == [(1, 1, "p1", None), (2, 2, "p2", None),
                                                                           (3, 0, "p0", None)]
    assert [c.weight for c in cites] == [0.55, 0.3, 0.15]
    assert a.cited_text == "Au [1][2][3]"
    d = a.to_dict()
    assert d["cited_text"] == "Au [1][2][3]" and d["citations"][0] == {"number": 1, "passage": 1, "id": "p1", "title": "T1",
                                                                      "weight": 0.55, "first_token": None}
    json.dumps(d, allow_nan=False)


def test_rag_token_citations_are_numbered_by_the_first_token_using_them():
    # token 0 read from passage 2, token 1 from passage 0, token 2 from passage 2 again; passage 1 never
    grid = [[0.02, 0.03, 0.95], [0.97, 0.01, 0.02], [0.05, 0.0, 0.95]]
    a = Answer("q?", "Ag 47", -2.0, "v1", _passages([0.4, 0.01, 0.59]), tokens=["Ag", "Ġ4", "7"], token_doc_posterior=grid)
    assert [(c.number, c.id, c.first_token) for c in a.citations] == [(1, "p2", 0), (2, "p0", 1)]
    assert [c.weight for c in a.citations] == [0.59, 0.4]  # the sequence posterior
    assert a.cited_text == "Ag 47 [1][2]"
    # by the sequence posterior alone the order would be rank order: the tokens decide it
    assert [c.id for c in cite(Answer("q?", "Ag 47", -2.0, "v1", _passages([0.4, 0.01, 0.59])))] == ["p2", "p0"]


def test_in_context_ralm_cites_each_passage_in_context_once_by_first_segment():
    segs = [SegmentProvenance(0, 4, "b", "B", 3.0, "v1", "q"), SegmentProvenance(4, 8, "a", "A", 2.0, "v1", "q"),
            SegmentProvenance(8, 12, "b", "B", 3.0, "v1", "q")]
    passages = [PassageProvenance("a", "A", "ta", 2.0, 1.0), PassageProvenance("b", "B", "tb", 3.0, 1.0)]
    a = Answer("p", " and so on", -3.0, "v1", passages, segments=segs)
    assert [(c.number, c.id, c.passage, c.first_token, c.weight) for c in a.citations] == [(1, "b", 1, 0, 1.0),
                                                                                           (2, "a", 0, 4, 1.0)]


def test_replug_without_a_posterior_cites_by_the_ensemble_weights():
    a = Answer("p", " x", -1.0, "v1", [PassageProvenance("a", "A", "t", 1.0, 0.3), PassageProvenance("b", "B", "t", 2.0, 0.7)])
    assert [c.id for c in a.citations] == ["b", "a"] and a.citations[0].weight == 0.7


def test_an_answer_without_passages_cites_nothing():
    a = Answer("q?", "Fe", -1.0, "v1", [], answered_with="no_retrieval")
    assert a.citations == [] and a.cited_text == "Fe" and a.to_dict()["citations"] == []


def test_bad_rule_parameters_are_refused():
    a = Answer("q?", "Fe", -1.0, "v1", _passages([1.0]))
    for kw in ({"mass": 0.0}, {"mass": 1.5}, {"min_weight": -0.1}):
        with pytest.raises(RagError, match="mass"):
            cite(a, **kw)
    assert cited_text("Fe ", cite(a, mass=CITE_MASS)) == "Fe [1]"
