"""What the engine needs to know about a transformers model, checked once at the boundary."""
from dataclasses import dataclass

import torch

from hetero.errors import UnsupportedModelError

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")


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
    layers, q_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
    if q_heads % kv_heads:
        raise UnsupportedModelError(f"{name}: {q_heads} query heads are not a multiple of {kv_heads} KV heads")
    for attr in ("kv_lora_rank", "q_lora_rank", "linear_num_key_heads", "global_head_dim"):
        if getattr(cfg, attr, None):
            raise UnsupportedModelError(f"{name}: config field {attr!r} means per-layer or latent KV shapes, which the engine lacks")
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
                     dtype=dtype, max_positions=getattr(cfg, "max_position_embeddings", None),
                     sliding=tuple(t == "sliding_attention" for t in layer_types), windows=windows)
