"""hetero.cpu_linear: a CPU fp32 model's linear layers as torch.mm(W, X^T) at 1-5 rows and
oneDNN's linear at more in engine steps and a generator's calls; nn.Linear's own forward
everywhere else (HF generate itself); nn.Linear back when the last user is done."""
import copy

import pytest
import torch
import torch.nn.functional as F

from hetero import cpu_linear
from hetero.cpu_linear import _FastLinear
from tests.conftest import build_model
from tests.test_engine import assert_exact, make, prompts, run


@pytest.mark.parametrize("bias", [False, True])
def test_its_forward_equals_f_linear(bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=bias)
    model = torch.nn.Sequential(lin)
    assert cpu_linear.install(model) and type(lin) is _FastLinear
    try:
        for m in (*range(0, 11), 33, 130):
            for shape in ((m, 96), (1, m, 96), (m, 1, 96)):
                x = torch.randn(shape)
                ref = F.linear(x, lin.weight, lin.bias)
                with torch.inference_mode():
                    assert torch.equal(lin(x), ref)                   # outside an engine step: F.linear
                    token = cpu_linear.ACTIVE.set(True)
                    try:
                        y = lin(x)
                    finally:
                        cpu_linear.ACTIVE.reset(token)
                assert y.shape == ref.shape and y.is_contiguous()
                torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
                y.view(-1)                                            # the model views its output
    finally:
        cpu_linear.uninstall(model)
    assert type(lin) is torch.nn.Linear


def test_onednn_sees_a_bounded_set_of_row_counts(monkeypatch):
    """oneDNN keeps a primitive (~1 MB) per shape it ran: every row count 6-2048 reaches it as
    one of 30 buckets, past 16 rows at most 25 % above them (padded with zero rows), and the result
    is F.linear's."""
    assert [cpu_linear.bucket(m) for m in (6, 8, 9, 16, 17, 21, 33, 65, 512, 513)] == \
        [8, 8, 16, 16, 20, 24, 40, 80, 512, 640]
    buckets = {cpu_linear.bucket(m) for m in range(6, 2049)}
    assert len(buckets) == 30 and all(m <= cpu_linear.bucket(m) <= 1.25 * m for m in range(17, 4097))
    if cpu_linear._onednn_linear is None:
        pytest.skip("this torch has no oneDNN")
    seen, dnn = set(), cpu_linear._onednn_linear

    def spy(x, *args):
        seen.add(x.shape[0])
        return dnn(x, *args)

    monkeypatch.setattr(cpu_linear, "_onednn_linear", spy)
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40)
    model = torch.nn.Sequential(lin)
    cpu_linear.install(model)
    token = cpu_linear.ACTIVE.set(True)
    try:
        with torch.inference_mode():
            rows = (*range(6, 70), 300, 777)
            for m in rows:
                x = torch.randn(1, m, 24)
                y = lin(x)
                assert y.shape == (1, m, 40) and y.is_contiguous()
                torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    finally:
        cpu_linear.ACTIVE.reset(token)
        cpu_linear.uninstall(model)
    assert seen == {8, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 320, 896} == {cpu_linear.bucket(m) for m in rows}


