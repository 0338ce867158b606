"""The Python generation API: answers with provenance, posteriors, heatmap, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from rag.pipeline.api import RagPipeline, load, plot_token_posterior
from rag.utils.errors import ConfigError, RagError


@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_dpr_context_dir, demo_passages):
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    return KnowledgeBase.build(demo_passages[:12], TextEncoder(tiny_dpr_context_dir), tmp_path_factory.mktemp("p") / "kb",
                               index="flat", show_progress=False)


@pytest.fixture(scope="module")
def pipe(kb, tiny_dpr_question_dir, tiny_bart_dir):
    from rag.models.rag.model import RagModel

    torch.manual_seed(0)
    return RagPipeline(RagModel.from_components(tiny_dpr_question_dir, tiny_bart_dir, kb, n_docs=3))


def _brute_force_token_lp(pipe, question, answer_ids, k):
    """log p(y_t | x, z, y_<t) for each of the K contexts, by plain full forward passes."""
    inputs = pipe.model.prepare_inputs([question], n_docs=k)
    gen = pipe.model.generator
    dec = answer_ids[None].repeat(k, 1)
    logits = gen(input_ids=inputs.context_input_ids, attention_mask=inputs.context_attention_mask,
                 decoder_input_ids=dec[:, :-1]).logits
    lp = torch.log_softmax(logits.float(), -1).gather(-1, dec[:, 1:, None]).squeeze(-1)  # (K, T-1)
    return lp, torch.log_softmax(inputs.doc_scores[0].float(), 0)


@pytest.mark.parametrize("marginalization", ["sequence", "token"])
def test_answers_carry_provenance(pipe, kb, marginalization):
    qs = ["what is the atomic number of argon?", "which element has the symbol He?"]
    answers = pipe.generate(qs, num_beams=2, marginalization=marginalization, max_new_tokens=6, min_new_tokens=2)
    assert [a.question for a in answers] == qs
    for a in answers:
        assert a.kb_version == kb.version and len(a.passages) == 3
        assert math.isclose(sum(p.prior for p in a.passages), 1.0, rel_tol=1e-5)
        assert math.isclose(sum(p.posterior for p in a.passages), 1.0, rel_tol=1e-4)
        assert math.isfinite(a.score) and a.score <= 0
        d = a.to_dict()
        assert set(d) >= {"question", "text", "score", "kb_version", "passages"}
        if marginalization == "token":
            assert len(a.token_doc_posterior) == len(a.tokens) >= 1
            assert all(math.isclose(sum(row), 1.0, rel_tol=1e-4) for row in a.token_doc_posterior)
        else:
            assert a.token_doc_posterior is None


def test_token_posterior_matches_brute_force(pipe):
    q = "what is the atomic number of argon?"
    [a] = pipe.generate([q], marginalization="token", max_new_tokens=5, min_new_tokens=3)
    tok = pipe.model.generator_tokenizer
    ids = tok.convert_tokens_to_ids(a.tokens)
    start = pipe.model.generator.config.decoder_start_token_id
    seq = torch.tensor([start] + ids)
    lp, log_prior = _brute_force_token_lp(pipe, q, seq, 3)
    expected = torch.softmax(log_prior[:, None] + lp, dim=0).T  # (T, K)
    assert torch.allclose(torch.tensor(a.token_doc_posterior), expected, atol=1e-4)
    seq_post = torch.softmax(log_prior + lp.sum(1), 0)
    assert torch.allclose(torch.tensor([p.posterior for p in a.passages]), seq_post, atol=1e-4)


def test_retrieve_matches_generate_priors(pipe, kb):
    [hits] = pipe.retrieve(["symbol of gold"], k=3)
    [a] = pipe.generate(["symbol of gold"], max_new_tokens=3)
    assert hits.question == "symbol of gold" and hits.kb_version == a.kb_version == kb.version
    assert [p.id for p in hits.passages] == [p.id for p in a.passages]
    assert [p.prior for p in hits.passages] == pytest.approx([p.prior for p in a.passages], abs=1e-6)
    assert all(p.posterior is None for p in hits.passages)
    assert hits.to_dict()["kb_version"] == kb.version and len(hits.to_dict()["passages"]) == 3


def test_retrieve_names_the_version_it_used(pipe, kb, tmp_path, tiny_dpr_context_dir):
    """Every retrieval names the knowledge base it came from, also across a swap."""
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.hotswap import KnowledgeBaseSlot
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.knowledge.passages import Passage

    other = [Passage(p.id, p.title, "[B] " + p.text) for p in kb.all_passages()]
    kb_b = KnowledgeBase.build(other, TextEncoder(tiny_dpr_context_dir), tmp_path / "kb_b", index="flat", show_progress=False)
    slot = KnowledgeBaseSlot.for_model(pipe)
    qs = ["symbol of gold", "noble gas"]
    before = pipe.retrieve(qs, k=2)
    assert [h.kb_version for h in before] == [kb.version] * 2
    slot.swap(kb_b.path)
    try:
        after = pipe.retrieve(qs, k=2)
        assert [h.kb_version for h in after] == [kb_b.version] * 2 and kb_b.version != kb.version
        assert all(p.text.startswith("[B] ") for h in after for p in h.passages)
    finally:
        slot.swap_back()
    assert [h.kb_version for h in pipe.retrieve(qs, k=2)] == [kb.version] * 2


def test_heatmap_png(pipe, tmp_path):
    [a] = pipe.generate(["what is the atomic number of argon?"], marginalization="token", max_new_tokens=4, min_new_tokens=2)
    out = plot_token_posterior(a, tmp_path / "fig2.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [s] = pipe.generate(["x?"], marginalization="sequence", max_new_tokens=2)
    with pytest.raises(RagError, match="marginalization='token'"):
        plot_token_posterior(s, tmp_path / "no.png")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(questions=["ok", ""]), r"questions\[1\] is empty"),
        (dict(questions=["ok", 3]), r"questions\[1\] is int"),
        (dict(questions="a string"), "list of strings"),
        (dict(questions=["ok"], n_docs=13), "exceeds the 12 passages"),
        (dict(questions=["ok"], num_beams=0), "num_beams"),
    ],
)
def test_bad_input(pipe, kwargs, match):
    with pytest.raises(RagError, match=match):
        pipe.generate(**kwargs)


def test_load_round_trip_and_missing_path(pipe, tmp_path):
    pipe.model.save_pretrained(tmp_path / "ckpt")
    again = load(tmp_path / "ckpt")
    q = ["what is the atomic number of argon?"]
    assert again.generate(q, max_new_tokens=4)[0].text == pipe.generate(q, max_new_tokens=4)[0].text
    with pytest.raises(RagError, match="no such"):
        load(str(tmp_path / "missing" / "ckpt"))


def test_ensemble_with_a_rag_model_is_rag_token_over_k_passages(pipe):
    """REPLUG's ensemble with a frozen seq2seq generator is RAG-Token decoding: ensemble=K means n_docs=K, token."""
    q = ["what is the atomic number of argon?"]
    [a] = pipe.generate(q, ensemble=2, max_new_tokens=6)
    [b] = pipe.generate(q, n_docs=2, marginalization="token", max_new_tokens=6)
    assert a.text == b.text and a.score == pytest.approx(b.score) and len(a.passages) == 2
    assert [p.id for p in a.passages] == [p.id for p in b.passages] and a.token_doc_posterior == b.token_doc_posterior
    with pytest.raises(ConfigError, match="marginalization='sequence'"):
        pipe.generate(q, ensemble=2, marginalization="sequence")
    with pytest.raises(ConfigError, match="n_docs=3"):
        pipe.generate(q, ensemble=2, n_docs=3)
    with pytest.raises(ConfigError, match="ensemble"):
        pipe.generate(q, ensemble=0)
    with pytest.raises(ConfigError, match="retrieval_temperature"):
        pipe.generate(q, ensemble=2, retrieval_temperature=0.5)
