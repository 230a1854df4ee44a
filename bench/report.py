"""Print the README's benchmark tables (markdown) from bench/results/*.json."""
import glob
import json
import os

from common import RESULTS, steady


def _load(name):
    path = os.path.join(RESULTS, name)
    return json.load(open(path)) if os.path.exists(path) else None


def _targets(rows):
    """rows: [(target, value text, met)] -> a markdown table."""
    met = {True: "yes", False: "no", None: "(no target)"}
    return ["| target | value | met |", "|---|---|---|"] + [f"| {t} | {v} | {met[m]} |" for t, v, m in rows]


def decode_tables():
    """One table per bench/results/decode_cpu_*.json: ms/token per system (median over rounds,
    [fastest-slowest round]), idle and beside a busy core, then the slopes."""
    out = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "decode_cpu_*.json"))):
        r = json.load(open(path))
        systems = [s for s in ("hf", "static", "hetero", "llamacpp") if any(s in row for row in r["results"])]
        names = {"hf": "HF default cache", "static": "HF static cache", "hetero": "hetero", "llamacpp": "llama.cpp (Q4_1)"}
        plans = sorted({tuple(row["hetero"]["plan"]) for row in r["results"] if "hetero" in row})
        out += [f"**{r['model']}, {r['dtype']}**, {r['cores']} cores for every system (hetero: the parent and "
                f"up to {r['hetero_workers']} worker; plans (workers, splits) used: {plans}), {r['rounds']} rounds "
                "in fresh processes:", "",
                "| neighbour | context | " + " | ".join(f"{names[s]} ms" for s in systems)
                + " | HF / hetero | HF static / hetero |", "|---" * (len(systems) + 4) + "|"]
        for row in r["results"]:
            cells = " | ".join(f"{row[s]['ms']:.1f} [{row[s]['spread_ms'][0]:.1f}-{row[s]['spread_ms'][1]:.1f}]"
                               if s in row else "" for s in systems)
            out.append(f"| {'busy core' if row['busy'] else 'idle'} | {row['context'] // 1024}K | {cells} | "
                       f"{row.get('hf_over_hetero', 0):.2f}x | {row.get('static_over_hetero', 0):.2f}x |")
        out += ["", "Slope, ms per 1K tokens of context (the attention cost; KV GB/s it implies): "
                + "; ".join(f"{k} {v['ms_per_1k']:.2f}" + (f" ({v['kv_gbps']:.1f} GB/s)" if v["kv_gbps"] else "")
                            for k, v in r["slopes"].items()), ""]
    return "\n".join(out)


