"""LoRA on the CPU workers against peft itself (real PeftModels, real save_pretrained directories)."""
import copy
import gc
import json
import os

import psutil
import pytest
import torch
from peft import LoraConfig, get_peft_model

from hetero import AdapterError, ContextFileError, HeteroGenerator
from hetero.adapters.hooks import plan_units
from tests.conftest import build_model, our_segments, padded_batch

NEW = 8
NAMES = ["legal", "code", "__base__"]
# per family: (targets of adapter a (rank 4), targets of adapter b (rank 16, rsLoRA))
TARGETS = {
    "llama": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen2": (["k_proj", "o_proj"], ["q_proj", "v_proj", "up_proj", "down_proj"]),
    "phi3": (["qkv_proj"], ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),   # fused projections
}


def make_adapters(model_type, tmp_path, **overrides):
    """(base model, PeftModel with adapters a and b, directory holding both saved)."""
    model, ref_impl = build_model(model_type, **overrides)
    base = copy.deepcopy(model)
    ta, tb = TARGETS[model_type]
    torch.manual_seed(3)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ta, init_lora_weights=False),
                        adapter_name="legal")
    pm.add_adapter("code", LoraConfig(r=16, lora_alpha=16, use_rslora=True, target_modules=tb, init_lora_weights=False))
    pm.eval()
    pm.base_model.model.set_attn_implementation(ref_impl)
    pm.save_pretrained(tmp_path)
    return base, pm, ref_impl


def generate(gen_or_model, ids, mask, **kw):
    return gen_or_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0, return_dict_in_generate=True, output_scores=True, **kw)


def assert_same(out, ref, rows=None, atol=1e-4):
    rows = list(range(out.sequences.shape[0])) if rows is None else rows
    assert torch.equal(out.sequences[rows], ref.sequences[rows])
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a[rows], b[rows], atol=atol, rtol=atol)


@pytest.mark.parametrize("model_type", list(TARGETS))
def test_mixed_batch_matches_peft_and_merged(model_type, tmp_path):
    base, pm, ref_impl = make_adapters(model_type, tmp_path)
    ids, mask = padded_batch()
    ref = generate(pm, ids, mask, adapter_names=NAMES)
    dirs = {n: str(tmp_path / n) for n in ("legal", "code")}
    with HeteroGenerator(base, cpu_workers=2, adapters=dirs) as gen:
        out = generate(gen, ids, mask, adapter_names=NAMES)
        assert gen.adapters == ["code", "legal"]
    assert_same(out, ref)
    # the base model is untouched afterwards: no hook left behind
    assert all("forward" not in m.__dict__ for m in base.modules())
    # a PeftModel is accepted directly, its adapters served by name
    with HeteroGenerator(pm, cpu_workers=2) as gen:
        out2 = generate(gen, ids, mask, adapter_names=["code", None, "legal"])
    ref2 = generate(pm, ids, mask, adapter_names=["code", "__base__", "legal"])
    assert_same(out2, ref2)
    # and each adapter equals the model with it merged into the weights
    for k, name in enumerate(("legal", "code")):
        merged = copy.deepcopy(pm)
        merged.set_adapter(name)
        merged = merged.merge_and_unload(adapter_names=[name])
        merged.set_attn_implementation(ref_impl)
        assert_same(out, generate(merged, ids, mask), rows=[k], atol=1e-3)


@pytest.mark.parametrize("lengths,names", [((12, 8, 5), NAMES),
                                           ((1500, 1400, 1300), ["code"] * 3)], ids=["short", "two-jobs"])
