"""`hetero serve`: load the model, start the engine, run the API under uvicorn until SIGTERM/Ctrl-C.

SIGTERM (or Ctrl-C) stops accepting requests (503), lets the ones in flight finish for up to
--shutdown-timeout seconds, answers those still running then with a 503 (a stream: an error event
and [DONE]), then closes the engine: its workers exit and no shared-memory segment is left.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import threading

from hetero.errors import MissingDependencyError

ANSWER_TIME = 5.0     # s after --shutdown-timeout for the requests aborted then to get their 503 (a step, the answer)
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)


def size(text: str, zero: bool = False) -> int:
    """argparse type: bytes, with an optional K/M/G/T suffix (powers of 1024); zero: 0 allowed."""
    m = SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512M, 8G)")
    value = float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper())
    if value < 1 and not (zero and value == 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size{' or 0' if zero else ''}")
    return int(value)


def size_or_zero(text: str) -> int:
    """argparse type: size(), or 0 (0, 0M, ...)."""
    return size(text, zero=True)


def seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def adapter_pair(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--adapters takes name=DIR, got {text!r}")
    return name, path


def autoscaling(text: str) -> dict:
    """argparse type: Ray Serve's autoscaling_config as a JSON object, checked by Ray's own class."""
    import json

    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(cfg, dict) or "max_replicas" not in cfg:
        raise argparse.ArgumentTypeError(f"a JSON object with max_replicas (Ray Serve's autoscaling_config), "
                                         f"got {text!r}")
    try:
        from ray.serve.config import AutoscalingConfig
    except ImportError:
        return cfg                          # serve_replicas names the missing extra
    unknown = sorted(set(cfg) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown autoscaling_config fields {unknown} (Ray Serve's: "
                                         f"{sorted(AutoscalingConfig.model_fields)})")
    try:
        checked = AutoscalingConfig(**cfg)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("\n", " ")) from None
    if checked.min_replicas < 1:              # the ingress asks a replica for the tokenizer as it starts
        raise argparse.ArgumentTypeError(f"min_replicas must be at least 1, got {checked.min_replicas}")
    return checked.model_dump(exclude_unset=True)     # as Ray read them ("4" -> 4)


def add_arguments(p: argparse.ArgumentParser, positive):
    p.add_argument("--model", default=None, help="a transformers causal LM directory or hub id "
                                                "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the model's id in the API (default: from --model)")
    p.add_argument("--adapters", nargs="*", type=adapter_pair, default=[], metavar="NAME=DIR",
                   help="peft LoRA adapters served by name (a request's model picks one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("HETERO_API_KEY"), help="required as 'Authorization: "
                                                                               "Bearer KEY' (env HETERO_API_KEY)")
    p.add_argument("--max-queue", type=positive, default=256, help="requests waiting beyond this get 429")
    p.add_argument("--context-memory", type=size, default=None, help="the KV pool's size (e.g. 8G; default: a "
                                                                      "share of the RAM)")
    p.add_argument("--saved-contexts", default=None, help="a directory where named contexts are saved and from "
                                                          "which they are loaded at start, without a prefill")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where the dense layers and "
                   "prompt chunks run (auto: the GPU when there is one); decode attention is on the CPU workers")
    p.add_argument("--max-num-seqs", type=positive, default=32)
    p.add_argument("--max-model-len", type=positive, default=None)
    p.add_argument("--max-num-batched-tokens", type=positive, default=None, help="tokens per engine step (default: "
                   "512 on the CPU; on a GPU 8192 with 70 GiB or more, else 2048)")
    p.add_argument("--step-time-target", type=seconds, default=None, metavar="SECONDS", help="while requests decode, "
                   "prompt chunks shrink so that a step takes about this long (their inter-token latency), as "
                   "measured; new documents then take longer to their first token. Default: no target")
    p.add_argument("--prefix-rows-memory", type=size_or_zero, default=None, metavar="SIZE", help="memory of the "
                   "model's device that keeps cached and pinned documents' rows for the questions that continue "
                   "them (default: 512M on the CPU, an eighth of a GPU's free memory; 0: read them back each time)")
    p.add_argument("--cpu-workers", type=positive, default=None)
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests may finish "
                   "after SIGTERM; those still running then get a 503")
    p.add_argument("--log-level", default="info")
    p.add_argument("--replicas", type=positive, default=None, help="N engines on Ray Serve (the ray extra), each on "
                   "its share of the cores, requests routed by document; --saved-contexts is their shared context "
                   "store (default: a temporary directory)")
    p.add_argument("--autoscaling", type=autoscaling, default=None, metavar="JSON", help="replicas as with "
                   "--replicas, their number set by Ray Serve's autoscaler: its autoscaling_config as JSON, e.g. "
                   "'{\"min_replicas\": 1, \"max_replicas\": 4, \"target_ongoing_requests\": 8}'; each replica gets "
                   "the cores / max_replicas")
    p.add_argument("--routing", choices=["document", "pow2"], default="document", help="with --replicas: by the "
                   "prompt's document (default), or Ray Serve's default power-of-two-choices (load only)")


def serve(args) -> int:
    if args.replicas and args.autoscaling:
        print("hetero serve: error: give --replicas N or --autoscaling JSON, not both", file=sys.stderr)
        return 2
    args.device = resolve_device(args.device)
    if args.replicas or args.autoscaling:
        return serve_replicas(args)
    try:
        import uvicorn
    except ImportError as e:
        raise MissingDependencyError(f"hetero serve needs the serve extra ({e}): pip install 'hetero[serve]'") from e

    from hetero.engine.config import EngineConfig
    from hetero.server.app import build_app
    from hetero.server.state import ServerState

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model, tok, name = load(args.model, args.dtype, args.device)
    state = ServerState(model, tok, model_name=args.served_model_name or name,
                        engine_config=EngineConfig(**engine_options(args)),
                        adapters=dict(args.adapters), api_key=args.api_key, max_queue=args.max_queue,
                        saved_contexts=args.saved_contexts)
    try:
        state.load_saved_contexts()
        app = build_app(state)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout + ANSWER_TIME)
        server = _Server(config, state, args.shutdown_timeout)
        # uvicorn re-raises the signal that stopped it once it has shut down, under the handler that was
        # there before: a plain exit here, so the process's exit handlers (its last shared-memory name)
        # run, as they would not under SIGTERM's default action
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        server.run()
    finally:
        state.close()                          # idempotent; the lifespan closes it on a clean stop
    return 0


def serve_replicas(args) -> int:
    """`hetero serve --replicas N` (or --autoscaling): a local Ray instance, the replicas' application (hetero.server.replicas)
    on its HTTP proxy, until SIGTERM/Ctrl-C; then Serve and Ray shut down (the replicas close their engines)."""
    import tempfile

    try:
        import ray
        from ray import serve as ray_serve

        from hetero.server.replicas import build
    except ImportError as e:
        raise MissingDependencyError(f"hetero serve --replicas needs the ray extra ({e}): pip install 'hetero[ray]'") \
            from e
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    cores = len(os.sched_getaffinity(0))
    most = args.autoscaling["max_replicas"] if args.autoscaling else args.replicas
    per = max(1, cores // most)
    store = os.path.abspath(args.saved_contexts) if args.saved_contexts else tempfile.mkdtemp(prefix="hetero-store-")
    engine = engine_options(args)
    adapters = {name: os.path.abspath(path) for name, path in args.adapters}
    model = os.path.abspath(args.model) if args.model and os.path.isdir(args.model) else args.model
    gpus = 0
    if args.device == "cuda":          # each replica its GPU, or a share of one when there are fewer
        import torch

        n = torch.cuda.device_count()    # Ray fits floor(1 / share) replicas on a GPU: a share it can place
        gpus = 1 if n >= most else math.floor(1e4 / math.ceil(most / n)) / 1e4
    ray.init(num_cpus=max(cores, per * most), include_dashboard=False, log_to_driver=args.log_level ==
             "debug", logging_level=args.log_level.upper())
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):     # after ray.init, which installs its own
        signal.signal(sig, lambda s, f: stop.append(s))
    try:
        ray_serve.start(http_options={"host": args.host, "port": args.port})
        ray_serve.run(build(replicas=args.replicas or 1, autoscaling_config=args.autoscaling, model=model,
                            dtype=args.dtype, engine=engine, store=store, adapters=adapters, api_key=args.api_key,
                            cores_per_replica=per, gpus_per_replica=gpus, device=args.device,
                            max_ongoing_requests=args.max_num_seqs,
                            max_queued_requests=args.max_queue, routing=args.routing,
                            served_model_name=args.served_model_name),
                      name="hetero", route_prefix="/")
        count = (f"{args.autoscaling.get('min_replicas', 1)}-{most}" if args.autoscaling else args.replicas)
        print(f"hetero serve: {count} replicas on {per} core(s) each at http://{args.host}:{args.port} "
              f"(context store {store})", flush=True)
        while not stop:
            signal.pause()
    finally:
        ray_serve.shutdown()
        ray.shutdown()
    return 0


class _Server:
    """uvicorn's server, telling the state it stops (503 for new requests) as soon as a signal comes;
    `timeout` s later what still runs is aborted (answered 503), and uvicorn, ANSWER_TIME s later
    again, cancels what is left (a handler cancelled cannot answer)."""

    def __new__(cls, config, state, timeout: float):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if state.status != "stopping":
                    timer = threading.Timer(timeout, state.abort_in_flight)
                    timer.daemon = True
                    timer.start()
                state.status = "stopping"
                super().handle_exit(sig, frame)

        return Server(config)


def engine_options(args) -> dict:
    """EngineConfig's fields from the command's arguments (one engine, or each replica's)."""
    tokens = args.max_num_batched_tokens or step_tokens(resolve_device(args.device))
    return dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=tokens,
                long_prefill_chunk=tokens, max_model_len=args.max_model_len,
                kv_memory=args.context_memory, cpu_workers=args.cpu_workers, step_time_target=args.step_time_target,
                prefix_rows_memory=args.prefix_rows_memory)


def step_tokens(device: str, gpu_memory: int | None = None) -> int:
    """--max-num-batched-tokens' default. The CPU: 512 (bench/engine.py's budget on 2 cores). A GPU:
    vLLM's rule for its OpenAI server, 8192 tokens with 70 GiB or more (the setting of every GPU
    figure in the README), else 2048; a chunk of a few hundred tokens would leave it waiting on
    each step's fixed costs. gpu_memory: the GPU's bytes (None: device 0's)."""
    if device != "cuda":
        return 512
    if gpu_memory is None:
        import torch

        gpu_memory = torch.cuda.get_device_properties(0).total_memory
    return 8192 if gpu_memory >= 70 << 30 else 2048


def resolve_device(device: str) -> str:
    """--device: "auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda" without one raises."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    return device


def load(path: str | None, dtype: str, device: str = "cpu"):
    """(model, tokenizer, served name) in dtype "fp32", "bf16" or "fp16" on `device`: the embedded
    SmolLM2 by default."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if path is None:
        from hetero.models import load_smollm2

        model, tok = load_smollm2(dtype)
        return model.to(device), tok, "SmolLM2-135M-Instruct"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok, os.path.basename(os.path.normpath(path))