def attention_tables():
    r = _load("attention.json")
    if r is None:
        return ""
    lines = [f"Streaming-read bound, measured next to each row ({len(r['cores'])} cores; best of the run: "
             f"1 core {r['stream_1core_gbps']:.1f} GB/s, all cores {r['stream_all_gbps']:.1f} GB/s); "
             f"/dev/shm huge pages: {r['machine'].get('shmem_thp', 'unknown')}.", "",
             "| shape, KV dtype | context | KV rotated (MB, L3 MB) | hetero 1 core GB/s | of 1-core bound | "
             "hetero all cores GB/s | of all-core bound | SDPA 1 / all threads GB/s | fp32 grouped matmul / hetero, "
             "all cores | planner (workers, splits) / best of sweep |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, rows in r["results"].items():
        for row in rows:
            k, s, b = row["kernel_gbps"], row["sdpa_gbps"], row["stream_gbps"]
            n, t = max(k, key=int), max(s, key=int)
            rot = (f"{row['rotated_mb']:.0f} ({row['llc_mb']:.0f}{', cache-resident' if row['cache_resident'] else ''})"
                   if "rotated_mb" in row else "one layer, warm (older run)")
            mm = f"{row['vs_matmul'][t]:.1f}x" if "vs_matmul" in row else "n/a"
            lines.append(f"| {key} | {row['context'] // 1024}K | {rot} | {k['1']:.1f} | {k['1'] / b['1']:.2f} | "
                         f"{k[n]:.1f} | {k[n] / b['all']:.2f} | {s['1']:.2f} / {s[t]:.2f} | {mm} | "
                         f"{tuple(row['planner'])} {row['planner_ms']:.2f} ms / {tuple(row['best'])} {row['best_ms']:.2f} ms |")
    if r.get("batch"):
        lines += ["", "Planner on a mixed batch (units of unequal size):", "",
                  "| shape, KV dtype | contexts | planner (workers, splits) | best of sweep | planner / best |",
                  "|---|---|---|---|---|"]
        lines += [f"| {key} | {'/'.join(str(n) for n in b['lengths'])} | {tuple(b['planner'])} {b['planner_ms']:.2f} ms | "
                  f"{tuple(b['best'])} {b['best_ms']:.2f} ms | {b['planner_of_best']:.3f} |" for key, b in r["batch"].items()]
    lines += [""] + _targets([(name, value, met) for name, (value, met) in r["summary"].items()])
    return "\n".join(lines)


def ipc_table():
    r = _load("ipc.json")
    if r is None:
        return ""
    lines = ["| mechanism | workers | p50 us | p99 us |", "|---|---|---|---|"]
    lines += [f"| {x['mechanism']} | {x['workers']} | {x['p50_us']:.1f} | {x['p99_us']:.1f} |" for x in r["results"]]
    return "\n".join(lines)


def lora_tables():
    r = _load("lora.json")
    if r is None:
        return ""
    lat, ttft = r["latency_ms"], r["ttft_ms"]
    lines = [f"Context {r['context'] // 1024}K, {r['cpu_workers']} CPU worker(s); per-token decode latency:", "",
             "| batch | no adapter ms | with adapters ms | overhead |", "|---|---|---|---|",
             f"| 1 request, rank-16 on q/k/v/o | {lat['b1_base']:.1f} | {lat['b1_r16_qkvo']:.1f} | "
             f"{100 * r['overhead']['b1_r16_qkvo']:+.1f} % |",
             f"| 4 requests, ranks 8/16/32/64 mixed | {lat['b4_base']:.1f} | {lat['b4_mixed_r8_r64']:.1f} | "
             f"{100 * r['overhead']['b4_mixed_r8_r64']:+.1f} % |", "",
             "| adapters registered | shared memory GB | tokens/s (batch 1, rank 16) |", "|---|---|---|"]
    lines += [f"| {x['registered']} | {x['shm_gb']:.2f} | {x['tokens_per_s']:.1f} |" for x in r["registered"].values()]
    lines += ["", f"Time to first token ({ttft['prompt']}-token prompt): adapter on the device {ttft['warm']:.0f} ms, "
              f"cold (device copy held back, prefill deltas on the CPU workers) {ttft['cold']:.0f} ms.", ""]
    lines += _targets([(k, f"{v['value']:.3f} ({v['target']})", v["met"]) for k, v in r["summary"].items()])
    return "\n".join(lines)


def contexts_table():
    r = _load("contexts.json")
    if r is None:
        return ""
    m, spread = r["median_s"], {k: (min(v), max(v)) for k, v in r["runs_s"].items()}
    names = {"ttft_cached": "time to first token, question over the cached context",
             "ttft_hetero": "time to first token, hetero re-prefilling document + question",
             "ttft_hf": "time to first token, HF generate re-prefilling document + question",
             "prefill_s": "prefill of the document (gen.prefill)",
             "load_s": f"load of the saved context ({r['saved_file_bytes'] / 2**20:.0f} MB file, page-cached)"}
    if "decode_shared" in m:
        B = r["batch"]
        names.update({"decode_shared": f"decode per token, {B} questions sharing the context in one batch",
                      "decode_private": f"decode per token, {B} questions each with a private copy",
                      "decode_dense": f"decode per token, the {B} questions without the context (dense floor)"})
    out = [f"{r['model']}, a {r['context'] // 1024}K-token document and a {r['question']}-token question, "
           f"{r['rounds']} rounds (median [fastest-slowest]):", "", "| what | seconds |", "|---|---|"]
    out += [f"| {names[k]} | {m[k]:.3f} [{spread[k][0]:.3f}-{spread[k][1]:.3f}] |" for k in names]
    out += ["", *_targets([(k.strip(), f"{v}x", met) for k, (v, met) in r["summary"].items()])]
    return "\n".join(out)


GPU_DECODE_SYSTEMS = [("hetero", "hetero (CUDA transport)"), ("hetero_host", "hetero (host copies)"),
                      ("hetero_all", "hetero, every worker"), ("hetero_lora", "hetero + LoRA (CUDA)"),
                      ("hetero_lora_host", "hetero + LoRA (host)"), ("hf", "HF dynamic"), ("peft", "HF + peft"),
                      ("offloaded", "HF offloaded"), ("static", "HF static")]


def _gpu_decode_runs():
    """[(run name, its JSON)] of bench/results/gpu_decode*.json, by name."""
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "gpu_decode*.json")))
    return [(n[:-5], r) for n, r in ((n, _load(n)) for n in names) if r]