def test_cold_start_gives_the_same_tokens(tmp_path, lengths, names):
    """"two-jobs": 4500 cold prompt rows, more than one staging job holds (4096 here)."""
    base, pm, _ = make_adapters("llama", tmp_path, max_position_embeddings=2048)
    ids, mask = padded_batch(lengths)
    with HeteroGenerator(base, cpu_workers=2) as gen:
        gen.load_adapter("legal", tmp_path / "legal")
        assert gen._store.x.shape[0] == 4096          # staging rows of this model: "two-jobs" needs 2 jobs
        gen._store.copy_gate.clear()                 # hold every further device copy: "code" stays cold
        gen.load_adapter("code", tmp_path / "code")
        assert not gen.adapter_on_device("code")
        cold = generate(gen, ids, mask, adapter_names=names)
        assert not gen.adapter_on_device("code")        # so code's prefill ran on the CPU workers
        gen._store.copy_gate.set()
        assert gen._store.adapters["code"].ready.wait(10)
        warm = generate(gen, ids, mask, adapter_names=names)
    assert_same(cold, warm)
    assert_same(cold, generate(pm, ids, mask, adapter_names=names))


def test_bad_adapters_are_refused_and_leave_nothing(tmp_path):
    base, _, _ = make_adapters("llama", tmp_path)
    other = build_model("llama", hidden_size=32)[0]                     # another base: other shapes
    get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "other")
    dora_model = build_model("llama")[0]
    get_peft_model(dora_model, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)).save_pretrained(tmp_path / "dora")
    os.makedirs(tmp_path / "ia3")
    cfg = json.loads((tmp_path / "legal" / "adapter_config.json").read_text())
    (tmp_path / "ia3" / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    (tmp_path / "ia3" / "adapter_model.safetensors").write_bytes((tmp_path / "legal" / "adapter_model.safetensors").read_bytes())
    with HeteroGenerator(base, cpu_workers=1) as gen:
        gen.load_adapter("a", tmp_path / "legal")
        segs = our_segments(os.getpid())
        cases = [("x", tmp_path / "other", "another base"), ("x", tmp_path / "dora", "DoRA"),
                 ("x", tmp_path / "ia3", "only LoRA"), ("x", tmp_path / "nope", "not a directory"),
                 ("a", tmp_path / "code", "already loaded"), ("__base__", tmp_path / "code", "reserved"),
                 ("bad name!", tmp_path / "code", "adapter name")]
        for name, path, msg in cases:
            with pytest.raises(AdapterError, match=msg):
                gen.load_adapter(name, path)
            assert gen.adapters == ["a"] and our_segments(os.getpid()) == segs
        ids, mask = padded_batch()
        with pytest.raises(AdapterError, match="'zzz', which is not loaded"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=2, adapter_names=["a", "zzz", None])
        with pytest.raises(ValueError, match="2 entries for a batch of 3"):
            gen.generate(ids, attention_mask=mask, max_new_tokens=2, adapter_names=["a", None])
        with pytest.raises(AdapterError, match="no adapter named 'b'"):
            gen.unload_adapter("b")
        gen.unload_adapter("a")
        assert gen.adapters == []


def test_load_unload_100_adapters_does_not_grow(tmp_path):
    base, _, _ = make_adapters("llama", tmp_path)
    ids, mask = padded_batch()
    proc = psutil.Process()
    start = our_segments(os.getpid())          # other tests' shared generators may hold some
    with HeteroGenerator(base, cpu_workers=2) as gen:
        gen.load_adapter("keep", tmp_path / "code")
        before_segs = our_segments(os.getpid())
        workers = [psutil.Process(p.pid) for p in gen._pool.procs]

        def rss():
            return proc.memory_info().rss + sum(w.memory_info().rss for w in workers)

        for i in range(100):
            gen.load_adapter(f"t{i}", tmp_path / "code")
            if i % 25 == 0:
                generate(gen, ids, mask, adapter_names=[f"t{i}", "keep", None])
            gen.unload_adapter(f"t{i}")
            if i == 9:
                gc.collect()
                base_rss = rss()
        gc.collect()
        assert our_segments(os.getpid()) == before_segs
        assert gen.adapters == ["keep"]
        assert rss() - base_rss < 16 * 2**20, "RSS grew while loading and unloading adapters"
    assert our_segments(os.getpid()) == start


def test_plan_units_is_rank_aware():
    # tiny job: one worker
    n, per = plan_units([(1, 0, 0, 1, 1.0, 4)], 64, 64, 8)
    assert n == 1 and [u[4:6] for u in per[0]] == [(0, 64)]
    # mixed ranks 8..64 over 4 workers: every row/column covered once, loads within 1.5x of the mean
    pieces = [(s, 0, b, b + 1, 1.0, r) for b, (s, r) in enumerate([(1, 8), (2, 64), (3, 16), (4, 32), (2, 64)])]
    n, per = plan_units(pieces, 4096, 4096, 4)
    assert n == 4
    loads = [sum(pieces[u[2]][5] * (4096 + u[5] - u[4]) for u in us) for us in per]   # rank * (in + cols)
    assert max(loads) < 1.5 * sum(loads) / n
    cover = {}
    for us in per:
        for slot, site, r0, r1, c0, c1, s in us:
            cover.setdefault(r0, []).append((c0, c1))
    for r0, spans in cover.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == 4096
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # one big request is cut along its output columns so every worker helps
    n, per = plan_units([(1, 0, 0, 1, 1.0, 64)], 4096, 14336, 4)
    assert n == 4 and all(len(us) == 1 for us in per)
    # never more workers than there are
    assert plan_units(pieces, 4096, 4096, 2)[0] == 2


def test_hooks_keep_accelerate_dispatch_hooks(tmp_path):
    """An accelerate-dispatched model keeps its device hooks after the adapters' hooks are removed."""
    from accelerate import dispatch_model

    base, pm, ref_impl = make_adapters("llama", tmp_path)
    base = dispatch_model(base, device_map={"": "cpu"}, force_hooks=True)
    q = base.get_submodule("model.layers.0.self_attn.q_proj")
    assert hasattr(q, "_hf_hook") and "forward" in q.__dict__
    accelerate_forward = q.__dict__["forward"]
    ids, mask = padded_batch()
    with HeteroGenerator(base, cpu_workers=1, adapters={"legal": tmp_path / "legal"}) as gen:
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           adapter_names=["legal"] * 3)
    assert q.__dict__.get("forward") is accelerate_forward
    pm.set_adapter("legal")
    ref = pm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


