"""Read peft LoRA adapters (a save_pretrained directory, or a live PeftModel) into plain tensors,
validated against the base model before anything is stored.

An adapter becomes {module path: (A [r, in] f32, B [out, r] f32, scaling)}, module paths
relative to the causal-LM model (e.g. "model.layers.3.self_attn.q_proj").
"""
import json
import math
import os
import re

import torch
from torch import nn

from hetero.errors import AdapterError

BASE = "__base__"      # peft's name for "no adapter" in adapter_names
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_PREFIX = "base_model.model."
PEFT_DEFAULT_R, PEFT_DEFAULT_ALPHA = 8, 8   # peft.LoraConfig's r and lora_alpha where a config leaves them out
# LoraConfig fields that change what a LoRA layer computes; hetero implements plain (rs)LoRA only
UNSUPPORTED = {
    "use_dora": "DoRA", "lora_bias": "a LoRA bias", "use_qalora": "QA-LoRA", "target_parameters": "LoRA on parameters",
    "modules_to_save": "fully trained modules_to_save", "layer_replication": "layer replication",
    "trainable_token_indices": "trainable tokens", "alora_invocation_tokens": "aLoRA", "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA", "use_bdlora": "BD-LoRA", "arrow_config": "Arrow routing",
    "kasa_config": "KaSA", "megatron_config": "Megatron layers", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
}


def check_name(name, existing):
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise AdapterError(f"adapter name must be 1-64 characters of letters, digits, '_', '-', '.', got {name!r}")
    if name == BASE:
        raise AdapterError(f"{BASE!r} is reserved: it means the base model in adapter_names")
    if name in existing:
        raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first or pick another name")


def check_config(name, cfg):
    """cfg: the adapter_config.json dict (or a LoraConfig's __dict__)."""
    peft_type = str(cfg.get("peft_type", "")).split(".")[-1].upper()
    if peft_type != "LORA":
        raise AdapterError(f"adapter {name!r} is a {cfg.get('peft_type')!r} adapter; only LoRA is supported")
    for field, what in UNSUPPORTED.items():
        if cfg.get(field):
            raise AdapterError(f"adapter {name!r} uses {what} ({field}={cfg[field]!r}), which hetero does not support")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r} trains base-layer biases (bias={cfg['bias']!r}), which hetero does not support")


def base_linear(model, path, name):
    """(in, out) of the linear layer at `path` (plain nn.Linear or a peft LoRA layer around one)."""
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        raise AdapterError(f"adapter {name!r} targets {path!r}, which this model does not have "
                           "(an adapter for another base model?)") from None
    base = getattr(mod, "base_layer", mod)
    if not isinstance(base, nn.Linear):
        raise AdapterError(f"adapter {name!r} targets {path!r}, a {type(base).__name__}; "
                           "only LoRA on linear layers is supported")
    return base.in_features, base.out_features


def _peft():
    """peft, or an AdapterError naming the extra to install (it is not a core dependency)."""
    try:
        import peft
        import peft.tuners.lora
        import peft.utils.other
    except ImportError as e:
        raise AdapterError(f"LoRA adapters need peft, which is not installed ({e}): "
                           "pip install 'hetero[lora]' (or pip install peft)") from None
    return peft


def _pattern(patterns, path, default):
    get_pattern_key = _peft().utils.other.get_pattern_key
    key = get_pattern_key(patterns.keys(), path)
    return patterns.get(key, default)


def _checked(name, model, path, A, B, scaling):
    fin, fout = base_linear(model, path, name)
    if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1] or A.shape[1] != fin or B.shape[0] != fout:
        raise AdapterError(f"adapter {name!r}: {path} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}, "
                           f"but the model's layer maps {fin} -> {fout} (an adapter for another base model?)")
    if not math.isfinite(scaling):
        raise AdapterError(f"adapter {name!r}: {path} has a non-finite scaling {scaling}")
    return A.detach().to("cpu", torch.float32).contiguous(), B.detach().to("cpu", torch.float32).contiguous(), float(scaling)


