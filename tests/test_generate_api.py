"""generate()'s settings resolve as transformers resolves them (the model's generation_config
under the call's arguments, an explicit None included), what hetero cannot run is refused by
name, and its outputs are ordinary tensors without a dead cache, as HF's are."""
import contextlib
import copy

import numpy as np
import pytest
import torch

from hetero import HeteroGenerator, compat
from tests.conftest import build_model, padded_batch

SCORES = dict(return_dict_in_generate=True, output_scores=True)


@contextlib.contextmanager
def transformers_warnings():
    """The messages transformers logs meanwhile (its loggers do not reach pytest's caplog)."""
    import logging

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    root = logging.getLogger("transformers")
    handler = Keep(logging.WARNING)
    root.addHandler(handler)
    try:
        yield messages
    finally:
        root.removeHandler(handler)


def same(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def shared():
    """One model and one generator for the module (a worker pool each costs a second here)."""
    model = build_model("llama")[0]
    with HeteroGenerator(model, cpu_workers=1) as gen:
        yield model, gen


@pytest.fixture
def model(shared):
    """The module's model, its generation_config put back after each test (the tests edit it)."""
    saved = copy.deepcopy(shared[0].generation_config)
    yield shared[0]
    shared[0].generation_config = saved


@pytest.fixture
def gen(shared):
    return shared[1]


def test_max_new_tokens_omitted_as_transformers_decides(model, gen):
    ids, mask = padded_batch()
    assert model.generation_config.max_length is None             # transformers 5: 20 new tokens
    out, ref = gen.generate(ids, attention_mask=mask), model.generate(ids, attention_mask=mask)
    assert out.shape == ref.shape == (3, 12 + 20) and torch.equal(out, ref)
    ctx = gen.prefill(ids[:1, 4:])
    assert gen.generate(ids[:1, :2], context=ctx, eos_token_id=None).shape == (1, 8 + 2 + 20)
    model.generation_config.max_length = 16                       # a checkpoint's: prompt included
    with transformers_warnings() as warned:
        out, ref = gen.generate(ids, attention_mask=mask), model.generate(ids, attention_mask=mask)
        assert out.shape == ref.shape == (3, 16) and torch.equal(out, ref)
        with gen.prefill(ids[:1, 4:]) as ctx2:                    # 8 tokens, 2 new: 6 to generate
            assert gen.generate(ids[:1, :2], context=ctx2, eos_token_id=None).shape == (1, 16)
    assert not [w for w in warned if "max_length" in w]           # HF's "both ... set": hetero set neither
    ctx.close()
    with pytest.raises(ValueError, match="max_length is 16"):
        gen.generate(torch.cat([ids[:1], ids[:1]], 1))          # row 0: 12 real tokens, twice


def test_explicit_none_overrides_the_models_generation_config(model, gen):
    ids, mask = padded_batch()
    gc = model.generation_config
    eos = int(model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)[0, 12 + 2])
    gc.eos_token_id, gc.pad_token_id = eos, 0                          # row 0 emits it at its 3rd step
    for kw in ({"eos_token_id": None},                            # runs to the end, as HF
               {"pad_token_id": None, "eos_token_id": eos},       # finished rows padded with eos
               {}):
        kw = dict(kw, max_new_tokens=8, **SCORES)
        same(gen.generate(ids, attention_mask=mask, **kw), model.generate(ids, attention_mask=mask, **kw))
    gc.do_sample, gc.top_k = True, 5
    for kw in ({"top_k": None}, {}):                              # None: no top-k at all
        torch.manual_seed(3)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, **kw)
        torch.manual_seed(3)
        assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=8, **kw), ref)