def test_missing_peft_is_a_clear_error(tmp_path, monkeypatch):
    base, _, _ = make_adapters("llama", tmp_path)
    with HeteroGenerator(base, cpu_workers=1) as gen:
        for mod in [m for m in list(__import__("sys").modules) if m == "peft" or m.startswith("peft.")]:
            monkeypatch.setitem(__import__("sys").modules, mod, None)      # import peft now fails
        with pytest.raises(AdapterError, match=r"need peft.*hetero\[lora\]"):
            gen.load_adapter("legal", tmp_path / "legal")
        assert gen.adapters == []


def test_contexts_keep_the_adapter_they_were_prefilled_with(tmp_path):
    """A context prefilled with an adapter holds that adapter's KV: its continuations use it (equal
    to peft over the whole prompt), naming another raises, a PeftModel's plain prefill is its
    active adapter's ("__base__": the base model's), and a saved context needs the same adapter to load."""
    base, pm, _ = make_adapters("llama", tmp_path)
    g = torch.Generator().manual_seed(4)
    doc, q = torch.randint(3, 160, (40,), generator=g), torch.randint(3, 160, (6,), generator=g)
    full = torch.cat([doc, q])[None]
    ones = torch.ones_like(full)
    ref_legal = generate(pm, full, ones, adapter_names=["legal"])
    ref_base = generate(pm, full, ones, adapter_names=["__base__"])
    with HeteroGenerator(pm, cpu_workers=1) as gen:
        legal, plain = gen.prefill(doc[None], adapter_name="legal"), gen.prefill(doc[None], adapter_name="__base__")
        with gen.prefill(doc[None]) as active:                       # the PeftModel's active adapter
            assert_same(generate(gen, q[None], None, context=active, extend_context=False), ref_legal)
        assert_same(generate(gen, q[None], None, context=legal, extend_context=False), ref_legal)
        assert_same(generate(gen, q[None], None, context=plain, extend_context=False), ref_base)
        out = generate(gen, torch.stack([q, q]), None, context=[legal, plain])
        assert torch.equal(out.sequences[0], ref_legal.sequences[0]) and torch.equal(out.sequences[1],
                                                                                      ref_base.sequences[0])
        with pytest.raises(ValueError, match="prefilled with"):
            generate(gen, q[None], None, context=legal, adapter_names=["code"])
        with pytest.raises(ValueError, match="prefilled with"):
            generate(gen, q[None], None, context=plain, adapter_names=["legal"])
        legal.save(tmp_path / "legal.ctx")
        plain.save(tmp_path / "plain.ctx")
        with gen.load_context(tmp_path / "legal.ctx") as back:
            assert_same(generate(gen, q[None], None, context=back), ref_legal)
    with HeteroGenerator(copy.deepcopy(base), cpu_workers=1, adapters={"code": str(tmp_path / "code")}) as gen:
        with pytest.raises(ContextFileError, match="has not loaded"):
            gen.load_context(tmp_path / "legal.ctx")
        gen.load_adapter("legal", str(tmp_path / "code"))          # the name, with other weights
        with pytest.raises(ContextFileError, match="weights differ"):
            gen.load_context(tmp_path / "legal.ctx")
        gen.unload_adapter("legal")
        gen.load_adapter("legal", str(tmp_path / "legal"))
        ctx = gen.load_context(tmp_path / "legal.ctx")
        assert_same(generate(gen, q[None], None, context=ctx, extend_context=False), ref_legal)
        gen.unload_adapter("legal")
        with pytest.raises(AdapterError, match="unloaded"):
            generate(gen, q[None], None, context=ctx)
    with HeteroGenerator(copy.deepcopy(base), cpu_workers=1) as gen, gen.load_context(tmp_path / "plain.ctx") as ctx:
        assert_same(generate(gen, q[None], None, context=ctx), ref_base)     # a PeftModel's base = the model


