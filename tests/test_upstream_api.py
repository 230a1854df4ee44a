"""The private or fragile transformers / peft / accelerate / torch APIs hetero relies on, one
test per API (or per tight group), each checking exactly the assumption hetero makes and failing
with "<library> API changed: <API>: <what hetero assumes>; used by <hetero file:function>".

UPSTREAM_API.md is the inventory these tests cover. Everything here runs on tiny models built
from configs (tests/conftest.py build_model) and in-process: no worker pool, no hub access. The
tests accept both transformers 5.17 and 5.24, whose cache argument is named `past_key_values`
and `cache` respectively (hetero.compat picks the installed one).
"""
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import time
import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationConfig

from hetero import attention as hattn
from hetero.compat import (GENERATE_CACHE_KWARG, OUTPUT_CACHE_FIELD, forward_cache_kwarg, output_cache,
                           without_cache)
from hetero.model_spec import CACHE_DROPPING_MODEL_TYPES, inspect_model
from hetero.offload.cache import HeteroCache, HeteroLayer
from tests.conftest import COMMON, build_model, padded_batch

TF, PEFT, ACC, TORCH = "transformers", "peft", "accelerate", "torch"


@contextlib.contextmanager
def upstream(lib, api, assumes, used_by):
    """Any failure (an assertion, or the API raising) inside is reported as the named API having changed."""
    msg = f"{lib} API changed: {api}: {assumes}; used by {used_by}"
    try:
        yield
    except Exception as e:
        raise AssertionError(f"{msg}\n    ({type(e).__name__}: {e})") from e


class _Deprecations(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.found = []

    def emit(self, record):
        text = record.getMessage()
        if "deprecat" in text.lower():
            self.found.append(text)


@contextlib.contextmanager
def deprecations():
    """Collects the deprecation warnings (FutureWarning / DeprecationWarning) and transformers'
    deprecation log lines (its once-only cache cleared first) emitted inside: a list."""
    handler = _Deprecations()
    root = logging.getLogger("transformers")
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield handler.found
    finally:
        root.removeHandler(handler)
    handler.found += [f"{w.category.__name__}: {w.message}" for w in caught
                      if issubclass(w.category, (FutureWarning, DeprecationWarning))]


def _register_probe(name, record, mask_fn=None):
    """An attention function (sdpa underneath, eager where soft-capped or with sinks, as hetero's)
    registered as `name` with transformers, recording each call in `record`; and its mask function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def probe(module, query, key, value, attention_mask, **kwargs):
        record.append(SimpleNamespace(module=module, q=tuple(query.shape), k=tuple(key.shape),
                                      v=tuple(value.shape), mask=attention_mask, kwargs=dict(kwargs)))
        scaling, softcap, sinks = kwargs.get("scaling"), kwargs.get("softcap"), kwargs.get("s_aux")
        if softcap or sinks is not None:
            out, _ = hattn.eager_attention(module, query, key, value, attention_mask, scaling, softcap, sinks)
            return out, None
        neutral = {k: v for k, v in kwargs.items() if k in hattn.NEUTRAL_KWARGS}
        return hattn.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                            scaling=scaling, **neutral)[0], None

    AttentionInterface.register(name, probe)
    AttentionMaskInterface.register(name, mask_fn or sdpa_mask)


@contextlib.contextmanager
def attn_impl(model, name):
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@pytest.fixture(scope="module")
def llama():
    return build_model("llama")[0]


def _tiny_gpt_oss():
    cfg = AutoConfig.for_model("gpt_oss", **{**COMMON, "num_local_experts": 2, "num_experts_per_tok": 1,
                                             "head_dim": 16, "sliding_window": 4,
                                             "layer_types": ["sliding_attention", "full_attention"],
                                             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for m in model.modules():                       # sinks start at zero: make them count
        if isinstance(getattr(m, "sinks", None), torch.Tensor):
            torch.nn.init.normal_(m.sinks.data)
    return model


@pytest.fixture(scope="module")
def attention_calls():
    """{family: (model, [calls of the attention function over a 2-token generate])}, by a probe
    registered like hetero's function (llama, mistral: a window, gemma2: soft-cap, gpt_oss: sinks)."""
    calls = {}
    for family in ("llama", "mistral", "gemma2", "gpt_oss"):
        model = _tiny_gpt_oss() if family == "gpt_oss" else build_model(family)[0]
        record = []
        _register_probe(f"hetero-api-probe-{family}", record)
        ids, mask = padded_batch((6, 4))
        with attn_impl(model, f"hetero-api-probe-{family}"), torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        calls[family] = (model, record)
    return calls


# ---------------------------------------------------------------- attention and mask interfaces

def test_attention_interface_registration(llama):
    record = []
    _register_probe("hetero-api-registration", record)
    with upstream(TF, "AttentionInterface.register + PreTrainedModel.set_attn_implementation + "
                      "config._attn_implementation",
                  "a function registered under a new name becomes the model's attention after "
                  "set_attn_implementation(name), which config._attn_implementation then reads back (and takes "
                  "again to restore the previous one)", "hetero/attention.py:register, hetero/routing.py:routed"):
        previous = llama.config._attn_implementation
        with attn_impl(llama, "hetero-api-registration"), torch.no_grad():
            assert llama.config._attn_implementation == "hetero-api-registration"
            llama(torch.tensor([[5, 6, 7]]))
        assert llama.config._attn_implementation == previous
        assert len(record) == llama.config.num_hidden_layers        # one call per layer
        record.clear()
        with torch.no_grad():
            llama(torch.tensor([[5, 6, 7]]))
        assert not record                                             # restored: no longer called


def test_attention_call_keywords(attention_calls):
    allowed = set(hattn.NEUTRAL_KWARGS) | set(hattn.HARMLESS_ONLY_AS) | {"scaling", "dropout", "sliding_window",
                                                                        "softcap", "s_aux"}
    named = set(inspect.signature(hattn.hetero_attention).parameters) - {"kwargs"}
    for family, (model, record) in attention_calls.items():
        with upstream(TF, f"attention function keywords ({family})",
                      "models call it as f(module, query, key, value, attention_mask, **kw) with kw among the ones "
                      "hetero implements (scaling, dropout, sliding_window, softcap, s_aux) or knows to be neutral "
                      "(NEUTRAL_KWARGS, HARMLESS_ONLY_AS); any other keyword makes hetero refuse the model",
                      "hetero/attention.py:hetero_attention, _check_kwargs"):
            assert record
            for call in record:
                assert set(call.kwargs) <= allowed, sorted(set(call.kwargs) - allowed)
                for k in ("scaling", "dropout"):
                    assert k in call.kwargs
            assert {"scaling", "dropout", "sliding_window", "softcap", "s_aux"} <= named


def test_attention_call_values(attention_calls):
    for family, (model, record) in attention_calls.items():
        cfg = model.config.get_text_config()
        spec = inspect_model(model)
        with upstream(TF, f"attention function arguments ({family})",
                      "query [B, Hq, T, D] and key/value [B, Hkv, S, D] (what the cache's update returned); the "
                      "module has layer_idx and is_causal; scaling is the module's; sliding_window, when given, is "
                      "the layer's configured window; softcap is config.attn_logit_softcapping; s_aux is the module's "
                      "sinks [Hq]; dropout 0.0 in eval mode",
                      "hetero/attention.py:hetero_attention, _decode; hetero/model_spec.py:inspect_model"):
            for call in record:
                m, kw = call.module, call.kwargs
                B, Hq, T, D = call.q
                assert Hq == cfg.num_attention_heads and D == spec.head_dim
                assert call.k[:2] == (B, spec.kv_heads) and call.k[3] == D and call.v == call.k
                assert 0 <= m.layer_idx < spec.layers and getattr(m, "is_causal", True) is True
                assert kw["dropout"] == 0.0 and kw["scaling"] == m.scaling
                w = kw.get("sliding_window")
                assert not w or w == spec.windows[m.layer_idx], (w, spec.windows)
                if family == "mistral":
                    assert w == cfg.sliding_window
                if family == "gemma2":
                    assert kw.get("softcap") == cfg.attn_logit_softcapping
                if family == "gpt_oss":
                    assert kw.get("s_aux") is m.sinks and tuple(m.sinks.shape) == (Hq,)


def test_attention_output_layout(llama):
    record = []
    _register_probe("hetero-api-layout", record)
    ids, mask = padded_batch((6, 4))
    with upstream(TF, "attention function return value",
                  "the model takes (out [B, T, Hq, D], None) from the attention function, as from sdpa's (no "
                  "attention weights)", "hetero/attention.py:hetero_attention"), torch.no_grad():
        ref = llama(ids, attention_mask=mask).logits
        with attn_impl(llama, "hetero-api-layout"):
            got = llama(ids, attention_mask=mask).logits
        torch.testing.assert_close(got, ref)


def test_sdpa_attention_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = build_model("llama")[0].model.layers[0].self_attn
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    neutral = {"position_ids": torch.arange(5)[None], "use_cache": True, "cache_position": torch.arange(5),
               "is_causal": True,
               "output_router_logits": False, "logits_to_keep": 0, "tokenizer": None}
    with upstream(TF, "integrations.sdpa_attention.sdpa_attention_forward",
                  "sdpa_attention_forward(module, q [B,Hq,T,D], k, v [B,Hkv,S,D], mask, dropout=, scaling=, **kw) "
                  "accepts the neutral keywords models pass, groups query heads h -> KV head h // G, and returns "
                  "(causal attention [B, T, Hq, D], _)", "hetero/attention.py:hetero_attention (prefill)"):
        out = sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.25, **neutral)[0]
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        w = (q @ kk.transpose(2, 3) * 0.25).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
        ref = (torch.softmax(w, -1) @ vv).transpose(1, 2)
        assert out.shape == (2, 5, 4, 16)
        torch.testing.assert_close(out, ref)


