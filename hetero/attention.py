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

NAME = "hetero"
active_session = ContextVar("hetero_active_session", default=None)


def eager_attention(module, query, key, value, attention_mask, scaling, softcap=None):
    """Plain softmax attention with optional logit soft-capping (Gemma2), as transformers' eager path."""
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
            attention_mask = torch.zeros_like(attention_mask, dtype=w.dtype).masked_fill(~attention_mask, torch.finfo(w.dtype).min)
        w = w + attention_mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


def hetero_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, softcap=None, **kwargs):
    """query [B, Hq, q_len, D]; key/value: what HeteroCache.update returned. -> ([B, q_len, Hq, D], None)"""
    session = active_session.get()
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if session is not None and session.prefilled:
        return session.attend(module.layer_idx, query, sliding_window, scaling, softcap), None
    if softcap:
        out, _ = eager_attention(module, query, key, value, attention_mask, scaling, softcap)
    else:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
    if session is not None and module.layer_idx == session.spec.layers - 1:
        session.finish_prefill()
    return out, None


def register():
    AttentionInterface.register(NAME, hetero_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