def test_an_adapter_merged_into_the_weights_is_refused_until_unmerged(tmp_path):
    """peft's merge_adapter() writes an adapter into the base weights: hetero would add it twice on
    its own rows and to the base-model rows too, so calls are refused (as peft refuses adapter_names
    then), also when it was merged after the generator was built; unmerged, the calls equal peft."""
    _, pm, _ = make_adapters("llama", tmp_path)
    ids, mask = padded_batch()
    names = ["legal", "__base__", "code"]
    with HeteroGenerator(pm, cpu_workers=1) as gen:
        pm.set_adapter("legal")
        pm.merge_adapter()
        for call in (lambda: generate(gen, ids, mask, adapter_names=names), lambda: generate(gen, ids, mask),
                     lambda: gen.prefill(ids[:1, 4:])):
            with pytest.raises(AdapterError, match=r"merged LoRA adapters \['legal'\]"):
                call()
        pm.unmerge_adapter()
        assert_same(generate(gen, ids, mask, adapter_names=names), generate(pm, ids, mask, adapter_names=names))


def test_lora_on_the_lm_head_from_a_directory_matches_peft(tmp_path):
    """An adapter on the LM head (wider than every decoder layer: the workers' staging grows for
    it, and narrows back when it is unloaded) saved with peft's defaults (the head's base weight saved beside it) or without that
    weight: peft's tokens and scores. A saved head weight unlike the model's (peft would load it
    into the model) is refused by name."""
    from safetensors.torch import load_file, save_file

    model, ref_impl = build_model("llama")               # vocab 160 > 128, the widest decoder layer
    base = copy.deepcopy(model)
    torch.manual_seed(3)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                                          init_lora_weights=False), adapter_name="head")
    pm.add_adapter("q", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False))
    pm.eval()
    pm.base_model.model.set_attn_implementation(ref_impl)
    pm.save_pretrained(tmp_path / "default")
    pm.save_pretrained(tmp_path / "lora_only", save_embedding_layers=False)
    saved = load_file(tmp_path / "default" / "head" / "adapter_model.safetensors")
    assert "base_model.model.lm_head.base_layer.weight" in saved
    ids, mask = padded_batch()
    ref = generate(pm, ids, mask, adapter_names=["head", "__base__", "q"])
    with HeteroGenerator(base, cpu_workers=2, adapters={"q": str(tmp_path / "default" / "q")}) as gen:
        for where in ("default", "lora_only"):               # loaded after the staging was sized without it
            gen.load_adapter("head", str(tmp_path / where / "head"))
            assert gen._store.max_out == 160
            assert_same(generate(gen, ids, mask, adapter_names=["head", None, "q"]), ref)
            gen.unload_adapter("head")
            assert (gen._store.max_in, gen._store.max_out) == gen._store.decoder_dims == (128, 128)   # narrowed
        assert_same(generate(gen, ids, mask, adapter_names=["q", None, "q"]),
                    generate(pm, ids, mask, adapter_names=["q", "__base__", "q"]))
        bad = tmp_path / "changed_head"
        bad.mkdir()
        (bad / "adapter_config.json").write_text((tmp_path / "default" / "head" / "adapter_config.json").read_text())
        saved["base_model.model.lm_head.base_layer.weight"] += 1
        save_file(saved, bad / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match=r"saves its own lm_head weight .* values that differ from this model"):
            gen.load_adapter("head", str(bad))
        assert gen.adapters == ["q"]
    with HeteroGenerator(copy.deepcopy(base).to(torch.bfloat16), cpu_workers=1) as gen:
        gen.load_adapter("head", str(tmp_path / "default" / "head"))    # saved from fp32: equal in bf16, as peft loads it


