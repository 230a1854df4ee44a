"""What the engine needs to know about a transformers model, checked once at the boundary."""
from dataclasses import dataclass

import torch

from hetero.errors import UnsupportedModelError

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# families whose attention modules tile KV heads (query head h reads KV head h mod Hkv, i.e.
# k.repeat(...) instead of repeat_kv's grouping); handled by permuting the query heads
TILED_KV_MODEL_TYPES = ("jetmoe",)
# families whose prepare_inputs_for_generation drops the cache the first time a sequence passes
# config.original_max_position_embeddings (LongRoPE switches from its short to its long factors,
# and transformers recomputes every key)
CACHE_DROPPING_MODEL_TYPES = ("phi3", "phimoe", "phi4_multimodal")
# families whose configured window applies at decode only (their prefill attends without it)
DECODE_ONLY_WINDOW_MODEL_TYPES = ("moshi",)
# rope types whose rotation of a position does not depend on the sequence's length: a rotary model
# with only these runs past max_position_embeddings as transformers runs it ("dynamic" NTK scaling
# rescales by the longest position of each forward, which a chunk or a context would change)
STATIC_ROPE_TYPES = (None, "default", "linear", "llama3", "yarn", "longrope")
# config fields that mean something this engine cannot run exactly -> what it is
UNSUPPORTED_FIELDS = {
    "kv_lora_rank": "latent (MLA) KV", "q_lora_rank": "latent (MLA) queries",
    "linear_num_key_heads": "linear-attention layers", "global_head_dim": "per-layer head sizes",
    "num_kv_shared_layers": "KV shared across layers",
    "cross_attention_layers": "cross-attention layers",
    "keep_window_size": "dynamic mask attention (learned per-key biases and top-k key selection in the mask)",
}


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_positions: int | None
    sliding: tuple  # per layer: True for sliding-window attention layers
    windows: tuple = ()  # per layer: the sliding window in tokens (0: full attention)
    kv_tiled: bool = False  # query head h reads KV head h mod kv_heads (else h // group)
    one_pass_only: str | None = None  # why multi-token steps over the cache (chunks, contexts) would differ
    drops_cache: bool = False    # CACHE_DROPPING_MODEL_TYPES: its generate would drop hetero's cache
    rope_switch: int | None = None  # LongRoPE (any family): its factors differ below and above this many positions
    position_limit: int | None = None  # positions hetero runs up to (_position_limit), None: no limit


def inspect_model(model):
    """Return the ModelSpec of `model`, or raise UnsupportedModelError naming what is missing."""
    from transformers import GenerationMixin, PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    name = type(model).__name__
    if not isinstance(model, GenerationMixin):
        raise UnsupportedModelError(f"{name} cannot generate (it is not a *ForCausalLM model with GenerationMixin)")
    cfg = model.config.get_text_config()
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; only decoder-only causal LMs are supported")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not route attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so its attention cannot be moved to the CPU workers")
    missing = [a for a in ("num_hidden_layers", "num_attention_heads") if getattr(cfg, a, None) is None]
    if missing:
        raise UnsupportedModelError(f"{name}'s config has no {', '.join(missing)}: it is not a standard attention model")
    for attr, what in UNSUPPORTED_FIELDS.items():
        if _field(cfg, attr):
            raise UnsupportedModelError(f"{name}: config field {attr!r} means {what}, which the engine lacks")
    if getattr(cfg, "is_heterogeneous", False):     # per-layer config overrides
        _check_uniform_attention(cfg, name)
        cfg = cfg.per_layer_config[0]
    layers, q_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
    head_dim = _field(cfg, "head_dim") or cfg.hidden_size // q_heads
    if q_heads % kv_heads:
        raise UnsupportedModelError(f"{name}: {q_heads} query heads are not a multiple of {kv_heads} KV heads")
    kv_tiled, causal = _check_attention_modules(model, name, cfg.model_type, q_heads // kv_heads, head_dim)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope = rope if isinstance(rope, dict) else {}
    ropes = [r for r in rope.values() if isinstance(r, dict)] or [rope]     # per layer type (Gemma3), or one
    max_positions = getattr(cfg, "max_position_embeddings", None)
    original_max = getattr(cfg, "original_max_position_embeddings", None) or \
        next((r["original_max_position_embeddings"] for r in ropes if r.get("original_max_position_embeddings")), None)
    switches = {r.get("original_max_position_embeddings") or original_max for r in ropes
                if r.get("rope_type", r.get("type")) == "longrope"}
    if len(switches) > 1:
        raise UnsupportedModelError(f"{name}: LongRoPE switches at different positions per layer type "
                                    f"{sorted(switches)}; not supported")
    drops_cache = cfg.model_type in CACHE_DROPPING_MODEL_TYPES and original_max is not None
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * layers
    other = sorted(set(layer_types) - ATTENTION_LAYER_TYPES)
    if other:
        raise UnsupportedModelError(f"{name} has layer types {other}; the engine supports only {sorted(ATTENTION_LAYER_TYPES)}")
    window = getattr(cfg, "sliding_window", None) or 0
    if getattr(cfg, "layer_types", None):
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    else:       # no layer types (Mistral, Phi-3, ...): a configured window applies to every layer
        windows = (window,) * layers
    dtype = model.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedModelError(f"{name} is in {dtype}; supported: float32, bfloat16, float16")
    return ModelSpec(model_type=cfg.model_type, layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, max_positions=max_positions,
                     sliding=tuple(t == "sliding_attention" for t in layer_types), windows=windows, kv_tiled=kv_tiled,
                     one_pass_only=_one_pass_only(cfg, causal, windows), drops_cache=drops_cache,
                     rope_switch=next(iter(switches), None), position_limit=_position_limit(model, ropes, max_positions))


def _position_limit(model, ropes, max_positions):
    """The positions a call may reach: none for a rotary model whose rope types are all static
    (STATIC_ROPE_TYPES; transformers runs it past max_position_embeddings, with a reminder), else
    max_position_embeddings: learned or fixed position tables end there (transformers fails with
    an IndexError past it), and a length-dependent rope would rotate a chunk's keys differently."""
    rotary = any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules())
    types = {r.get("rope_type", r.get("type")) for r in ropes}
    return None if rotary and types <= set(STATIC_ROPE_TYPES) else max_positions