def _bound(run, shape, row, fallback):
    """KV bytes / the run's host read bandwidth + the base layers' time (see gpu_decode_table)."""
    static_base = "HF static cache at 256" in run.get("note", "")         # else HF dynamic's: not a base
    base = shape.get("base_ms") if static_base and shape.get("base_ms") else fallback
    return row["kv_bytes"] / (run["host_read_gbps"] * 1e9) * 1e3 + base


def _static_fallback(runs):
    statics = [steady(row["static"]["times"])["ms"] for _, run in runs for shape in run["results"].values()
               for row in shape["rows"] if "times" in row.get("static", {})]
    return min(statics) if statics else 0.0


def gpu_decode_table():
    """bench/results/gpu_decode*.json (one run per file, any subset of systems): ms/token per
    system and context, a row per (file, context); columns only for the systems some file ran.
    The bound takes the run's base layers' time (HF static cache at 256 tokens) where it recorded
    one, else HF static at the shortest context of all runs (the first files used HF's dynamic
    cache there, bound by kernel launches)."""
    runs = _gpu_decode_runs()
    if not runs:
        return ""
    rows = [(name, run, shape, row) for name, run in runs for shape in run["results"].values() for row in shape["rows"]]
    ran = [(k, title) for k, title in GPU_DECODE_SYSTEMS if any(k in row for *_, row in rows)]
    fallback = _static_fallback(runs)
    run0 = runs[0][1]
    out = [f"{run0['gpu']}, {run0['cores']} host cores, Llama-3-8B shape (bf16, random weights), batch 1, "
           "ms per token at steady state (bench.common.steady; ≤: still falling at the run's end, an upper "
           "bound); bound = KV bytes / the all-core host read bandwidth "
           "measured in the same run + the base layers' time:", "",
           "| run | context | " + " | ".join(title for _, title in ran) +
           " | host read GB/s | bound | hetero / bound | offloaded / hetero | peak GPU GiB hetero / HF dynamic |",
           "|" + "---|" * (len(ran) + 7)]

    def level(row, k):          # (ms, an upper bound?) at steady state, re-read from the steps
        r = row.get(k, {})
        if "times" not in r:    # a run that kept no steps: its own figure
            return r.get("ms"), bool(r.get("still_falling"))
        s = steady(r["times"])
        return s["ms"], s["still_falling"]

    def cell(row, k):
        v, up = level(row, k)
        return (("≤" if up else "") + f"{v:.1f}") if v else ("OOM" if row.get(k, {}).get("oom") else "–")

    for name, run, shape, row in sorted(rows, key=lambda x: (x[3]["context"], x[0])):
        bound = _bound(run, shape, row, fallback)
        cells = [cell(row, k) for k, _ in ran]
        (het, het_up), (off, off_up) = level(row, "hetero"), level(row, "offloaded")
        peaks = [row.get(k, {}).get("peak_gpu_bytes") for k in ("hetero", "hf")]
        out.append(f"| {name} | {row['context'] // 1024}K | " + " | ".join(cells) +
                   f" | {run['host_read_gbps']:.0f} | {bound:.1f} | " + (f"{het / bound:.2f}" if het else "–") +
                   " | " + (("≤" if het_up or off_up else "") + f"{off / het:.2f}x" if het and off else "–") + " | " +
                   " / ".join(f"{p / 2**30:.1f}" if p else "–" for p in peaks) + " |")
    return "\n".join(out)