def test_settings_hetero_does_not_run_are_refused_by_name(model, gen):
    ids, mask = padded_batch()
    base = copy.deepcopy(model.generation_config)
    model.generation_config.cache_implementation = "static"       # a checkpoint's: hetero's cache replaces it
    same(gen.generate(ids, attention_mask=mask, max_new_tokens=4, **SCORES),
         model.generate(ids, attention_mask=mask, max_new_tokens=4, **SCORES))
    for field, value in (("num_beams", 2), ("num_return_sequences", 2), ("use_cache", False),
                         ("guidance_scale", 1.5), ("output_hidden_states", True)):
        model.generation_config = copy.deepcopy(base)
        setattr(model.generation_config, field, value)
        model.generation_config.do_sample = field == "num_return_sequences"
        model.generation_config.return_dict_in_generate = field == "output_hidden_states"   # else inert in HF
        with pytest.raises(ValueError, match=f"'{field}'"):       # set in the model's generation_config
            gen.generate(ids, attention_mask=mask, max_new_tokens=2)
    model.generation_config = base
    with pytest.raises(ValueError, match="'num_return_sequences'"):   # or in the call
        gen.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True, num_return_sequences=2)
    noop = dict(num_beams=1, use_cache=True, output_attentions=False, num_return_sequences=1, penalty_alpha=0.6,
                top_k=1)                                               # values transformers runs as plain greedy
    same(gen.generate(ids, attention_mask=mask, max_new_tokens=2, **noop, **SCORES),
         model.generate(ids, attention_mask=mask, max_new_tokens=2, **noop, **SCORES))
    assert gen.generate(ids, attention_mask=mask, max_new_tokens=2).shape == (3, 14)   # still usable


@pytest.mark.parametrize("kw", [dict(suppress_tokens=[5, 7], begin_suppress_tokens=[9], min_length=16),
                                dict(bad_words_ids=[[11], [12, 13]], sequence_bias={(14,): 2.0}, forced_eos_token_id=2),
                                dict(do_sample=True, epsilon_cutoff=3e-3, exponential_decay_length_penalty=(2, 1.5),
                                     eos_token_id=2, renormalize_logits=True)])
def test_transformers_logits_processors_by_keyword(model, gen, kw):
    ids, mask = padded_batch()
    kw = dict(kw, max_new_tokens=6, pad_token_id=0, **SCORES)
    torch.manual_seed(2)
    ref = model.generate(ids, attention_mask=mask, **kw)
    torch.manual_seed(2)
    same(gen.generate(ids, attention_mask=mask, **kw), ref)


def test_outputs_are_ordinary_tensors_without_a_cache(model, gen):
    ids, mask = padded_batch()
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=3, **SCORES)
    with gen.prefill(ids[:1, 4:]) as ctx:
        ctx_out = gen.generate(ids[:1, :2], context=ctx, max_new_tokens=3, **SCORES)
    for o in (out, ctx_out):
        assert compat.output_cache(o) is None                              # hetero's cache closed with the call
        assert not o.sequences.is_inference() and not o.scores[0].is_inference()
        o.scores[0].div_(2)                                           # in place, as on HF's outputs
    loss = model(out.sequences, labels=out.sequences).loss            # and into a training step
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_prefix_reuse_returns_hfs_sequences_on_an_early_stop_and_odd_padding(model, gen, monkeypatch):
    """A prompt continuing a live context (automatic reuse) returns exactly HF's sequences: an
    EOS before max_new_tokens, pad cells holding another id than the pad, a prompt padded wider
    than its longest row (logits processors, min_length among them, see every column)."""
    g = torch.Generator().manual_seed(5)
    doc = torch.randint(3, 160, (40,), generator=g)
    qs = [torch.randint(3, 160, (n,), generator=g) for n in (5, 3)]
    calls = []
    with gen.prefill(doc[None]):
        real_one, real_many = gen._generate_in_context, gen._generate_in_contexts
        monkeypatch.setattr(gen, "_generate_in_context", lambda *a, **k: calls.append("one") or real_one(*a, **k))
        monkeypatch.setattr(gen, "_generate_in_contexts", lambda *a, **k: calls.append("many") or real_many(*a, **k))
        full = torch.cat([doc, qs[0]])[None]
        eos = int(model.generate(full, max_new_tokens=4, pad_token_id=0)[0, -1])
        kw = dict(max_new_tokens=10, eos_token_id=eos, pad_token_id=0, **SCORES)
        out, ref = gen.generate(full, **kw), model.generate(full, **kw)
        assert out.sequences.shape[1] < full.shape[1] + 10 and calls == ["one"]    # reused, stopped early
        same(out, ref)
        rows = [torch.cat([doc, q]) for q in qs]
        W = max(map(len, rows)) + 2                                         # two columns of pads too many
        for pad_cell in (0, 9):                                             # 9: not the pad id
            ids = torch.full((2, W), pad_cell)
            mask = torch.zeros(2, W, dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, W - len(r):], mask[b, W - len(r):] = r, 1
            kw = dict(max_new_tokens=5, pad_token_id=0, min_length=W + 3, repetition_penalty=1.3, **SCORES)
            same(gen.generate(ids, attention_mask=mask, **kw), model.generate(ids, attention_mask=mask, **kw))
        assert calls == ["one", "many"]         # pads of another id: the ordinary path (the one-shot sequences)