def test_eager_paths_match_hetero():
    """hetero's eager attention (soft-cap, sinks) reproduces transformers' eager paths."""
    from transformers.masking_utils import sdpa_mask
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gpt_oss import modeling_gpt_oss

    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]).bool()
    bool_mask = sdpa_mask(batch_size=2, q_length=5, kv_length=7, q_offset=2, attention_mask=pad,
                          allow_is_causal_skip=False)
    additive = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=2, training=False, head_dim=16,
                             sinks=torch.randn(4))
    with upstream(TF, "models.gemma2.modeling_gemma2.eager_attention_forward (softcap)",
                  "eager attention with logit soft-capping is tanh(qk*scale/softcap)*softcap, then the mask, then an "
                  "fp32 softmax, as hetero's eager_attention computes it",
                  "hetero/attention.py:eager_attention, hetero/prefetch/schedule.py:device_attention"):
        ref, _ = modeling_gemma2.eager_attention_forward(module, q, k, v, additive, scaling=0.25, softcap=5.0)
        got, _ = hattn.eager_attention(module, q, k, v, bool_mask, 0.25, softcap=5.0)
        torch.testing.assert_close(got, ref)
    with upstream(TF, "models.gpt_oss.modeling_gpt_oss.eager_attention_forward (sinks)",
                  "attention sinks are one logit per query head joining the softmax and dropped after it, as "
                  "hetero's eager_attention (and its CPU kernel's merge) computes them",
                  "hetero/attention.py:eager_attention, hetero/offload/session.py:attend"):
        ref, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, additive, scaling=0.25)
        got, _ = hattn.eager_attention(module, q, k, v, bool_mask, 0.25, sinks=module.sinks)
        torch.testing.assert_close(got, ref)


def test_attention_mask_interface(llama):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    mask_calls, record = [], []

    def mask_fn(*args, **kwargs):           # as hetero_mask: None once "prefilled" (here: decode steps)
        mask_calls.append(kwargs)
        return None if kwargs.get("q_length") == 1 else sdpa_mask(*args, **kwargs)

    _register_probe("hetero-api-mask", record, mask_fn)
    ids, mask = padded_batch((6, 4))
    with upstream(TF, "masking_utils.AttentionMaskInterface.register + create_causal_mask",
                  "the mask function registered under the attention implementation's name builds the model's "
                  "masks (only a registered name gets one), called with sdpa_mask's keywords, and a None it returns "
                  "reaches the attention function as attention_mask=None",
                  "hetero/attention.py:hetero_mask, register"), torch.no_grad():
        assert ALL_MASK_ATTENTION_FUNCTIONS["hetero-api-mask"] is mask_fn
        with attn_impl(llama, "hetero-api-mask"):
            llama.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert mask_calls and all(set(c) >= {"batch_size", "q_length", "kv_length", "attention_mask"}
                                  for c in mask_calls)
        prefill = [c for c in record if c.q[2] > 1]
        decode = [c for c in record if c.q[2] == 1]
        assert prefill and all(isinstance(c.mask, torch.Tensor) for c in prefill)      # padded: a real mask
        assert decode and all(c.mask is None for c in decode)


def test_sdpa_mask():
    from transformers.masking_utils import sdpa_mask

    pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]).bool()
    with upstream(TF, "masking_utils.sdpa_mask",
                  "sdpa_mask(batch_size=, q_length=, kv_length=, q_offset=, attention_mask=2D, ...) returns a "
                  "boolean [B, 1, q, kv] mask, True where a query attends (causal and not a pad), or None where "
                  "sdpa's is_causal does it", "hetero/attention.py:hetero_mask, eager_attention"):
        m = sdpa_mask(batch_size=2, q_length=2, kv_length=4, q_offset=2, attention_mask=pad)
        assert m.dtype == torch.bool and tuple(m.shape) == (2, 1, 2, 4)
        want = torch.tensor([[[0, 1, 1, 0], [0, 1, 1, 1]], [[1, 1, 1, 0], [1, 1, 1, 1]]]).bool()
        assert torch.equal(m[:, 0], want)
        assert sdpa_mask(batch_size=1, q_length=4, kv_length=4, attention_mask=None) is None


# ---------------------------------------------------------------- the cache

class _FakeSession:
    """What HeteroLayer / HeteroCache use of a KVSession, recording calls."""

    def __init__(self, spec, events=None):
        self.spec, self.prefilled = spec, False
        self.events = [] if events is None else events

    def note_update(self, layer):
        self.events.append(("update", layer))

    def store_prefill(self, layer, key, value):
        self.events.append(("store", layer, tuple(key.shape)))

    def stage_kv(self, key, value):
        self.events.append(("stage", tuple(key.shape)))


def test_cache_layer_mixin_interface():
    from transformers.cache_utils import Cache, CacheLayerMixin

    with upstream(TF, "cache_utils.CacheLayerMixin",
                  "a layer is complete with lazy_initialization(k, v), update(k, v, *args, **kwargs), "
                  "get_mask_sizes(query_length), get_seq_length(), get_max_length() and reset(); __init__ takes no "
                  "argument; is_compileable / is_croppable / is_sliding / is_initialized are plain attributes",
                  "hetero/offload/cache.py:HeteroLayer"):
        abstract = set(getattr(CacheLayerMixin, "__abstractmethods__", ()))
        assert abstract <= set(vars(HeteroLayer)), sorted(abstract - set(vars(HeteroLayer)))
        for name, params in (("lazy_initialization", ["key_states", "value_states"]),
                             ("get_mask_sizes", ["query_length"]), ("get_seq_length", []), ("get_max_length", [])):
            got = [p for p in inspect.signature(getattr(CacheLayerMixin, name)).parameters if p != "self"]
            assert got == params, (name, got)
        update = inspect.signature(CacheLayerMixin.update).parameters
        assert list(update)[1:3] == ["key_states", "value_states"]
        layer = HeteroLayer(_FakeSession(SimpleNamespace(layers=1, sliding=(False,))), 0, True)
        assert layer.is_initialized is False and layer.is_sliding is True
        for name in ("is_compileable", "is_croppable"):
            assert isinstance(getattr(CacheLayerMixin, name), bool)
    with upstream(TF, "cache_utils.Cache",
                  "Cache(layers=[...]) holds the given layers; reorder_cache, crop, batch_repeat_interleave and "
                  "batch_select_indices are the methods generate uses to reshape a cache (hetero refuses them)",
                  "hetero/offload/cache.py:HeteroCache"):
        assert "layers" in inspect.signature(Cache.__init__).parameters
        for name in ("reorder_cache", "crop", "batch_repeat_interleave", "batch_select_indices"):
            assert callable(getattr(Cache, name, None)), name