def test_adapter_names_none_runs_a_peftmodels_active_adapter_as_peft_does(tmp_path):
    """HeteroGenerator(peft_model).generate without adapter_names equals peft_model.generate: its
    active adapter (set_adapter) for every request, the base model inside disable_adapter(); two
    active adapters (peft adds them) are refused by name. A generator over a plain model: base."""
    base, pm, _ = make_adapters("llama", tmp_path)
    ids, mask = padded_batch()
    with HeteroGenerator(pm, cpu_workers=1) as gen:
        for name in ("legal", "code"):
            pm.set_adapter(name)
            ref = generate(pm, ids, mask)
            assert_same(generate(gen, ids, mask), ref)
            assert not torch.equal(ref.sequences, generate(pm, ids, mask, adapter_names=["__base__"] * 3).sequences)
        with pm.disable_adapter():
            assert_same(generate(gen, ids, mask), generate(pm, ids, mask))
        pm.base_model.set_adapter(["legal", "code"])
        with pytest.raises(AdapterError, match=r"2 active adapters \['legal', 'code'\]"):
            generate(gen, ids, mask)
        pm.set_adapter("legal")
    with HeteroGenerator(base, cpu_workers=1, adapters={"legal": str(tmp_path / "legal")}) as gen:
        assert_same(generate(gen, ids, mask), generate(pm, ids, mask, adapter_names=["__base__"] * 3))


def test_a_peftmodels_adapters_are_followed_after_they_change(tmp_path):
    """The PeftModel's LoRA weights changed in place (a training step, set_peft_model_state_dict)
    or its scaling (set_scale) after the generator copied them: the next call copies them again
    and equals peft (it served the old copy); a context prefilled with the old copy refuses to go
    on; an adapter deleted from the PeftModel is unloaded here."""
    _, pm, _ = make_adapters("llama", tmp_path)
    ids, mask = padded_batch()
    names = ["legal", "code", "__base__"]
    with HeteroGenerator(pm, cpu_workers=1) as gen:
        assert_same(generate(gen, ids, mask, adapter_names=names), generate(pm, ids, mask, adapter_names=names))
        ctx = gen.prefill(ids[:1, 4:], adapter_name="legal")
        with torch.no_grad():
            for m in pm.modules():
                if hasattr(m, "lora_B") and "legal" in getattr(m, "lora_B", {}):
                    m.lora_B["legal"].weight.mul_(3.0)
        pm.base_model.model.model.layers[0].self_attn.q_proj.set_scale("code", 0.5)
        ref = generate(pm, ids, mask, adapter_names=names)
        assert_same(generate(gen, ids, mask, adapter_names=names), ref)
        with pytest.raises(AdapterError, match="'legal', which has been unloaded or changed since"):
            gen.generate(ids[:1, :2], context=ctx, max_new_tokens=2)
        pm.delete_adapter("code")
        with pytest.raises(AdapterError, match="'code', which is not loaded"):
            generate(gen, ids, mask, adapter_names=names)
        assert gen.adapters == ["legal"]