def from_directory(name, path, model):
    """A peft save_pretrained directory -> {module path: (A, B, scaling)}."""
    path = os.fspath(path)
    cfg_file, weights = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    if not os.path.isdir(path):
        raise AdapterError(f"adapter {name!r}: {path!r} is not a directory")
    for f in (cfg_file, weights):
        if not os.path.isfile(f):
            raise AdapterError(f"adapter {name!r}: {f!r} is missing (save the adapter with save_pretrained, safetensors)")
    try:
        with open(cfg_file) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {cfg_file!r}: {e}") from None
    check_config(name, cfg)
    from safetensors.torch import load_file

    try:
        sd = load_file(weights)
    except Exception as e:
        raise AdapterError(f"adapter {name!r}: cannot read {weights!r}: {e}") from None
    pairs, saved_base = {}, {}
    for key, t in sd.items():
        m = re.match(rf"^{re.escape(_PREFIX)}(.+)\.(?:lora_([AB])|base_layer)\.weight$", key)
        if not m:
            raise AdapterError(f"adapter {name!r}: unsupported tensor {key!r} (only lora_A/lora_B weights of linear layers)")
        if m.group(2) is None:
            saved_base[m.group(1)] = t
        else:
            pairs.setdefault(m.group(1), {})[m.group(2)] = t
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {weights!r} holds no LoRA weights")
    for mod, t in saved_base.items():
        _check_saved_base(name, model, mod, t, pairs)
    out = {}
    for mod, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {mod} has lora_{'A' if 'A' in ab else 'B'} but not its pair")
        r = ab["A"].shape[0]
        want_r = _pattern(cfg.get("rank_pattern") or {}, mod, cfg.get("r", PEFT_DEFAULT_R))
        if want_r != r:
            raise AdapterError(f"adapter {name!r}: {mod} has rank {r} but its config says {want_r}")
        alpha = _pattern(cfg.get("alpha_pattern") or {}, mod, cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA))
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out[mod] = _checked(name, model, mod, ab["A"], ab["B"], scaling)
    return out


def _check_saved_base(name, model, path, saved, pairs):
    """A base weight saved beside the adapter (peft's save_embedding_layers, its default for an
    adapter on the LM head): peft would load it into the model. hetero serves every adapter over
    one base model, so it must equal the model's own."""
    if path not in pairs:
        raise AdapterError(f"adapter {name!r}: unsupported tensor {_PREFIX}{path}.base_layer.weight "
                           "(a saved base weight of a layer the adapter does not adapt)")
    base_linear(model, path, name)
    mod = model.get_submodule(path)
    own = getattr(mod, "base_layer", mod).weight.detach()
    if saved.shape != own.shape:
        differs = f"{tuple(saved.shape)}, not this model's {tuple(own.shape)}"
    elif not torch.equal(saved.to(own.dtype), own.cpu()):        # as peft loads it: in the model's dtype
        differs = "with values that differ from this model's"
    else:
        return
    raise AdapterError(f"adapter {name!r} saves its own {path} weight (peft's save_embedding_layers) {differs}: "
                       "peft would replace the model's; hetero serves adapters over one shared base model")


def from_peft_model(peft_model, name, model):
    """Adapter `name` of a live PeftModel (its LoRA layers) -> {module path: (A, B, scaling)}."""
    check_config(name, {k: v for k, v in vars(peft_model.peft_config[name]).items()})
    LoraLayer = _peft().tuners.lora.LoraLayer

    out = {}
    for path, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and name in mod.lora_A:
            if name in getattr(mod, "lora_variant", {}) or mod.use_dora.get(name):
                raise AdapterError(f"adapter {name!r}: {path} uses a LoRA variant (e.g. DoRA), which hetero does not support")
            out[path] = _checked(name, model, path, mod.lora_A[name].weight, mod.lora_B[name].weight, mod.scaling[name])
        elif isinstance(mod, LoraLayer) and (name in getattr(mod, "lora_embedding_A", {})
                                             or name in getattr(mod, "lora_magnitude_vector", {})):
            raise AdapterError(f"adapter {name!r}: {path} is not a plain LoRA linear layer")
    if not out:
        raise AdapterError(f"adapter {name!r} of the PeftModel has no LoRA linear layers")
    return out
