#!/usr/bin/env bash
# One command for a lent GPU machine (16 cores, one H100/H200, root, no package index):
# the GPU tests, then the CPU benchmarks on its cores, logs and JSON under $OUT.
#
# Here, once per checkout (.whl is git-ignored): posix_ipc and, for the GPU server test (hetero serve
# --device cuda on a tiny model; it skips without them), the server's and the openai client's wheels
# with everything they need, at the versions the suite passed on (pip resolves the closure):
#   rm -rf .whl && python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
#     --platform manylinux1_x86_64 -c constraints.txt -d .whl posix_ipc fastapi uvicorn openai prometheus_client
# Then with the device tool: run(command="bash bench/device.sh", carry=[".whl"]).
# STEPS picks the parts (default all): STEPS="gpu gpu_decode gpu_prefill gpu_engine prefix_rows engine_cores engine_gpu probe kernel attention ipc contexts" bash bench/device.sh.
# A device call is limited to 10 minutes: run one step per call (STEPS=gpu, then STEPS=gpu_decode, ...);
# gpu_decode writes its JSON after every row, so a run cut by the limit still returns what it measured
# (GPU_DECODE_ARGS="--contexts 8192 65536" narrows it; "--systems hetero hetero_all" A/Bs the planner against
# every worker; LoRA decode: GPU_DECODE_ARGS="--contexts 8192 32768
# --systems hetero hetero_lora hetero_lora_host peft --out gpu_decode_lora"). gpu_prefill builds an 8B model per cell: run it
# in parts, each with its own --out, e.g. GPU_PREFILL_ARGS="--contexts 8192 32768 --continue-context 0
# --out gpu_prefill_a", then "--contexts 65536 131072 --continue-context 0 --out gpu_prefill_b", then
# "--contexts --out gpu_prefill_c" (the 512-token continuation over 64K only). The longest prompt:
# "--contexts 262144 --systems hf hetero_chunked --chunk auto --continue-context 0 --out gpu_prefill_256k",
# then 524288 (a 64 GiB arena) alone. --profile puts the timed hetero prefill under torch.profiler and its
# top ops in the JSON (e.g. "--contexts 131072 --systems hetero_chunked --chunk 32768 --continue-context 0 --profile":
# "auto" runs 128K in one pass, no tiles). The 768K prompt (a 96 GiB arena): add "--ram-fraction 0.95 --timeout 540";
# every cell's log goes to $OUT/<out>_cells.log as it runs.
# gpu_engine (the engine vs transformers' continuous batching, bench/gpu_engine.py): one load per call, each
# cell a fresh 8B model, e.g. GPU_ENGINE_ARGS="--loads 8x32768 --timeout 200" (8x32K: engine 60 s, transformers 90 s
# plus ~20 s start each; 16x32K engine 125 s); "--systems engine --phases" times the parts of its steps.
# prefix_rows (bench/prefix_rows.py): 12 questions over a pinned 32K document, 8B shape, ~2 minutes.
# engine_cores (bench/engine.py --random-weights): #29's full RAG mix on the 16 cores, the engine beside hetero
# one call at a time and transformers' continuous batching (unsized: give it a call of its own, timeout 600).
# engine_gpu (bench/engine.py --device cuda, random weights of SmolLM2's shape, bf16): #29's inter-token target
# where it belongs, prefill and the dense layers on the GPU, decode attention on the cores: the engine plain and
# paced at a medium rate and saturated, beside one call at a time (ENGINE_GPU_ARGS; ~6 cells of ~40 s).
# At most 8 files come back from $OUT: one log per step and one JSON per benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/hetero_device}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# the KV cache streams much faster from 2 MB pages (README: Huge pages); a tmpfs defaults to half
# the RAM, which would cap the arena (the longest prompts) at 64 GiB on a 128 GiB host
mount -o remount,huge=advise,size=${SHM_SIZE:-90%} /dev/shm 2>/dev/null || echo "note: could not remount /dev/shm"
df -h /dev/shm | tail -1
python3 -c "import torch, transformers, numba, posix_ipc
from hetero.ipc.shm import shmem_huge_pages
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__,
      'numba', numba.__version__, '/dev/shm huge pages:', shmem_huge_pages())" || exit 1