def _one_pass_only(cfg, causal, windows):
    """Why a multi-token step over cached KV (a chunked prefill, a context's continuation) cannot
    attend as the model's one pass does, or None."""
    if not causal:
        return f"{cfg.model_type}'s self-attention is bidirectional (an encoder; is_decoder=False)"
    if cfg.model_type in DECODE_ONLY_WINDOW_MODEL_TYPES and any(windows):
        return f"{cfg.model_type} applies its sliding window at decode only (its prefill attends without it)"
    return None


def _field(cfg, attr):
    """cfg.attr, or None; per-layer configs raise on ambiguous global reads, which count as set."""
    try:
        return getattr(cfg, attr, None)
    except Exception:
        return True


def _check_uniform_attention(cfg, name):
    """A heterogeneous config (per-layer overrides) is fine while every layer's attention has one shape."""
    shapes = {i: tuple(getattr(c, a, None) for a in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                     "sliding_window"))
              for i, c in enumerate(cfg.per_layer_config)}
    if len(set(shapes.values())) > 1:
        raise UnsupportedModelError(f"{name}: attention shapes (heads, KV heads, head_dim, window) differ across layers "
                                    f"{sorted(set(shapes.values()), key=str)}; per-layer attention shapes are not supported")


def _check_attention_modules(model, name, model_type, group, head_dim):
    """Every attention layer must have the config's head size and query grouping. Returns (whether
    the KV heads are tiled (TILED_KV_MODEL_TYPES), whether every layer is causal); anything else
    that differs is refused."""
    tiled, causal = False, True
    try:                                    # the language model's attention (not an audio or vision encoder's)
        decoder = {id(m) for m in model.get_decoder().modules()}
    except Exception:
        decoder = None
    for path, mod in model.named_modules():
        if not (type(mod).__name__.endswith("Attention") and hasattr(mod, "layer_idx")):
            continue
        d = getattr(mod, "head_dim", head_dim)
        if d != head_dim or getattr(mod, "v_head_dim", d) != d:
            raise UnsupportedModelError(f"{name}: {path} has head size {d} (values {getattr(mod, 'v_head_dim', d)}) "
                                        f"but the config says {head_dim}; per-layer head sizes are not supported")
        if decoder is None or id(mod) in decoder:
            causal = causal and getattr(mod, "is_causal", True) is not False
        g = getattr(mod, "num_key_value_groups", group)
        if g != group:
            if g == 1 and model_type in TILED_KV_MODEL_TYPES:
                tiled = True
            else:
                raise UnsupportedModelError(f"{name}: {path} groups {g} query heads per KV head but the config "
                                            f"implies {group}; per-layer KV head counts are not supported")
    return tiled, causal
