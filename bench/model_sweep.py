"""Which transformers causal-LM families does hetero run exactly? A sweep over every model type.

For each decoder-only model type in the installed transformers' causal-LM mapping, build a tiny
random model from its config (small sizes, few experts, sliding windows smaller than the
prompt + generation so they bite), run HF greedy generate (sdpa, or eager where the model has no
sdpa path) on a left-padded batch, then HeteroGenerator on the same inputs, and classify:

  exact    sequences equal and every score within 1e-4
  refused  HeteroGenerator raised hetero.UnsupportedModelError (its message is kept)
  wrong    different tokens or scores (a silent error: the worst outcome)
  crash    any other exception, or the family's process timed out
  skipped  encoder-decoder, config or tiny model cannot be built offline, or HF itself fails

Each family runs in its own low-priority process with a timeout, so one crash or hang does not
stop the sweep. Also recorded per family: the keyword arguments the model passes to its attention
function (from one HF generate through a recording attention function) and how many times
attention runs per forward. Writes bench/results/model_sweep.json (merged with the file's other
families when --only is given).

With --engine, the same families through hetero.Engine instead (model_sweep_engine.json): each
prompt of the batch is its own request (its real tokens), they run together (chunked prefill of 8
tokens beside decodes, so steps mix both), and each must give HF generate's tokens and scores for
that prompt alone.

    python bench/model_sweep.py [--only llama,gpt_oss] [--timeout 120] [--markdown] [--kwargs] [--report] [--engine]
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import RESULTS, machine, padded_batch, write_json  # noqa: E402

OUT = "model_sweep.json"
OUT_ENGINE = "model_sweep_engine.json"
VOCAB = 160
LENGTHS = (20, 13, 7)          # left-padded prompts
NEW_TOKENS = 16
WINDOW = 8                     # < prompt + new tokens: sliding windows bite in prefill and decode
SCORE_TOL = 1e-4
STATUSES = ("exact", "refused", "wrong", "crash", "skipped")
MARK = "@@SWEEP@@"             # prefix of the child's result line on stdout

# Set on a config only where its default config has the field (attribute_map names count:
# gpt2's n_embd answers to hidden_size), so no family gets a field it would misread.
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    # sliding windows / chunked attention (Qwen2-style configs: layer 0 or 2 slides, the others do not)
    sliding_window=WINDOW, attention_chunk_size=WINDOW, use_sliding_window=True, max_window_layers=2,
    # mixtures of experts: few and small
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_k=2, moe_topk=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
    n_group=1, topk_group=1,
    # partial rotary, latent (MLA) and indexer attention, per-layer embeddings: small and consistent
    rotary_dim=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=32,
    index_n_heads=2, index_head_dim=16, global_head_dim=32, vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16,
)
SMALL_SUB = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_heads=2,
                 num_key_value_heads=2, head_dim=16, depth=1, initializer_range=0.2, image_size=32, patch_size=8,
                 vocab_size=VOCAB, hidden_dim=32, embed_dim=32)
# model_type -> config overrides (None removes a SMALL key), for fields named or constrained otherwise
QSA = dict(n_heads=2, kv_heads=1, head_dim=16, budget=16, compress_ratio=4)     # Qwen4-Exp's sparse indexer
HYBRID = ["linear_attention", "full_attention", "linear_attention"]   # one attention layer among recurrent ones
OVERRIDES = {
    "falcon": {"head_dim": None, "num_kv_heads": 2, "new_decoder_architecture": True},
    "gpt_bigcode": {"num_key_value_heads": None},   # derived from multi_query; setting it contradicts the model
    "hrm_text": {"num_hidden_layers": 1},     # layers per stack; the config multiplies it by its cycles
    # hybrids whose default layer pattern leaves no attention layer among 3
    **{mt: {"layer_types": HYBRID} for mt in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    **{mt: {"text_config.layer_types": HYBRID} for mt in ("qwen3_5", "qwen3_5_moe")},
    "qwen4_exp_text": {"layer_types": HYBRID, **{f"indexer_{k}": v for k, v in QSA.items()}},
    "qwen4_exp": {"text_config.layer_types": HYBRID, **{f"text_config.indexer_{k}": v for k, v in QSA.items()}},
    "bailing_hybrid": {"layer_group_size": 2},
    "kimi_linear": {"linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 16,
                                           "num_heads": 2}},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba"]},
    "zamba2": {"layers_block_type": ["mamba", "hybrid", "mamba"]},
    "mamba2": {"num_heads": 8, "n_groups": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 1], [["global"], 1]], "window_size": WINDOW},
    "zaya": {"num_experts_per_tok": 1},
    "dbrx": {"d_model": 64, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
    "xlnet": {"max_position_embeddings": None, "d_head": 16},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 16]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"]},
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                            "rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0}
                                                for t in ("full_attention", "sliding_attention")}},
    "xlstm": {"v_head_dim": None, "qk_rope_head_dim": None},
    "gemma3n_text": {"num_kv_shared_layers": 1,   # layer 2 reuses layer 0's KV
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
}
# model_type -> why the sweep does not build it
SKIP = {
    "prophetnet": "encoder-decoder",
    "gemma4_assistant": "speculative-decoding drafter: runs on a target model's shared KV states, not alone",
    "gemma4_unified_assistant": "speculative-decoding drafter: runs on a target model's shared KV states, not alone",
    "dots3_note": "per-layer config (per_layer_config by layer index) that this sweep does not shrink",
    "dots3_note_text": "per-layer config (per_layer_config by layer type) that this sweep does not shrink",
}
# model_type -> what a built model needs before it can generate
PREPARE = {"xmod": lambda model: model.set_default_language("en_XX")}


def config_kwargs(model_type):
    """The tiny-config keyword arguments for `model_type`: SMALL filtered by its default config
    (a composite config gets SMALL as its text_config and SMALL_SUB for its other parts, e.g.
    vision towers), then the family's overrides ("text_config.x" keys reach into the text part)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    subs = getattr(default, "sub_configs", None) or {}
    if "text_config" in subs:
        kw = _filtered({k: SMALL[k] for k in ("vocab_size", "pad_token_id", "initializer_range")}, default)
    else:
        kw = _filtered(SMALL, default)
    for name in subs:
        kw[name] = _filtered(SMALL if name == "text_config" else SMALL_SUB, getattr(default, name, None))
    if "kv_lora_rank" in kw and "num_key_value_heads" in kw:   # latent attention: one k/v head per query head
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    for k, v in OVERRIDES.get(model_type, {}).items():
        part, _, name = k.rpartition(".")
        target = kw.setdefault(part, {}) if part else kw
        if v is None:
            target.pop(name, None)
        else:
            target[name] = v
    return kw


