"""The KV cache is passed and read by the installed transformers' name (rag.generation.kv_cache)."""

from __future__ import annotations

import logging

import pytest
import torch


def test_a_forward_without_cache_reads_no_deprecated_name(tiny_bart_dir):
    """output_cache read ``past_key_values`` whenever ``cache`` was None (a forward with use_cache=False): after
    transformers' rename that is a deprecated property, which logged "`past_key_values`/`cache_params` are deprecated"
    on loading the demo generator. The test suite turns that wording into an error (setup.cfg, tests/conftest.py)."""
    from rag.generation.kv_cache import cache_field, output_cache
    from rag.generators.load import load_generator

    model, tok, _ = load_generator(tiny_bart_dir, kind="seq2seq")
    enc = tok(["hello world"], return_tensors="pt")
    start = torch.tensor([[model.config.decoder_start_token_id]])
    with torch.no_grad():
        assert output_cache(model(**enc, decoder_input_ids=start, use_cache=False)) is None
        cached = output_cache(model(**enc, decoder_input_ids=start, use_cache=True))
    assert cached is not None and cached.get_seq_length() == 1
    assert cache_field() in type(model(**enc, decoder_input_ids=start)).__dataclass_fields__


def test_the_suite_fails_on_the_deprecated_cache_wording():
    log = logging.getLogger("transformers.utils.generic")
    for wording in ("`past_key_values`/`cache_params` are deprecated. Use `cache` instead.", "`past_key_values` is deprecated"):
        with pytest.raises(FutureWarning):
            log.warning(wording)