def test_seeded_sampling_matches_hf_on_the_call_that_measures_the_profile(model, tmp_path, monkeypatch):
    """The planner's profile is measured inside the first generate on a machine: it draws its
    synthetic KV from its own generator, so a seeded sampling run is HF's from the first call."""
    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))                  # no cached profile
    ids, mask = padded_batch()
    kw = dict(do_sample=True, top_k=20, max_new_tokens=6, pad_token_id=0)
    torch.manual_seed(11)
    ref = model.generate(ids, attention_mask=mask, **kw)
    with HeteroGenerator(model, cpu_workers=1) as gen:
        torch.manual_seed(11)
        out = gen.generate(ids, attention_mask=mask, **kw)
    assert list(tmp_path.glob("profile-*.json"))                           # it was measured in this call
    assert torch.equal(out, ref)


def test_bad_input_is_named(llama, llama_gen):
    from hetero import HeteroConfig

    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="outside the model's vocabulary of 160"):
        llama_gen.generate(torch.cat([ids, torch.full((3, 1), 160)], 1), max_new_tokens=2)
    with pytest.raises(ValueError, match="token id -1"):
        llama_gen.generate(ids - 1, max_new_tokens=2)
    for bad in (0, -1, "5"):
        with pytest.raises(ValueError, match="reserve must be a positive int"):
            llama_gen.prefill(ids[:1], reserve=bad)
    with pytest.raises(TypeError, match="context= takes a Context"):
        llama_gen.generate(ids[:1], context="doc", max_new_tokens=2)
    with pytest.raises(TypeError, match="adapters= takes"):
        HeteroGenerator(llama, adapters=5)
    for bad in (1, (True,), (0.0,)):
        with pytest.raises(ValueError, match="worker_cores"):
            HeteroConfig(worker_cores=bad)
    import numpy as np

    assert HeteroConfig(worker_cores=np.array([0])).worker_cores == (0,)
    with pytest.raises(ValueError, match="spin_budget"):
        HeteroConfig(spin_budget=1 << 63)
    assert llama_gen.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0).shape == (3, 14)


def test_no_attention_mask_is_inferred_from_the_pad_as_transformers_does(llama, llama_gen):
    ids, mask = padded_batch()                        # pad 0 on the left, eos 2
    ref = llama.generate(ids, max_new_tokens=4, pad_token_id=0)          # HF infers ids != 0
    assert torch.equal(ref, llama.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0))
    assert torch.equal(llama_gen.generate(ids, max_new_tokens=4, pad_token_id=0), ref)


def test_outputs_hold_no_cache_in_their_mapping_either(llama_gen):
    ids, mask = padded_batch()
    out = llama_gen.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, **SCORES)
    assert compat.OUTPUT_CACHE_FIELD not in out.keys() and all(not hasattr(x, "layers") for x in out.to_tuple())


def test_hetero_calls_no_deprecated_transformers_api(llama_gen, caplog):
    """No deprecation notice from transformers comes from hetero's own calls (transformers 5.24
    renamed past_key_values to cache; its notice is a warning_once in the log, or a FutureWarning):
    a one-shot call, a chunked prefill, a context and its continuation."""
    import warnings

    from transformers.utils import logging as hf_logging

    from hetero import HeteroConfig

    hf_logging.warning_once.cache_clear()          # a notice already given in this process is given again
    hf_logging.enable_propagation()
    ids, mask = padded_batch()
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
            warnings.simplefilter("always")
            llama_gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, **SCORES)
            ctx = llama_gen.prefill(ids[:1, 3:])
            llama_gen.generate(ids[:1, :2], context=ctx, max_new_tokens=2,
                               pad_token_id=0, **SCORES)
            ctx.close()
            with HeteroGenerator(llama_gen.model, cpu_workers=1, config=HeteroConfig(prefill_chunk=4)) as gen:
                gen.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
    finally:
        hf_logging.disable_propagation()
    notices = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    notices += [r.getMessage() for r in caplog.records if "deprecat" in r.getMessage().lower()]
    assert notices == []


