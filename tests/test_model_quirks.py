"""Families whose generate differs from the common path: Phi-3's LongRoPE (transformers drops the
cache and recomputes every key when a sequence passes original_max_position_embeddings), models
that .view() the attention output, encoders run as LMs (bidirectional attention), and a model
whose forward takes no position ids. Each is exact where hetero runs it, and refused by name
where it cannot be."""
import copy
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench import model_sweep
from hetero import HeteroConfig, HeteroGenerator, UnsupportedModelError
from tests.conftest import VOCAB, build_model, our_segments, padded_batch

KW = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
HD = 16
CFG = HeteroConfig(cpu_workers=1, profile="off")      # exactness, not the planner's choice: no profile to measure
N = 64                                          # original_max_position_embeddings


def sweep_model(model_type):
    """bench/model_sweep.py's tiny model of a family, or a skip where this transformers lacks it."""
    try:
        return model_sweep.build(model_type)
    except model_sweep.Skip as e:
        pytest.skip(f"{model_type}: {e}")


def phi3(rope_type):
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    if rope_type == "longrope":
        rope.update(short_factor=[1.0] * (HD // 2), long_factor=[float(4 + i) for i in range(HD // 2)],
                    original_max_position_embeddings=N)
    return build_model("phi3", max_position_embeddings=256, original_max_position_embeddings=N,
                       rope_parameters=rope)[0]


def same(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def hf(model, ids, mask, new):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, **KW)


def test_phi3_longrope_runs_where_every_key_has_transformers_factors():
    """A prompt past N in one pass: transformers drops the (empty) cache at the first forward and
    computes every key with the long factors; hetero keeps its cache and computes the same. A
    sequence that passes N mid-call (transformers recomputes the cache), a chunked prefill past N
    (its first chunks lie below) and a short context continued past N are refused up front."""
    model = phi3("longrope")
    ids, mask = padded_batch((100, 90))
    with HeteroGenerator(model, config=CFG) as gen:
        same(gen.generate(ids, attention_mask=mask, max_new_tokens=8, **KW), hf(model, ids, mask, 8))
        short, short_mask = padded_batch((40, 30))
        same(gen.generate(short, attention_mask=short_mask, max_new_tokens=25, **KW),   # 40 + 25 = N + 1
             hf(model, short, short_mask, 25))
        with pytest.raises(UnsupportedModelError, match="original_max_position_embeddings=64"):
            gen.generate(short, attention_mask=short_mask, max_new_tokens=26)          # passes N mid-call
        doc = ids[:1, 10:]                                                           # 90 tokens, one pass
        with gen.prefill(doc[:, :80]) as ctx:
            same(gen.generate(doc[:, 80:], context=ctx, max_new_tokens=6, **KW), hf(model, doc, None, 6))
        with gen.prefill(doc[:, :40]) as ctx:                                        # below N: short factors
            with pytest.raises(UnsupportedModelError, match="LongRoPE"):
                gen.generate(doc[:, 40:], context=ctx, max_new_tokens=6)
            same(gen.generate(doc, max_new_tokens=6, **KW), hf(model, doc, None, 6))  # no reuse of ctx: exact
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, profile="off", prefill_chunk=16)) as gen:
        with pytest.raises(UnsupportedModelError, match="prefill_chunk=None"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=4)
        with pytest.raises(UnsupportedModelError, match="LongRoPE"):
            gen.prefill(ids[:1])


def test_phi3_default_rope_passes_the_switch_point_exactly():
    """Default RoPE: transformers' cache drop at N recomputes the same keys; hetero keeps its cache
    (it used to fail there, its cache gone), chunked or not, contexts too. The reference is HF
    without the switch (the same math): transformers 5.17's own drop goes wrong (after dropping the
    cache its generate still feeds the last token alone, next_sequence_length=1; fixed by 5.23)."""
    model = phi3("default")
    no_switch = copy.deepcopy(model)
    no_switch.config.original_max_position_embeddings = 10 ** 6
    ids, mask = padded_batch((50, 40))
    ref = hf(no_switch, ids, mask, 30)
    for chunk in (None, 7):
        with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, profile="off", prefill_chunk=chunk)) as gen:
            same(gen.generate(ids, attention_mask=mask, max_new_tokens=30, **KW), ref)
            with gen.prefill(ids[:1, :30]) as ctx:
                same(gen.generate(ids[:1, 30:], context=ctx, max_new_tokens=30, **KW),
                     hf(no_switch, ids[:1], None, 30))


