"""Importing transformers RAG checkpoints, and parity of RagModel with transformers' RAG classes.

transformers' RagSequenceForGeneration / RagTokenForGeneration run their whole forward here
(question encoding, doc scores, context strings, loss); only the index lookup is replaced by
the passages our model retrieved, through their own `RagRetriever` (which builds the contexts).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from model_support import sharpen

from rag.models.rag.hf_compat import convert_hf_rag, is_hf_rag_checkpoint, load_hf_rag, split_hf_rag
from rag.models.rag.model import CHECKPOINT_CONFIG, RagModel
from rag.utils.errors import ConfigError

# Mixed case and punctuation: the question's round trip through the uncased DPR tokenizer shows.
QUESTIONS = ["What's the atomic Number of IRON?", "Who discovered  oxygen, and when?", "Which element has symbol Na?"]
ANSWERS = ["26", "Joseph Priestley in 1774", "Sodium"]
K = 3
MAX_COMBINED = 48  # short enough that long passages are truncated (transformers cuts from the right)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, demo_passages, tiny_dpr_question_dir, tiny_dpr_context_dir, tiny_bart_dir):
    """Sharpened tiny DPR + BART, a KB over 30 demo passages, and transformers RAG checkpoints
    (sequence and token) saved with RagTokenizer's layout."""
    from transformers import (
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
        DPRQuestionEncoder,
        RagConfig,
        RagSequenceForGeneration,
        RagTokenForGeneration,
        RagTokenizer,
    )

    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    root = tmp_path_factory.mktemp("hf_compat")
    q_dir = sharpen(tiny_dpr_question_dir, root / "q", "question", 0.2, 1)
    c_dir = sharpen(tiny_dpr_context_dir, root / "c", "context", 0.2, 2)
    g_dir = sharpen(tiny_bart_dir, root / "g", "generator", 0.3, 3)
    kb = root / "kb"
    KnowledgeBase.build(demo_passages[:30], TextEncoder(c_dir), kb, index="flat", show_progress=False)
    qtok, gtok = AutoTokenizer.from_pretrained(q_dir), AutoTokenizer.from_pretrained(g_dir)
    hf_dirs = {}
    for name, cls in (("sequence", RagSequenceForGeneration), ("token", RagTokenForGeneration)):
        qenc, gen = DPRQuestionEncoder.from_pretrained(q_dir), AutoModelForSeq2SeqLM.from_pretrained(g_dir)
        config = RagConfig.from_question_encoder_generator_configs(
            qenc.config, gen.config, n_docs=K, max_combined_length=MAX_COMBINED, retrieval_vector_size=32
        )
        hf = cls(config=config, question_encoder=qenc, generator=gen)
        hf_dirs[name] = root / f"hf_rag_{name}"
        hf.save_pretrained(hf_dirs[name])
        RagTokenizer(qtok, gtok).save_pretrained(hf_dirs[name])
    return {"kb": str(kb), "hf": hf_dirs, "qtok": qtok, "gtok": gtok, "root": root}


@pytest.fixture(scope="module")
def imported(setup):
    return {name: load_hf_rag(path, setup["kb"]) for name, path in setup["hf"].items()}


@pytest.fixture(scope="module")
def references(setup):
    from transformers import RagSequenceForGeneration, RagTokenForGeneration

    return {
        "sequence": RagSequenceForGeneration.from_pretrained(setup["hf"]["sequence"]).eval(),
        "token": RagTokenForGeneration.from_pretrained(setup["hf"]["token"]).eval(),
    }


def documented_labels(gtok, answers) -> torch.Tensor:
    """Labels as transformers documents them and its RAG fine-tuning script builds them for BART:
    ``tokenizer(text_target=answer).input_ids`` (``<s> … </s>``, padded with the pad token)."""
    return gtok(text_target=list(answers), padding=True, return_tensors="pt")["input_ids"]


def hf_labels(gtok, decoder_start: int, answers) -> torch.Tensor:
    """The start token prepended by hand (the convention of RagModel's default mode): labels are also the decoder
    input, so transformers then feeds ``</s> <s> …`` and scores every answer token, ``<s>`` included."""
    ids = gtok(list(answers), padding=True, return_tensors="pt")["input_ids"]
    return torch.cat([torch.full((ids.shape[0], 1), decoder_start), ids], dim=1)


