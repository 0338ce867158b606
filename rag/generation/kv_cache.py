"""The KV-cache argument of a transformers forward, by the name the installed transformers uses.

transformers renamed ``past_key_values`` to ``cache`` (the keyword and the output field; the old keyword is accepted with
a FutureWarning until 5.40, then removed). Every cached forward in rag passes and reads the cache through these two
functions, so decoding works, silently, on both sides of the rename (setup.cfg allows transformers 4.45 to 5.x).
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["cache_kwarg", "output_cache", "cache_field"]


@functools.lru_cache(maxsize=None)
def _keyword(model_type: type) -> str:
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def cache_kwarg(model, cache) -> dict:
    """``{name: cache}`` for calling `model` (an instance, or its class): ``cache`` where its forward takes it, else
    ``past_key_values``. A peft wrapper passes keywords through to its base model, whose forward decides."""
    if not isinstance(model, type) and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    return {_keyword(model if isinstance(model, type) else type(model)): cache}


def output_cache(out):
    """The cache a forward returned, read by the field name its output class declares (``cache``, or
    ``past_key_values`` before the rename); None if none. Never the other name: after the rename ``past_key_values`` is a
    deprecated property that logs "`past_key_values`/`cache_params` are deprecated" (reading it whenever ``cache`` was
    None, e.g. a forward with ``use_cache=False``, printed that warning on loading the demo generator)."""
    fields = getattr(type(out), "__dataclass_fields__", None)
    if fields is not None:
        name = "cache" if "cache" in fields else "past_key_values" if "past_key_values" in fields else None
        return getattr(out, name, None) if name is not None else None
    return getattr(out, "cache", None) if hasattr(out, "cache") else getattr(out, "past_key_values", None)


@functools.lru_cache(maxsize=None)
def cache_field() -> str:
    """The name of the cache field of transformers' output classes (to build one)."""
    from transformers.modeling_outputs import Seq2SeqLMOutput

    return "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"