rc=0
for step in ${STEPS:-gpu gpu_decode gpu_prefill probe kernel attention ipc contexts}; do
    echo "== $step"
    case $step in
        gpu)
            timeout ${GPU_TEST_TIMEOUT:-900} python3 -m pytest -q -rs --durations=8 tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log" || rc=1 ;;
        gpu_decode)  # Llama-3-8B shape, 8K-128K: hetero (CUDA transport, host copies) vs HF GPU / offloaded / static
            python3 bench/gpu_decode.py --copy-to "$OUT" ${GPU_DECODE_ARGS:-} 2>&1 | tee "$OUT/gpu_decode.log" || rc=1 ;;
        attention)   # 16 workers x 5 split counts per row: the long contexts only
            if python3 bench/attention.py --contexts 8192 32768 65536 --out attention_gpu_host 2>&1 | tee "$OUT/attention.log"; then
                cp bench/results/attention_gpu_host.json bench/results/attention_gpu_host.png "$OUT"/
            else
                rc=1
            fi ;;
        kernel)       # the decode kernel with / without its next-block prefetch, one core (~30 s)
            python3 bench/kernel_prefetch.py --out kernel_prefetch_gpu_host --copy-to "$OUT" 2>&1 | tee "$OUT/kernel_prefetch.log" || rc=1 ;;
        ipc)
            python3 bench/ipc.py --iters 5000 --out "$OUT/ipc_gpu_host.json" 2>&1 | tee "$OUT/ipc.log" || rc=1 ;;
        gpu_prefill)  # Llama-3-8B shape: hetero one-pass / chunked+prefetch vs HF GPU / offloaded; 512 over 64K
            python3 bench/gpu_prefill.py --copy-to "$OUT" ${GPU_PREFILL_ARGS:-} 2>&1 | tee "$OUT/gpu_prefill.log" || rc=1 ;;
        gpu_engine)   # the engine (KV and decode attention on the host) vs transformers' continuous batching on the GPU
            python3 bench/gpu_engine.py --copy-to "$OUT" ${GPU_ENGINE_ARGS:-} 2>&1 | tee "$OUT/gpu_engine.log" || rc=1 ;;
        prefix_rows)  # questions over a pinned 32K document: its rows kept on the GPU vs read back (PrefixRows)
            python3 bench/prefix_rows.py --shape llama3-8b --device cuda --doc 32768 --questions 12 --chunk 8192 \
                --out prefix_rows_gpu.json --copy-to "$OUT" ${PREFIX_ROWS_ARGS:-} 2>&1 | tee "$OUT/prefix_rows.log" || rc=1 ;;
        engine_cores) # #29's RAG mix on the host's 16 cores, CPU only (bf16, SmolLM2's shape with random weights: its GGUF cannot travel)
            if python3 bench/engine.py --random-weights --dtypes bfloat16 --out engine_gpu_host.json ${ENGINE_CORES_ARGS:---docs 8 \
                    --doc-min 2048 --doc-max 8192 --requests 32 --new-min 64 --new-max 128 --rates 0.5 inf \
                    --systems engine serial hf_cb --timeout 240} 2>&1 | tee "$OUT/engine_cores.log"; then
                cp bench/results/engine_gpu_host.json "$OUT"/
            else
                rc=1
            fi ;;
        engine_gpu)   # #29's RAG mix with the model on the GPU: inter-token p99 at a medium rate / the batch-1 time
            if python3 bench/engine.py --random-weights --device cuda --dtypes bfloat16 --out engine_gpu.json \
                    ${ENGINE_GPU_ARGS:---docs 8 --doc-min 2048 --doc-max 8192 --requests 32 --new-min 64 --new-max 128 \
                    --rates 2 inf --systems engine engine_paced serial --timeout 240} 2>&1 | tee "$OUT/engine_gpu.log"; then
                cp bench/results/engine_gpu.json "$OUT"/
            else
                rc=1
            fi ;;
        probe)        # the host: cudaHostRegister cost and adjacent slices; the strided host copy's GB/s (#14)
            python3 bench/host_probe.py --copy-to "$OUT" 2>&1 | tee "$OUT/host_probe.log" || rc=1 ;;
        contexts)     # CPU only, on the host's 16 cores: 8 questions sharing a 16K context vs private copies
            if python3 bench/contexts.py --rounds 2 --out contexts_gpu_host.json 2>&1 | tee "$OUT/contexts.log"; then
                cp bench/results/contexts_gpu_host.json "$OUT"/
            else
                rc=1
            fi ;;
        *)
            echo "unknown step $step (gpu, gpu_decode, gpu_prefill, gpu_engine, engine_gpu, probe, kernel, attention, ipc, contexts)"; rc=1 ;;
    esac
done
exit $rc