def attach_retriever(hf, model: RagModel, setup, questions) -> dict:
    """Give `hf` a real RagRetriever whose index lookup returns the passages `model` retrieves for the question
    whose query vector is nearest (RagSequenceForGeneration.generate looks up one question's copies at a time);
    returns a dict that collects the context strings transformers tokenizes and its query vectors."""
    from transformers import RagRetriever

    retrieved, _ = model.retrieve(questions)
    ours = torch.from_numpy(model.question_encoder.encode(list(questions), show_progress=False))
    seen: dict = {}

    class Capture:  # the generator tokenizer, recording the strings it is given
        def __init__(self, tok):
            self.tok = tok

        def __call__(self, *args, **kwargs):
            seen["strings"] = list(args[0])
            return self.tok(*args, **kwargs)

    retriever = RagRetriever(hf.config, question_encoder_tokenizer=setup["qtok"], generator_tokenizer=Capture(setup["gtok"]),
                             index=object(), init_retrieval=False)

    def lookup(question_hidden_states, n_docs):
        seen["query_vectors"] = question_hidden_states
        which = torch.cdist(torch.from_numpy(question_hidden_states), ours).argmin(1)
        docs = [{"title": [p.title for p in retrieved.passages[i]], "text": [p.text for p in retrieved.passages[i]]}
                for i in which.tolist()]
        return retrieved.doc_embeds[which].numpy(), retrieved.rows[which].numpy(), docs

    retriever.retrieve = lookup
    hf.set_retriever(retriever)
    return seen


def hf_loss(hf, model, setup, questions, answers, *, epsilon=0.0, exclude_bos=False, reduce=False):
    seen = attach_retriever(hf, model, setup, questions)
    q = setup["qtok"](list(questions), padding=True, return_tensors="pt")
    labels = documented_labels(setup["gtok"], answers)
    hf.config.label_smoothing = epsilon
    kwargs = {"exclude_bos_score": exclude_bos} if hf.__class__.__name__.startswith("RagSequence") else {}
    out = hf(input_ids=q["input_ids"], attention_mask=q["attention_mask"], labels=labels, reduce_loss=reduce, **kwargs)
    return out, seen


def assert_grads_close(ours: dict, theirs, what: str) -> int:
    """Gradients of named parameters equal up to float32 rounding, measured against the whole
    gradient's scale (transformers pads contexts to max_combined_length and we do not, so matmul
    shapes and summation orders differ; gradients that are zero in exact arithmetic, e.g. of
    attention key biases, are pure rounding noise). Returns how many tensors have nonzero grads."""
    pairs = [(name, ours[name].grad, p.grad) for name, p in theirs if p.grad is not None]
    assert pairs, f"{what}: transformers computed no gradients"
    flat_ours = torch.cat([a.reshape(-1) for _, a, _ in pairs])
    flat_theirs = torch.cat([b.reshape(-1) for _, _, b in pairs])
    scale = flat_theirs.abs().max().item()
    assert scale > 0
    # elementwise 2e-5 (with transformers' documented labels one query-encoder entry differs by 1.1e-5 of the scale)
    assert (flat_ours - flat_theirs).abs().max().item() <= 2e-5 * scale, what
    assert (flat_ours - flat_theirs).norm().item() <= 1e-5 * flat_theirs.norm().item(), what
    return sum(int(b.abs().sum() > 0) for _, _, b in pairs)


def configured(model: RagModel, **changes) -> RagModel:
    model.config = dataclasses.replace(model.config, **changes)
    return model


# --------------------------------------------------------------------------- import


