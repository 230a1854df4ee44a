"""LoRA adapters through the engine against peft itself (real PeftModels, real save_pretrained
directories): each request runs the adapter it names, in a batch mixing adapters, prompts
chunked beside decodes, and gives peft generate's tokens and scores for it alone."""
import copy
import threading

import pytest
import torch

from hetero import AdapterError, Engine, EngineConfig, HeteroGenerator
from hetero.engine import RankAwarePolicy
from tests.conftest import padded_batch
from tests.test_lora import make_adapters

NEW = 8
ROWS_NAMES = ["legal", "code", None]


def rows_of(ids, mask):
    return [ids[b][mask[b].bool()].tolist() for b in range(ids.shape[0])]


def peft_alone(pm, row, name, new=NEW):
    t = torch.tensor([row])
    out = pm.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=new, do_sample=False,
                      pad_token_id=0, adapter_names=[name or "__base__"], return_dict_in_generate=True,
                      output_scores=True)
    return out.sequences[0, len(row):].tolist(), torch.cat(out.scores)


def config(**kw):
    return EngineConfig(**{**dict(background=False, cpu_workers=1, kv_blocks=48, long_prefill_chunk=4,
                                  max_num_batched_tokens=10, max_model_len=128), **kw})


def run(engine, streams):
    while not all(s.finished for s in streams):
        engine.step()


def assert_peft(pm, streams, rows, names):
    for s, r, n in zip(streams, rows, names):
        tokens, scores = peft_alone(pm, r, n)
        assert s.token_ids == tokens, (n, s.token_ids, tokens)
        assert (torch.stack(s.scores) - scores).abs().max() < 1e-4


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_mixed_adapters_match_peft(model_type, tmp_path):
    base, pm, _ = make_adapters(model_type, tmp_path)
    rows = rows_of(*padded_batch())
    dirs = {n: str(tmp_path / n) for n in ("legal", "code")}
    with Engine(base, config(policy=RankAwarePolicy()), adapters=dirs) as eng:
        assert eng.adapters == ["code", "legal"] and eng.adapter_rank("code") == 16 and eng.adapter_rank(None) == 0
        streams = [eng.add_request(r, NEW, adapter=n, output_scores=True) for r, n in zip(rows, ROWS_NAMES)]
        run(eng, streams)
        # a prompt cached under one adapter is not reused under another (the hash includes the adapter)
        again = eng.add_request(rows[0], NEW, adapter="code", output_scores=True)
        run(eng, [again])
    assert_peft(pm, streams + [again], rows + [rows[0]], ROWS_NAMES + ["code"])
    assert all("forward" not in m.__dict__ for m in base.modules())       # no hook left behind


def test_a_peft_model_and_adapters_loaded_at_run_time(tmp_path):
    base, pm, _ = make_adapters("llama", tmp_path)
    rows = rows_of(*padded_batch())
    with Engine(pm, config()) as eng:
        assert eng.adapters == ["code", "legal"]
        streams = [eng.add_request(r, NEW, adapter=n, output_scores=True) for r, n in zip(rows, ROWS_NAMES)]
        run(eng, streams)
        assert_peft(pm, streams, rows, ROWS_NAMES)
    with Engine(base, config()) as eng:
        with pytest.raises(AdapterError, match="no adapter named 'legal'"):
            eng.add_request(rows[0], NEW, adapter="legal")
        eng.load_adapter("legal", tmp_path / "legal")
        s = eng.add_request(rows[0], NEW, adapter="legal", output_scores=True)
        late = eng.add_request(rows[1], 30, adapter="legal")
        run(eng, [s])
        eng.unload_adapter("legal")
        eng.step()
        assert isinstance(late.error, AdapterError) and "unloaded" in str(late.error)
        assert eng.kv_manager.num_used_blocks == 0
        with pytest.raises(AdapterError, match="no adapter named 'legal'"):
            eng.unload_adapter("legal")
        # a document's blocks cached under "legal", then other weights loaded as "legal": never found
        doc = list(range(3, 3 + 70))
        eng.load_adapter("legal", tmp_path / "legal")
        before = eng.add_request(doc, NEW, adapter="legal", output_scores=True)
        run(eng, [before])
        eng.unload_adapter("legal")
        eng.load_adapter("legal", tmp_path / "code")
        hits = eng.kv_manager.prefix_hits
        after = eng.add_request(doc, NEW, adapter="legal", output_scores=True)
        run(eng, [after])
        assert eng.kv_manager.prefix_hits == hits
        # a request queued, or a document pinned, before a reload: refused, never mixing the two
        pin = eng.pin(doc, adapter="legal")
        pin.result()
        queued = eng.add_request(doc + [5, 6], NEW, adapter="legal")
        eng.unload_adapter("legal")
        eng.load_adapter("legal", tmp_path / "legal")
        eng.step()
        assert isinstance(queued.error, AdapterError) and "reloaded" in str(queued.error)
        with pytest.raises(AdapterError, match="reloaded since this document was pinned"):
            eng.save_pin(pin, tmp_path / "doc.ctx")
        eng.unpin(pin)
    assert_peft(pm, [s], rows[:1], ["legal"])
    assert_peft(pm, [before, after], [doc, doc], ["legal", "code"])