def test_cache_update_dispatch(llama):
    spec = inspect_model(llama)
    events = []
    session = _FakeSession(spec, events)
    cache = HeteroCache(session)
    _register_probe("hetero-api-cache", events)
    ids, mask = padded_batch((6, 4))
    B, S = ids.shape
    with upstream(TF, "Cache.update(key, value, layer_idx, ...) inside the attention modules",
                  "each attention layer calls cache.update with its new key/value [B, Hkv, T, D] (rotated), which "
                  "the Cache hands to layers[layer_idx].update, and attends over what update returned right after "
                  "it, before the next layer's update; the model returns the cache object it was given",
                  "hetero/offload/cache.py:HeteroLayer.update, hetero/offload/session.py:note_update/take_update"), \
            torch.no_grad():
        with attn_impl(llama, "hetero-api-cache"):
            out = llama(input_ids=ids, attention_mask=mask, use_cache=True,
                        **{forward_cache_kwarg(llama.forward): cache})
        ref = llama(input_ids=ids, attention_mask=mask, use_cache=False).logits
        shape = (B, spec.kv_heads, S, spec.head_dim)
        seq = [e if isinstance(e, tuple) else ("attend", e.module.layer_idx, e.k) for e in events]
        want = []
        for i in range(spec.layers):
            want += [("update", i), ("store", i, shape), ("attend", i, shape)]
        assert seq == want
        torch.testing.assert_close(out.logits, ref)            # mask sizes as transformers' own cache gives them
        assert output_cache(out) is cache
        assert cache.get_seq_length() == S


def test_cache_mask_sizes():
    from transformers.cache_utils import Cache, DynamicLayer

    spec = SimpleNamespace(layers=2, sliding=(False, False))
    k = torch.randn(1, 2, 5, 8)
    with upstream(TF, "CacheLayerMixin.get_mask_sizes / get_seq_length, Cache.get_mask_sizes / get_seq_length / "
                      "get_query_offset",
                  "the mask of a forward over T new tokens after n cached ones is sized by layer.get_mask_sizes(T) "
                  "= (n + T, 0) (what DynamicLayer returns), the cache's length by layer.get_seq_length() = n, and "
                  "Cache delegates both (and get_query_offset) to the layer", "hetero/offload/cache.py:HeteroLayer"):
        dyn = DynamicLayer()
        dyn.update(k, k)
        het = HeteroCache(_FakeSession(spec))
        het.update(k, k, 0)
        het.update(k, k, 1)
        for T in (1, 3):
            assert het.layers[0].get_mask_sizes(T) == dyn.get_mask_sizes(T) == (5 + T, 0)
            assert Cache.get_mask_sizes(het, T, 1) == (5 + T, 0)
        assert Cache.get_seq_length(het) == dyn.get_seq_length() == 5
        if hasattr(Cache, "get_query_offset"):
            assert het.get_query_offset(0) == 5


def test_cache_is_sliding():
    model = build_model("gemma3_text")[0]
    spec = inspect_model(model)
    with upstream(TF, "Cache.is_sliding / CacheLayerMixin.is_sliding",
                  "Cache.is_sliding lists each layer's is_sliding, and transformers' own cache for the config marks "
                  "exactly the layer_types 'sliding_attention' layers sliding (as hetero's ModelSpec.sliding)",
                  "hetero/offload/cache.py:HeteroCache, hetero/model_spec.py:inspect_model"):
        assert spec.sliding == (True, False)
        assert HeteroCache(_FakeSession(spec)).is_sliding == list(spec.sliding)
        assert DynamicCache(config=model.config).is_sliding == list(spec.sliding)


# ---------------------------------------------------------------- generate's cache keyword and output (hetero.compat)

def test_generate_cache_keyword(llama):
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    ids = torch.tensor([[5, 6, 7, 8]])
    cache = DynamicCache(config=llama.config)
    with upstream(TF, f"generate({GENERATE_CACHE_KWARG}=...) / GenerateDecoderOnlyOutput.{OUTPUT_CACHE_FIELD}",
                  "generate takes a caller's Cache under the name of the output field that holds it ('cache' from "
                  "5.24, 'past_key_values' before), fills that very object without a deprecation warning, and "
                  "returns it in that field", "hetero/compat.py:GENERATE_CACHE_KWARG/OUTPUT_CACHE_FIELD, "
                  "hetero/generator.py:_generate"), torch.no_grad():
        assert OUTPUT_CACHE_FIELD in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
        with deprecations() as found:
            out = llama.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                                 **{GENERATE_CACHE_KWARG: cache})
            held = output_cache(out)
        assert not found, found
        assert held is cache and cache.get_seq_length() == ids.shape[1] + 2


def test_forward_cache_keyword():
    with upstream(TF, "the models' forward(cache=... | past_key_values=...)",
                  "a causal LM's forward names its cache argument 'cache' (5.24) or 'past_key_values' (5.17), found "
                  "by its signature, and takes it under that name without a deprecation warning",
                  "hetero/compat.py:forward_cache_kwarg, hetero/prefill.py:_forward"), torch.no_grad():
        for family in ("llama", "gemma2"):
            model = build_model(family)[0]
            name = forward_cache_kwarg(model.forward)
            assert name in inspect.signature(model.forward).parameters
            cache = DynamicCache(config=model.config)
            with deprecations() as found:
                out = model(torch.tensor([[5, 6, 7]]), use_cache=True, **{name: cache})
            assert not found, found
            assert cache.get_seq_length() == 3 and output_cache(out) is cache


def test_model_output_mapping(llama):
    with upstream(TF, "utils.generic.ModelOutput (an OrderedDict of the fields that are not None)",
                  "a generate output is an OrderedDict subclass whose mapping holds the non-None fields; dropping "
                  "the cache from the mapping (OrderedDict.__delitem__) and setting the attribute to None "
                  "(object.__setattr__) leaves an output without it: not in keys(), to_tuple() or out[field], None "
                  "as an attribute, every other field intact", "hetero/compat.py:without_cache, output_cache"), \
            torch.no_grad():
        out = llama.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False,
                             return_dict_in_generate=True, output_scores=True)
        assert isinstance(out, transformers.utils.ModelOutput) and isinstance(out, dict)
        keys = list(out.keys())
        assert OUTPUT_CACHE_FIELD in keys
        with deprecations() as found:
            cut = without_cache(out)
            assert output_cache(cut) is None
        assert not found, found
        assert list(cut.keys()) == [k for k in keys if k != OUTPUT_CACHE_FIELD]
        assert len(cut.to_tuple()) == len(keys) - 1
        with pytest.raises(KeyError):
            cut[OUTPUT_CACHE_FIELD]
        assert cut.sequences.shape == (1, 5) and len(cut.scores) == 2


# ---------------------------------------------------------------- the generation loop

def test_generate_continues_prefilled_cache(llama):
    from hetero.generator import HeteroGenerator

    ids, mask = padded_batch((7, 5))
    S = ids.shape[1]
    with torch.no_grad():
        ref = llama.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    for cached in (S - 1, S - 3):              # a context's last token / a chunked prefill's last chunk left
        cache = DynamicCache(config=llama.config)
        owner = SimpleNamespace(model=llama, _forward_params=None, _cache_kwarg=None)
        fed = []
        hook = llama.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]),
                                               with_kwargs=True)
        with upstream(TF, "generate over a pre-filled Cache (GenerationMixin._prefill / "
                          "prepare_inputs_for_generation) and the model forward's keywords",
                      "the model forward takes input_ids, attention_mask (all positions so far), the cache, use_cache, "
                      "cache_position (riding **kwargs) and position_ids / logits_to_keep where its signature names "
                      "them, without a deprecation warning, and fills the "
                      "cache as generate would; generate(full input_ids, full mask, cache holding the first n) then feeds "
                      "only input_ids[:, n:] in its first forward, and the result equals a generate without the cache",
                      "hetero/prefill.py:_forward, prefill_chunks, _feed, _generate_in_context(s)"), torch.no_grad():
            try:
                with deprecations() as found:
                    HeteroGenerator._forward(owner, cache, ids, mask, 0, cached)
                assert not found, found
                assert cache.get_seq_length() == cached and fed == [cached]
                fed.clear()
                out = llama.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                                     **{GENERATE_CACHE_KWARG: cache})
            finally:
                hook.remove()
            assert fed == [S - cached, 1]
            assert torch.equal(out, ref)