def test_import_maps_config_and_weights(setup, imported, references):
    for name in ("sequence", "token"):
        m, hf = imported[name], references[name]
        assert m.config.hf_compat and m.config.effective_truncation == "hf" and m.config.mask_padded_contexts is False
        assert m.config.marginalization == name
        assert (m.config.n_docs, m.config.max_context_length) == (K, MAX_COMBINED)
        assert (m.config.title_sep, m.config.doc_sep) == (" / ", " // ")
        ours = m.generator.state_dict()
        for key, value in hf.generator.state_dict().items():
            assert torch.equal(ours[key], value), key
        ours_q = m.question_encoder.model.state_dict()
        for key, value in hf.question_encoder.state_dict().items():
            assert torch.equal(ours_q[key], value), key
    assert is_hf_rag_checkpoint(setup["hf"]["sequence"]) and not is_hf_rag_checkpoint(setup["root"] / "g")


def test_generator_inputs_identical_to_transformers(setup, imported, references):
    m, hf = imported["sequence"], references["sequence"]
    with torch.no_grad():
        inputs = m.prepare_inputs(QUESTIONS)
        out, seen = hf_loss(hf, m, setup, QUESTIONS, ANSWERS)
    assert [str(s) for s in inputs.context_strings] == seen["strings"]
    assert "what ' s the atomic number of iron?" in seen["strings"][0]  # the round trip happened
    ours = inputs.context_input_ids
    # transformers pads to max_combined_length; we pad to the longest context only.
    ref = setup["gtok"](seen["strings"], max_length=MAX_COMBINED, padding="max_length", truncation=True, return_tensors="pt")
    width = ours.shape[1]
    assert torch.equal(ref["input_ids"][:, :width], ours)
    assert (ref["attention_mask"][:, width:] == 0).all()
    assert inputs.n_truncated > 0  # some contexts were cut (from the right, like transformers)
    query_vectors = torch.from_numpy(m.question_encoder.encode(QUESTIONS, show_progress=False))
    torch.testing.assert_close(torch.from_numpy(seen["query_vectors"]), query_vectors, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out.loss).all()


@pytest.mark.parametrize("name", ["sequence", "token"])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("exclude_bos", [False, True])
def test_loss_parity_with_transformers(setup, imported, references, name, epsilon, exclude_bos):
    m = configured(imported[name], label_smoothing=epsilon, exclude_bos_score=exclude_bos, reduce_loss=False)
    with torch.no_grad():
        ours = m(QUESTIONS, ANSWERS)
        theirs, _ = hf_loss(references[name], m, setup, QUESTIONS, ANSWERS, epsilon=epsilon, exclude_bos=exclude_bos)
    assert ours.loss.shape == (len(QUESTIONS),)
    torch.testing.assert_close(ours.doc_scores, theirs.doc_scores, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)


def test_reduced_loss_and_gradients_match_transformers(setup, imported, references):
    m = configured(imported["sequence"], label_smoothing=0.1, exclude_bos_score=False, reduce_loss=True)
    hf = references["sequence"]
    m.zero_grad()
    hf.zero_grad()
    ours = m(QUESTIONS, ANSWERS)
    theirs, _ = hf_loss(hf, m, setup, QUESTIONS, ANSWERS, epsilon=0.1, reduce=True)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)  # both sum over the batch
    ours.loss.backward()
    theirs.loss.backward()
    # the query encoder learns, identically, in both
    assert assert_grads_close(dict(m.question_encoder.model.named_parameters()), hf.question_encoder.named_parameters(),
                              "query encoder") > 0
    assert assert_grads_close(dict(m.generator.named_parameters()), hf.generator.named_parameters(), "generator") > 0