def test_multi_token_steps_give_a_contiguous_attention_output():
    """afmoe .view()s the attention output: a context continued by 8 tokens at once (automatic
    reuse) needs it contiguous, as sdpa's is."""
    model = sweep_model("afmoe")[0]
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    with HeteroGenerator(model, config=CFG) as gen, gen.prefill(ids[:, :12]):
        same(gen.generate(ids, max_new_tokens=6, **KW), hf(model, ids, None, 6))


def bert_encoder():
    """BERT built as an encoder (is_decoder=False): bidirectional self-attention."""
    cfg = AutoConfig.for_model("bert", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=256, is_decoder=False, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("build,why", [(bert_encoder, "bidirectional"),
                                       (lambda: sweep_model("moshi")[0], "decode only")], ids=["bert", "moshi"])
def test_one_pass_only_models(build, why):
    """An encoder run as an LM attends bidirectionally; Moshi's prefill attends without the window
    its decode applies. One-pass generate is HF's (each decode step is one query); contexts and
    chunked prefill, whose multi-token steps over the cache hetero would attend causally and
    windowed, are refused."""
    model = build()
    ids, mask = padded_batch((20, 12))
    with HeteroGenerator(model, config=CFG) as gen:
        same(gen.generate(ids, attention_mask=mask, max_new_tokens=5, **KW), hf(model, ids, mask, 5))
        with pytest.raises(UnsupportedModelError, match=why):
            gen.prefill(ids[:1])
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, profile="off", prefill_chunk=4)) as gen:
        with pytest.raises(UnsupportedModelError, match=why):
            gen.generate(ids, attention_mask=mask, max_new_tokens=2)


def test_a_forward_without_position_ids_gets_none_in_chunks():
    """MossTranscribeDiarize's forward takes no position_ids, so generate passes none (the model
    counts padded positions); a chunked prefill must not pass its own either."""
    model = sweep_model("moss_transcribe_diarize")[0]
    ids, mask = padded_batch((20, 13, 7))
    ref = hf(model, ids, mask, 6)
    with HeteroGenerator(model, config=HeteroConfig(cpu_workers=1, profile="off", prefill_chunk=3)) as gen:
        same(gen.generate(ids, attention_mask=mask, max_new_tokens=6, **KW), ref)


def test_an_instance_level_prepare_inputs_is_used_or_refused(tmp_path):
    """A user's (or a library's) prepare_inputs_for_generation on the model instance: used and left
    in place on a model whose generate keeps the cache; on Phi-3, whose one hetero replaces during
    a call, refused by name when the generator is built, or, set afterwards, by every call
    (load_context before it allocates), and the instance keeps it."""
    for model in (build_model("llama")[0], phi3("default")):
        calls = []
        real = model.prepare_inputs_for_generation

        def mine(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        ids, mask = padded_batch((12, 8))
        if model.config.model_type == "phi3":
            with HeteroGenerator(model, config=CFG) as gen:
                with gen.prefill(ids[:1, 4:]) as ctx:
                    ctx.save(tmp_path / "ctx")
                model.prepare_inputs_for_generation = mine                 # after the generator was built
                with pytest.raises(UnsupportedModelError, match="its own prepare_inputs_for_generation"):
                    gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
                before = set(our_segments(os.getpid()))
                with pytest.raises(UnsupportedModelError, match="its own prepare_inputs_for_generation"):
                    gen.load_context(tmp_path / "ctx")
                assert not gen._contexts and set(our_segments(os.getpid())) == before
            with pytest.raises(UnsupportedModelError, match="its own prepare_inputs_for_generation"):
                HeteroGenerator(model, config=CFG)
        else:
            model.prepare_inputs_for_generation = mine
            with HeteroGenerator(model, config=CFG) as gen:
                gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
                assert calls
        assert model.__dict__["prepare_inputs_for_generation"] is mine


def test_hetero_s_own_input_preparation_mid_call_is_not_taken_for_a_users(tmp_path):
    """During a Phi-3 call hetero's replacement sits on the instance: a second generator built over
    the model meanwhile is not refused as if the user had put it there, and a nested load_context
    gets the nested-call error."""
    model = phi3("default")
    ids, mask = padded_batch((12, 8))
    seen = []

    class Streamer:
        def put(self, value):
            if len(seen) == 1:                                     # at the first decode token
                other = HeteroGenerator(model, config=CFG)
                other.close()
                with pytest.raises(RuntimeError, match="inside a call"):
                    gen.load_context(tmp_path / "ctx")
            seen.append(1)

        def end(self):
            pass

    with HeteroGenerator(model, config=CFG) as gen:
        with gen.prefill(ids[:1, 4:]) as ctx:
            ctx.save(tmp_path / "ctx")
        gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, streamer=Streamer())
    assert len(seen) >= 2 and "prepare_inputs_for_generation" not in model.__dict__


