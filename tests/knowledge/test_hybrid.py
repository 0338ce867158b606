"""Hybrid retrieval: score fusion and reciprocal rank fusion of the dense and BM25 rankings, the prior's gradient, the
per-call choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rag.knowledge.encoders import TextEncoder
from rag.knowledge.hybrid import NUMERAL_WEIGHT, HybridRetriever, has_numeral, reciprocal_rank_fusion, score_fusion
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage
from rag.knowledge.retriever import default_query_encoder
from rag.models.rag.config import RagModelConfig
from rag.utils.errors import ConfigError, KnowledgeBaseError


def test_reciprocal_rank_fusion_sums_inverse_ranks():
    dense = np.array([[4, 7, 9]])
    bm25 = np.array([[7, 1, 4]])
    rows, scores = reciprocal_rank_fusion([dense, bm25], 4, rrf_k=60)
    want = {4: 1 / 61 + 1 / 63, 7: 1 / 62 + 1 / 61, 9: 1 / 63, 1: 1 / 62}
    assert rows[0].tolist() == [7, 4, 1, 9]  # in both lists first; 1 and 9 once each, the better rank first
    assert np.allclose(scores[0], [want[r] for r in rows[0].tolist()])


def test_fusion_ties_keep_the_first_rankings_order_and_missing_rows_are_padding():
    rows, scores = reciprocal_rank_fusion([np.array([[3, -1]]), np.array([[5, -1]])], 3)
    assert rows[0].tolist() == [3, 5, -1] and scores[0, 2] == 0
    with pytest.raises(ConfigError, match="hybrid_rrf_k"):
        reciprocal_rank_fusion([np.array([[1]])], 1, rrf_k=0)


@pytest.fixture(scope="module")
def kb(tmp_path_factory, demo_passages, tiny_dpr_context_dir, tiny_dpr_question_dir):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    out = tmp_path_factory.mktemp("hybrid") / "kb"
    KnowledgeBase.build(demo_passages[:40], TextEncoder(tiny_dpr_context_dir), out, index="flat", bm25=True,
                        query_encoder=tiny_dpr_question_dir, show_progress=False)
    return KnowledgeBase.open(out)


def test_score_fusion_ranks_candidates_by_the_sum_ties_in_candidate_order_padding_last():
    dense = np.array([[0.9, 0.5, 0.2, 0.0]], dtype=np.float32)
    sparse = np.array([[0.0, 0.5, 0.7, 0.3]], dtype=np.float32)
    valid = np.array([[True, True, True, False]])
    pick, scores = score_fusion(dense, sparse, valid, 3)
    assert pick[0].tolist() == [1, 0, 2]  # 1.0 > 0.9 = 0.9: the tie goes to the earlier (dense) candidate
    np.testing.assert_allclose(scores[0], [1.0, 0.9, 0.9], rtol=1e-6)
    pick, scores = score_fusion(dense, sparse, valid, 4)
    assert pick[0, 3] == -1 and scores[0, 3] == -np.inf


def test_score_fusion_is_the_dense_score_plus_the_normalised_bm25_score_over_both_top_k(kb):
    """Brute force: every passage in either top-k, scored q · d + β_q · bm25 / (the query's best bm25), β_q = β · ν for a
    query with a numeral; the top k of those."""
    from rag.knowledge.retriever import default_query_encoder

    encoder = default_query_encoder(kb)
    hybrid = HybridRetriever.from_knowledge_base(kb, encoder, bm25_weight=0.7)
    questions = ["which element has the symbol Li?", "what is a noble gas?", "atomic number 8"]
    got = hybrid.retrieve(questions, 3)
    q = torch.from_numpy(encoder.encode(questions, show_progress=False))
    dense, bm25 = hybrid.dense.retrieve(questions, 3), hybrid.bm25.retrieve(questions, 3)
    everything = np.tile(np.arange(len(kb)), (len(questions), 1))
    all_bm25 = kb.bm25.score_rows(questions, everything)  # (B, N)
    all_dense = (q @ kb.get_embeddings(torch.arange(len(kb))).T).numpy()  # (B, N)
    for b in range(len(questions)):
        beta = 0.7 * (NUMERAL_WEIGHT if b == 2 else 1.0)  # "atomic number 8" holds a numeral
        cand = set(dense.rows[b].tolist()) | set(bm25.rows[b].tolist())
        want = {r: all_dense[b, r] + beta * all_bm25[b, r] / all_bm25[b].max() for r in cand}
        best = sorted(want, key=lambda r: -want[r])[:3]
        assert got.rows[b].tolist() == best
        np.testing.assert_allclose(got.scores[b].numpy(), [want[r] for r in best], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.prior_bias[b].numpy(), [beta * all_bm25[b, r] / all_bm25[b].max() for r in best],
                                   rtol=1e-5, atol=1e-7)
    assert torch.equal(got.doc_embeds, kb.get_embeddings(got.rows))


def test_bad_fusion_options_are_refused_naming_the_field(kb):
    from rag.knowledge.retriever import default_query_encoder
    from rag.models.rag.config import RagModelConfig

    with pytest.raises(ConfigError, match="hybrid_fusion"):
        HybridRetriever.from_knowledge_base(kb, default_query_encoder(kb), fusion="max")
    with pytest.raises(ConfigError, match="hybrid_bm25_weight"):
        RagModelConfig(hybrid_bm25_weight=-1)
    with pytest.raises(ConfigError, match="hybrid_fusion"):
        RagModelConfig(hybrid_fusion="sum")


def test_a_config_saved_before_score_fusion_keeps_reciprocal_rank_fusion():
    from rag.models.rag.config import RagModelConfig

    assert RagModelConfig.from_dict({"retrieval": "hybrid", "hybrid_rrf_k": 60}).hybrid_fusion == "rrf"
    assert RagModelConfig.from_dict({"retrieval": "hybrid"}).hybrid_fusion == "score"


def test_rrf_hybrid_retrieval_is_the_rank_fusion_of_the_two_retrievers(kb):
    from rag.knowledge.retriever import default_query_encoder

    hybrid = HybridRetriever.from_knowledge_base(kb, default_query_encoder(kb), fusion="rrf")
    questions = ["which element has the symbol Li?", "what is a noble gas?"]
    got = hybrid.retrieve(questions, 3)
    dense, bm25 = hybrid.dense.retrieve(questions, 3), hybrid.bm25.retrieve(questions, 3)
    want, _ = reciprocal_rank_fusion([dense.rows.numpy(), bm25.rows.numpy()], 3)
    assert got.rows.tolist() == want.tolist()
    assert got.kb_version == kb.served_version
    assert torch.equal(got.doc_embeds, kb.get_embeddings(got.rows))  # stored vectors: the dense prior can be recomputed
    assert [p.title for p in got.passages[0]] == [kb.get_passages(got.rows.numpy())[0][j].title for j in range(3)]


def test_a_knowledge_base_without_bm25_is_refused_naming_the_fix(tmp_path, demo_passages, tiny_dpr_context_dir):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    KnowledgeBase.build(demo_passages[:5], TextEncoder(tiny_dpr_context_dir), tmp_path / "kb", index="flat", show_progress=False)
    kb = KnowledgeBase.open(tmp_path / "kb")
    encoder = TextEncoder(tiny_dpr_context_dir)
    with pytest.raises(KnowledgeBaseError, match="--bm25"):
        HybridRetriever.from_knowledge_base(kb, encoder)


def test_rag_with_hybrid_retrieval_trains_the_query_encoder_through_the_dense_prior(kb, tiny_dpr_question_dir, tiny_bart_dir):
    from rag.models.rag.model import RagModel, RagModelConfig

    model = RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kb, RagModelConfig(n_docs=3, retrieval="hybrid"))
    model.train()
    questions = ["which element has the symbol Li?", "what is the atomic number of helium?"]
    out = model(questions, ["Lithium", "2"])
    fused = model.scoring.retriever.retrieve(questions, 3)
    assert out.retrieved.rows.tolist() == fused.rows.tolist()
    q = model.question_encoder(**model.scoring.tokenize_questions(questions))
    want = torch.einsum("bd,bkd->bk", q, fused.doc_embeds) + fused.prior_bias  # q · d + β · normalised BM25
    torch.testing.assert_close(out.doc_scores, want, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    assert sum(float(p.grad.abs().sum()) for p in model.question_encoder.parameters() if p.grad is not None) > 0


def test_retrieval_can_be_chosen_per_call_and_follows_a_swap(kb, tiny_dpr_question_dir, tiny_bart_dir, tmp_path, demo_passages,
                                                             tiny_dpr_context_dir):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.hotswap import KnowledgeBaseSlot
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.models.rag.model import RagModel, RagModelConfig
    from rag.pipeline.api import RagPipeline

    pipe = RagPipeline(RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kb, RagModelConfig(n_docs=2)))
    q = ["which element has the symbol Li?"]
    bm25 = pipe.retrieve(q, k=2, retrieval="bm25")[0]
    from rag.knowledge.retriever_kinds import retriever_for_kind

    want = retriever_for_kind("bm25", kb).retrieve(q, 2)
    assert [p.id for p in bm25.passages] == [p.id for p in want.passages[0]]
    [a] = pipe.generate(q, retrieval="hybrid", max_new_tokens=3)
    assert len(a.passages) == 2
    KnowledgeBase.build(demo_passages[40:60], TextEncoder(tiny_dpr_context_dir), tmp_path / "kb2", index="flat", bm25=True,
                        show_progress=False)
    KnowledgeBaseSlot(pipe.retriever).swap(tmp_path / "kb2")
    after = pipe.retrieve(q, k=2, retrieval="hybrid")[0]
    assert after.kb_version != bm25.kb_version
    assert {p.id for p in after.passages} <= {p.id for p in demo_passages[40:60]}


def test_an_exact_rare_code_that_bm25_ranks_first_is_not_outweighed_by_a_dense_neighbour(tmp_path, demo_passages,
                                                                                          tiny_dpr_context_dir):
    """"Commodore 1571": BM25 ranks its own entry first, a sibling whose text names the 1571 second, by a margin m of
    the normalised score; the query vector is set so that dense retrieval ranks the sibling first, 2m ahead (a
    word-piece encoder sees 1570 and 1571 alike). Fused with β alone the sibling wins (2m > β · m); the numeral factor
    ν > 2 keeps the entry BM25 found at rank 1, and a question without a numeral is fused as before."""
    entry = Passage("c1571", "Commodore 1571", "A double-sided floppy disk drive for the Commodore 128.")
    sibling = Passage("c1570", "Commodore 1570", "A single-sided version of the Commodore 1571 floppy disk drive.")
    KnowledgeBase.build([entry, sibling, *demo_passages[:8]], TextEncoder(tiny_dpr_context_dir), tmp_path / "kb",
                        index="flat", bm25=True, show_progress=False)
    kb = KnowledgeBase.open(tmp_path / "kb")
    encoder = TextEncoder(tiny_dpr_context_dir)
    question = "Commodore 1571"
    bm25 = kb.bm25.score_rows([question], np.arange(len(kb))[None])[0]
    assert bm25.argmax() == 0 and np.argsort(-bm25)[1] == 1  # BM25: the entry, then the sibling
    margin = float((bm25[0] - bm25[1]) / bm25[0])
    assert 0 < margin < 0.5
    e = kb.get_embeddings(torch.arange(len(kb))).double()  # (N, D), N = 10 < D = 32: any N dense scores are reachable
    target = torch.full((len(kb),), -1.0, dtype=torch.float64)  # the other passages far behind
    target[0], target[1] = 0.0, 2 * margin  # the sibling first, 2m ahead of the entry
    q = (torch.linalg.pinv(e) @ target).float()
    dense_scores = (e.float() @ q).numpy()
    assert dense_scores.argmax() == 1 and np.isclose(dense_scores[1] - dense_scores[0], 2 * margin, rtol=1e-3)
    fused = HybridRetriever.from_knowledge_base(kb, encoder)
    assert fused.numeral_weight == NUMERAL_WEIGHT > 2 and has_numeral(question)
    assert fused.search([question], q[None], 1).rows[0].tolist() == [0]
    assert fused.search([question], q[None], 2).rows[0].tolist() == [0, 1]
    plain = HybridRetriever.from_knowledge_base(kb, encoder, numeral_weight=1.0)
    assert plain.search([question], q[None], 1).rows[0].tolist() == [1]  # without ν the dense neighbour wins
    assert not has_numeral("Commodore floppy drive")
    same = fused.search(["Commodore floppy drive"], q[None], 2)
    assert same.rows.tolist() == plain.search(["Commodore floppy drive"], q[None], 2).rows.tolist()
    torch.testing.assert_close(same.scores, plain.search(["Commodore floppy drive"], q[None], 2).scores)


def test_the_numeral_factor_is_a_model_setting_and_saved_models_keep_fusing_without_it(kb):
    assert RagModelConfig().hybrid_numeral_weight == NUMERAL_WEIGHT
    saved = RagModelConfig(retrieval="hybrid").to_dict()
    del saved["hybrid_numeral_weight"]  # a config written before the field existed
    assert RagModelConfig.from_dict(saved).hybrid_numeral_weight == 1.0
    with pytest.raises(ConfigError, match="hybrid_numeral_weight"):
        RagModelConfig(hybrid_numeral_weight=-1)
    settings = RagModelConfig(retrieval="hybrid", hybrid_numeral_weight=2.5)
    fused = HybridRetriever.for_settings(kb, default_query_encoder(kb), settings)
    assert fused.options["numeral_weight"] == 2.5