@pytest.mark.parametrize("name", ["sequence", "token"])
def test_default_mode_matches_transformers_on_the_same_contexts(setup, imported, references, name):
    """The default (non-hf_compat) loss equals transformers' given the same contexts and doc scores,
    wherever transformers' quirks do not apply (multi-token targets)."""
    m = configured(imported[name], hf_compat=False, truncation="keep_question", reduce_loss=False, exclude_bos_score=False)
    hf = references[name]
    hf.set_retriever(None)
    try:
        labels = hf_labels(setup["gtok"], hf.config.generator.decoder_start_token_id, ANSWERS)
        for epsilon in (0.0, 0.1):
            configured(m, label_smoothing=epsilon)
            hf.config.label_smoothing = epsilon
            with torch.no_grad():
                ours = m(QUESTIONS, ANSWERS)
                inputs = m.prepare_inputs(QUESTIONS)
                assert str(inputs.context_strings[0]).endswith(QUESTIONS[0])  # raw question, not round-tripped
                theirs = hf(context_input_ids=inputs.context_input_ids, context_attention_mask=inputs.context_attention_mask,
                            doc_scores=inputs.doc_scores, labels=labels, reduce_loss=False, n_docs=K)
            torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)
        if name == "sequence":  # exclude_bos_score agrees too without smoothing (every BART target starts with <s>)
            configured(m, label_smoothing=0.0, exclude_bos_score=True)
            hf.config.label_smoothing = 0.0
            with torch.no_grad():
                ours = m(QUESTIONS, ANSWERS)
                theirs = hf(context_input_ids=inputs.context_input_ids, context_attention_mask=inputs.context_attention_mask,
                            doc_scores=inputs.doc_scores, labels=labels, reduce_loss=False, n_docs=K, exclude_bos_score=True)
            torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)
    finally:
        configured(m, hf_compat=True, truncation="hf", label_smoothing=0.0, exclude_bos_score=False, reduce_loss=True)


# --------------------------------------------------------------------------- conversion and errors


def test_convert_then_load_gives_the_same_loss(setup, imported, tmp_path):
    m = configured(imported["token"], label_smoothing=0.0, exclude_bos_score=False, reduce_loss=True)
    dst = convert_hf_rag(setup["hf"]["token"], tmp_path / "converted", setup["kb"])
    meta = json.loads((dst / CHECKPOINT_CONFIG).read_text())
    assert meta["config"]["hf_compat"] is True and meta["config"]["marginalization"] == "token"
    assert meta["config"]["mask_padded_contexts"] is False  # the converted checkpoint keeps transformers' search
    loaded = RagModel.from_pretrained(dst)
    with torch.no_grad():
        torch.testing.assert_close(loaded(QUESTIONS, ANSWERS).loss, m(QUESTIONS, ANSWERS).loss, atol=0, rtol=0)
    with pytest.raises(FileExistsError):
        convert_hf_rag(setup["hf"]["token"], dst, setup["kb"])


def test_import_errors_are_clear(setup, tmp_path):
    import shutil

    with pytest.raises(ConfigError, match="not a transformers RAG checkpoint"):
        split_hf_rag(setup["root"] / "g", tmp_path / "split")
    broken = tmp_path / "no_tokenizers"
    shutil.copytree(setup["hf"]["sequence"], broken)
    shutil.rmtree(broken / "generator_tokenizer")
    with pytest.raises(ConfigError, match="generator_tokenizer.*RagTokenizer.save_pretrained"):
        load_hf_rag(broken, setup["kb"])
    with pytest.raises(ConfigError, match="load_hf_rag"):
        RagModel.from_pretrained(setup["hf"]["sequence"])
    with pytest.raises(ConfigError, match="unknown RagModelConfig field"):
        load_hf_rag(setup["hf"]["sequence"], setup["kb"], ndocs=2)


# --------------------------------------------------------------------------- label convention, overrides, settings


@pytest.mark.parametrize("name", ["sequence", "token"])
def test_hf_compat_loss_uses_transformers_documented_label_convention(setup, imported, references, name):
    """From answer strings, the hf_compat loss equals transformers' called with labels=tokenizer(text_target=...)
    (fed ``<s> …``, scored from the second token), not the start-token-prepended convention, which differs here by
    nats; the default mode keeps the generation-consistent convention (``</s> <s> …``, every token scored)."""
    m = configured(imported[name], label_smoothing=0.0, exclude_bos_score=False, reduce_loss=False)
    hf = references[name]
    with torch.no_grad():
        ours = m(QUESTIONS, ANSWERS).loss
        documented, _ = hf_loss(hf, m, setup, QUESTIONS, ANSWERS)
        prepended = hf(**_question_inputs(setup),
                       labels=hf_labels(setup["gtok"], hf.config.generator.decoder_start_token_id, ANSWERS),
                       reduce_loss=False).loss
    torch.testing.assert_close(ours, documented.loss, atol=1e-5, rtol=1e-5)
    assert (ours - prepended).abs().max() > 0.5  # the two conventions really differ on these answers
    decoder_inputs, labels, mask = m.training_targets(ANSWERS)
    assert decoder_inputs is not None and bool((decoder_inputs[:, 0] == setup["gtok"].bos_token_id).all())
    try:
        configured(m, hf_compat=False)
        assert m.training_targets(ANSWERS)[0] is None  # default: shifted right after the start token
    finally:
        configured(m, hf_compat=True)