def test_penalty_alpha_without_top_k_is_greedy_as_in_transformers(model, gen):
    """transformers runs contrastive search only with penalty_alpha > 0 and top_k > 1; else the
    plain mode, which hetero runs too."""
    ids, mask = padded_batch()
    model.generation_config.penalty_alpha = 0.6                     # a checkpoint's
    kw = dict(attention_mask=mask, max_new_tokens=4, top_k=1, pad_token_id=0, **SCORES)
    same(gen.generate(ids, **kw), model.generate(ids, **kw))
    with pytest.raises(ValueError, match="'penalty_alpha'"):
        gen.generate(ids, **dict(kw, top_k=4))
    kw = dict(kw, top_k=4, do_sample=True)                             # sampling: penalty_alpha unused
    torch.manual_seed(5)
    ref = model.generate(ids, **kw)
    torch.manual_seed(5)
    same(gen.generate(ids, **kw), ref)


def test_max_time_counts_the_continuations_prefill(gen, monkeypatch):
    """max_time is the call's: a context's new tokens are prefilled before transformers' loop
    starts, and that time counts (here a slow prefill uses it all: one token, as transformers
    stops after a token once the time is over)."""
    import time

    ids, _ = padded_batch()
    feed = type(gen)._feed
    monkeypatch.setattr(type(gen), "_feed", lambda self, *a, **k: (time.sleep(0.5), feed(self, *a, **k))[1])
    with gen.prefill(ids[:1, 4:]) as ctx:
        out = gen.generate(ids[:1, :3], context=ctx, max_new_tokens=6, eos_token_id=None, max_time=0.3,
                           extend_context=False)
        assert out.shape == (1, 8 + 3 + 1)
        out = gen.generate(ids[:1, :3], context=ctx, max_new_tokens=6, eos_token_id=None, max_time=30.0,
                           extend_context=False)
        assert out.shape == (1, 8 + 3 + 6)


def test_a_users_max_time_criteria_takes_precedence_as_in_transformers(model, gen):
    from transformers import MaxTimeCriteria, StoppingCriteriaList

    ids, mask = padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=0, eos_token_id=None, max_time=0.0,
              stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(100.0)]))
    out, ref = gen.generate(ids, **kw), model.generate(ids, **kw)
    assert out.shape == ref.shape == (3, 12 + 6) and torch.equal(out, ref)


def test_a_batch_of_contexts_without_a_mask_infers_it_from_the_pad(model, gen):
    """As generate without contexts: the left pads of the new tokens are masked (they were
    attended as tokens), equal to HF over [context, new tokens] with its own inferred mask."""
    doc = torch.arange(3, 43)[None]
    q = torch.tensor([[9, 73, 155, 24, 109], [0, 0, 0, 26, 5]])
    with gen.prefill(doc) as ctx:
        out = gen.generate(q, context=[ctx, ctx], max_new_tokens=4, pad_token_id=0, eos_token_id=None)
    full = torch.stack([torch.cat([doc[0], q[0]]), torch.cat([torch.zeros(3, dtype=torch.long), doc[0], q[1, 3:]])])
    ref = model.generate(full, max_new_tokens=4, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out[:, -4:], ref[:, -4:])


def test_a_rotary_model_runs_past_max_position_embeddings_as_in_transformers(model, gen):
    """transformers runs a RoPE model past max_position_embeddings (with a reminder): so does hetero,
    in one pass, in a context and in a batch of contexts, with HF's tokens and scores."""
    M = model.config.max_position_embeddings
    ids = torch.randint(3, 100, (1, M - 4), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=None, **SCORES)
    same(gen.generate(ids, **kw), model.generate(ids, **kw))
    doc, q = ids[:, :-2], ids[:, -2:]
    with gen.prefill(doc) as ctx:                                  # the default reserve: past M too
        assert ctx.capacity >= M
        same(gen.generate(q, context=[ctx], **kw), model.generate(ids, **kw))
        same(gen.generate(q, context=ctx, **kw), model.generate(ids, **kw))
    same(gen.generate(torch.full((1, M), 5), **kw), model.generate(torch.full((1, M), 5), **kw))


