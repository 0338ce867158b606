"""The generation-options schema's sampling options (temperature, top_p): checked once, offered by `rag generate` and
`POST /generate`, honoured by a causal reader, and refused where they would do nothing."""

from __future__ import annotations

import pytest

from rag.generation.options import GenerationOptions, option_specs
from rag.utils.errors import ConfigError

PROMPT = "The capital of France is"


def test_sampling_options_need_do_sample_and_stay_in_range():
    assert {"temperature", "top_p"} <= set(option_specs())
    GenerationOptions(do_sample=True, temperature=0.5, top_p=0.9)
    for kw in (dict(temperature=0.5), dict(top_p=0.9), dict(do_sample=False, temperature=0.5)):
        with pytest.raises(ConfigError, match="applies to sampling only"):
            GenerationOptions(**kw)
    for kw in (dict(temperature=0.0), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ConfigError, match="--temperature|--top-p"):
            GenerationOptions(do_sample=True, **kw)


def test_cli_offers_them():
    from rag.cli import build_parser

    args = build_parser().parse_args(["generate", "q", "--sample", "--temperature", "0.7", "--top-p", "0.9"])
    assert (args.do_sample, args.temperature, args.top_p) == (True, 0.7, 0.9)


def test_causal_reader_samples_with_them(serve_layout, tiny_gpt2_dir):
    import rag

    pipe = rag.load(tiny_gpt2_dir, knowledge_base=serve_layout["kbs"]["kb_a"].path, stride=4, query_length=8, max_length=96,
                    doc_max_length=24)
    draw = lambda **kw: pipe.generate([PROMPT], max_new_tokens=12, do_sample=True, seed=3, **kw)[0].text  # noqa: E731
    assert draw(temperature=0.7) == draw(temperature=0.7)
    # A near-zero temperature or nucleus keeps only the most likely token: the greedy answer.
    greedy = pipe.generate([PROMPT], max_new_tokens=12)[0].text
    assert draw(temperature=1e-3) == greedy and draw(top_p=1e-6) == greedy
    assert draw(temperature=50.0) != greedy  # a flat distribution wanders off the greedy path