def test_generation_config_fields():
    from hetero.generator import UNSUPPORTED_SETTINGS, _GC_FIELDS

    known = {
        "assistant_confidence_threshold", "assistant_early_exit", "assistant_ensemble_weight", "assistant_lookbehind",
        "bad_words_ids", "begin_suppress_tokens", "bos_token_id", "cache_config", "cache_implementation",
        "compile_config", "constraints", "continuous_batching_config", "decoder_start_token_id", "disable_compile",
        "diversity_penalty", "do_sample", "dola_layers", "early_stopping", "encoder_no_repeat_ngram_size",
        "encoder_repetition_penalty", "eos_token_id", "epsilon_cutoff", "eta_cutoff",
        "exponential_decay_length_penalty", "force_words_ids", "forced_bos_token_id", "forced_eos_token_id",
        "guidance_scale", "is_assistant", "length_penalty", "low_memory", "max_cache_len", "max_length",
        "max_matching_ngram_size", "max_new_tokens", "max_time", "min_length", "min_new_tokens", "min_p",
        "no_repeat_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule", "num_beam_groups",
        "num_beams", "num_return_sequences", "output_attentions", "output_hidden_states", "output_logits",
        "output_scores", "pad_token_id", "penalty_alpha", "prefill_chunk_size", "prompt_lookup_num_tokens",
        "remove_invalid_values", "renormalize_logits", "repetition_penalty", "return_dict_in_generate",
        "sequence_bias", "speculation_type", "stop_strings", "suppress_tokens", "target_lookbehind", "temperature",
        "token_healing", "top_h", "top_k", "top_p", "typical_p", "use_cache", "use_mtp", "watermarking_config"}
    fields = set(_GC_FIELDS)
    with upstream(TF, "GenerationConfig fields (vars(GenerationConfig()))",
                  "the public instance attributes of GenerationConfig() are its fields; hetero takes each as a generate "
                  "keyword and refuses by name the ones it cannot run (UNSUPPORTED_SETTINGS): a field added by a "
                  f"release must be reviewed there (new: {sorted(fields - known)})",
                  "hetero/settings.py:GC_FIELDS, UNSUPPORTED_SETTINGS, generation_settings"):
        assert not fields - known
    read = {"max_new_tokens", "max_length", "pad_token_id", "eos_token_id", "cache_implementation", "max_time",
            "watermarking_config", "return_dict_in_generate", "output_attentions", "output_hidden_states",
            "num_beams", "num_return_sequences", "use_cache"}
    with upstream(TF, "GenerationConfig fields hetero reads",
                  f"GenerationConfig has the fields {sorted(read)} (hetero reads them from the model's "
                  "generation_config and the resolved settings), and the ones it refuses",
                  "hetero/generator.py:_generate, hetero/settings.py:default_new_tokens, inferred_mask, generation_settings"):
        assert read <= fields, sorted(read - fields)
        missing = sorted(set(UNSUPPORTED_SETTINGS) - fields)
        assert not missing, f"UNSUPPORTED_SETTINGS names fields transformers no longer has: {missing}"


def test_generation_config_update(llama):
    with upstream(TF, "GenerationConfig.update(**kwargs)",
                  "update sets each field it is given, None included (a call's explicit None sets the model's value "
                  "aside), and returns the keywords that are no field", "hetero/settings.py:generation_settings"):
        gc = copy.deepcopy(llama.generation_config)
        gc.max_new_tokens = 7
        rest = gc.update(max_new_tokens=None, temperature=0.5, not_a_field=1)
        assert gc.max_new_tokens is None and gc.temperature == 0.5 and rest == {"not_a_field": 1}


def test_generation_mode():
    from transformers.generation import GenerationMode

    from hetero.generator import UNSUPPORTED_SETTINGS

    with upstream(TF, "GenerationConfig.get_generation_mode / generation.GenerationMode",
                  "every setting that takes generate off greedy search or sampling is one hetero refuses "
                  "(get_generation_mode reads no other field but do_sample and top_k), and penalty_alpha matters only "
                  "as CONTRASTIVE_SEARCH (top_k > 1, no sampling)",
                  "hetero/settings.py:UNSUPPORTED_SETTINGS, generation_settings"):
        src = inspect.getsource(GenerationConfig.get_generation_mode)
        read = set(re.findall(r"self\.([a-z_]+)", src))
        assert read - {"do_sample", "top_k"} <= set(UNSUPPORTED_SETTINGS), sorted(read - set(UNSUPPORTED_SETTINGS))
        assert GenerationConfig(penalty_alpha=0.6, top_k=4).get_generation_mode() == GenerationMode.CONTRASTIVE_SEARCH
        assert GenerationConfig(penalty_alpha=0.6, top_k=4, do_sample=True).get_generation_mode() == \
            GenerationMode.SAMPLE
        assert GenerationConfig().get_generation_mode() == GenerationMode.GREEDY_SEARCH


def test_generate_keyword_resolution(llama):
    ids = torch.tensor([[5, 6, 7]])
    saved = copy.deepcopy(llama.generation_config)
    with upstream(TF, "generate(**kwargs) / generate(generation_config=) resolution (_prepare_generation_config)",
                  "keywords override the model's generation_config, an explicit None included (max_new_tokens=None "
                  "lets max_length count; cache_implementation=None sets a checkpoint's 'static' aside); a "
                  "generation_config object's None fields take the model's",
                  "hetero/settings.py:generation_settings, with_generation_config, "
                  "hetero/generator.py:_generate"), torch.no_grad():
        try:
            llama.generation_config.max_new_tokens = 5
            llama.generation_config.cache_implementation = "static"
            cache = DynamicCache(config=llama.config)
            out = llama.generate(ids, max_new_tokens=None, max_length=5, cache_implementation=None,
                                 do_sample=False, eos_token_id=None, **{GENERATE_CACHE_KWARG: cache})
            assert out.shape[1] == 5
            out = llama.generate(ids, generation_config=GenerationConfig(do_sample=False), eos_token_id=None,
                                 cache_implementation=None)
            assert out.shape[1] == 3 + 5
        finally:
            llama.generation_config = saved


def test_generate_default_length(llama):
    from hetero.generator import DEFAULT_NEW_TOKENS

    with upstream(TF, "generate's default length",
                  f"without max_new_tokens or max_length anywhere (GenerationConfig().max_length is None), generate "
                  f"adds {DEFAULT_NEW_TOKENS} new tokens",
                  "hetero/settings.py:DEFAULT_NEW_TOKENS, default_new_tokens"), \
            torch.no_grad():
        assert GenerationConfig().max_length is None and llama.generation_config.max_length is None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)          # "Using the model-agnostic default `max_length`"
            out = llama.generate(torch.tensor([[5, 6, 7]]), do_sample=False, eos_token_id=None)
        assert out.shape[1] == 3 + DEFAULT_NEW_TOKENS


def test_generate_infers_attention_mask(llama):
    masks = []
    hook = llama.register_forward_pre_hook(lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    ids = torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]])          # pad_token_id 0 (not an eos id)
    with upstream(TF, "generate's attention-mask inference (_prepare_attention_mask_for_generation)",
                  "without attention_mask, generate masks input_ids == pad_token_id where the pad id occurs and is no "
                  "eos id, else attends every token", "hetero/settings.py:inferred_mask"), torch.no_grad():
        try:
            llama.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=2)
            assert torch.equal(masks[0].long(), (ids != 0).long())
            masks.clear()
            llama.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=[2, 0])
            assert masks[0] is None or bool(masks[0].all())
        finally:
            hook.remove()


def test_max_time_criteria(llama):
    from transformers import MaxTimeCriteria, StoppingCriteriaList

    with upstream(TF, "MaxTimeCriteria(max_time, initial_timestamp=) + a caller's stopping_criteria in generate "
                      "(_merge_criteria_processor_list)",
                  "MaxTimeCriteria counts from initial_timestamp; generate runs a caller's criteria, and where the "
                  "caller's list holds a MaxTimeCriteria as well as max_time= the caller's wins",
                  "hetero/settings.py:generation_settings"), torch.no_grad():
        assert list(inspect.signature(MaxTimeCriteria).parameters)[:2] == ["max_time", "initial_timestamp"]
        late = StoppingCriteriaList([MaxTimeCriteria(1.0, initial_timestamp=time.time() - 10)])
        ids = torch.tensor([[5, 6, 7]])
        out = llama.generate(ids, max_new_tokens=5, do_sample=False, max_time=None, stopping_criteria=late)
        assert out.shape[1] == 4                     # stopped after the first token
        out = llama.generate(ids, max_new_tokens=5, do_sample=False, max_time=1000.0, stopping_criteria=late)
        assert out.shape[1] == 4


