"""The transformers API that changed between the releases hetero supports, in one place.

transformers 5.24 renamed the cache argument of `generate` and of the models' `forward` from
`past_key_values` to `cache` (the old name warns; it leaves `forward` in 5.40 and `generate` in
6.0), and a `ModelOutput` holds the cache under `cache`, `past_key_values` being a warning alias.
hetero passes whichever name the installed release takes, so no call of hetero's warns.
tests/test_upstream_api.py checks every private or fragile API hetero relies on.
"""
import collections
import dataclasses
import inspect

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

# the field of generate's output (and the keyword of generate) that holds the cache
OUTPUT_CACHE_FIELD = "cache" if any(f.name == "cache" for f in dataclasses.fields(GenerateDecoderOnlyOutput)) \
    else "past_key_values"
GENERATE_CACHE_KWARG = OUTPUT_CACHE_FIELD


def forward_cache_kwarg(forward) -> str:
    """The name under which `forward` (a model's, hooks unwrapped) takes the KV cache."""
    params = inspect.signature(forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "past_key_values"
    raise TypeError(f"{getattr(forward, '__qualname__', forward)} takes neither cache= nor past_key_values=")


def without_cache(out):
    """generate's output with its cache field emptied: hetero's cache closes with the call."""
    if isinstance(out, torch.Tensor):
        return out
    if collections.OrderedDict.get(out, OUTPUT_CACHE_FIELD) is not None:
        collections.OrderedDict.__delitem__(out, OUTPUT_CACHE_FIELD)   # a ModelOutput: its mapping, then the field
    if OUTPUT_CACHE_FIELD in {f.name for f in dataclasses.fields(out)}:
        object.__setattr__(out, OUTPUT_CACHE_FIELD, None)
    return out


def output_cache(out):
    """The cache generate returned (None when hetero emptied it), read without a deprecation warning."""
    return getattr(out, OUTPUT_CACHE_FIELD)