def test_a_generator_s_overlapping_calls_keep_their_adapters(tmp_path):
    base, pm, _ = make_adapters("llama", tmp_path)
    ids, mask = padded_batch()
    dirs = {n: str(tmp_path / n) for n in ("legal", "code")}
    with HeteroGenerator(base, cpu_workers=1, adapters=dirs) as gen:
        started, release = threading.Event(), threading.Event()

        class Gate:
            n = 0

            def put(self, value):
                self.n += 1
                if self.n == 2:
                    started.set()
                    release.wait(30)

            def end(self):
                pass

        out = {}
        first = threading.Thread(target=lambda: out.setdefault("first", gen.generate(
            ids[:1], attention_mask=mask[:1], max_new_tokens=NEW, pad_token_id=0, adapter_names=["code"],
            streamer=Gate())))
        first.start()
        assert started.wait(30)
        second = threading.Thread(target=lambda: out.setdefault("batch", gen.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, adapter_names=["legal", "code", None])))
        second.start()
        while gen._engine.engine is None or not gen._engine.busy:
            second.join(0.01)
        release.set()
        first.join(30)
        second.join(30)
        assert gen._engine.engine.steps > 0
    ref = pm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                      adapter_names=["legal", "code", "__base__"])
    assert torch.equal(out["batch"], ref)
    ref1 = pm.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=NEW, do_sample=False,
                       pad_token_id=0, adapter_names=["code"])
    assert torch.equal(out["first"], ref1)


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("names", [["head", None], [None, "head"]])
def test_an_lm_head_adapter_reaches_its_own_request_when_prompts_end_together(tmp_path, names, cold):
    """An adapter on lm_head with two prompts ending in one step: the head computes the sampling
    rows alone (logits_to_keep), and each gets its own request's delta (its device copy, or cold:
    through the CPU workers), as peft gives. Before, the delta went to a neighbour's row or the
    step raised."""
    from peft import LoraConfig, get_peft_model

    from tests.conftest import build_model

    model, ref_impl = build_model("llama")
    base = copy.deepcopy(model)
    torch.manual_seed(3)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=64, target_modules=["lm_head"], init_lora_weights=False),
                        adapter_name="head")
    pm.eval()
    pm.base_model.model.set_attn_implementation(ref_impl)
    pm.save_pretrained(tmp_path)
    rows = [[3, 4, 5], [10, 11, 12, 13]]
    with Engine(base, config(), adapters={"head": str(tmp_path / "head")}) as eng:
        store = eng._adapters.store
        if cold:                                 # a just-loaded adapter whose device copy is not made yet
            store.copy_gate.clear()
            eng.unload_adapter("head")
            eng.load_adapter("head", tmp_path / "head")
        else:
            assert store.adapters["head"].ready.wait(10)
        try:
            streams = [eng.add_request(r, NEW, adapter=n, output_scores=True) for r, n in zip(rows, names)]
            run(eng, streams)
        finally:
            store.copy_gate.set()
    assert_peft(pm, streams, rows, names)