def test_a_model_whose_positions_end_at_max_position_embeddings_is_refused_there():
    """A learned position table (GPT-2: transformers fails with an IndexError past it) or a rope
    that rescales with the length ("dynamic": a chunk would rotate differently) ends at
    max_position_embeddings: hetero names it before it allocates."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hetero import CapacityError

    cfg = AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, n_positions=24, vocab_size=128,
                               bos_token_id=1, eos_token_id=2)
    gpt2 = AutoModelForCausalLM.from_config(cfg).eval()
    dynamic = build_model("llama", num_hidden_layers=1, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                         "rope_theta": 10000.0})[0]
    with pytest.raises(IndexError):
        gpt2.generate(torch.randint(3, 100, (1, 12)), max_new_tokens=20, pad_token_id=0)
    ids = torch.randint(3, 100, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2], ids[1, :8], mask[1, :8] = 0, 0, 0, 0    # 20 + 6 > 24, each row's own positions fit
    kw = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=None, **SCORES)
    ref = gpt2.generate(ids, attention_mask=mask, **kw)
    with HeteroGenerator(gpt2, cpu_workers=1) as g:
        same(g.generate(ids, attention_mask=mask, **kw), ref)
        with g.prefill(ids[:1, 2:10]), g.prefill(ids[1:, 8:12]):     # live prefixes of both rows: reused
            same(g.generate(ids, attention_mask=mask, **kw), ref)
        with g.prefill(ids[:1, 2:18]) as ctx:           # 16 + 2 + 7 - 1 = 24 fits (the last token is not fed)
            kw7 = dict(kw, max_new_tokens=7)
            same(g.generate(ids[:1, 18:], context=ctx, extend_context=False, **kw7), gpt2.generate(ids[:1, 2:], **kw7))
            for context in (ctx, [ctx]):
                with pytest.raises(CapacityError, match=r"25 positions exceed the model's max_position_embeddings"):
                    g.generate(ids[:1, 18:], context=context, max_new_tokens=8)
    for m, M in ((gpt2, 24), (dynamic, 256)):
        with HeteroGenerator(m, cpu_workers=1) as g:
            assert g.spec.position_limit == M
            with pytest.raises(CapacityError, match=rf"\+ max_new_tokens \(20\) needs {M + 7} positions .*\({M}\); "
                                                    "hetero runs past it only a rotary"):
                g.generate(torch.randint(3, 100, (1, M - 12)), max_new_tokens=20)
            calls = ((M + 1, lambda: g.generate(torch.full((1, M + 1), 5), max_new_tokens=1)),
                     (M, lambda: g.prefill(torch.full((1, M), 5))))                 # a reserve's rows are all fed
            for n, call in calls:
                with pytest.raises(CapacityError, match=rf"prompt \({n} positions\) leaves no room") as e:
                    call()
                assert "reserve" not in str(e.value) and "max_new_tokens" not in str(e.value)


def test_the_last_new_token_needs_no_position_and_no_kv_row():
    """generate chooses its last new token without feeding it: with learned positions (GPT-2,
    n_positions=64) prompt 64 + 1 new, 60 + 5 and 63 + 2 run as in transformers (they were refused
    one position early); past that, where transformers would index past its position table, a
    CapacityError. Likewise max_cache_tokens=256 holds prompt 250 + 7 new: 256 rows are written."""
    from transformers import GPT2Config, AutoModelForCausalLM

    from hetero import CapacityError, HeteroConfig

    cfg = GPT2Config(vocab_size=160, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(5)
    kw = dict(pad_token_id=0, eos_token_id=None, do_sample=False, **SCORES)
    with HeteroGenerator(gpt2, cpu_workers=1) as gen:
        for prompt, new in ((64, 1), (60, 5), (63, 2)):
            ids = torch.randint(3, 160, (1, prompt), generator=g)
            same(gen.generate(ids, max_new_tokens=new, **kw), gpt2.generate(ids, max_new_tokens=new, **kw))
        for prompt, new in ((64, 2), (65, 1)):
            ids = torch.randint(3, 160, (1, prompt), generator=g)
            with pytest.raises(IndexError):                          # transformers runs off its position table
                gpt2.generate(ids, max_new_tokens=new, **kw)
            with pytest.raises(CapacityError, match=r"max_position_embeddings \(64\)"):
                gen.generate(ids, max_new_tokens=new, **kw)
        with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
            gen.generate(torch.randint(3, 160, (1, 65), generator=g), max_new_tokens=0)
    llama = build_model("llama")[0]
    ids = torch.randint(3, 160, (1, 250), generator=g)
    kw = dict(pad_token_id=0, **SCORES)
    with HeteroGenerator(llama, config=HeteroConfig(cpu_workers=1, max_cache_tokens=256)) as gen:
        same(gen.generate(ids, max_new_tokens=7, **kw), llama.generate(ids, max_new_tokens=7, **kw))
        with pytest.raises(CapacityError, match=r"needs 257 KV rows \(prompt 250 \+ 8 new.*max_cache_tokens=256"):
            gen.generate(ids, max_new_tokens=8)


def test_pad_ids_hetero_cannot_mask_are_named(gen):
    """Without an attention_mask transformers masks every pad id; hetero takes left padding only
    (and none in a context's new tokens): a pad id among the tokens names itself and the way out."""
    ids, _ = padded_batch()
    mid = ids[:1].clone()
    mid[0, 6] = 0
    with pytest.raises(ValueError, match="pad_token_id 0 after a token"):
        gen.generate(mid, max_new_tokens=2, pad_token_id=0)
    with gen.prefill(ids[:1, 4:]) as ctx:
        for q in (torch.tensor([[0, 9, 24]]), torch.tensor([[9, 0, 24]])):
            with pytest.raises(ValueError, match="pad_token_id 0 and no attention_mask"):
                gen.generate(q, context=ctx, max_new_tokens=2, pad_token_id=0)
        out = gen.generate(q, attention_mask=torch.ones_like(q), context=ctx, max_new_tokens=2, pad_token_id=0)
        assert out.shape == (1, 8 + 3 + 2)


def test_an_explicit_max_new_tokens_none_sets_the_models_aside_as_in_transformers(model, gen):
    """max_new_tokens=None in the call cancels the model's generation_config.max_new_tokens (as
    transformers' GenerationConfig.update does): 20 new tokens, or up to the model's max_length."""
    ids, mask = padded_batch()
    gc = model.generation_config
    gc.max_new_tokens = 7
    for kw in ({}, {"max_new_tokens": None}):
        out, ref = gen.generate(ids, attention_mask=mask, **kw), model.generate(ids, attention_mask=mask, **kw)
        assert out.shape == ref.shape and torch.equal(out, ref)
    assert ref.shape[1] == 12 + 20
    gc.max_new_tokens, gc.max_length = 4, 30
    with transformers_warnings() as warned:
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=None)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=None)
    assert out.shape == ref.shape == (3, 30) and torch.equal(out, ref)
    assert not [w for w in warned if "max_length" in w]


