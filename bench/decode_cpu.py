"""Per-token decode latency on the CPU at long context: hetero vs HF generate's DynamicCache.

Both systems get the same random KV of length L (decode cost does not depend on
what the KV holds), the same Llama-shaped model and the same total cores, and
run the same greedy loop of single-token forwards. Writes bench/results/decode_cpu.json.

    python bench/decode_cpu.py [--contexts 4096 16384 32768] [--steps 16]
"""
import argparse
import os
import statistics
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, stream_read_gbps, write_json  # noqa: E402
from hetero import HeteroConfig, HeteroGenerator  # noqa: E402


def build(dtype, kv_heads):
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=kv_heads, max_position_embeddings=65536)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval(), cfg


def random_kv(cfg, L, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, L, D)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def decode_loop(model, cache, L, steps, batch=1):
    """Greedy single-token forwards of `batch` requests from position L; returns per-step seconds."""
    tok = torch.full((batch, 1), 5)
    times = []
    with torch.inference_mode():
        for i in range(steps):
            t = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, position_ids=torch.full((batch, 1), L + i), use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
    return times


def run_hf(model, keys, values, L, steps):
    model.set_attn_implementation("sdpa")
    cache = DynamicCache()
    for i in range(keys.shape[0]):
        cache.update(keys[i].clone(), values[i].clone(), i)
    return decode_loop(model, cache, L, steps)


def run_hetero(gen, keys, values, L, steps, batch=1):
    """Decode `batch` requests whose caches all hold keys/values (length L) through hetero."""
    with gen.kv_context(pads=[0] * batch, real_lens=[L] * batch, cap=L + steps) as cache:
        for layer in range(keys.shape[0]):
            for b in range(batch):
                cache.session.write_rows(layer, b, keys[layer, 0], values[layer, 0])
        cache.session.finish_prefill()
        for layer in cache.layers:
            layer.seen = L
        return decode_loop(gen.model, cache, L, steps, batch)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="total cores for each system")
    ap.add_argument("--kv-heads", type=int, default=4, help="16 = MHA (Llama-2-like), 4 = GQA (Llama-3-like)")
    ap.add_argument("--workers", type=int, default=None, help="hetero CPU workers (default: cores - 1)")
    ap.add_argument("--threads", type=int, default=None, help="hetero parent torch threads (default: cores)")
    ap.add_argument("--out", default="decode_cpu.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model, cfg = build(dtype, args.kv_heads)
    cores = args.cores
    # HF: torch uses all the cores. hetero: workers do attention while the parent's torch threads wait, and
    # the parent's torch threads do the dense layers while the workers idle: the phases take turns on the cores.
    workers = args.workers or max(1, cores - 1)
    threads = args.threads or cores
    usable = sorted(os.sched_getaffinity(0))[:cores]
    gen = HeteroGenerator(model, config=HeteroConfig(cpu_workers=workers, worker_cores=tuple(usable[1:] or usable)))
    bw1 = stream_read_gbps()
    rows = []
    for L in args.contexts:
        keys, values = random_kv(cfg, L, dtype)
        kv_bytes = keys.numel() * keys.element_size() * 2
        torch.set_num_threads(cores)
        hf = run_hf(model, keys, values, L, args.steps)[2:]
        torch.set_num_threads(threads)
        het = run_hetero(gen, keys, values, L, args.steps)[2:]
        torch.set_num_threads(cores)
        h, m = statistics.median(hf), statistics.median(het)
        row = {"context": L, "kv_bytes_per_token": kv_bytes, "hf_ms": h * 1e3, "hetero_ms": m * 1e3, "speedup": h / m,
               "hetero_kv_gbps": kv_bytes / m / 1e9, "hf_kv_gbps": kv_bytes / h / 1e9,
               "hf_raw_s": hf, "hetero_raw_s": het}
        rows.append(row)
        print(f"L={L:6d}  HF {h * 1e3:8.2f} ms/token   hetero {m * 1e3:8.2f} ms/token   speedup {h / m:5.2f}x   "
              f"hetero KV read {row['hetero_kv_gbps']:.1f} GB/s (1-core stream bound {bw1:.1f} GB/s)")
    gen.close()
    path = write_json(args.out, {
        "bench": "decode_cpu", "machine": machine(), "dtype": args.dtype, "cores": cores, "hetero_workers": workers,
        "hetero_torch_threads": threads, "model": cfg.to_dict(), "steps": args.steps,
        "stream_read_gbps_1core": bw1, "results": rows,
        "note": "per-token latency = one full-model single-token forward (4 layers); KV GB/s = KV bytes / latency",
    })
    print("wrote", path)


if __name__ == "__main__":
    main()