def _question_inputs(setup) -> dict:
    q = setup["qtok"](list(QUESTIONS), padding=True, return_tensors="pt")
    return {"input_ids": q["input_ids"], "attention_mask": q["attention_mask"]}


def test_load_applies_known_overrides_and_refuses_unknown_ones(setup):
    import rag

    pipe = rag.load(setup["hf"]["sequence"], knowledge_base=setup["kb"], n_docs=2, label_smoothing=0.1)
    assert pipe.model.config.n_docs == 2 and pipe.model.config.label_smoothing == 0.1 and pipe.model.config.hf_compat
    [answer] = pipe.generate([QUESTIONS[0]], max_new_tokens=3)
    assert len(answer.passages) == 2
    with pytest.raises(ConfigError, match=r"unknown RagModelConfig field\(s\) \['bogus_field'\]; valid fields are .*'n_docs'"):
        rag.load(setup["hf"]["sequence"], knowledge_base=setup["kb"], bogus_field=1)


def test_stored_generation_settings_become_pipeline_defaults(setup, tmp_path):
    """Settings a released BART-based RAG checkpoint stores (here in the generator sub-config and in
    generation_config.json) are the pipeline's defaults: its output equals transformers' generate with no
    arguments, token for token (Answer.token_ids); an explicit argument still wins."""
    import shutil

    from transformers import RagTokenForGeneration

    import rag

    src = tmp_path / "hf_token_settings"
    shutil.copytree(setup["hf"]["token"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["generator"].update(no_repeat_ngram_size=2, forced_bos_token_id=setup["gtok"].bos_token_id)
    (src / "config.json").write_text(json.dumps(cfg))
    gen_cfg = json.loads((src / "generation_config.json").read_text()) if (src / "generation_config.json").is_file() else {}
    gen_cfg.update(num_beams=3, max_length=9, no_repeat_ngram_size=2, forced_bos_token_id=setup["gtok"].bos_token_id)
    (src / "generation_config.json").write_text(json.dumps(gen_cfg))

    pipe = rag.load(src, knowledge_base=setup["kb"])
    stored = pipe.model.config.generation
    assert stored["num_beams"] == 3 and stored["max_length"] == 9 and stored["no_repeat_ngram_size"] == 2
    assert stored["forced_bos_token_id"] == setup["gtok"].bos_token_id
    answers = pipe.generate(QUESTIONS)
    hf = RagTokenForGeneration.from_pretrained(src).eval()
    attach_retriever(hf, pipe.model, setup, QUESTIONS)
    with torch.no_grad():
        seqs = hf.generate(**_question_inputs(setup))
    eos = setup["gtok"].eos_token_id
    for a, row in zip(answers, seqs.tolist()):
        expected = row[:row.index(eos, 1) + 1] if eos in row[1:] else row
        assert a.token_ids == expected
        assert a.token_ids[1] == setup["gtok"].bos_token_id and len(a.token_ids) <= 9
    [short] = pipe.generate([QUESTIONS[0]], max_new_tokens=2, num_beams=1)  # explicit arguments win
    assert len(short.token_ids) <= 3


def test_weights_read_from_a_file_stay_inside_and_garbage_is_an_integrity_error(setup, tmp_path):
    """A sharded checkpoint's index names its shards: absolute or ../ names are refused (a real shard copied
    outside would otherwise be loaded); non-safetensors bytes give an IntegrityError naming the checkpoint."""
    import shutil

    from rag.utils.errors import IntegrityError

    src = tmp_path / "sharded"
    shutil.copytree(setup["hf"]["sequence"], src)
    outside = tmp_path / "outside.safetensors"
    (src / "model.safetensors").rename(outside)
    for name in (str(outside), "../outside.safetensors"):
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"rag.generator.x": name}}))
        with pytest.raises(IntegrityError, match="points outside"):
            load_hf_rag(src, setup["kb"])
    shutil.copy(outside, src / "inside.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"rag.generator.x": "inside.safetensors"}}))
    assert load_hf_rag(src, setup["kb"]).config.hf_compat  # an inside shard still loads
    (src / "model.safetensors.index.json").unlink()
    (src / "model.safetensors").write_bytes(b"not safetensors at all" * 8)
    with pytest.raises(IntegrityError, match=f"{src}: cannot read the RAG weights.*download the checkpoint again"):
        load_hf_rag(src, setup["kb"])


# --------------------------------------------------------------------------- RAG-Sequence per-passage search

# Questions of different lengths; with max_combined_length 128 over these passages some contexts are cut, most padded.
SEARCH_QUESTIONS = QUESTIONS + ["Is helium a noble gas?", "Why is the sky blue on a clear day at noon?", "Gold?"]
SEARCH_COMBINED = 128


@pytest.fixture(scope="module")
def long_context_sequence(setup, tmp_path_factory):
    """The RAG-Sequence checkpoint with max_combined_length 128 (48 cuts every context here, so none is padded)."""
    import shutil

    src = tmp_path_factory.mktemp("hf_long") / "hf_rag_sequence"
    shutil.copytree(setup["hf"]["sequence"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_combined_length"] = SEARCH_COMBINED
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def _hf_sequence_generate(hf, model, setup, questions, **options) -> list[list[int]]:
    """transformers' RagSequenceForGeneration.generate from the questions (its retriever returning the passages
    `model` retrieves, so it builds and pads the contexts itself), each row cut after its first EOS."""
    attach_retriever(hf, model, setup, questions)
    q = setup["qtok"](list(questions), padding=True, return_tensors="pt")
    with torch.no_grad():
        seqs = hf.generate(input_ids=q["input_ids"], attention_mask=q["attention_mask"], **options)
    eos = setup["gtok"].eos_token_id
    return [row[:row.index(eos, 1) + 1] if eos in row[1:] else row for row in seqs.tolist()]


@pytest.mark.parametrize("num_beams", [4, 1])
def test_rag_sequence_generate_matches_transformers_on_padded_contexts(setup, long_context_sequence, num_beams):
    """An imported RAG-Sequence checkpoint decodes as RagSequenceForGeneration.generate does, token for token, on
    contexts of different lengths: transformers' per-passage search attends to the pads of its max_combined_length
    contexts (attention_mask=None), and the import reproduces that (mask_padded_contexts=False). The default, masked
    search gives other answers on these inputs, so the quirk is really what is reproduced."""
    from transformers import RagSequenceForGeneration

    import rag

    pipe = rag.load(long_context_sequence, knowledge_base=setup["kb"])
    assert pipe.model.config.mask_padded_contexts is False and pipe.model.config.max_context_length == SEARCH_COMBINED
    inputs = pipe.model.prepare_inputs(SEARCH_QUESTIONS)
    lengths = inputs.context_attention_mask.sum(1)
    assert len(set(lengths.tolist())) > 5 and inputs.n_truncated > 0 and int(lengths.min()) < SEARCH_COMBINED  # uneven padding
    hf = RagSequenceForGeneration.from_pretrained(long_context_sequence).eval()
    options = dict(num_beams=num_beams, max_length=10)
    expected = _hf_sequence_generate(hf, pipe.model, setup, SEARCH_QUESTIONS, **options)
    answers = pipe.generate(SEARCH_QUESTIONS, **options)
    assert [a.token_ids for a in answers] == expected
    masked = rag.load(long_context_sequence, knowledge_base=setup["kb"], mask_padded_contexts=True)
    masked_ids = [a.token_ids for a in masked.generate(SEARCH_QUESTIONS, **options)]
    assert masked_ids != expected