def _filtered(values, cfg):
    if cfg is None:
        return {}
    return {k: v for k, v in values.items() if _has_field(cfg, k)}


def _has_field(cfg, name):
    try:
        return hasattr(cfg, name)
    except Exception:
        return False




def build(model_type):
    """-> (model, reference attention implementation, config kwargs); raises Skip."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type in SKIP:
        raise Skip(SKIP[model_type])
    try:
        kw = config_kwargs(model_type)
        cfg = AutoConfig.for_model(model_type, **kw)
    except Exception as e:
        raise Skip(f"config cannot be built: {type(e).__name__}: {_first_line(e)}") from e
    if getattr(cfg, "is_encoder_decoder", False):
        raise Skip("encoder-decoder")
    n = _parameters(cfg)
    if n > 20e6:
        raise Skip(f"cannot be built tiny from {type(cfg).__name__} ({n / 1e6:.0f}M parameters)")
    last = None
    for impl in ("sdpa", "eager"):
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32).eval()
            break
        except Exception as e:   # no sdpa path: "does not support ... sdpa"
            last = e
    else:
        raise Skip(f"model cannot be built: {type(last).__name__}: {_first_line(last)}")
    if model_type in PREPARE:
        PREPARE[model_type](model)
    return model, impl, kw


def _parameters(cfg):
    """Parameter count of the model `cfg` describes, built on the meta device (no memory, no init)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception:
        return 0     # the real build reports the error
    return sum(p.numel() for p in model.parameters())