def test_engines_use_it_while_open_and_the_last_puts_nn_linear_back(llama, monkeypatch):
    """A step with 1-5 decode tokens goes through torch.mm with the layers' weights on the left,
    a prompt chunk through oneDNN, and every request still gets HF's tokens; a second engine over the model keeps the layers
    _FastLinear when the first closes; a deep copy made meanwhile computes with its own weights;
    a bf16 model's layers are left alone."""
    linears = [m for m in llama.modules() if isinstance(m, torch.nn.Linear)]
    weights = {id(m.weight) for m in linears}
    mm, left = torch.mm, []

    def spy(a, b, *args, **kw):
        if id(a) in weights:
            left.append(a.shape)
        return mm(a, b, *args, **kw)

    dnn, rows = cpu_linear._onednn_linear, []

    def dnn_spy(x, w, *args):
        if id(w) in weights:
            rows.append(x.numel() // x.shape[-1])
        return dnn(x, w, *args)

    a = make(llama)
    b = make(llama)
    try:
        assert all(type(m) is _FastLinear for m in linears)
        twin = copy.deepcopy(llama)
        twin_lin = next(m for m in twin.modules() if isinstance(m, torch.nn.Linear))
        with torch.inference_mode():
            twin_lin.weight.mul_(2)
            x = torch.randn(3, twin_lin.in_features)
            token = cpu_linear.ACTIVE.set(True)
            try:
                y = twin_lin(x)
            finally:
                cpu_linear.ACTIVE.reset(token)
            torch.testing.assert_close(y, F.linear(x, twin_lin.weight), rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(torch, "mm", spy)
        if dnn is not None:
            monkeypatch.setattr(cpu_linear, "_onednn_linear", dnn_spy)
        ps = prompts([5, 40, 12], seed=2)
        streams = [a.add_request(p, 6, output_scores=True) for p in ps]
        run(a, streams)
        monkeypatch.setattr(torch, "mm", mm)
        for s, p in zip(streams, ps):
            assert_exact(llama, s, p, 6)
        assert left                                                  # the decode steps took it
        assert dnn is None or min(rows) >= 6 and max(rows) > 8       # the prompt steps took oneDNN
        a.close()
        assert all(type(m) is _FastLinear for m in linears)          # b still uses them
    finally:
        a.close()
        b.close()
    assert all(type(m) is torch.nn.Linear for m in linears)
    bf16 = build_model("llama", dtype=torch.bfloat16)[0]
    with make(bf16):
        assert not any(type(m) is _FastLinear for m in bf16.modules())



def test_a_generator_s_calls_use_it_and_hf_generate_does_not(llama_gen, llama, monkeypatch):
    """A generator's call through HF's loop (a left-padded batch of 3: decode steps at 3 rows)
    takes the torch.mm path, its prefill oneDNN's, and gives HF's tokens and scores; HF generate on the same model runs
    nn.Linear, and the layers are nn.Linear again after the call."""
    from tests.conftest import padded_batch

    weights = {id(m.weight) for m in llama.modules() if isinstance(m, torch.nn.Linear)}
    mm, left = torch.mm, []

    def spy(a, b, *args, **kw):
        if id(a) in weights:
            left.append(type(a))
        return mm(a, b, *args, **kw)

    dnn, rows = cpu_linear._onednn_linear, []

    def dnn_spy(x, w, *args):
        rows.append(x.numel() // x.shape[-1])
        return dnn(x, w, *args)

    ids, mask = padded_batch()
    llama.set_attn_implementation("sdpa")
    monkeypatch.setattr(torch, "mm", spy)
    if dnn is not None:
        monkeypatch.setattr(cpu_linear, "_onednn_linear", dnn_spy)
    ref = llama.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True)
    assert not left and not rows                                      # HF generate: F.linear
    out = llama_gen.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_scores=True)
    monkeypatch.setattr(torch, "mm", mm)
    assert left                                                       # the call's decode steps: torch.mm
    assert dnn is None or rows                                        # its prefill: oneDNN
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), rtol=1e-4, atol=1e-4)
    assert all(type(m) is torch.nn.Linear for m in llama.modules() if isinstance(m, torch.nn.Linear))


def test_a_strided_bias_and_a_forward_with_gradients_equal_f_linear():
    """Past five rows oneDNN reads a bias as contiguous (a strided view's, e.g. a fused bias's
    column, is copied first) and has no backward (with gradients wanted the layer is F.linear)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40)
    lin.bias = torch.nn.Parameter(torch.randn(40, 3)[:, 0])       # stride 3
    assert not lin.bias.is_contiguous()
    model = torch.nn.Sequential(lin)
    assert cpu_linear.install(model)
    token = cpu_linear.ACTIVE.set(True)
    try:
        for m in (3, 6, 8, 100):
            x = torch.randn(m, 24)
            with torch.inference_mode():
                torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
            x.requires_grad_()
            params = (x, lin.weight, lin.bias)
            got = torch.autograd.grad(lin(x).square().sum(), params)
            want = torch.autograd.grad(F.linear(x, lin.weight, lin.bias).square().sum(), params)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    finally:
        cpu_linear.ACTIVE.reset(token)
        cpu_linear.uninstall(model)
    assert type(lin) is torch.nn.Linear


def test_an_engine_that_fails_to_build_leaves_nn_linear():
    """The runner patches the layers last: an engine whose build raises after the pool (here a model
    whose forward takes no cache) leaves every layer an nn.Linear and no user counted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hetero import Engine, EngineConfig

    class NoCache(LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, use_cache=None, return_dict=None, logits_to_keep=0):
            return super().forward(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache,
                                   return_dict=return_dict, logits_to_keep=logits_to_keep)

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    model = NoCache(cfg).eval()
    with pytest.raises(TypeError, match="takes neither cache= nor past_key_values="):
        Engine(model, EngineConfig(kv_blocks=48, background=False, cpu_workers=1, max_model_len=256))
    assert all(type(m) is not _FastLinear for m in model.modules()) and model not in cpu_linear._USERS


def test_a_layer_hooked_for_adapters_before_the_patch_takes_it(monkeypatch):
    """LoRA hooks put on a plain nn.Linear before install (an engine loads its adapters before its
    runner patches the layers) call the layer's class forward as it is at the call: _FastLinear's."""
    from hetero.adapters.hooks import LoraHooks

    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40)
    model = torch.nn.Sequential(lin)
    hooks = LoraHooks(model)
    hooks.ensure("0", "site0")
    mm, left = torch.mm, []

    def spy(a, b, *args, **kw):
        left.append(a is lin.weight)
        return mm(a, b, *args, **kw)

    assert cpu_linear.install(model)
    monkeypatch.setattr(torch, "mm", spy)
    token = cpu_linear.ACTIVE.set(True)
    try:
        with torch.inference_mode():
            x = torch.randn(3, 24)
            y, ref = model(x), F.linear(x, lin.weight, lin.bias)
    finally:
        cpu_linear.ACTIVE.reset(token)
        monkeypatch.setattr(torch, "mm", mm)
        cpu_linear.uninstall(model)
        hooks.remove()
    assert any(left)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert type(lin) is torch.nn.Linear and "forward" not in lin.__dict__