@pytest.mark.parametrize("pad", [np.int64(0), torch.tensor(0)])
def test_a_pad_id_given_as_a_numpy_int_or_a_tensor_masks_the_pads(model, gen, pad):
    """pad_token_id as transformers takes it (a numpy integer, a 0-d tensor), no attention_mask:
    the pads are masked as in transformers, not attended."""
    ids, _ = padded_batch()
    kw = dict(max_new_tokens=5, pad_token_id=pad, eos_token_id=None, **SCORES)
    same(gen.generate(ids, **kw), model.generate(ids, **kw))
    model.generation_config.pad_token_id = pad
    kw.pop("pad_token_id")
    same(gen.generate(ids, **kw), model.generate(ids, **kw))


def test_a_watermarking_config_given_as_a_dict_on_the_model_runs_as_in_transformers(model, gen):
    ids, mask = padded_batch()
    model.generation_config.watermarking_config = {"greenlist_ratio": 0.5, "bias": 4.0, "context_width": 1}
    kw = dict(max_new_tokens=5, pad_token_id=0, **SCORES)
    same(gen.generate(ids, attention_mask=mask, **kw), model.generate(ids, attention_mask=mask, **kw))


def test_max_length_in_the_call_counts_the_whole_sequence_as_in_transformers(model, gen):
    """max_length= (prompt included; for a context, the context's tokens too) as transformers takes
    it: alone, or beside max_new_tokens (which then wins, with transformers' own warning)."""
    ids, mask = padded_batch()
    for kw in ({"max_length": 17}, {"max_length": 17, "max_new_tokens": 3}):
        out = gen.generate(ids, attention_mask=mask, pad_token_id=0, **kw)
        assert torch.equal(out, model.generate(ids, attention_mask=mask, pad_token_id=0, **kw))
    assert out.shape == (3, 15)
    model.generation_config.max_length = 16                       # the call's wins over the model's
    with transformers_warnings() as warned:
        out = gen.generate(ids, attention_mask=mask, pad_token_id=0, max_length=30)
    assert out.shape == (3, 30) and torch.equal(out, model.generate(ids, attention_mask=mask, pad_token_id=0,
                                                                    max_length=30))
    assert not [w for w in warned if "max_length" in w]
    with gen.prefill(ids[:1, 4:]) as ctx:                          # 8 cached + 2 new: 6 to generate
        out = gen.generate(ids[:1, :2], context=ctx, extend_context=False, max_length=16, pad_token_id=0)
        assert out.shape == (1, 16) and torch.equal(
            out, model.generate(torch.cat([ids[:1, 4:], ids[:1, :2]], 1), max_length=16, pad_token_id=0))
    for bad, match in ((0, "positive int"), (2.5, "positive int"), (12, "max_length is 12: no room")):
        with pytest.raises(ValueError, match=match):
            gen.generate(ids, attention_mask=mask, max_length=bad)