def test_a_pool_restart_that_fails_half_way_is_not_taken_as_alive(tmp_path, monkeypatch):
    """A new pool whose adapter store failed to attach is closed and the failure raised: a later
    call must not take it as alive with the store still bound to the old pool."""
    import signal

    from hetero.adapters.store import AdapterStore

    _, pm, _ = make_adapters("llama", tmp_path)
    ids, mask = padded_batch()
    with HeteroGenerator(pm, cpu_workers=1) as gen:
        os.kill(gen._pool.procs[0].pid, signal.SIGKILL)
        gen._pool.procs[0].wait()
        attach = AdapterStore.attach

        def failing(store, pool):
            raise OSError("attach failed")
        monkeypatch.setattr(AdapterStore, "attach", failing)
        with pytest.raises(OSError, match="attach failed"):
            gen._ensure_pool()
        assert not gen._pool.alive
        monkeypatch.setattr(AdapterStore, "attach", attach)
        names = ["legal", "code", "__base__"]
        assert_same(generate(gen, ids, mask, adapter_names=names), generate(pm, ids, mask, adapter_names=names))
        assert gen._store.pool is gen._pool


def test_peft_layers_hetero_does_not_serve_run_their_base_layer_as_peft_would(tmp_path):
    """Each request gets the adapter it names and no other, as in peft: inside disable_adapter()
    adapter_names are ignored (the base model, as peft's layers skip them; a context prefilled
    with an adapter is not continued there); an adapter added to the PeftModel after the
    generator was built and set active adds nothing to the named requests (and
    adapter_names=None names it: refused, not loaded); the same adapter loaded into both the
    generator and the PeftModel (peft's new layer wraps the module hetero hooked) counts once. A
    PeftModel's inner model with peft layers: as transformers runs it, and adapters= refused."""
    base, pm, _ = make_adapters("llama", tmp_path)
    ids, mask = padded_batch()
    with HeteroGenerator(pm, cpu_workers=1) as gen:
        legal = gen.prefill(ids[:1, 4:], adapter_name="legal")
        with pm.disable_adapter():
            assert_same(generate(gen, ids, mask, adapter_names=NAMES), generate(pm, ids, mask))
            with gen.prefill(ids[:1, 4:10], adapter_name="legal") as ctx:          # the base model's KV
                assert_same(generate(gen, ids[:1, 10:], None, context=ctx), generate(pm, ids[:1, 4:], None))
            with pytest.raises(AdapterError, match="disabled"):
                generate(gen, ids[:1, 4:6], None, context=legal)
        legal.close()
        torch.manual_seed(5)
        pm.add_adapter("late", LoraConfig(r=4, target_modules=["gate_proj", "q_proj"], init_lora_weights=False))
        pm.set_adapter("late")
        assert_same(generate(gen, ids, mask, adapter_names=["legal", None, "code"]),
                    generate(pm, ids, mask, adapter_names=["legal", "__base__", "code"]))
        with pytest.raises(AdapterError, match="active adapter 'late' is not loaded"):
            generate(gen, ids, mask)
        torch.manual_seed(6)                 # an adapter on the LM head, which no peft layer wraps yet
        head = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["lm_head", "q_proj"],
                                                               init_lora_weights=False), adapter_name="head")
        head.save_pretrained(tmp_path / "saved")
        gen.load_adapter("head", str(tmp_path / "saved" / "head"))            # hooks the plain lm_head
        pm.load_adapter(str(tmp_path / "saved" / "head"), adapter_name="head")  # wraps it in a peft layer
        pm.set_adapter("head")
        pm.eval()
        assert type(pm.get_base_model().lm_head).__name__ == "Linear" and hasattr(pm.get_base_model().lm_head, "lora_A")
        assert_same(generate(gen, ids, mask), generate(pm, ids, mask))                # head counted once
        with gen.prefill(ids[:1, 4:], adapter_name="__base__") as plain:    # base weights unchanged by adapters,
            ref = generate(pm, torch.cat([ids[:1, 4:], ids[:1, 2:4]], 1), None, adapter_names=["__base__"])
            pm.add_adapter("kept", LoraConfig(r=4, target_modules=["k_proj"], modules_to_save=["embed_tokens"]))
            assert_same(generate(gen, ids[:1, 2:4], None, context=plain, extend_context=False), ref)  # copies too
    inner = pm.get_base_model()
    with HeteroGenerator(inner, cpu_workers=1) as gen:
        assert_same(generate(gen, ids, mask), generate(inner, ids, mask))
        with pytest.raises(AdapterError, match="pass the PeftModel itself"):
            gen.load_adapter("legal", str(tmp_path / "legal"))


