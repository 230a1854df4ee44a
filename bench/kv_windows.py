"""KV memory of a model that mixes sliding-window and full layers, through the engine.

A Gemma-3-shaped model (transformers' Gemma3 text classes built from a config: 6 layers, 5
windowed to 1 full as Gemma 3 has them, the window --window keys; small widths so the CPU runs
it quickly, since the block counts do not depend on them) serves --requests requests of
--prompt tokens (+ --new) at once through hetero.Engine. Each step the blocks the requests hold
in the two pools are counted (hetero.engine.kv_hybrid: the full layers' pool keeps every block,
the windowed layers' a ring per request); the KV bytes held at the peak are compared with what
every layer keeping every block needs (the peak of the full pool's blocks times every layer: a
pool whose block tables serve every layer, as before the windowed layers had a pool of their own).
Also the pools' sizes as allocated (EngineConfig kv_memory large: the window pool is sized for the
running requests' rings, twice over). Pure bookkeeping on a real engine: no timing.

    python bench/kv_windows.py [--requests 8] [--prompt 4096] [--new 16] [--window 512]
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import machine, positive, write_json  # noqa: E402


def model_for(window: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    types = ["sliding_attention"] * 5 + ["full_attention"]
    cfg = AutoConfig.for_model("gemma3_text", vocab_size=512, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                               sliding_window=window, layer_types=types, max_position_embeddings=1 << 17,
                               query_pre_attn_scalar=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive, default=8)
    ap.add_argument("--prompt", type=positive, default=4096)
    ap.add_argument("--new", type=positive, default=16)
    ap.add_argument("--window", type=positive, default=512)
    ap.add_argument("--out", default="kv_windows.json")
    args = ap.parse_args()
    from hetero import Engine, EngineConfig
    from hetero.engine.kv_hybrid import HybridKVCacheManager
    from hetero.offload.arena import SessionLayout
    from hetero.offload.session import STORAGE_CODES

    model = model_for(args.window)
    cfg = EngineConfig(background=False, cpu_workers=1, kv_memory=4 << 30, max_num_seqs=args.requests,
                       max_model_len=args.prompt + args.new, long_prefill_chunk=512, max_num_batched_tokens=4096)
    g = torch.Generator().manual_seed(1)
    with Engine(model, cfg) as eng:
        kv = eng.kv_manager
        assert isinstance(kv, HybridKVCacheManager)
        s = eng.spec
        layer_block = SessionLayout(1, s.q_heads, s.kv_heads, s.head_dim, 32, 1, STORAGE_CODES[s.dtype],
                                    blocks=1, maxblk=1).kv_bytes
        ringed = sum(1 for w in s.windows if w)
        streams = [eng.add_request(torch.randint(3, 512, (args.prompt,), generator=g).tolist(), args.new,
                                   ignore_eos=True) for _ in range(args.requests)]
        peak_full = peak_window = peak_bytes = 0
        while not all(st.finished for st in streams):
            eng.step()
            full, window = kv.full.num_used_blocks, kv.windowed.num_used_blocks
            peak_full, peak_window = max(peak_full, full), max(peak_window, window)
            peak_bytes = max(peak_bytes, (full * (s.layers - ringed) + window * ringed) * layer_block)
        every = peak_full * s.layers * layer_block
        out = {
            "machine": machine(), "model": "gemma3_text (5 windowed : 1 full layers), tiny widths",
            "requests": args.requests, "prompt": args.prompt, "new": args.new, "window": args.window,
            "layer_block_bytes": layer_block,
            "pool_blocks": {"full": kv.full.num_blocks, "window": kv.windowed.num_blocks},
            "peak_blocks_held": {"full": peak_full, "window": peak_window},
            "peak_kv_bytes": peak_bytes, "every_block_kv_bytes": every, "ratio": peak_bytes / every,
            "allocated_bytes": (kv.full.num_blocks * (s.layers - ringed) + kv.windowed.num_blocks * ringed) * layer_block,
            "allocated_every_block_bytes": kv.full.num_blocks * s.layers * layer_block,
        }
    print(f"{args.requests} requests of {args.prompt}+{args.new} tokens, window {args.window}: peak KV held "
          f"{peak_bytes / 2**20:.1f} MiB vs {every / 2**20:.1f} MiB with every block in every layer "
          f"({out['ratio']:.3f}x); blocks held: full {peak_full}, window {peak_window}; pools allocated "
          f"{out['allocated_bytes'] / 2**20:.1f} vs {out['allocated_every_block_bytes'] / 2**20:.1f} MiB")
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