def test_a_document_s_kept_rows_are_per_adapter(tmp_path):
    """One document's rows kept on the device (PrefixRows) under each adapter apart: questions
    over it under "legal", "code" and the base model each read their own, exact vs peft; after
    other weights are loaded as "legal", its questions never find the old rows."""
    base, pm, _ = make_adapters("llama", tmp_path)
    doc = list(range(3, 3 + 70))                           # 64 rows in whole blocks
    qs = [[5, 9, 11], [7, 4], [12, 13, 14, 15]]
    names = ["legal", "code", None]
    dirs = {n: str(tmp_path / n) for n in ("legal", "code")}
    with Engine(base, config(long_prefill_chunk=16, max_num_batched_tokens=40), adapters=dirs) as eng:
        for n in names:
            run(eng, [eng.add_request(doc, NEW, adapter=n)])
        streams = [eng.add_request(doc + q, NEW, adapter=n, output_scores=True) for q in qs for n in names]
        run(eng, streams)
        rows = eng.runner.prefix_rows
        # per adapter: the first question reads back (seen once), the second keeps, the third finds
        assert len(rows.entries) == 3 and rows.misses == 3 and rows.hits == 3
        eng.unload_adapter("legal")
        eng.load_adapter("legal", tmp_path / "code")
        run(eng, [eng.add_request(doc, NEW, adapter="legal")])
        again = [eng.add_request(doc + q, NEW, adapter="legal", output_scores=True) for q in qs[:2]]
        run(eng, again)
        assert rows.misses == 4 and rows.hits == 3 and len(rows.entries) == 4 and rows.stale == 0
    assert_peft(pm, streams + again, [doc + q for q in qs for _ in names] + [doc + q for q in qs[:2]],
                names * 3 + ["code", "code"])


def test_an_engine_keeps_to_its_adapters_as_the_peft_model_changes(tmp_path):
    """A PeftModel changed after Engine(pm): an adapter added and made active there reaches no
    request (each runs the adapter it names, as in a generator's calls); an adapter merged into
    the weights fails the requests by name, and they run again once it is unmerged; the inner
    model with peft's layers in it is refused as an adapters' base."""
    from peft import LoraConfig

    _, pm, _ = make_adapters("llama", tmp_path)
    rows = rows_of(*padded_batch())
    names = [None, "legal"]
    want = [peft_alone(pm, r, n) for r, n in zip(rows, names)]
    with Engine(pm, config()) as eng:
        torch.manual_seed(4)
        pm.add_adapter("new", LoraConfig(r=4, lora_alpha=64, target_modules=["lm_head"], init_lora_weights=False))
        pm.set_adapter("new")
        assert peft_alone(pm, rows[0], "new")[0] != want[0][0]         # "new" changes the base request's tokens
        streams = [eng.add_request(r, NEW, adapter=n, output_scores=True) for r, n in zip(rows, names)]
        run(eng, streams)
        for s, (tokens, scores) in zip(streams, want):
            assert s.token_ids == tokens
            assert (torch.stack(s.scores) - scores).abs().max() < 1e-4
        pm.set_adapter("legal")
        pm.merge_adapter()
        failed = eng.add_request(rows[0], NEW)
        eng.step()
        assert isinstance(failed.error, AdapterError) and "merged LoRA adapters ['legal']" in str(failed.error)
        assert eng.kv_manager.num_used_blocks == 0
        pm.unmerge_adapter()
        again = eng.add_request(rows[1], NEW, adapter="legal", output_scores=True)
        run(eng, [again])
        assert again.token_ids == want[1][0]
    with pytest.raises(AdapterError, match="pass the PeftModel itself"):
        Engine(pm.get_base_model(), config(), adapters={"legal": str(tmp_path / "legal")})
    with Engine(pm.get_base_model(), config()) as eng:
        with pytest.raises(AdapterError, match="pass the PeftModel itself"):
            eng.load_adapter("legal", tmp_path / "legal")