def test_watermarking_config():
    from transformers import WatermarkingConfig

    d = {"greenlist_ratio": 0.5, "bias": 1.5, "seeding_scheme": "lefthash", "context_width": 1}
    with upstream(TF, "WatermarkingConfig.from_dict / GenerationConfig(watermarking_config=dict)",
                  "GenerationConfig(...) turns a watermarking_config dict into a WatermarkingConfig, and "
                  "WatermarkingConfig.from_dict(d) gives the same", "hetero/settings.py:generation_settings"):
        made = GenerationConfig(watermarking_config=d).watermarking_config
        assert isinstance(made, WatermarkingConfig)
        assert WatermarkingConfig.from_dict(d).to_dict() == made.to_dict()


def test_generate_signature():
    from hetero.generator import PASS_THROUGH

    with upstream(TF, "GenerationMixin.generate signature",
                  "generate(inputs, generation_config=, logits_processor=, stopping_criteria=, streamer=, **kwargs) "
                  "(tokenizer, for stop_strings, and the GenerationConfig fields ride **kwargs)",
                  "hetero/settings.py:PASS_THROUGH, hetero/generator.py:generate"):
        params = inspect.signature(transformers.GenerationMixin.generate).parameters
        assert list(params)[1] == "inputs"
        for name in set(PASS_THROUGH) - {"tokenizer"} | {"generation_config"}:
            assert name in params, name
        assert any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_streamer_protocol(llama):
    calls = []

    class Recorder:
        def put(self, value):
            calls.append(("put", tuple(value.shape)))

        def end(self):
            calls.append(("end",))

    with upstream(TF, "generation streamers (BaseStreamer.put / end)",
                  "generate calls streamer.put(the prompt) first, then put(one token per request) per step, then "
                  "end() once", "hetero/cli.py:_Clock"), torch.no_grad():
        llama.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                       streamer=Recorder())
        assert calls[0][0] == "put" and calls[0][1][-1] == 3
        assert [c[0] for c in calls[1:]] == ["put"] * 3 + ["end"]
        assert all(math.prod(c[1]) == 1 for c in calls[1:4])


def test_cache_dropping_prepare_inputs():
    from transformers import GenerationMixin

    from hetero.generator import _keeping_cache

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 8}
    model = build_model("phi3", rope_parameters=rope, original_max_position_embeddings=8)[0]
    with upstream(TF, "prepare_inputs_for_generation overrides of " + ", ".join(CACHE_DROPPING_MODEL_TYPES),
                  "these families override GenerationMixin.prepare_inputs_for_generation (in their "
                  "transformers.models module) to drop the cache once input_ids pass "
                  "original_max_position_embeddings with a cache not past it; the generic one (super()) keeps it",
                  "hetero/model_spec.py:CACHE_DROPPING_MODEL_TYPES, hetero/routing.py:keeping_cache"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        import importlib

        for model_type in CACHE_DROPPING_MODEL_TYPES:
            name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
            cls = getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), name)
            own = [c for c in cls.__mro__ if "prepare_inputs_for_generation" in c.__dict__]
            assert own[0].__module__.startswith(f"transformers.models.{model_type}"), (model_type, own[0])
            assert "original_max_position_embeddings" in inspect.getsource(own[0].prepare_inputs_for_generation)
        cache = DynamicCache(config=model.config)
        cache.update(torch.zeros(1, 4, 3, 16), torch.zeros(1, 4, 3, 16), 0)
        ids = torch.arange(3, 13)[None]                                  # 10 tokens > 8
        kw = {GENERATE_CACHE_KWARG: cache, "attention_mask": torch.ones_like(ids), "use_cache": True}
        dropped = model.prepare_inputs_for_generation(ids, **kw)
        kept = _keeping_cache(model)(ids, **kw)
        generic = super(type(model), model).prepare_inputs_for_generation
        assert generic.__func__ is GenerationMixin.prepare_inputs_for_generation
        assert dropped.get(GENERATE_CACHE_KWARG) is None
        assert kept.get(GENERATE_CACHE_KWARG) is cache


def test_generate_uses_instance_prepare_inputs(llama):
    calls = []
    generic = llama.prepare_inputs_for_generation

    def wrapper(*args, **kwargs):
        calls.append(1)
        return generic(*args, **kwargs)

    with upstream(TF, "GenerationMixin.generate -> self.prepare_inputs_for_generation",
                  "generate prepares each step's inputs through self.prepare_inputs_for_generation, so a function "
                  "set on the model instance for the call replaces the family's override",
                  "hetero/routing.py:routed, keeping_cache"), torch.no_grad():
        llama.prepare_inputs_for_generation = wrapper
        try:
            llama.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, eos_token_id=None)
        finally:
            del llama.prepare_inputs_for_generation
        assert len(calls) == 3


# ---------------------------------------------------------------- models and configs

def test_model_classes_and_attention_backend(llama):
    from transformers import GenerationMixin, PreTrainedModel

    with upstream(TF, "PreTrainedModel / GenerationMixin / PreTrainedModel._supports_attention_backend",
                  "a causal LM is a PreTrainedModel and a GenerationMixin; _supports_attention_backend (False by "
                  "default) is True on models whose attention goes through AttentionInterface",
                  "hetero/model_spec.py:inspect_model"):
        assert isinstance(llama, PreTrainedModel) and isinstance(llama, GenerationMixin)
        assert PreTrainedModel._supports_attention_backend is False
        assert type(llama)._supports_attention_backend is True


def test_get_text_config():
    with upstream(TF, "PreTrainedConfig.get_text_config()",
                  "get_text_config() is the config itself for a text model and the text sub-config of a composite "
                  "(multimodal) one", "hetero/model_spec.py:inspect_model, hetero/generator.py:__init__/"
                  "_check_model_state/_chunk_size"):
        cfg = AutoConfig.for_model("llama", **COMMON)
        assert cfg.get_text_config() is cfg
        composite = AutoConfig.for_model("gemma3")
        assert composite.get_text_config() is composite.text_config