def test_a_subclass_overriding_phi3s_input_preparation_is_refused_by_name():
    """hetero replaces Phi-3's prepare_inputs_for_generation during a call (it drops the cache);
    a user's subclass overriding it would be skipped silently, so the generator is refused, the
    model left as it was; a subclass that does not override it runs."""
    base = phi3("default")

    class Mine(type(base)):
        def prepare_inputs_for_generation(self, *args, **kwargs):
            return super().prepare_inputs_for_generation(*args, **kwargs)

    class Plain(type(base)):
        pass

    ids, mask = padded_batch((12, 8))
    base.__class__ = Mine
    with pytest.raises(UnsupportedModelError, match="Mine overrides prepare_inputs_for_generation"):
        HeteroGenerator(base, config=CFG)
    assert "prepare_inputs_for_generation" not in base.__dict__
    assert base.config._attn_implementation != "hetero"
    base.__class__ = Plain
    ref = hf(base, ids, mask, 3)
    with HeteroGenerator(base, config=CFG) as gen:
        same(gen.generate(ids, attention_mask=mask, max_new_tokens=3, **KW), ref)


def test_longrope_of_a_family_that_keeps_its_cache_and_per_layer_type():
    """LongRoPE outside Phi-3: transformers' Llama keeps its cache when decode passes N, so a call
    whose prompt is within N passes it in the same forwards as transformers' (exact, no longer
    refused), but not one extending a context (its keys would mix both factors). Gemma3 with LongRoPE
    on one layer type (rope_parameters per layer type) is guarded like a top-level one: a context or a
    chunked prefill across N is refused, one pass is exact."""
    from hetero import HeteroConfig

    hd, n = 16, 16
    longrope = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(hd // 2)],
                "long_factor": [8.0 + 4.0 * i for i in range(hd // 2)], "original_max_position_embeddings": n,
                "rope_theta": 10000.0}
    llama = build_model("llama", head_dim=hd, max_position_embeddings=64, rope_parameters=longrope)[0]
    gemma3 = build_model("gemma3_text", head_dim=hd, max_position_embeddings=64, rope_parameters={
        "full_attention": longrope, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})[0]
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with HeteroGenerator(llama, config=CFG) as gen:
        assert gen.spec.rope_switch == n and not gen.spec.drops_cache
        same(gen.generate(ids[:, :10], max_new_tokens=20, **KW), hf(llama, ids[:, :10], None, 20))   # passes N
        with gen.prefill(ids[:, :6]) as ctx:                                       # all within N: short factors
            same(gen.generate(ids[:, 6:10], context=ctx, extend_context=False, max_new_tokens=20, **KW),
                 hf(llama, ids[:, :10], None, 20))
            with pytest.raises(UnsupportedModelError, match="extend_context=False"):   # it would keep both kinds
                gen.generate(ids[:, 6:10], context=ctx, max_new_tokens=20)
    try:
        ref = hf(gemma3, ids, None, 6)
    except UnboundLocalError as e:              # transformers 5.17's per-layer-type LongRoPE fails at its 2nd step
        pytest.skip(f"transformers' own per-layer-type LongRoPE fails here: {e}")
    with HeteroGenerator(gemma3, config=CFG) as gen:
        assert gen.spec.rope_switch == n
        same(gen.generate(ids, max_new_tokens=6, **KW), ref)
        with gen.prefill(ids[:, :10]) as ctx, pytest.raises(UnsupportedModelError, match="LongRoPE"):
            gen.generate(ids[:, 10:], context=ctx, max_new_tokens=6)
    with HeteroGenerator(gemma3, config=HeteroConfig(cpu_workers=1, profile="off", prefill_chunk=8)) as gen:
        with pytest.raises(UnsupportedModelError, match="LongRoPE"):
            gen.generate(ids, max_new_tokens=6)