def test_a_model_in_training_mode_with_dropout_is_refused(gen):
    """transformers' generate drops activations at random on a model left in training mode with
    dropout; hetero's attention would not: refused by name (without dropout, training mode runs)."""
    model = gen.model
    ids, mask = padded_batch()
    cfg = model.config
    saved = cfg.attention_dropout
    try:
        model.train()
        gen.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)    # p = 0 everywhere: runs
        cfg.attention_dropout = 0.1
        with pytest.raises(ValueError, match=r"training mode with dropout \(p=0.1\).*model.eval\(\)"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
    finally:
        cfg.attention_dropout = saved
        model.eval()


def test_a_generation_config_in_the_call_resolves_as_in_transformers(model, gen):
    """generation_config= as transformers takes it: its fields win over the model's, fields it
    leaves None take the model's, the call's keywords win over it; not a GenerationConfig: named."""
    from transformers import GenerationConfig

    ids, mask = padded_batch()
    eos = int(model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)[0, 12 + 2])
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, 0
    model.generation_config.max_new_tokens = 3
    user = GenerationConfig(max_new_tokens=8, repetition_penalty=1.3, custom_entry="kept inert")
    calls = ({"generation_config": user},                                  # the model's eos and pad, its 8 tokens
             {"generation_config": user, "max_new_tokens": 5, "eos_token_id": None},   # keywords win
             {"generation_config": GenerationConfig(eos_token_id=None, max_length=17)},  # None: the model's
             {"generation_config": None})
    for kw in calls:
        out = gen.generate(ids, attention_mask=mask, **kw, **SCORES)
        same(out, model.generate(ids, attention_mask=mask, **kw, **SCORES))
    assert user.max_new_tokens == 8 and user.eos_token_id is None      # the caller's object is not changed
    model.generation_config.max_new_tokens = None
    with gen.prefill(ids[:1, 4:]) as ctx:                                 # 8 cached + 2 new
        out = gen.generate(ids[:1, :2], context=ctx, extend_context=False,
                           generation_config=GenerationConfig(max_length=16, num_beams=1))
        assert out.shape == (1, 16)
    with pytest.raises(ValueError, match="'num_beams'"):
        gen.generate(ids, attention_mask=mask, generation_config=GenerationConfig(num_beams=2))
    with pytest.raises(TypeError, match="generation_config must be a transformers GenerationConfig, got dict"):
        gen.generate(ids, attention_mask=mask, generation_config={"max_new_tokens": 2})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_a_float_or_bool_attention_mask_of_zeros_and_ones_runs_as_in_transformers(model, gen, dtype):
    ids, mask = padded_batch()
    kw = dict(max_new_tokens=4, pad_token_id=0, **SCORES)
    same(gen.generate(ids, attention_mask=mask.to(dtype), **kw), model.generate(ids, attention_mask=mask, **kw))


