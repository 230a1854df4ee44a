"""Dry runs of the GPU benchmarks' cells on the CPU, so a broken script fails here and not in a
rare GPU session."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_decode_lora_cell_dry_run():
    """bench/gpu_decode.py's hetero_lora cell (a peft adapter on every projection, its decode
    deltas through the session's transport) runs on a tiny model and reports its timings."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_decode.py"), "--one", "hetero_lora",
                        "--shape", "tiny", "--context", "64", "--steps", "3", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-2000:]
    out = json.loads(line[0][len("RESULT "):])
    assert len(out["times"]) == 3 and all(t > 0 for t in out["times"]) and out["info"]["plan"][0] >= 0


def test_report_gpu_tables_take_partial_runs(tmp_path, monkeypatch):
    """bench/report.py's GPU tables over the committed runs plus a run of a subset of systems (a
    LoRA decode run, an OOM, a failed cell; a longest-prompt prefill run with an auto chunk)."""
    import shutil

    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import report

    for name in os.listdir(os.path.join(ROOT, "bench", "results")):
        if name.startswith("gpu_"):
            shutil.copy(os.path.join(ROOT, "bench", "results", name), tmp_path / name)
    run = json.load(open(tmp_path / "gpu_decode.json"))
    row = {"context": 8192, "kv_bytes": 2**30, "hetero": {"ms": 40.0, "peak_gpu_bytes": 16e9},
           "hetero_lora": {"ms": 45.0}, "peft": {"oom": True}, "hetero_lora_host": {"error": "x"}}
    run["results"] = {"llama3-8b": {"base_ms": 25.0, "rows": [row]}}
    run["note"] = "bound = ... + the base layers' time (HF static cache at 256 tokens)"
    json.dump(run, open(tmp_path / "gpu_decode_lora.json", "w"))
    pre = json.load(open(tmp_path / "gpu_prefill_a.json"))
    pre["chunk"] = "auto"
    pre["results"] = {"prefill": [{"context": 524288, "hf": {"oom": True},
                                   "hetero_chunked": {"s": 300.0, "pin_s": 9.0, "peak_gpu_bytes": 2**31}}]}
    json.dump(pre, open(tmp_path / "gpu_prefill_512k.json", "w"))
    monkeypatch.setattr(report, "RESULTS", str(tmp_path))
    dec, pre_table = report.gpu_decode_table(), report.gpu_prefill_table()
    assert "| gpu_decode_lora | 8K | 40.0 |" in dec and "hetero + LoRA (CUDA)" in dec and "OOM" in dec
    assert "| gpu_prefill_512k | 512K | OOM | - | - | 300.00 (9.00) [2.00] (auto) |" in pre_table


def test_gpu_engine_cell_dry_run():
    """bench/gpu_engine.py's engine_host cell (--phases) serves a tiny model's load and reports
    its throughput, the transport it used and where its steps' time went."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_engine.py"), "--one", "engine_host",
                        "--shape", "tiny", "--n", "2", "--context", "96", "--new", "3", "--chunk", "64",
                        "--device", "cpu", "--phases"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-2000:]
    out = json.loads(line[0][len("RESULT "):])
    assert out["complete"] and out["throughput_tok_s"] > 0 and out["transport"] == "host"
    assert 0 < out["phases"]["execute"][0] < out["steps"] and out["phases"]["post_decode"][0] > 0   # warm-up untimed
    assert out["dma_copies"] == out["sync_copies"] == 0 and out["pin_s"] is None    # a CPU model: no page locks


def test_engine_summary_takes_each_ratio_from_its_systems_cells(monkeypatch):
    """bench/engine.py's summary divides by the cells of the systems it names (engine_paced, listed
    beside them, is none of its peers)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    from engine import summary

    def cell(system, tps, ttft):
        return {"dtype": "float32", "rate": "inf", "system": system, "throughput_tok_s": tps, "cached_ttft_p50": ttft,
                "kv_peak_bytes": 1, "kv_private_bytes": 4}

    out = summary([cell("engine", 60.0, 1.0), cell("engine_paced", 50.0, 2.0), cell("serial", 20.0, 5.0),
                   cell("hf_cb", 10.0, 4.0)])
    assert out["float32 saturated throughput, engine / serial"] == [3.0, True]
    assert out["float32 saturated throughput, engine / hf_cb"] == [6.0, None]
    assert out["float32 saturated cached-document TTFT p50, engine / best peer"] == [0.25, True]


def test_serve_summary_counts_misses_by_cause_and_cold_document():
    """bench/serve.py's goodput: a request within the SLO has its first token by --slo-ttft and its
    own p99 gap within --slo-itl; each miss is counted by cause, for the first request sent over
    its document (cold) and for the later ones."""
    from types import SimpleNamespace

    from bench.serve import summarize

    args = SimpleNamespace(slo_ttft=2.0, slo_itl=0.2)
    reqs = [{"doc": 0}, {"doc": 1}, {"doc": 0}, {"doc": 1}, {"doc": 0}]
    res = [(0.0, [3.0, 3.1, 3.2], 3),          # doc 0, first: its first token late
           (1.0, [1.5, 1.6, 2.0], 3),          # doc 1, first: a 0.4 s gap
           (2.0, [2.5, 2.6, 2.7], 3),          # within
           (3.0, [6.0, 6.5], 2),               # doc 1, later: both late
           (4.0, [4.2], 1)]                    # one token: no gap, within
    out = summarize(res, reqs, args)
    assert out["within_slo"] == 2 / 5 and out["requests"] == 5
    assert out["slo_misses"] == {"first_ttft": 1, "first_itl": 1, "later_ttft": 1, "later_itl": 1}


@pytest.mark.slow
def test_engine_paced_cell_dry_run():
    """bench/engine.py's paced engine cell serves a small mix of SmolLM2's shape (random weights) and
    takes the batch-1 time before and after the load (the ratio's denominator: their mean)."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "engine.py"), "--random-weights", "--one",
                        "engine_paced", "--rate", "4", "--docs", "2", "--doc-min", "64", "--doc-max", "128",
                        "--requests", "3", "--new-min", "4", "--new-max", "6", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = [x for x in p.stdout.splitlines() if x.startswith("CELL ")]
    assert p.returncode == 0 and line, p.stderr[-2000:]
    cell = json.loads(line[0][len("CELL "):])
    assert 3 * 4 <= cell["output_tokens"] <= 3 * 6 and cell["throughput_tok_s"] > 0
    before, after = cell["batch1_itl_before_s"], cell["batch1_itl_after_s"]
    assert before > 0 and after > 0 and cell["batch1_itl_s"] == (before + after) / 2
    assert cell["step_time_target_s"] > 0 and cell["steps"] > 0