def test_config_fields():
    with upstream(TF, "model config fields (rope_parameters, layer_types, sliding_window, head_dim, "
                      "original_max_position_embeddings, attn_logit_softcapping, is_heterogeneous/per_layer_config)",
                  "rope_parameters is a dict with rope_type (per layer type, keyed by it, where layer types differ), "
                  "layer_types holds 'full_attention' / 'sliding_attention', a LongRoPE config names "
                  "original_max_position_embeddings, Gemma2 its attn_logit_softcapping, and a config is heterogeneous "
                  "only with per-layer overrides", "hetero/model_spec.py:inspect_model, _field, _position_limit"):
        llama = AutoConfig.for_model("llama", **COMMON)
        assert llama.rope_parameters["rope_type"] == "default"
        assert getattr(llama, "is_heterogeneous", False) is False
        g3 = AutoConfig.for_model("gemma3_text", **COMMON, head_dim=16, sliding_window=6,
                                  layer_types=["sliding_attention", "full_attention"])
        assert set(g3.rope_parameters) == {"sliding_attention", "full_attention"}
        assert all("rope_type" in r for r in g3.rope_parameters.values())
        assert g3.layer_types == ["sliding_attention", "full_attention"] and g3.sliding_window == 6
        assert g3.head_dim == 16
        phi3 = AutoConfig.for_model("phi3", **COMMON, original_max_position_embeddings=64, rope_scaling={
            "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})     # as Phi-3 checkpoints
        assert phi3.original_max_position_embeddings == 64
        assert phi3.rope_parameters["rope_type"] == "longrope"
        assert phi3.rope_parameters.get("original_max_position_embeddings", 64) == 64
        g2 = AutoConfig.for_model("gemma2", **COMMON, attn_logit_softcapping=5.0)
        assert g2.attn_logit_softcapping == 5.0


def test_attention_and_rotary_modules():
    for family in ("llama", "gemma3_text"):
        model = build_model(family)[0]
        cfg = model.config
        with upstream(TF, f"attention / rotary module naming and attributes ({family})",
                      "each decoder layer's attention is a module whose class name ends in 'Attention' with layer_idx, "
                      "head_dim, num_key_value_groups and is_causal; rotary models hold a '*RotaryEmbedding' module; "
                      "get_decoder() holds the attention modules; get_input_embeddings().num_embeddings is the "
                      "vocabulary; get_output_embeddings() is the LM head",
                      "hetero/model_spec.py:_check_attention_modules, _position_limit, "
                      "hetero/settings.py:check_inputs, hetero/adapters/hooks.py:max_linear_dims"):
            attn = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
            assert sorted(m.layer_idx for m in attn) == list(range(cfg.num_hidden_layers))
            decoder = {id(m) for m in model.get_decoder().modules()}
            for m in attn:
                assert id(m) in decoder
                assert m.head_dim == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
                assert m.num_key_value_groups == cfg.num_attention_heads // cfg.num_key_value_heads
                assert m.is_causal is True
            assert any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules())
            assert model.get_input_embeddings().num_embeddings == cfg.vocab_size
            assert model.get_output_embeddings() is model.lm_head


def test_config_to_dict_stable(llama):
    from hetero.offload.saved import model_config

    with upstream(TF, "PreTrainedConfig.to_dict()",
                  "the config's dict changes with set_attn_implementation / a dtype change only in private or "
                  "ignored keys (IGNORED_CONFIG), so a saved context's config fingerprint stays the model's",
                  "hetero/offload/saved.py:model_config, fingerprint, check_model"):
        before = model_config(llama)
        with attn_impl(llama, "eager"):
            during = model_config(llama)
        model = build_model("llama", dtype=torch.bfloat16)[0]
        assert during == before and model_config(model) == before


def test_from_pretrained_dtype(tmp_path):
    model = build_model("llama")[0]
    model.save_pretrained(tmp_path)
    with upstream(TF, "PreTrainedModel.from_pretrained(dtype=)",
                  "from_pretrained takes the weights' dtype as dtype= (torch_dtype is the deprecated name)",
                  "hetero/models.py:load_smollm2, hetero/generator.py:HeteroGenerator.from_pretrained"):
        with deprecations() as found:
            loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        assert loaded.dtype == torch.bfloat16
        assert not [f for f in found if "dtype" in f], found


def _write_tiny_gguf(path):
    """A llama-architecture GGUF of random weights, Q8_0 where the rows allow it (the real SmolLM2 file
    takes ~13 s to dequantize; this one milliseconds)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    V, H, I, L, NH, NKV, D = 64, 64, 128, 2, 4, 2, 16
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}".encode() for i in range(V)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([1] * V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def tensor(name, shape):
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ones(shape, np.float32))

    tensor("token_embd.weight", (V, H))
    tensor("output_norm.weight", (H,))
    tensor("output.weight", (V, H))
    for i in range(L):
        for name, shape in (("attn_norm", (H,)), ("ffn_norm", (H,)), ("attn_q", (NH * D, H)),
                            ("attn_k", (NKV * D, H)), ("attn_v", (NKV * D, H)), ("attn_output", (H, NH * D)),
                            ("ffn_gate", (I, H)), ("ffn_up", (I, H)), ("ffn_down", (H, I))):
            tensor(f"blk.{i}.{name}.weight", shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    _write_tiny_gguf(d / "tiny.gguf")
    return d


def test_gguf_load_is_dense(tiny_gguf):
    with upstream(TF, "from_pretrained(gguf_file=) of a llama-architecture GGUF",
                  "transformers dequantizes the GGUF into a plain model (every linear layer an nn.Linear with float "
                  "weights, the default attention) that only carries the GGUF quantizer and its config "
                  "(hf_quantizer, config.quantization_config, is_quantized), which hetero's _plain then strips; a "
                  "load that kept the weights packed (GgufLinear, the ggml attention) would be left half-quantized",
                  "hetero/models.py:load_smollm2, _plain"):
        model = AutoModelForCausalLM.from_pretrained(tiny_gguf, gguf_file="tiny.gguf", dtype=torch.float32)
        linears = [m for m in model.modules() if "Linear" in type(m).__name__]
        assert linears and all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in linears), \
            sorted({type(m).__name__ for m in linears})
        assert model.config._attn_implementation in ("sdpa", "eager")
        assert getattr(model, "hf_quantizer", None) is not None and model.is_quantized
        assert getattr(model.config, "quantization_config", None) is not None


def test_gguf_plain_copy_roundtrip(tiny_gguf, tmp_path):
    from hetero.models import _drop_quantization_config, _plain

    with upstream(TF, "save_pretrained / from_pretrained of a dequantized GGUF model after _plain",
                  "with the quantizer and its config removed, a GGUF-loaded model saves (save_pretrained refuses a "
                  "quantized one) a config.json without quantization_config and weights that load back equal, in "
                  "another dtype, without a quantization warning; an older copy's config.json holds the GGUF config "
                  "under 'quantization_config'", "hetero/models.py:load_smollm2, _plain, _drop_quantization_config"):
        model = AutoModelForCausalLM.from_pretrained(tiny_gguf, gguf_file="tiny.gguf", dtype=torch.float32)
        with pytest.raises(ValueError):
            model.save_pretrained(tmp_path / "refused")
        model.config.save_pretrained(tmp_path / "old")
        assert "quantization_config" in json.load(open(tmp_path / "old" / "config.json"))
        _plain(model)
        model.save_pretrained(tmp_path / "copy")
        config = json.load(open(tmp_path / "copy" / "config.json"))
        assert "quantization_config" not in config
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "copy", dtype=torch.bfloat16)
        assert back.dtype == torch.bfloat16 and not getattr(back, "is_quantized", False)
        theirs = back.state_dict()
        for name, p in model.state_dict().items():
            torch.testing.assert_close(theirs[name], p.to(torch.bfloat16))
        _drop_quantization_config(os.fspath(tmp_path / "old" / "config.json"))
        assert "quantization_config" not in json.load(open(tmp_path / "old" / "config.json"))


def test_remove_quantization_config():
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    from hetero.models import _plain

    def quantized():
        """A model as a GGUF load leaves it (see test_gguf_load_is_dense)."""
        model = build_model("llama")[0]
        model.hf_quantizer = SimpleNamespace(quantization_config=GgufConfig())
        model.quantization_method = "gguf"
        model.config.quantization_config = GgufConfig()
        model.config._is_quantized = True
        model.is_quantized = True
        model._weight_conversions = []
        return model

    theirs, ours = quantized(), quantized()
    with upstream(TF, "HfQuantizer.remove_quantization_config",
                  "a model stops counting as quantized (.half() / .float() allowed, no quantization_config in its "
                  "config) once hf_quantizer, quantization_method and config.quantization_config are deleted and "
                  "is_quantized is False: what remove_quantization_config does and _plain repeats (5.24 also drops "
                  "_weight_conversions, which a GGUF load leaves empty)", "hetero/models.py:_plain"):
        with pytest.raises(ValueError):
            theirs.half()
        HfQuantizer.remove_quantization_config(SimpleNamespace(), theirs)
        _plain(ours)
        assert set(vars(theirs)) - {"_weight_conversions"} == set(vars(ours)) - {"_weight_conversions"}
        assert getattr(theirs, "_weight_conversions", []) == getattr(ours, "_weight_conversions", []) == []
        assert theirs.is_quantized is ours.is_quantized is False
        assert theirs.config.to_dict() == ours.config.to_dict()
        assert "quantization_config" not in ours.config.to_dict()
        ours.half()
        ours.float()


# ---------------------------------------------------------------- peft

@pytest.fixture(scope="module")
def peft_lib():
    return pytest.importorskip("peft")


def _peft_model(peft_lib, dtype=torch.float32, **config):
    model = build_model("llama", dtype=dtype)[0]
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)
    cfg.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)       # peft 0.21 calls is_gradient_checkpointing (5.24)
        return peft_lib.get_peft_model(model, peft_lib.LoraConfig(**cfg)).eval()


@pytest.fixture(scope="module")
def peft_model(peft_lib):
    return _peft_model(peft_lib)


def test_peft_layer_classes(peft_lib, peft_model):
    from hetero.adapters.hooks import peft_layers

    base = peft_model.get_base_model()
    with upstream(PEFT, "peft.tuners.lora.LoraLayer / peft.tuners.tuners_utils.BaseTunerLayer / "
                        "PeftModel.get_base_model()",
                  "LoRA layers are LoraLayer (a BaseTunerLayer) instances placed in get_base_model() (the causal LM) "
                  "at the adapted modules' paths (e.g. model.layers.0.self_attn.q_proj)",
                  "hetero/adapters/hooks.py:peft_layers, hetero/adapters/source.py:from_peft_model, "
                  "hetero/generator.py:__init__, hetero/adapters/sync.py:is_peft_model"):
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer

        assert isinstance(peft_model, peft_lib.PeftModel)
        assert type(base).__name__ == "LlamaForCausalLM"
        q = base.get_submodule("model.layers.0.self_attn.q_proj")
        assert isinstance(q, LoraLayer) and isinstance(q, BaseTunerLayer)
        assert len(peft_layers(base, lora_only=True)) == 2 * base.config.num_hidden_layers


def test_peft_lora_layer_attributes(peft_lib, peft_model):
    q = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    dropping = _peft_model(peft_lib, lora_dropout=0.1).get_base_model().model.layers[0].self_attn.q_proj
    with upstream(PEFT, "LoraLayer attributes (base_layer, lora_A, lora_B, scaling, lora_dropout, merged_adapters, "
                        "disable_adapters, use_dora, lora_variant, lora_embedding_A, lora_magnitude_vector, "
                        "adapter_layer_names)",
                  "base_layer is the wrapped nn.Linear; lora_A / lora_B map adapter name -> nn.Linear with weights "
                  "[r, in] / [out, r]; scaling maps name -> float; lora_dropout holds an nn.Dropout module where "
                  "dropout is set (found by the training-mode check); merged_adapters is a list and disable_adapters a "
                  "bool; use_dora and lora_variant are dicts by adapter name; adapter_layer_names names the "
                  "ModuleDicts holding the adapter weights",
                  "hetero/adapters/source.py:from_peft_model, base_linear, hetero/adapters/hooks.py:LoraHooks.ensure, "
                  "hetero/adapters/sync.py:adapter_keys, check_model_state, hetero/offload/registry.py:weights_key"):
        assert isinstance(q.base_layer, torch.nn.Linear)
        A, B = q.lora_A["default"], q.lora_B["default"]
        assert isinstance(A, torch.nn.Linear) and isinstance(B, torch.nn.Linear)
        assert A.weight.shape == (4, q.base_layer.in_features) and B.weight.shape == (q.base_layer.out_features, 4)
        assert q.scaling == {"default": 2.0}
        assert isinstance(dropping.lora_dropout["default"], torch.nn.Dropout)
        assert dropping.lora_dropout["default"].p == 0.1
        assert isinstance(q.merged_adapters, list) and q.disable_adapters is False
        assert isinstance(q.use_dora, dict) and isinstance(q.lora_variant, dict) and "default" not in q.lora_variant
        assert "default" not in q.lora_embedding_A and "default" not in q.lora_magnitude_vector
        assert {"lora_A", "lora_B"} <= set(q.adapter_layer_names)
        held = {id(p) for name in q.adapter_layer_names for p in getattr(q, name).parameters()}
        assert {id(A.weight), id(B.weight)} <= held and id(q.base_layer.weight) not in held


def test_peft_lora_forward(peft_lib):
    torch.manual_seed(3)
    x = torch.randn(4, 16, 64)
    for dtype in (torch.float32, torch.bfloat16):
        model = _peft_model(peft_lib, dtype=dtype)
        q = model.get_base_model().model.layers[0].self_attn.q_proj
        A, B, s = q.lora_A["default"].weight, q.lora_B["default"].weight, q.scaling["default"]
        with upstream(PEFT, f"LoraLayer.forward ({dtype})",
                      "a LoRA linear computes base(x) + scaling * (x A^T) B^T with the adapter weights in fp32 (also "
                      "over a bf16 model: peft's autocast_adapter_dtype), the delta added to the base output in fp32 "
                      "and the sum cast back to the output dtype (not the delta cast first)",
                      "hetero/adapters/hooks.py:LoraBatch.apply, _add, hetero/adapters/layout.py"), torch.no_grad():
            assert A.dtype == B.dtype == torch.float32
            xd = x.to(dtype)
            got = q(xd)
            assert got.dtype == dtype
            want = (q.base_layer(xd).float() + (xd.float() @ A.T @ B.T) * s).to(dtype)
            torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 0,
                                       atol=1e-6 if dtype == torch.float32 else 0)


def test_peft_base_name_in_adapter_names(peft_lib, peft_model):
    from hetero.adapters.source import BASE

    x = torch.randint(3, 100, (2, 4))
    with upstream(PEFT, "PeftModel(..., adapter_names=[...]) and its '__base__'",
                  f"in peft's adapter_names, {BASE!r} means the base model for that request (hetero takes the same "
                  "name)", "hetero/adapters/source.py:BASE, hetero/adapters/sync.py:lora_batch"), torch.no_grad():
        mixed = peft_model(x, adapter_names=[BASE, "default"]).logits
        with peft_model.disable_adapter():
            base = peft_model(x).logits
        lora = peft_model(x).logits
        torch.testing.assert_close(mixed[0], base[0])
        torch.testing.assert_close(mixed[1], lora[1])
        assert not torch.allclose(base[1], lora[1])


def test_peft_active_and_disabled(peft_lib):
    model = _peft_model(peft_lib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.add_adapter("second", peft_lib.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    from hetero.adapters.hooks import peft_layers

    layers = peft_layers(model.get_base_model())
    with upstream(PEFT, "PeftModel.active_adapters / set_adapter / disable_adapter() / "
                        "BaseTunerLayer.disable_adapters",
                  "active_adapters is the list of the active adapter names (one after set_adapter); inside "
                  "disable_adapter() every tuner layer's disable_adapters is True, and False again after",
                  "hetero/adapters/sync.py:default_adapter, adapters_disabled"):
        assert list(model.active_adapters) == ["default"]
        model.set_adapter("second")
        assert list(model.active_adapters) == ["second"]
        with model.disable_adapter():
            assert all(m.disable_adapters is True for m in layers)
        assert all(m.disable_adapters is False for m in layers)


def test_peft_merge(peft_lib):
    model = _peft_model(peft_lib)
    from hetero.adapters.hooks import peft_layers

    layers = peft_layers(model.get_base_model())
    with upstream(PEFT, "PeftModel.merge_adapter / unmerge_adapter / BaseTunerLayer.merged_adapters",
                  "merge_adapter() lists the adapter in each layer's merged_adapters (its delta written into the "
                  "base weight), unmerge_adapter() empties them", "hetero/adapters/sync.py:check_model_state"):
        model.merge_adapter()
        assert all(m.merged_adapters == ["default"] for m in layers)
        model.unmerge_adapter()
        assert all(m.merged_adapters == [] for m in layers)


def test_peft_changes_are_visible(peft_lib):
    from hetero.generator import _peft_adapter_keys
    from hetero.adapters.hooks import peft_layers

    model = _peft_model(peft_lib)
    layers = peft_layers(model.get_base_model())
    with upstream(PEFT, "set_peft_model_state_dict / LoraLayer.set_scale / PeftModel.delete_adapter",
                  "loading an adapter's state dict changes each LoRA weight's identity, storage or in-place version "
                  "counter; set_scale changes LoraLayer.scaling; delete_adapter removes the name from lora_A",
                  "hetero/adapters/sync.py:adapter_keys, hetero/generator.py:_sync_peft_adapters"):
        before = _peft_adapter_keys(layers)
        sd = {k: v + 1 for k, v in peft_lib.get_peft_model_state_dict(model).items()}
        peft_lib.set_peft_model_state_dict(model, sd)
        after = _peft_adapter_keys(layers)
        assert set(after) == {"default"} and after["default"] != before["default"]
        layers[0].set_scale("default", 3.0)
        assert layers[0].scaling["default"] == 3.0 * 8 / 4
        assert _peft_adapter_keys(layers)["default"] != after["default"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.add_adapter("gone", peft_lib.LoraConfig(r=2, target_modules=["q_proj"]))
        assert "gone" in _peft_adapter_keys(layers)
        model.delete_adapter("gone")
        assert "gone" not in _peft_adapter_keys(layers) and all("gone" not in m.lora_A for m in layers)


def test_peft_save_pretrained_layout(peft_model, tmp_path):
    from safetensors.torch import load_file

    from hetero.adapters.source import _PREFIX

    peft_model.save_pretrained(tmp_path)
    with upstream(PEFT, "PeftModel.save_pretrained layout",
                  "a LoRA adapter saves adapter_config.json (peft_type 'LORA', r, lora_alpha, use_rslora, "
                  "rank_pattern, alpha_pattern, bias) and adapter_model.safetensors whose keys are "
                  f"'{_PREFIX}<module path>.lora_A.weight' / '.lora_B.weight' (the adapter name left out)",
                  "hetero/adapters/source.py:from_directory, check_config"):
        cfg = json.load(open(tmp_path / "adapter_config.json"))
        assert str(cfg["peft_type"]).split(".")[-1].upper() == "LORA"
        for field in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "bias"):
            assert field in cfg, field
        keys = load_file(os.fspath(tmp_path / "adapter_model.safetensors")).keys()
        pattern = re.compile(rf"^{re.escape(_PREFIX)}(.+)\.lora_([AB])\.weight$")
        base = peft_model.get_base_model()
        assert keys and all(pattern.match(k) for k in keys), sorted(keys)[:4]
        for k in keys:
            base.get_submodule(pattern.match(k).group(1))


def test_peft_scaling_and_patterns(peft_lib, tmp_path):
    from hetero.adapters.source import from_directory, from_peft_model

    variants = {"plain": {}, "rslora": {"use_rslora": True},
                "patterns": {"rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 3}}}
    for label, extra in variants.items():
        model = _peft_model(peft_lib, **extra)
        model.save_pretrained(tmp_path / label)
        base = model.get_base_model()
        with upstream(PEFT, f"LoRA scaling, rank_pattern / alpha_pattern ({label})",
                      "a layer's scaling is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), r and lora_alpha "
                      "taken per module from rank_pattern / alpha_pattern (matched by peft.utils.other.get_pattern_key), "
                      "as hetero recomputes it from adapter_config.json",
                      "hetero/adapters/source.py:from_directory, _pattern"):
            saved = from_directory(label, tmp_path / label, base)
            live = from_peft_model(model, "default", base)
            assert saved.keys() == live.keys()
            for path, (A, B, s) in live.items():
                sA, sB, ss = saved[path]
                assert math.isclose(ss, s) and torch.equal(sA, A) and torch.equal(sB, B), (path, ss, s)
            if label == "patterns":
                assert live["model.layers.0.self_attn.q_proj"][0].shape[0] == 2
                assert live["model.layers.0.self_attn.v_proj"][2] == 3 / 4


def test_peft_get_pattern_key(peft_lib):
    with upstream(PEFT, "peft.utils.other.get_pattern_key(pattern_keys, key_to_match)",
                  "returns the pattern that matches the module path's tail (a suffix after '.', or a regex), else "
                  "the path itself", "hetero/adapters/source.py:_pattern"):
        from peft.utils.other import get_pattern_key

        path = "model.layers.0.self_attn.q_proj"
        assert get_pattern_key(["q_proj"], path) == "q_proj"
        assert get_pattern_key([r"layers\.0\.self_attn\.q_proj"], path) == r"layers\.0\.self_attn\.q_proj"
        assert get_pattern_key(["k_proj"], path) == path


def test_peft_lora_config_fields(peft_lib):
    from hetero.adapters.source import UNSUPPORTED

    known = {"alora_invocation_tokens", "alpha_pattern", "arrow_config", "auto_mapping", "base_model_name_or_path",
             "bias", "corda_config", "ensure_weight_tying", "eva_config", "exclude_modules", "fan_in_fan_out",
             "inference_mode", "init_lora_weights", "kasa_config", "layer_replication", "layers_pattern",
             "layers_to_transform", "loftq_config", "lora_alpha", "lora_bias", "lora_dropout", "lora_ga_config",
             "megatron_config", "megatron_core", "modules_to_save", "monteclora_config", "peft_type", "peft_version",
             "qalora_group_size", "r", "rank_pattern", "revision", "runtime_config", "target_modules",
             "target_parameters", "task_type", "trainable_token_indices", "use_bdlora", "use_dora", "use_qalora",
             "use_rslora", "velora_config"}
    fields = {f.name for f in dataclasses.fields(peft_lib.LoraConfig)}
    with upstream(PEFT, "LoraConfig fields",
                  "every LoraConfig field that changes what a LoRA layer computes is refused by name "
                  "(hetero.adapters.source.UNSUPPORTED, bias) and each of those names is still a field: a field added "
                  f"by a release must be reviewed there (new: {sorted(fields - known)}; gone: "
                  f"{sorted(set(UNSUPPORTED) - fields)})", "hetero/adapters/source.py:check_config, UNSUPPORTED"):
        assert set(UNSUPPORTED) | {"bias", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern"} <= fields
        assert not fields - known
        cfg = vars(peft_lib.LoraConfig(r=4, target_modules=["q_proj"]))       # what check_config reads of a live one
        assert str(cfg["peft_type"]).split(".")[-1].upper() == "LORA" and cfg["bias"] == "none"
        assert fields <= set(cfg)


def test_peft_variants_recorded(peft_lib):
    model = _peft_model(peft_lib, use_dora=True)
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    with upstream(PEFT, "LoraLayer.lora_variant / use_dora",
                  "an adapter using a LoRA variant (DoRA here) is listed in its layers' lora_variant (and use_dora), "
                  "so hetero can refuse it", "hetero/adapters/source.py:from_peft_model"):
        assert "default" in q.lora_variant and q.use_dora.get("default") is True


def test_peft_parameter_names(peft_lib):
    plain = {n for n, _ in build_model("llama")[0].named_parameters()}
    model = _peft_model(peft_lib, modules_to_save=["lm_head"])
    names = [n for n, _ in model.get_base_model().named_parameters()]
    with upstream(PEFT, "parameter names of a peft-wrapped model",
                  "a LoRA layer's base weight is named '<path>.base_layer.weight', its adapter weights contain "
                  "'lora_', and a modules_to_save copy '.modules_to_save.' (beside '.original_module.')",
                  "hetero/offload/saved.py:fingerprint, hetero/offload/registry.py:weights_key"):
        base = {n.replace(".base_layer", "") for n in names
                if "lora_" not in n and ".modules_to_save." not in n and ".original_module." not in n}
        assert base == plain - {"lm_head.weight"}, sorted(base ^ (plain - {"lm_head.weight"}))[:6]
        assert any(".base_layer.weight" in n for n in names) and any("lora_A" in n for n in names)
        assert any(".modules_to_save." in n for n in names)


# ---------------------------------------------------------------- accelerate and torch

def test_accelerate_hooks_survive():
    hooks_mod = pytest.importorskip("accelerate.hooks")
    from hetero.adapters.hooks import LoraHooks

    calls = []

    class Count(hooks_mod.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(1)
            return args, kwargs

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    lin = model[0]
    x = torch.randn(1, 4)
    with upstream(ACC, "accelerate.hooks.add_hook_to_module / remove_hook_from_module",
                  "add_hook_to_module wraps a module by setting an instance attribute `forward`, which hetero keeps "
                  "and puts back when its own hook is removed; remove_hook_from_module then restores the class's",
                  "hetero/adapters/hooks.py:LoraHooks.ensure/remove, _restore"):
        hooks_mod.add_hook_to_module(lin, Count())
        theirs = lin.__dict__.get("forward")
        assert theirs is not None
        hooks = LoraHooks(model)
        hooks.ensure("0", 0)
        assert lin.__dict__["forward"] is not theirs
        lin(x)
        hooks.remove()
        assert lin.__dict__.get("forward") is theirs
        lin(x)
        assert len(calls) == 2
        hooks_mod.remove_hook_from_module(lin)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_torch_onednn_linear():
    with upstream(TORCH, 'torch.ops.mkldnn._linear_pointwise(x, W, b, "none", [], "")',
                  "oneDNN's fp32 linear over a plain weight gives F.linear's result for 2-D and 3-D inputs",
                  "hetero/cpu_linear.py:_FastLinear.forward"):
        if not torch.backends.mkldnn.is_available():
            pytest.skip("this torch has no oneDNN (hetero.cpu_linear uses F.linear)")
        from hetero import cpu_linear
        assert cpu_linear.ONEDNN
        torch.manual_seed(0)
        w, b = torch.randn(40, 24), torch.randn(40)
        for x in (torch.randn(7, 24), torch.randn(2, 5, 24)):
            for bias in (None, b):
                y = torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
                assert y.dtype == torch.float32 and y.is_contiguous()
                torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_torch_internals():
    with upstream(TORCH, "Tensor._version / Tensor.data_ptr / nn.Module._modules",
                  "an in-place write (copy_, load_state_dict) bumps a tensor's _version; data_ptr() is its storage; "
                  "_modules holds a module's children", "hetero/offload/registry.py:weights_key, "
                  "hetero/adapters/sync.py:_version, _storage, "
                  "hetero/adapters/hooks.py:peft_layers"):
        lin = torch.nn.Linear(2, 2)
        v, ptr = lin.weight._version, lin.weight.data_ptr()
        with torch.no_grad():
            lin.weight.copy_(torch.ones(2, 2))
        assert lin.weight._version > v and lin.weight.data_ptr() == ptr
        v = lin.weight._version
        lin.load_state_dict({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)})
        assert lin.weight._version > v
        seq = torch.nn.Sequential(lin)
        assert list(seq._modules.values()) == [lin]
