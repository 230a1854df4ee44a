"""LoRA serving: per-token decode latency with adapters, registered-adapter count, cold start.

One run, one model (the Llama-shaped model of decode_cpu.py), random KV of length L:
  (a) per-token decode latency at L: batch 1 with no adapter / one rank-16 adapter on q,k,v,o;
      batch 4 with no adapter / four adapters of ranks 8, 16, 32, 64 (mixed in one batch);
  (b) decode throughput (batch 1, the rank-16 adapter) with 1, 10, 100, 1000 adapters registered
      (S-LoRA's claim: no drop once adapters live in host memory);
  (c) time to first token (prefill of a P-token prompt + one token) with an adapter whose
      device copy is held back (cold: its prefill deltas run on the CPU workers) against the
      same adapter already on the device (warm).
Writes bench/results/lora.json.

    python bench/lora.py [--context 16384] [--steps 12] [--registered 1 10 100 1000]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from peft import LoraConfig, get_peft_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, positive, write_json  # noqa: E402
from bench.decode_cpu import build, filled_decode, random_kv  # noqa: E402
from hetero import HeteroGenerator  # noqa: E402
from hetero.generator import _active as lora_active  # noqa: E402

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = {"one_worker_latency_overhead": 0.10, "registered_1000_vs_10": 0.95, "cold_ttft_vs_warm": 1.05}


def save_adapter(model, rank, path, seed):
    torch.manual_seed(seed)
    pm = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=QKVO, init_lora_weights=False))
    pm.save_pretrained(path)
    pm.unload()                                      # the base model gets its plain modules back


def decode_steps(gen, keys, values, L, steps, names):
    """Per-step seconds of `steps` greedy single-token forwards of a batch of len(names) requests,
    request b on adapter names[b] (None: base model)."""
    with lora_active(gen._lora_batch(names, len(names))):
        times, _ = filled_decode(gen, keys, values, L, steps, len(names))
    return times[2:]                                  # the first steps warm up plans and caches


def ttft(gen, ids, name):
    t = time.perf_counter()
    gen.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0, adapter_names=[name])
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=positive, default=16384)
    ap.add_argument("--steps", type=positive, default=12)
    ap.add_argument("--rounds", type=positive, default=3, help="interleaved rounds per latency figure (median)")
    ap.add_argument("--registered", type=positive, nargs="+", default=[1, 10, 100, 1000])
    ap.add_argument("--prompt", type=positive, default=1024, help="prompt tokens for time to first token")
    ap.add_argument("--workers", type=positive, default=None)
    ap.add_argument("--out", default="lora.json")
    args = ap.parse_args()
    model = build("bench", torch.float32)          # decode_cpu's Llama shape: 4 layers, hidden 1024, GQA 16/4
    cfg = model.config
    L = args.context
    keys, values = random_kv(cfg, L, torch.float32)
    tmp = tempfile.mkdtemp(prefix="hetero-lora-bench-")
    ranks = {"r16": 16, "r8": 8, "r32": 32, "r64": 64}
    for k, (name, r) in enumerate(ranks.items()):
        save_adapter(model, r, os.path.join(tmp, name), seed=k)
    result = {"context": L, "steps": args.steps, "model": cfg.to_dict(), "targets": TARGETS}
    with HeteroGenerator(model, cpu_workers=args.workers) as gen:
        for name in ranks:
            gen.load_adapter(name, os.path.join(tmp, name))
        for name in ranks:
            gen._store.adapters[name].ready.wait(30)
        # (a) latency, interleaved rounds so drift hits every configuration alike
        configs = {"b1_base": [None], "b1_r16_qkvo": ["r16"],
                   "b4_base": [None] * 4, "b4_mixed_r8_r64": ["r8", "r16", "r32", "r64"]}
        lat = {c: [] for c in configs}
        for _ in range(args.rounds):
            for c, names in configs.items():
                lat[c].append(statistics.median(decode_steps(gen, keys, values, L, args.steps, names)))
        lat_ms = {c: statistics.median(v) * 1e3 for c, v in lat.items()}
        result["latency_ms"] = lat_ms
        result["overhead"] = {"b1_r16_qkvo": lat_ms["b1_r16_qkvo"] / lat_ms["b1_base"] - 1,
                              "b4_mixed_r8_r64": lat_ms["b4_mixed_r8_r64"] / lat_ms["b4_base"] - 1}
        print(f"decode at {L}: " + ", ".join(f"{c} {v:.2f} ms" for c, v in lat_ms.items()))
        # (b) registered adapters against decode throughput (batch 1, rank-16 adapter)
        for name in ("r8", "r32", "r64"):
            gen.unload_adapter(name)
        reg = {}
        n_extra = 0
        for n in sorted(args.registered):
            while len(gen.adapters) < n:
                gen.load_adapter(f"extra{n_extra}", os.path.join(tmp, "r16"))
                n_extra += 1
            t = [statistics.median(decode_steps(gen, keys, values, L, args.steps, ["r16"])) for _ in range(args.rounds)]
            reg[n] = {"registered": len(gen.adapters), "step_ms": statistics.median(t) * 1e3,
                      "tokens_per_s": 1 / statistics.median(t), "shm_gb": gen._store.nbytes / 1e9}
            print(f"{len(gen.adapters):5d} adapters registered ({reg[n]['shm_gb']:.2f} GB shared): "
                  f"{reg[n]['tokens_per_s']:.1f} tokens/s")
        result["registered"] = reg
        for k in range(n_extra):
            gen.unload_adapter(f"extra{k}")
        # (c) time to first token, cold vs warm
        ids = torch.randint(3, cfg.vocab_size, (1, args.prompt))
        ttft(gen, ids, "r16")                                  # warm-up of the prefill shapes
        warm, cold = [], []
        for i in range(args.rounds):
            warm.append(ttft(gen, ids, "r16"))
            gen._store.copy_gate.clear()                       # the cold adapter's device copy waits
            gen.load_adapter(f"cold{i}", os.path.join(tmp, "r16"))
            assert not gen.adapter_on_device(f"cold{i}")
            cold.append(ttft(gen, ids, f"cold{i}"))
            gen._store.copy_gate.set()
            gen.unload_adapter(f"cold{i}")
        result["ttft_ms"] = {"warm": statistics.median(warm) * 1e3, "cold": statistics.median(cold) * 1e3,
                             "prompt": args.prompt}
        result["cpu_workers"] = gen.cpu_workers
    t = result["ttft_ms"]
    print(f"TTFT ({args.prompt}-token prompt): warm {t['warm']:.1f} ms, cold {t['cold']:.1f} ms")
    lo = 10 if 10 in reg else min(reg)
    reg_lo, reg_hi = reg[lo], reg[max(reg)]
    checks = {
        "rank-16 q/k/v/o per-token overhead at %dK" % (L // 1024):
            (result["overhead"]["b1_r16_qkvo"], "<=", TARGETS["one_worker_latency_overhead"]),
        "%d registered vs %d: throughput ratio" % (max(reg), lo):
            (reg_hi["tokens_per_s"] / reg_lo["tokens_per_s"], ">=", TARGETS["registered_1000_vs_10"]),
        "cold / warm time to first token": (t["cold"] / t["warm"], "<=", TARGETS["cold_ttft_vs_warm"]),
    }
    result["summary"] = {}
    for k, (v, op, tgt) in checks.items():
        met = v <= tgt if op == "<=" else v >= tgt
        result["summary"][k] = {"value": v, "target": f"{op} {tgt}", "met": met}
        print(f"  {'MET ' if met else 'MISS'} {k}: {v:.3f} (target {op} {tgt})")
    result["machine"] = machine()
    write_json(args.out, result)


if __name__ == "__main__":
    main()