def test_every_generation_config_field_is_taken_as_a_keyword(model, gen):
    """Any GenerationConfig field is a generate keyword, as in transformers (watermarking_config,
    top_h: exact); what hetero does not run is refused by value (token_healing rewrites the prompt)."""
    from transformers import GenerationConfig, WatermarkingConfig

    ids, mask = padded_batch()
    for kw in ({"watermarking_config": WatermarkingConfig(bias=4.0)}, {"do_sample": True, "top_h": 0.5},
               {"length_penalty": 2.0, "early_stopping": True}):                # beam-search fields: inert
        kw = dict(kw, max_new_tokens=5, pad_token_id=0, **SCORES)
        torch.manual_seed(1)
        ref = model.generate(ids, attention_mask=mask, **kw)
        torch.manual_seed(1)
        same(gen.generate(ids, attention_mask=mask, **kw), ref)
    with pytest.raises(ValueError, match="'token_healing'"):
        gen.generate(ids, attention_mask=mask, max_new_tokens=2, token_healing=True)
    for kw in ({"cache_implementation": "quantized"}, {"generation_config": GenerationConfig(cache_implementation="paged")}):
        with pytest.raises(ValueError, match="cache_implementation=.*hetero's KV cache replaces"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=2, **kw)
    model.generation_config.cache_implementation = "static"        # a checkpoint's, also in a copy of it: set aside
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                       generation_config=copy.deepcopy(model.generation_config))
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                                           cache_implementation=None))
    with pytest.raises(TypeError, match=r"unsupported arguments \['assistant_model'\]"):
        gen.generate(ids, attention_mask=mask, max_new_tokens=2, assistant_model=model)


def test_what_transformers_takes_as_it_takes_it(model, gen):
    """max_new_tokens as a numpy integer or a 0-d tensor, output_hidden_states / output_attentions
    without return_dict_in_generate (transformers returns the sequences alone: inert), the prompt
    as inputs= (transformers' name): the same sequences as HF."""
    ids, mask = padded_batch()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=3)
    for kw in (dict(max_new_tokens=np.int64(3)), dict(max_new_tokens=torch.tensor(3)),
               dict(max_new_tokens=3, output_hidden_states=True, output_attentions=True)):
        assert torch.equal(gen.generate(ids, attention_mask=mask, **kw), ref)
    assert torch.equal(gen.generate(inputs=ids, attention_mask=mask, max_new_tokens=3), ref)
    assert torch.equal(gen.generate(ids, inputs=None, attention_mask=mask, max_new_tokens=3), ref)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_length=np.int64(ids.shape[1] + 3)), ref)
    with pytest.raises(TypeError, match="both input_ids and inputs"):
        gen.generate(ids, inputs=ids, max_new_tokens=3)
    with pytest.raises(TypeError, match="needs the prompt's token ids"):
        gen.generate(attention_mask=mask, max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        gen.generate(ids, attention_mask=mask, max_new_tokens=torch.tensor(3.0))


def test_pad_ids_among_a_contexts_tokens_are_named_without_a_mask(model, gen):
    """transformers, given [context, new tokens] without a mask, masks every pad id in it; a
    context attends every token it holds: named (one context or a list), and runs as HF with a
    mask of ones when the call passes one."""
    doc = torch.tensor([[5, 9, 0, 24, 109, 7, 31]])             # a pad id (0) inside the document
    q = torch.tensor([[12, 13]])
    with gen.prefill(doc) as ctx:
        for context in (ctx, [ctx]):
            with pytest.raises(ValueError, match="the context's tokens hold pad_token_id 0"):
                gen.generate(q, context=context, max_new_tokens=2, pad_token_id=0, eos_token_id=None)
        out = gen.generate(q, attention_mask=torch.ones_like(q), context=ctx, max_new_tokens=3, pad_token_id=0,
                           eos_token_id=None, extend_context=False)
    full = torch.cat([doc, q], 1)
    ref = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=3, pad_token_id=0,
                         eos_token_id=None)
    assert torch.equal(out, ref)


def test_a_dtype_change_after_the_generator_was_built_is_refused():
    """The KV arena and kernels are built in the model's dtype: after model.float() a call is
    refused (it read bf16-rounded KV for an fp32 model before), and a new generator runs."""
    model = build_model("llama")[0].to(torch.bfloat16)
    ids, mask = padded_batch()
    with HeteroGenerator(model, cpu_workers=1) as gen:
        gen.generate(ids, attention_mask=mask, max_new_tokens=2)
        model.float()
        with pytest.raises(ValueError, match="in torch.float32 now, but this HeteroGenerator was built over it in "
                                             "torch.bfloat16"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=2)
        with pytest.raises(ValueError, match="build a new HeteroGenerator"):
            gen.prefill(ids[:1, 4:])
    with HeteroGenerator(model, cpu_workers=1) as gen:
        same(gen.generate(ids, attention_mask=mask, max_new_tokens=3, **SCORES),
             model.generate(ids, attention_mask=mask, max_new_tokens=3, **SCORES))