def test_two_generators_over_one_model_serve_their_own_adapters(tmp_path):
    """Two generators over one model hook the same modules (one's wrappers around the other's):
    each acts on its own calls only (a call once posted its jobs through the other's hooks and
    stalled), and closing them in either order leaves no wrapper behind."""
    base, pm, _ = make_adapters("llama", tmp_path)
    ids, mask = padded_batch()
    ref = generate(pm, ids, mask, adapter_names=NAMES)
    dirs = {n: str(tmp_path / n) for n in ("legal", "code")}
    for first in (0, 1):
        gens = [HeteroGenerator(base, cpu_workers=1, adapters=dirs) for _ in range(2)]
        try:
            for g in gens + gens[:1]:
                assert_same(generate(g, ids, mask, adapter_names=NAMES), ref)
        finally:
            gens[first].close()
            gens[1 - first].close()
        assert all("forward" not in m.__dict__ for m in base.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deltas_added_to_rows_by_index_equal_slice_by_slice(dtype):
    """One adapter's pieces take one product and their rows get its deltas by index: the same
    values as adding each piece's slice (f32 deltas, added in f32 and cast back as peft does)."""
    from hetero.adapters.hooks import _add

    torch.manual_seed(0)
    out = torch.randn(7, 16).to(dtype)
    delta = torch.randn(4, 16)
    pieces = [(0, 1), (2, 4), (6, 7)]
    want = out.clone()
    k = 0
    for r0, r1 in pieces:
        _add(want, slice(r0, r1), delta[k:k + r1 - r0])
        k += r1 - r0
    assert not torch.equal(want, out)
    got = out.clone()
    _add(got, torch.cat([torch.arange(r0, r1) for r0, r1 in pieces]), delta)
    assert torch.equal(got, want)


def test_a_config_leaving_out_r_and_lora_alpha_takes_peft_s_defaults(tmp_path):
    """adapter_config.json without r and lora_alpha (a hand-written or converted one): peft's
    LoraConfig defaults (8 and 8), so the scaling is peft's (alpha 8 over rank 8 here, not 1 or r / r)."""
    from peft import PeftModel

    model, _ = build_model("llama")
    base = copy.deepcopy(model)
    torch.manual_seed(5)
    pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                          init_lora_weights=False))
    pm.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    cfg = json.loads(path.read_text())
    del cfg["r"], cfg["lora_alpha"]
    path.write_text(json.dumps(cfg))
    ref_model = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    assert ref_model.peft_config["default"].lora_alpha == 8
    ids, mask = padded_batch()
    ref = generate(ref_model, ids, mask)
    with HeteroGenerator(base, cpu_workers=1, adapters={"d": str(tmp_path)}) as gen:
        out = generate(gen, ids, mask, adapter_names=["d"] * ids.shape[0])
    assert_same(out, ref)
    assert not torch.equal(out.sequences, generate(base, ids, mask).sequences)     # the adapter does change them
