"""`hetero` command line: `hetero demo` (the embedded default job), `hetero chat`, `hetero info`,
`hetero profile`, `hetero serve` (hetero.server)."""
import argparse
import os
import sys
import time

from hetero.errors import HeteroError


class _Clock:
    """A transformers streamer that timestamps tokens: prefill time and median decode time per
    token; `inner`, another streamer, gets every call too (chat prints the tokens)."""

    def __init__(self, inner=None):
        self.stamps, self.inner = [], inner

    def put(self, value):
        self.stamps.append(time.perf_counter())
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        if self.inner is not None:
            self.inner.end()

    @property
    def prefill(self):
        return self.stamps[1] - self.stamps[0]   # put(prompt) ... put(first token)

    @property
    def per_token_ms(self):
        gaps = sorted(b - a for a, b in zip(self.stamps[1:], self.stamps[2:]))
        return 1e3 * gaps[len(gaps) // 2] if gaps else float("nan")


QUESTIONS = ("What is this document about? Answer in one sentence.",
             "Name two things the document requires of someone who shares the work.")


def demo(args):
    """The real SmolLM2-135M-Instruct answers two questions about a long real text (a left-padded
    batch), hetero beside HF generate: greedy tokens identical, prefill and decode timings."""
    import torch

    from hetero import HeteroGenerator
    from hetero.models import english_text, load_smollm2

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    model, tok = load_smollm2(dtype)
    print(f"SmolLM2-135M-Instruct ({model.config.num_hidden_layers} layers, {args.dtype}) loaded in "
          f"{time.perf_counter() - t0:.1f} s")
    words = tok(english_text())["input_ids"]
    if args.context > len(words):
        raise ValueError(f"--context {args.context}: the demo's text has {len(words)} tokens")
    doc = tok.decode(words[:args.context])                         # the document's first N tokens
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\n{q}"}], add_generation_prompt=True,
                                     tokenize=False) for q in QUESTIONS]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):                               # left padding
        ids[b, S - len(p):] = torch.tensor(p)
        mask[b, S - len(p):] = 1
    print(f"{len(prompts)} questions over the same {args.context}-token document (prompts of "
          f"{[len(p) for p in prompts]} tokens), {args.new_tokens} new tokens, greedy")
    kw = dict(attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)
    hf_clock = _Clock()
    ref = model.generate(ids, streamer=hf_clock, **kw)
    with HeteroGenerator(model, cpu_workers=args.workers) as gen:
        het_clock = _Clock()
        out = gen.generate(ids, streamer=het_clock, **kw)
        workers = gen.cpu_workers
    same = torch.equal(out, ref)
    for q, row in zip(QUESTIONS, out):
        print(f"\nQ: {q}\nA: {tok.decode(row[S:], skip_special_tokens=True).strip()}")
    print(f"\n{'':38s} {'prefill (s)':>12s} {'decode ms/token':>16s}")
    print(f"{'HF generate (sdpa + DynamicCache)':38s} {hf_clock.prefill:12.2f} {hf_clock.per_token_ms:16.1f}")
    print(f"{f'hetero ({workers} CPU worker(s), KV in /dev/shm)':38s} {het_clock.prefill:12.2f} "
          f"{het_clock.per_token_ms:16.1f}   decode speedup {hf_clock.per_token_ms / het_clock.per_token_ms:.2f}x")
    print(f"tokens identical to HF: {same}")
    return 0 if same else 1


