"""Tiny real transformers models built from configs (no hub access), shared by the tests."""
import atexit
import os

# the suite makes ~700 worker pools: a cleanly closed pool's workers serve the next one (no fresh
# interpreter importing numba, ~0.5 s each; hetero.ipc.pool.REUSE). Tests of the default (workers
# exit at close) turn it off; the processes the tests start inherit it.
os.environ.setdefault("HETERO_REUSE_WORKERS", "1")
import shutil
import tempfile

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench import common
from hetero.ipc import shm

# planner profiles measured by the tests go to a throw-away cache, not the user's; processes the
# tests start (and may kill) inherit the pytest process's, which removes it at exit
if not os.path.basename(os.environ.get("HETERO_CACHE_DIR", "")).startswith("hetero-test-cache-"):
    os.environ["HETERO_CACHE_DIR"] = tempfile.mkdtemp(prefix="hetero-test-cache-")
    atexit.register(shutil.rmtree, os.environ["HETERO_CACHE_DIR"], True)



def pytest_sessionstart(session):
    """Load the attention kernel from numba's cache (compiled in a child on a cold cache) before any
    test compiles it here: the workers load the cached code, and the tests compare them bit for bit
    with this process (see hetero.worker.prepare_parent)."""
    from hetero.worker import prepare_parent

    prepare_parent(dict(os.environ), 600)


VOCAB = 160
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# model_type -> (config overrides, HF reference attention implementation)
FAMILIES = {
    "llama": ({}, "sdpa"),
    "mistral": ({"sliding_window": 6}, "sdpa"),
    "qwen2": ({"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}, "sdpa"),
    "qwen3": ({"head_dim": 32}, "sdpa"),
    "gemma2": ({"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24,
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0}, "eager"),
    "phi3": ({"num_key_value_heads": 4, "pad_token_id": 0}, "sdpa"),
    "gemma": ({"head_dim": 16}, "sdpa"),
    "gemma3_text": ({"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 16,
                     "layer_types": ["sliding_attention", "full_attention"]}, "sdpa"),
}


def build_model(model_type, dtype=torch.float32, seed=0, **overrides):
    extra, ref_impl = FAMILIES[model_type]
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ref_impl, dtype=dtype).eval()
    return model, ref_impl


def padded_batch(lengths=(12, 8, 5), seed=1):
    """Left-padded prompts of different lengths: (input_ids, attention_mask)."""
    return common.padded_batch(lengths, VOCAB, seed)


def our_segments(pid=None):
    names = shm.list_ours()
    return [n for n in names if pid is None or n.startswith(f"{shm.PREFIX}{pid}_")]


@pytest.fixture(scope="session")
def llama():
    return build_model("llama")[0]


@pytest.fixture(scope="session")
def llama_gen(llama):
    """One generator (and worker pool) shared by the tests that only need a working engine."""
    from hetero import HeteroGenerator

    gen = HeteroGenerator(llama, cpu_workers=2)
    yield gen
    gen.close()


class RaisingStreamer:
    """A streamer whose put() raises `error` at its n-th call (the prompt's is the first)."""

    def __init__(self, n, error):
        self.n, self.error, self.calls = n, error, 0

    def put(self, value):
        self.calls += 1
        if self.calls == self.n:
            raise self.error

    def end(self):
        pass