class Skip(Exception):
    pass


def _first_line(e, limit=300):
    """The message's first line, or its first two when the first only introduces the second."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [""]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return text[:limit]


def hf_generate(model, ids, mask, max_new_tokens=NEW_TOKENS):
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True)


def compare(ref, out):
    """-> (exact?, detail)"""
    import torch

    if ref.sequences.shape != out.sequences.shape or not torch.equal(ref.sequences, out.sequences):
        if ref.sequences.shape == out.sequences.shape:
            diff = (ref.sequences != out.sequences).nonzero()
            b, t = diff[0].tolist()
            return False, (f"tokens differ: {len(diff)} positions, first request {b} position {t} "
                           f"(new token {t - ref.sequences.shape[1] + len(ref.scores)})")
        return False, f"sequences shape {tuple(out.sequences.shape)} vs HF {tuple(ref.sequences.shape)}"
    errs = [float((a - b).abs().max()) for a, b in zip(ref.scores, out.scores)]
    bad = [i for i, e in enumerate(errs) if e > SCORE_TOL]
    if bad:
        return False, f"same tokens but scores differ by {max(errs):.2e} (first at new token {bad[0]})"
    return True, f"max score error {max(errs):.1e}"


def probe_attention(model, ids, mask, impl):
    """Keyword arguments the model passes to its attention function (names -> value summaries),
    and attention calls per forward, from a 2-token HF generate through a recording function."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    calls = []

    def record(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append({"layer": getattr(module, "layer_idx", None), "q": tuple(query.shape), "k": tuple(key.shape),
                      "kwargs": {k: _summary(v) for k, v in kwargs.items()}, "extra_args": len(args)})
        kwargs.pop("softcap", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register("sweep_probe", record)
    AttentionMaskInterface.register("sweep_probe", sdpa_mask if impl == "sdpa" else eager_mask)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *a: forwards.append(len(calls)))
    model.set_attn_implementation("sweep_probe")
    try:
        hf_generate(model, ids, mask, max_new_tokens=2)
    finally:
        model.set_attn_implementation(impl)
        hook.remove()
    kwargs = {}
    for c in calls:
        for k, v in c["kwargs"].items():
            kwargs.setdefault(k, set()).add(v)
    bounds = forwards + [len(calls)]
    per_forward = [bounds[i + 1] - bounds[i] for i in range(len(forwards))]
    return {"kwargs": {k: sorted(v) for k, v in sorted(kwargs.items())}, "calls_per_forward": per_forward,
            "layer_idx": sorted({c["layer"] for c in calls}, key=str),
            "q_k_shapes_prefill": sorted({f"q{c['q']} k{c['k']}" for c in calls[:bounds[1] if forwards else 0]}),
            "extra_positional": max((c["extra_args"] for c in calls), default=0)}


def _summary(v):
    import torch

    if isinstance(v, torch.Tensor):
        return f"{type(v).__name__}{list(v.shape)}"
    if isinstance(v, (bool, int, float, str)) or v is None:
        return f"{type(v).__name__}={v!r}"
    return type(v).__name__


def run_one(model_type, lengths=LENGTHS):
    """Everything for one family, in this process -> result dict."""
    warnings.filterwarnings("ignore")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    from hetero import HeteroConfig, HeteroGenerator

    result = {"status": None, "detail": ""}
    try:
        model, impl, kw = build(model_type)
    except Skip as e:
        return {"status": "skipped", "detail": str(e)}
    result.update(reference=impl, model_class=type(model).__name__, config=_jsonable(kw))
    cfg = model.config.get_text_config()
    result["config_fields"] = {k: _jsonable(getattr(cfg, k)) for k in (
        "sliding_window", "layer_types", "use_sliding_window", "max_window_layers", "attention_chunk_size")
        if getattr(cfg, k, None) is not None}
    ids, mask = padded_batch(lengths, VOCAB)
    try:
        with torch.no_grad():
            ref = hf_generate(model, ids, mask)
    except Exception as e:
        return {**result, "status": "skipped",
                "detail": f"HF generate fails on the tiny model: {type(e).__name__}: {_first_line(e)}"}
    try:
        result["attention"] = probe_attention(model, ids, mask, impl)
    except Exception as e:
        result["attention"] = {"error": f"{type(e).__name__}: {_first_line(e)}"}
    try:
        with HeteroGenerator(model, cpu_workers=1, config=HeteroConfig(profile="off")) as gen:
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                               return_dict_in_generate=True, output_scores=True)
    except Exception as e:
        return {**result, **_failed(e)}
    ok, detail = compare(ref, out)
    return {**result, "status": "exact" if ok else "wrong", "detail": detail}