def chat(args):
    """Multi-turn chat with the embedded SmolLM2 (or --model PATH) over stdin: the conversation is
    one Context, so each turn prefills only its new tokens over the cached KV."""
    import sys

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    from hetero import CapacityError, HeteroGenerator
    from hetero.models import load_smollm2

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
        tok = AutoTokenizer.from_pretrained(args.model)
    else:
        model, tok = load_smollm2(dtype)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    sample = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    interactive = sys.stdin.isatty()
    ctx = None
    with HeteroGenerator(model, cpu_workers=args.workers) as gen:
        def restart(old, full):
            """A new context holding all of the conversation but its last token."""
            if old is not None:
                old.close()
            return gen.prefill(full[None, :-1], reserve=args.reserve)

        while True:
            try:
                line = input("you> " if interactive else "")
            except EOFError:
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            full = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
            if ctx is None or len(ctx.tokens) >= len(full) or not torch.equal(full[:len(ctx.tokens)], ctx.tokens):
                ctx = restart(ctx, full)      # first turn, or the template re-tokenized the history
            print("bot> ", end="", flush=True)
            clock = _Clock(TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
            kw = dict(max_new_tokens=args.max_new_tokens, streamer=clock, pad_token_id=tok.eos_token_id, **sample)
            fed = ctx.tokens
            try:
                out = gen.generate(full[None, len(fed):], context=ctx, **kw)
            except CapacityError:             # the conversation outgrew the context's reserve
                try:
                    ctx = restart(ctx, full)
                except CapacityError as e:    # past the model's positions: the chat is over
                    print(f"\n[{e}]")
                    break
                fed = ctx.tokens
                out = gen.generate(full[None, len(fed):], context=ctx, **kw)
            new = len(full) - len(fed)
            answer = tok.decode(out[0, len(full):], skip_special_tokens=True).strip()
            messages.append({"role": "assistant", "content": answer})
            print(f"     [{new} new tokens prefilled over {len(fed)} cached; first token after "
                  f"{clock.prefill:.2f} s, {clock.per_token_ms:.0f} ms/token]", flush=True)
        if ctx is not None:
            ctx.close()
    return 0


def info(args):
    from hetero import HeteroConfig

    n, cores = HeteroConfig(cpu_workers=args.workers).resolve_workers()
    print(f"usable cores: {sorted(os.sched_getaffinity(0))}")
    print(f"CPU workers: {n}, pinned to cores {[cores[r % len(cores)] for r in range(n)]}")
    return 0


SHAPES = {"llama3-8b": (32, 8, 128), "llama2-7b": (32, 32, 128)}


def profile(args):
    """Measure (or load) the planner profile for a head shape and print it with example plans."""
    import numpy as np
    import torch

    from hetero import HeteroConfig
    from hetero.cpu_attention.planner import ProfiledPlanner, profile_path
    from hetero.ipc.pool import WorkerPool
    from hetero.model_spec import ModelSpec
    from hetero.offload.arena import SessionLayout, whole_blocks
    from hetero.offload.session import STORAGE_CODES
    from hetero.profile import load_or_measure

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():       # before minutes of measuring
        raise ValueError(f"--device {args.device}: CUDA is not available here")
    Hq, Hkv, D = SHAPES[args.shape]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    spec = ModelSpec(model_type=args.shape, layers=1, q_heads=Hq, kv_heads=Hkv, head_dim=D, dtype=dtype,
                     max_positions=None, sliding=(False,))
    n, cores = HeteroConfig(cpu_workers=args.workers).resolve_workers()
    pool = WorkerPool(n, cores)
    try:
        prof, measured = load_or_measure(pool, spec, force=args.force)
    finally:
        pool.close()
    print(prof.describe())
    print(("measured now, saved to " if measured else "loaded from ") + profile_path(prof.fingerprint))
    planner = ProfiledPlanner(prof, n)
    print("decode-step plans (workers x splits), batch 1:")
    for L in (256, 1024, 4096, 16384, 65536, 262144):
        lay = SessionLayout(1, Hq, Hkv, D, whole_blocks(L + 1), 1, STORAGE_CODES[dtype])
        print(f"  context {L:7d}: {planner.plan(np.array([L]), 1, lay)}")
    from hetero.prefetch import policy

    rates = policy.measure(device, spec)
    print(f"continuing a context ({rates.describe()}): the new tokens attend on the device, over KV "
          "prefetched layer by layer, from this many on (else on the CPU workers):")
    for L in (4096, 16384, 65536, 262144):
        T = policy.crossover(prof, rates, spec, L, n)
        print(f"  context {L:7d}: {'never (pieces of up to 256 tokens)' if T is None else f'{T} new tokens'}")
    return 0


def temperature(text):
    """argparse type: a finite float >= 0 (0: greedy)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: greedy), got {text}")
    return value


def device(text):
    """argparse type: cpu or cuda[:N]."""
    import torch

    try:
        value = torch.device(text)
    except RuntimeError:
        value = None
    if value is None or value.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu or cuda[:N]")
    return text


def at_least(low):
    """argparse type: an int >= low."""
    def check(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return check


positive = at_least(1)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="hetero", description="heterogeneous CPU-GPU long-context inference")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the real SmolLM2-135M-Instruct answers questions about a long text: "
                                    "hetero beside HF generate")
    d.add_argument("--context", type=positive, default=3000, help="tokens of the document in each prompt")
    d.add_argument("--new-tokens", type=at_least(2), default=40, help="at least 2: decode is timed between tokens")
    d.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    d.add_argument("--workers", type=positive, default=None)
    d.set_defaults(fn=demo)
    c = sub.add_parser("chat", help="multi-turn chat (stdin) with the embedded SmolLM2: each turn prefills "
                                    "only its new tokens over the conversation's cached KV")
    c.add_argument("--model", default=None, help="a transformers causal LM directory (default: SmolLM2-135M-Instruct)")
    c.add_argument("--system", default=None, help="a system message")
    c.add_argument("--max-new-tokens", type=positive, default=128)
    c.add_argument("--temperature", type=temperature, default=0.0, help="0: greedy")
    c.add_argument("--reserve", type=positive, default=None, help="KV rows kept free for the conversation")
    c.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    c.add_argument("--workers", type=positive, default=None)
    c.set_defaults(fn=chat)
    i = sub.add_parser("info", help="what the engine would use on this machine")
    i.add_argument("--workers", type=positive, default=None)
    i.set_defaults(fn=info)
    p = sub.add_parser("profile", help="measure (or show the cached) per-core profile the decode planner uses")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--workers", type=positive, default=None)
    p.add_argument("--force", action="store_true", help="re-measure even if a cached profile matches")
    p.add_argument("--device", type=device, default=None, help="the model's device for the continuation crossover "
                                                    "(default: cuda when available, else cpu)")
    p.set_defaults(fn=profile)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine (continuous batching, "
                                     "LoRA adapters by model name, named contexts)")
    from hetero.server.main import add_arguments, serve

    add_arguments(s, positive)
    s.set_defaults(fn=serve)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (HeteroError, ValueError, OSError) as e:     # a user's input or machine: the message, no traceback
        print(f"hetero {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:                            # Ctrl-C: the generator has cleaned up on its way out
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
