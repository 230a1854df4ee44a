"""Dry runs of the GPU benchmarks' cells on the CPU, so a broken script fails here and not in a
rare GPU session."""
import json
import os
import subprocess
import sys

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