def run_engine_one(model_type, lengths=LENGTHS):
    """One family through hetero.Engine: each prompt alone in HF against the engine's requests."""
    warnings.filterwarnings("ignore")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    from hetero import Engine, EngineConfig

    try:
        model, impl, kw = build(model_type)
    except Skip as e:
        return {"status": "skipped", "detail": str(e)}
    result = {"status": None, "detail": "", "reference": impl, "model_class": type(model).__name__}
    ids, mask = padded_batch(lengths, VOCAB)
    rows = [ids[b][mask[b].bool()][None] for b in range(len(lengths))]
    try:
        with torch.no_grad():
            refs = [hf_generate(model, r, torch.ones_like(r)) for r in rows]
    except Exception as e:
        return {**result, "status": "skipped",
                "detail": f"HF generate fails on the tiny model: {type(e).__name__}: {_first_line(e)}"}
    try:
        cfg = EngineConfig(background=False, cpu_workers=1, kv_blocks=64, long_prefill_chunk=8,
                           max_num_batched_tokens=16, max_model_len=min(256, max(lengths) + NEW_TOKENS + 32))
        with Engine(model, cfg) as eng:
            streams = [eng.add_request(r, NEW_TOKENS, do_sample=False, pad_token_id=0, output_scores=True)
                       for r in rows]
            while not all(s.finished for s in streams):
                eng.step()
    except Exception as e:
        return {**result, **_failed(e)}
    errs = []
    for b, (ref, s) in enumerate(zip(refs, streams)):
        want = ref.sequences[0, rows[b].shape[1]:].tolist()
        if s.token_ids != want:
            t = next((i for i, (x, y) in enumerate(zip(s.token_ids, want)) if x != y), min(len(s.token_ids), len(want)))
            return {**result, "status": "wrong", "detail": f"tokens differ: request {b}, first at new token {t}"}
        errs += [float((a[0] - g).abs().max()) for a, g in zip(ref.scores, s.scores)]
    if max(errs) > SCORE_TOL:
        return {**result, "status": "wrong", "detail": f"same tokens but scores differ by {max(errs):.2e}"}
    return {**result, "status": "exact", "detail": f"max score error {max(errs):.1e}"}


def _failed(e):
    """A hetero call's exception as a result: refused (UnsupportedModelError, its message) or crash."""
    from hetero import UnsupportedModelError

    if isinstance(e, UnsupportedModelError):
        return {"status": "refused", "detail": str(e)}
    tb = traceback.extract_tb(e.__traceback__)[-1]
    return {"status": "crash", "detail": f"{type(e).__name__}: {_first_line(e)}",
            "where": f"{_short_path(tb.filename)}:{tb.lineno}"}


