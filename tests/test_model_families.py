"""Families that once decoded wrong tokens silently or crashed: each is now exact or refused with
UnsupportedModelError naming the feature (tiny configs from bench/model_sweep.py, the full sweep
over every causal LM of the installed transformers; its table is in the README)."""
import re

import pytest
import torch

from bench.model_sweep import run_one
from hetero import UnsupportedModelError
from hetero.attention import hetero_attention

EXPECTED = {
    "gpt_oss": ("exact", ""),                       # attention sinks (s_aux), eager reference
    "granite_swa": ("exact", ""),                   # sinks, written as out * sigmoid(lse - sink)
    "jetmoe": ("exact", ""),                        # KV heads tiled: query head h reads KV head h mod Hkv
    "qwen2_moe": ("exact", ""),                     # sliding window only in the mask, not passed as a keyword
    "diffllama": ("refused", "calls attention without a KV cache update"),     # two attention calls per layer
    "doge": ("refused", "dynamic mask attention"),
    "gemma3n_text": ("refused", "KV shared across layers"),
    "gemma4_text": ("refused", "attention shapes .* differ across layers"),
    "long:gpt_oss": ("exact", ""),                  # prompts past the window: ring storage and sinks
    "long:qwen2_moe": ("exact", ""),                # prompts past a mask-only window: ring storage
    "mimo_v2_flash": ("refused", "per-layer KV head counts"),
    "mllama": ("refused", "cross-attention layers"),
}


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_family_is_exact_or_refused(model_type):
    status, detail = EXPECTED[model_type]
    threads = torch.get_num_threads()
    if model_type.startswith("long:"):       # window 8 << prompts: sliding layers are stored as rings
        result = run_one(model_type[5:], lengths=(150, 101, 60))
    else:
        result = run_one(model_type)
    torch.set_num_threads(threads)            # run_one runs torch single-threaded
    assert result["status"] == status, result["detail"]
    assert re.search(detail, result["detail"]), result["detail"]


def test_unknown_attention_keywords_are_refused(llama):
    """A keyword the attention function does not implement raises instead of being ignored."""
    attn = llama.model.layers[0].self_attn
    q = torch.zeros(1, 4, 1, 16)
    kv = torch.zeros(1, 2, 1, 16)
    for kw, msg in [({"position_bias": q}, r"keyword\(s\) \['position_bias'\]"), ({"indices": q}, "indices"),
                    ({"output_attentions": True}, "output_attentions=True"), ({"dropout": 0.1}, "dropout"),
                    ({"is_causal": False}, "non-causal")]:
        with pytest.raises(UnsupportedModelError, match=msg):
            hetero_attention(attn, q, kv, kv, None, **kw)
    hetero_attention(attn, q, kv, kv, None, position_ids=None, use_cache=True, output_attentions=False)

