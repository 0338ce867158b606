"""Small random models and tokenizers trained on a given text, built from configs in code.

No model hub is needed: tests, the `tiny_cpu` training config and the demo model
build their generators here, save them with `save_pretrained`, and load them back
through the same `from_pretrained` path that users take with hub ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from rag.demo import load_demo_corpus

BART_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0..3, as in facebook/bart-*
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 1000):
    """A byte-level BPE tokenizer with BART's special tokens, trained on `texts`.

    Returns a `transformers` BART (RoBERTa-style) tokenizer: `<s>`=0, `<pad>`=1,
    `</s>`=2, `<unk>`=3 and `<mask>` last, the layout BART checkpoints use.
    """
    from tokenizers import ByteLevelBPETokenizer
    from transformers import BartTokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(list(texts), vocab_size=vocab_size, min_frequency=1, special_tokens=BART_SPECIALS)
    vocab = dict(bpe.get_vocab())
    vocab["<mask>"] = len(vocab)
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ")) for m in _bpe_merges(bpe)]
    return BartTokenizer(vocab=vocab, merges=merges)


def _bpe_merges(bpe) -> list:
    import json

    model = json.loads(bpe._tokenizer.to_str())["model"]
    return model["merges"]


def train_wordpiece_tokenizer(texts: Iterable[str], vocab_size: int = 1000):
    """A lower-cased WordPiece tokenizer with BERT's special tokens, trained on `texts`."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(list(texts), vocab_size=vocab_size, min_frequency=1, special_tokens=BERT_SPECIALS)
    # The trainer's token *set* is deterministic but its ids are not (ties in a randomly seeded hash map), so the same
    # seeded model saw different embeddings run to run. WordPiece matching does not depend on ids: number them
    # specials first, then in sorted order.
    trained = wp.get_vocab()
    tokens = list(BERT_SPECIALS) + sorted(t for t in trained if t not in BERT_SPECIALS)
    return BertTokenizer(vocab={t: i for i, t in enumerate(tokens)}, do_lower_case=True)


def train_sentencepiece_tokenizer(texts: Iterable[str], vocab_size: int = 400, workdir: str | os.PathLike | None = None):
    """A unigram SentencePiece tokenizer in T5's layout (`<pad>`=0, `</s>`=1, `<unk>`=2)."""
    import tempfile

    import sentencepiece as spm
    from transformers import T5Tokenizer

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(texts), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(Path(tmp) / "spm"), vocab_size=vocab_size,
            pad_id=0, eos_id=1, unk_id=2, bos_id=-1, model_type="unigram",
            hard_vocab_limit=False, minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_file=str(Path(tmp) / "spm.model"))
        vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def tiny_bart(tokenizer, d_model: int = 32, layers: int = 2, heads: int = 4, ffn: int = 64, max_positions: int = 512,
              seed: int = 0):
    """A randomly initialised `BartForConditionalGeneration` sized for `tokenizer`."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=len(tokenizer), d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id,
        forced_bos_token_id=None, forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, scale_embedding=False,
    )
    torch.manual_seed(seed)
    return BartForConditionalGeneration(config)


def tiny_t5(tokenizer, d_model: int = 32, layers: int = 2, heads: int = 4, ffn: int = 64, seed: int = 0):
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // heads, d_ff=ffn, num_layers=layers,
        num_decoder_layers=layers, num_heads=heads, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id, dropout_rate=0.0,
    )
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(config)


def tiny_gpt2(tokenizer, d_model: int = 32, layers: int = 2, heads: int = 4, max_positions: int = 512, seed: int = 0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=d_model, n_layer=layers, n_head=heads, n_positions=max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def _bert_config(tokenizer, d_model: int, layers: int, heads: int, ffn: int, max_positions: int):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(tokenizer), hidden_size=d_model, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=ffn, max_position_embeddings=max_positions, pad_token_id=tokenizer.pad_token_id,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )


def tiny_bert(tokenizer, d_model: int = 32, layers: int = 2, heads: int = 4, ffn: int = 64, max_positions: int = 512,
              seed: int = 0):
    """A randomly initialised `BertModel` (with pooler) sized for `tokenizer`."""
    import torch
    from transformers import BertModel

    torch.manual_seed(seed)
    return BertModel(_bert_config(tokenizer, d_model, layers, heads, ffn, max_positions))


def tiny_bert_classifier(tokenizer, id2label: dict[int, str], d_model: int = 32, layers: int = 2, heads: int = 4, ffn: int = 64,
                         max_positions: int = 512, seed: int = 0):
    """A randomly initialised `BertForSequenceClassification` with the given `id2label` (e.g. a tiny NLI model)."""
    import torch
    from transformers import BertForSequenceClassification

    config = _bert_config(tokenizer, d_model, layers, heads, ffn, max_positions)
    config.id2label = {int(i): str(n) for i, n in id2label.items()}
    config.label2id = {n: i for i, n in config.id2label.items()}
    config.num_labels = len(config.id2label)
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


def tiny_dpr(tokenizer, kind: str = "question", d_model: int = 32, layers: int = 2, heads: int = 4, ffn: int = 64,
             max_positions: int = 512, seed: int = 0):
    """A randomly initialised DPR question (`kind="question"`) or context encoder."""
    import torch
    from transformers import DPRConfig, DPRContextEncoder, DPRQuestionEncoder

    bert = _bert_config(tokenizer, d_model, layers, heads, ffn, max_positions)
    config = DPRConfig(**{k: getattr(bert, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "max_position_embeddings", "pad_token_id", "hidden_dropout_prob", "attention_probs_dropout_prob")})
    torch.manual_seed(seed)
    cls = {"question": DPRQuestionEncoder, "context": DPRContextEncoder}[kind]
    return cls(config)


def save(model, tokenizer, out_dir: str | os.PathLike) -> str:
    """`save_pretrained` model and tokenizer together; returns the directory as a string."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def sample_texts() -> Sequence[str]:
    """A few hundred words of varied English, enough to train the tiny tokenizers in tests."""
    return [f"{p.title} {p.text}" for p in load_demo_corpus()]
