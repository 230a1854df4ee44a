"""The attention function and mask function registered with transformers as "hetero".

Inside `HeteroGenerator.generate` a KVSession is active (a ContextVar): prefill
runs the model's ordinary attention on its device (sdpa, or eager when the
model soft-caps logits) and the cache offloads its KV; every later forward
sends q to the CPU workers. Outside generate, the function behaves like sdpa/eager.
"""
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hetero.errors import UnsupportedModelError

NAME = "hetero"
active_session = ContextVar("hetero_active_session", default=None)


# Keywords models pass to the attention function that do not change its result here; any other
# keyword raises (UnsupportedModelError) rather than being silently ignored.
NEUTRAL_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "is_causal", "output_router_logits",
                            "logits_to_keep",
                            "tokenizer"})         # generate's (stop_strings), forwarded with the model kwargs


def eager_attention(module, query, key, value, attention_mask, scaling, softcap=None, sinks=None):
    """Plain softmax attention with optional logit soft-capping (Gemma2) and attention sinks
    (gpt_oss: a logit per head that joins the softmax and is dropped), as transformers' eager paths."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)      # [B, Hq, S, D]
    value = value.repeat_interleave(groups, dim=1)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    q_len, kv_len = w.shape[-2:]
    if attention_mask is None and q_len > 1:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=w.device).tril(kv_len - q_len)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=w.dtype).masked_fill(
                ~attention_mask, torch.finfo(w.dtype).min)
        w = w + attention_mask
    if sinks is not None:       # [B, Hq, q, kv] -> [B, Hq, q, kv + 1], the sink last
        w = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(w.shape[0], -1, q_len, 1).to(w.dtype)], dim=-1)
        w = w - w.amax(-1, keepdim=True)
        w = torch.softmax(w, dim=-1, dtype=w.dtype)[..., :-1].to(query.dtype)
    else:
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


# keyword -> the only value it may have here (anything else changes the result)
HARMLESS_ONLY_AS = {"output_attentions": False, "encoder_hidden_states": None, "block_indices": None}


def _check_kwargs(module, dropout, kwargs):
    """Refuse any keyword the attention function does not implement, rather than ignore it."""
    where = type(module).__name__
    unknown = sorted(k for k in kwargs if k not in NEUTRAL_KWARGS and k not in HARMLESS_ONLY_AS)
    if unknown:
        raise UnsupportedModelError(f"{where} passes attention keyword(s) {unknown}, which hetero does not "
                                    "implement; refusing rather than ignoring them")
    for k, allowed in HARMLESS_ONLY_AS.items():
        if k in kwargs and kwargs[k] is not allowed and kwargs[k] != allowed:
            raise UnsupportedModelError(f"{where} passes attention keyword {k}={kwargs[k]!r}; hetero supports "
                                        f"only {allowed!r}")
    if dropout:
        raise UnsupportedModelError(f"{where} asks for attention dropout {dropout} (training mode?); call model.eval()")
    if kwargs.get("is_causal") is False:
        raise UnsupportedModelError(f"{where} asks for non-causal attention")


def _decode(session, module, query, window, scaling, softcap, sinks):
    """One decode step of `module`'s layer on the CPU workers: query [B, Hq, T, D] -> [B, T, Hq, D]."""
    spec, layer = session.spec, module.layer_idx
    configured = spec.windows[layer] if spec.windows else 0
    if window and configured and window != configured:
        raise UnsupportedModelError(f"layer {layer} attends with a window of {window} tokens but the config "
                                    f"gives {configured}")
    window = window or configured     # a window some models apply only through the mask (Qwen2-MoE, ...)
    if not spec.kv_tiled:
        return session.attend(layer, query, window, scaling, softcap, sinks=sinks)
    # tiled KV heads: query head h = g*Hkv + k reads KV head k; regroup to k*G + g and back
    B, Hq, T, D = query.shape
    Hkv = spec.kv_heads
    G = Hq // Hkv
    q = query.view(B, G, Hkv, T, D).transpose(1, 2).reshape(B, Hq, T, D)
    s = None if sinks is None else sinks.view(G, Hkv).t().reshape(Hq)
    out = session.attend(layer, q, window, scaling, softcap, sinks=s)          # [B, T, Hq, D], grouped
    return out.view(B, T, Hkv, G, D).transpose(2, 3).reshape(B, T, Hq, D)


def hetero_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """query [B, Hq, q_len, D]; key/value: what HeteroCache.update returned. -> ([B, q_len, Hq, D], None)"""
    session = active_session.get()
    _check_kwargs(module, dropout, kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if session is not None:
        session.take_update(getattr(module, "layer_idx", None), module)
        if session.prefilled:
            if query.shape[2] > 1 and getattr(module, "is_causal", True) is False:
                raise UnsupportedModelError(f"{type(module).__name__} attends bidirectionally; hetero's cached "
                                            "multi-token steps are causal")
            out = _decode(session, module, query, sliding_window, scaling, softcap, s_aux)   # [B, T, Hq, D]
            return out.contiguous(), None          # as sdpa's: a model may .view() it
    if softcap or s_aux is not None:
        out, _ = eager_attention(module, query, key, value, attention_mask, scaling, softcap, s_aux)
    else:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
    if session is not None and module.layer_idx == session.spec.layers - 1:
        session.finish_prefill()
    return out, None


def hetero_mask(*args, **kwargs):
    """The model's attention mask for a forward through hetero_attention: none where the session
    attends itself (decode steps and continuations: _decode and hetero.prefetch know each row's
    position), which saves a [B, T, S] mask per forward and, on a GPU, transformers' per-token
    host synchronization (its padding check); else sdpa's, for the prefill's own attention."""
    session = active_session.get()
    if session is not None and session.prefilled:
        return None
    return sdpa_mask(*args, **kwargs)


def register():
    AttentionInterface.register(NAME, hetero_attention)
    AttentionMaskInterface.register(NAME, hetero_mask)