def _short_path(path):
    """site-packages/x/y.py -> x/y.py; this repository's files relative to its root."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _jsonable(v):
    return json.loads(json.dumps(v, default=str))


def run_isolated(model_type, timeout, engine=False):
    """run_one (run_engine_one) in a nice'd child process (its own process group, killed whole on timeout)."""
    cmd = ["nice", "-n", "10", sys.executable, os.path.abspath(__file__), "--child", model_type] + \
        (["--engine"] if engine else [])
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        return {"status": "crash", "detail": f"timed out after {timeout} s",
                "seconds": round(time.perf_counter() - t, 1)}
    lines = [line for line in out.splitlines() if line.startswith(MARK)]
    if lines:
        result = json.loads(lines[-1][len(MARK):])
    else:
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        result = {"status": "crash", "detail": f"process exited with {p.returncode}: {tail[:300]}"}
    result["seconds"] = round(time.perf_counter() - t, 1)
    return result


def families():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def full_table(results):
    lines = ["| model type | status | detail |", "|---|---|---|"]
    for mt, r in sorted(results.items(), key=lambda kv: (STATUSES.index(kv[1]["status"]), kv[0])):
        lines.append(f"| {mt} | {r['status']} | {r['detail'].replace('|', '/')} |")
    return "\n".join(lines)


def compact_table(results):
    lines = ["| status | families | model types |", "|---|---|---|"]
    for s in STATUSES:
        names = sorted(mt for mt, r in results.items() if r["status"] == s)
        if names:
            lines.append(f"| {s} | {len(names)} | {', '.join(names)} |")
    return "\n".join(lines)


def kwargs_table(results):
    """Keyword arguments passed to the attention function: name, value kinds, families by status."""
    seen = {}
    for mt, r in results.items():
        for name, values in (r.get("attention") or {}).get("kwargs", {}).items():
            entry = seen.setdefault(name, ({}, set()))
            entry[0].setdefault(r["status"], []).append(mt)
            entry[1].update(values)
    lines = ["| kwarg | values seen | families by status |", "|---|---|---|"]
    for name, (by_status, values) in sorted(seen.items(), key=lambda kv: -sum(map(len, kv[1][0].values()))):
        fams = "; ".join(f"{s} {len(m)}" + (f": {', '.join(sorted(m))}" if len(m) <= 12 else "")
                         for s, m in sorted(by_status.items(), key=lambda kv: STATUSES.index(kv[0])))
        lines.append(f"| {name} | {', '.join(sorted(values)[:4])} | {fams} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types (default: every causal-LM model type)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per family")
    ap.add_argument("--markdown", action="store_true", help="print a compact table grouped by status (README)")
    ap.add_argument("--kwargs", action="store_true", help="also print the attention kwargs each family passes")
    ap.add_argument("--report", action="store_true", help="print the tables from the saved JSON; run nothing")
    ap.add_argument("--engine", action="store_true", help="through hetero.Engine (model_sweep_engine.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = run_engine_one if args.engine else run_one
        print(MARK + json.dumps(fn(args.child), default=str), flush=True)
        return
    out = OUT_ENGINE if args.engine else OUT
    path = os.path.join(RESULTS, out)
    saved = json.load(open(path)) if os.path.exists(path) else {"families": {}}
    if not args.report:
        names = args.only.split(",") if args.only else families()
        unknown = sorted(set(names) - set(families()))
        if unknown:
            ap.error(f"not causal-LM model types of this transformers: {unknown}")
        results = saved["families"] if args.only else {}
        for i, mt in enumerate(names):
            r = run_isolated(mt, args.timeout, args.engine)
            results[mt] = r
            print(f"[{i + 1}/{len(names)}] {mt}: {r['status']} ({r['seconds']} s) {r['detail'][:150]}", flush=True)
        counts = {s: sum(r["status"] == s for r in results.values()) for s in STATUSES}
        saved = {"machine": machine(), "prompt_lengths": LENGTHS, "new_tokens": NEW_TOKENS, "window": WINDOW,
                 "score_tolerance": SCORE_TOL, "counts": counts, "families": dict(sorted(results.items()))}
        print("wrote", write_json(out, saved))
    results = saved["families"]
    print(compact_table(results) if args.markdown else full_table(results))
    if args.kwargs:
        print("\n" + kwargs_table(results))
    print("\n" + ", ".join(f"{s}: {sum(r['status'] == s for r in results.values())}" for s in STATUSES))


if __name__ == "__main__":
    main()