def gpu_decode_plot(path):
    """bench/results/gpu_decode*.json as one figure: ms/token against context, a colour per system,
    a marker per run (runs come from different leases and code: the table says which)."""
    runs = _gpu_decode_runs()
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fallback = _static_fallback(runs)
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = dict(zip([k for k, _ in GPU_DECODE_SYSTEMS], plt.cm.tab10.colors))
    titles = dict(GPU_DECODE_SYSTEMS)
    markers = {n: "osD^v<>px*"[k % 10] for k, (n, _) in enumerate(runs)}
    seen = set()
    for name, run in runs:
        for shape in run["results"].values():
            ctx = [row["context"] for row in shape["rows"]]
            for k in titles:
                pts = [(row["context"], steady(row[k]["times"])["ms"]) for row in shape["rows"]
                       if "times" in row.get(k, {})]
                if pts:
                    ax.plot(*zip(*pts), marker=markers[name], color=colours[k], linestyle="-",
                            label=titles[k] if k not in seen else None)
                    seen.add(k)
            ax.plot(ctx, [_bound(run, shape, row, fallback) for row in shape["rows"]], marker=markers[name], color="black",
                    linestyle=":", label="bound" if "bound" not in seen else None)
            seen.add("bound")
    for name, m in markers.items():
        ax.plot([], [], marker=m, color="grey", linestyle="none", label=f"run {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per token")
    ax.set_title(f"decode on {runs[0][1]['gpu']}, Llama-3-8B shape, bf16, batch 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gpu_prefill_table():
    """bench/results/gpu_prefill_*.json: seconds and peak GPU memory over the weights per system."""
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "gpu_prefill_*.json")))
    named = [(n[:-5], r) for n, r in ((n, _load(n)) for n in names) if r]
    if not named:
        return ""
    runs = [r for _, r in named]
    systems = ("hf", "offloaded", "hetero", "hetero_chunked")
    out = [f"{runs[0]['gpu']}, Llama-3-8B shape (bf16, random weights), one fresh process per cell; seconds "
           "(host page-locking) [peak GPU GiB over the weights]:", "",
           "| run | prompt | HF (KV on the GPU) | HF offloaded | hetero one pass | hetero chunked + prefetch (chunk) |",
           "|---|---|---|---|---|---|"]
    for name, run in named:
        for row in run["results"]["prefill"]:
            cells = []
            for k in systems:
                r = row.get(k, {})
                if "s" not in r:
                    cells.append("OOM" if r.get("oom") else "-")
                    continue
                pin = f" ({r['pin_s']:.2f})" if r.get("pin_s") else ""
                cells.append(f"{r['s']:.2f}{pin} [{r['peak_gpu_bytes'] / 2**30:.2f}]")
            if "s" in row.get("hetero_chunked", {}):
                cells[-1] += f" ({run.get('chunk', '?')})"
            out.append(f"| {name} | {row['context'] // 1024}K | " + " | ".join(cells) + " |")
    for run in runs:
        c = run["results"].get("continuation")
        if c:
            parts = [f"{k} {c[k]['s']:.2f} s" for k in ("prefetch", "workers", "reprefill") if "s" in c.get(k, {})]
            out += ["", f"{c['new']} new tokens over a {c['context'] // 1024}K cached context: " + ", ".join(parts)
                    + " (re-prefill: HF over context + new tokens, KV on the GPU)."]
    return "\n".join(out)


if __name__ == "__main__":
    print(decode_tables())
    print()
    print(attention_tables())
    print()
    print(ipc_table())
    print()
    print(lora_tables())
    print()
    print(contexts_table())
    print()
    print(gpu_decode_table())
    print(f"(plot: {gpu_decode_plot(os.path.join(RESULTS, 'gpu_decode.png'))})")
    print()
    print(gpu_prefill_table())
