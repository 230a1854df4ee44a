"""Print the README's benchmark tables (markdown) from bench/results/*.json."""
import glob
import json
import os

from common import RESULTS


def decode_tables():
    lines = ["| shape | hetero workers + torch threads | context | HF ms/token | hetero ms/token | speedup | hetero KV GB/s | 1-core read bound GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for path in sorted(glob.glob(os.path.join(RESULTS, "decode_cpu*.json"))):
        r = json.load(open(path))
        m = r["model"]
        shape = f"{m['num_attention_heads']}q/{m['num_key_value_heads']}kv heads, {r['dtype']}"
        for row in r["results"]:
            lines.append(f"| {shape} | {r['hetero_workers']} + {r['hetero_torch_threads']} | {row['context'] // 1024}K | "
                         f"{row['hf_ms']:.1f} | {row['hetero_ms']:.1f} | {row['speedup']:.2f}x | "
                         f"{row['hetero_kv_gbps']:.1f} | {r['stream_read_gbps_1core']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(decode_tables())
