"""The engine's step scheduler (hetero.engine.scheduler): admission order, the token budget, chunked
prefill beside decodes, preemption and resumption, aborts, the rank-aware policy, capacity errors,
Contexts. Pure Python: no model, no torch."""
import pytest

from hetero.engine import (
    BlockPool,
    FCFSPolicy,
    KVCacheManager,
    RankAwarePolicy,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)
from hetero.errors import CapacityError

EOS = 2


def make(n_blocks=64, bs=32, **cfg):
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(BlockPool(n_blocks, bs)))


def token(r):
    """A deterministic 'sampler': the token depends only on the request and how many it has."""
    return 3 + (len(r.output_token_ids) * 7 + sum(map(ord, r.request_id))) % 50


def plan(out):
    return [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled]


def step(s, sample=token):
    out = s.schedule()
    s.kv.check_invariants()
    finished = s.update(out, {x.request.request_id: sample(x.request) for x in out.scheduled if x.samples})
    s.kv.check_invariants()
    return out, finished


def drive(s, sample=token, limit=2000):
    outs = []
    while s.has_unfinished:
        assert len(outs) < limit, "no progress"
        outs.append(step(s, sample)[0])
    return outs


def expected_outputs(r, n):
    probe = Request(r.request_id, r.prompt_token_ids, n)
    for _ in range(n):
        probe.output_token_ids.append(token(probe))
    return probe.output_token_ids


def test_fcfs_admits_in_arrival_order():
    s = make(max_num_seqs=1)
    reqs = {rid: Request(rid, [5] * 8, 2, arrival_time=t) for rid, t in
            [("a", 3.0), ("b", 1.0), ("c", 2.0), ("d", 1.0)]}
    for r in reqs.values():
        s.add(r)
    order = []
    for out in drive(s):
        order += [rid for rid, n, _ in plan(out) if n == 8]
    assert order == ["b", "d", "c", "a"]                   # ties keep the order they were added in
    assert all(r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 2 for r in reqs.values())


def test_token_budget_chunk_and_seq_limit_hold_every_step():
    s = make(n_blocks=40, max_num_seqs=4, max_num_batched_tokens=50, long_prefill_chunk=20)
    lengths = [5, 90, 33, 1, 64, 17, 120, 2, 45, 31]
    reqs = [Request(f"r{i}", [4 + i] * n, 3 + i % 4) for i, n in enumerate(lengths)]
    for r in reqs:
        s.add(r)
    while s.has_unfinished:
        out = s.schedule()
        assert 0 < out.num_tokens == sum(n for _, n, _ in plan(out)) <= 50
        assert len(out.scheduled) <= 4 and not out.preempted
        for x in out.scheduled:
            assert x.start == x.request.num_computed_tokens and 0 < x.num_new_tokens <= 20
            assert x.samples == (x.start + x.num_new_tokens == x.request.num_tokens)
        s.update(out, {x.request.request_id: token(x.request) for x in out.scheduled if x.samples})
    for r in reqs:
        assert r.output_token_ids == expected_outputs(r, r.max_new_tokens)
    assert s.kv.num_used_blocks == 0


def test_chunked_prefill_runs_beside_decodes():
    s = make(max_num_batched_tokens=80, long_prefill_chunk=64)
    a = Request("a", [7] * 10, 20)
    s.add(a)
    assert plan(step(s)[0]) == [("a", 10, True)]
    s.add(Request("b", [8] * 200, 3))
    plans = [plan(step(s)[0]) for _ in range(5)]
    assert plans == [[("a", 1, True), ("b", 64, False)]] * 3 + [[("a", 1, True), ("b", 8, True)],
                                                               [("a", 1, True), ("b", 1, True)]]
    # the budget, not the chunk, caps a prefill when decodes take part of it
    s2 = make(max_num_batched_tokens=50, long_prefill_chunk=64)
    s2.add(Request("a", [7] * 10, 20))
    step(s2)
    s2.add(Request("b", [8] * 200, 3))
    assert plan(step(s2)[0]) == [("a", 1, True), ("b", 49, False)]


def test_a_request_joins_while_others_decode():
    s = make()
    for rid in "ab":
        s.add(Request(rid, [5] * 12, 6))
    step(s)
    assert plan(step(s)[0]) == [("a", 1, True), ("b", 1, True)]
    c = Request("c", [6] * 40, 2)
    s.add(c)
    out, _ = step(s)
    assert plan(out) == [("a", 1, True), ("b", 1, True), ("c", 40, True)] and c.status is RequestStatus.RUNNING
    out, finished = step(s)
    assert plan(out) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    assert finished == [c] and c.output_token_ids == expected_outputs(c, 2)


def test_preemption_when_the_pool_is_full_and_the_preempted_request_finishes():
    s = make(n_blocks=4)
    a, b = Request("a", [5] * 40, 60), Request("b", [6] * 40, 30)
    s.add(a)
    s.add(b)
    outs = []
    for _ in range(100):
        outs.append(step(s)[0])
        if b.status is RequestStatus.PREEMPTED:
            break
    # both reached row 64 together; a, admitted first, needed a 3rd block: b, the last admitted, gave way
    assert outs[-1].preempted == ["b"] and plan(outs[-1]) == [("a", 1, True)]
    assert a.num_computed_tokens == 65 and len(b.output_token_ids) == 25
    assert b.block_table == [] and b.num_computed_tokens == 0 and s.waiting == [b] and s.running == [a]
    before = list(b.output_token_ids)
    outs = drive(s)
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == expected_outputs(a, 60)
    assert b.output_token_ids[:25] == before and b.output_token_ids == expected_outputs(b, 30)
    resumed = next(x for out in outs for x in out.scheduled if x.request is b)
    assert resumed.start == 0 and resumed.num_new_tokens == 65 and resumed.samples  # prompt + outputs
    assert b.num_preemptions == 1 and s.num_preemptions == 1 and s.kv.num_used_blocks == 0


def test_a_preempted_request_resumes_from_its_cached_blocks():
    s = make(n_blocks=16)
    r = Request("r", [5] * 60, 10)
    s.add(r)
    for _ in range(6):
        step(s)
    assert r.num_computed_tokens == 65 and len(r.output_token_ids) == 6
    s.preempt("r")
    assert r.status is RequestStatus.PREEMPTED and s.kv.num_used_blocks == 0
    out, _ = step(s)
    assert plan(out) == [("r", 2, True)] and out.scheduled[0].start == 64 and r.num_cached_tokens == 64
    drive(s)
    assert r.output_token_ids == expected_outputs(r, 10)
    with pytest.raises(ValueError, match="not running"):
        s.preempt("r")


def test_a_preempted_request_is_admitted_before_older_waiting_ones():
    s = make(max_num_seqs=1)
    x, y = Request("x", [5] * 8, 4, arrival_time=5.0), Request("y", [6] * 8, 4, arrival_time=1.0)
    s.add(x)
    step(s)
    s.add(y)                                              # older, but the batch is full
    step(s)
    s.preempt("x")
    assert s.waiting == [x, y]
    out, _ = step(s)
    assert plan(out) == [("x", 10, True)] and y.status is RequestStatus.WAITING


def test_abort_frees_blocks_at_once():
    s = make(n_blocks=16, max_num_seqs=3)
    a, b, c = Request("a", [5] * 70, 10), Request("b", [6] * 40, 10), Request("c", [7] * 10, 10)
    for r in (a, b, c):
        s.add(r)
    s.add(Request("w", [8] * 5, 1, arrival_time=1e12))
    out = s.schedule()
    assert s.kv.num_used_blocks == 3 + 2 + 1
    assert s.abort("a") is a and a.status is RequestStatus.FINISHED_ABORTED
    assert a.block_table == [] and s.kv.num_used_blocks == 3 and a not in s.running and "a" not in s.requests
    finished = s.update(out, {x.request.request_id: 9 for x in out.scheduled if x.samples})
    assert finished == [] and a.output_token_ids == [] and len(b.output_token_ids) == 1
    assert s.abort("w").status is RequestStatus.FINISHED_ABORTED and s.waiting == []
    assert s.abort("nope") is None
    s.kv.check_invariants()


def test_eos_stops_a_request():
    s = make()
    r = Request("r", [5] * 10, 50, eos_token_ids={EOS})
    s.add(r)
    drive(s, sample=lambda q: EOS if len(q.output_token_ids) == 2 else 9)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [9, 9, EOS]


def test_update_wants_a_token_for_each_request_that_samples():
    s = make()
    s.add(Request("r", [5] * 10, 5))
    out = s.schedule()
    with pytest.raises(ValueError, match="no token sampled"):
        s.update(out, {})
    s2 = make()
    s2.add(Request("r", [5] * 10, 5))
    out = s2.schedule()
    s2.update(out, {"r": 3})
    with pytest.raises(ValueError, match="already applied"):
        s2.update(out, {"r": 3})


def test_rank_aware_policy_order():
    ranks = {None: 0, "lo": 8, "lo2": 8, "mid": 16, "hi": 64}
    policy = RankAwarePolicy(ranks.__getitem__)
    running = [Request("run", [1], 5, adapter="lo")]
    waiting = [Request(name, [1], 5, adapter=ad, arrival_time=t) for name, ad, t in
               [("hi", "hi", 1), ("mid", "mid", 2), ("lo2", "lo2", 3), ("base", None, 4), ("lo", "lo", 5)]]
    by = {r.request_id: r for r in waiting}
    order = [r.request_id for r in sorted(waiting, key=policy.sort_key(running))]
    assert order == ["lo", "lo2", "base", "mid", "hi"]
    assert [r.request_id for r in sorted(waiting, key=policy.sort_key([]))] == ["hi", "mid", "lo2", "base", "lo"]
    aged = RankAwarePolicy(ranks.__getitem__, max_wait_s=10, clock=lambda: 12.0)
    assert [r.request_id for r in sorted(waiting, key=aged.sort_key(running))][:2] == ["hi", "lo"]
    assert sorted(waiting, key=FCFSPolicy().sort_key(running)) == waiting
    # in the scheduler: the oldest starts the batch, then its adapter's requests join first
    s = make(max_num_seqs=3, policy=policy)
    for r in waiting:
        s.add(r)
    s.add(Request("hi2", [1], 5, adapter="hi", arrival_time=6))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["hi", "hi2", "mid"]
    assert by["lo"].status is RequestStatus.WAITING


def test_a_prompt_that_can_never_fit_raises_at_add():
    s = make(n_blocks=4)
    with pytest.raises(CapacityError, match="5 blocks"):
        s.add(Request("big", [5] * 100, 30))             # 129 rows > 4 blocks of 32
    s.add(Request("ok", [5] * 100, 29))                  # 128 rows: fits alone
    assert s.waiting[0].request_id == "ok" and "big" not in s.requests
    with pytest.raises(ValueError, match="already in use"):
        s.add(Request("ok", [5], 1))


def test_a_context_pins_its_prompt_for_its_continuations():
    s = make(n_blocks=6)
    doc = list(range(10, 80))                            # 2 whole blocks + 6 tokens
    ctx = Request("ctx", doc, 0, pin_prompt=True)
    s.add(ctx)
    out, finished = step(s)
    assert plan(out) == [("ctx", 70, False)] and finished == [ctx]
    assert ctx.status is RequestStatus.FINISHED_LENGTH and ctx.output_token_ids == []
    pinned = ctx.pinned_blocks
    assert len(pinned) == 2 and s.kv.num_used_blocks == 2 and s.kv.pool.pins[pinned].tolist() == [1, 1]
    # pinned blocks leave less room: 4 blocks of someone else's, or 6 when the prefix is the context's
    with pytest.raises(CapacityError, match="2 of them pinned"):
        s.add(Request("other", [3] * 150, 1))
    q1, q2 = Request("q1", doc + [1, 2], 90), Request("q2", doc + [3], 4)
    s.add(q1)
    s.add(q2)
    out, _ = step(s)
    assert plan(out) == [("q1", 8, True), ("q2", 7, True)]
    assert q1.block_table[:2] == q2.block_table[:2] == pinned
    assert s.kv.blocks_shared(s.running) == {b: ["q1", "q2"] for b in pinned}
    drive(s)
    assert s.kv.pool.refcount[pinned].tolist() == [1, 1] and s.kv.num_used_blocks == 2
    s.kv.unpin(pinned)
    assert s.kv.num_used_blocks == 0
    s.kv.check_invariants()


def test_a_document_arriving_twice_at_once_is_computed_once():
    """Two requests over the same 100-token document arrive together: the second waits while the
    first computes the document's whole blocks, then reads them from the cache."""
    s = make(max_num_batched_tokens=48, long_prefill_chunk=48)
    doc = list(range(3, 103))
    a, b = Request("a", doc + [7, 8], 3), Request("b", doc + [9], 3)
    s.add(a)
    s.add(b)
    out, _ = step(s)
    assert plan(out) == [("a", 48, False)]              # b is held: its first block is a's to compute
    assert s.kv.pending_prefix(b, len(s.kv.get_computed_blocks(b)[0])) == "a"   # its second block
    outs = drive(s)
    computed = {rid: sum(x.num_new_tokens for o in [out] + outs for x in o.scheduled if x.request.request_id == rid)
                for rid in "ab"}
    assert b.num_cached_tokens == 96 and computed["b"] == 101 - 96 + 3 - 1
    assert computed["a"] == 102 + 3 - 1
    assert a.output_token_ids == expected_outputs(a, 3) and b.output_token_ids == expected_outputs(b, 3)
    assert not s.kv.promised


def test_a_held_request_is_admitted_when_its_leader_goes():
    """The request computing a document is aborted (or preempted): the one waiting for it computes
    the document itself."""
    s = make(max_num_batched_tokens=32, long_prefill_chunk=32)
    doc = list(range(3, 103))
    a, b = Request("a", doc + [7], 2), Request("b", doc + [9], 2)
    s.add(a)
    s.add(b)
    step(s)
    s.abort("a")
    assert not s.kv.promised
    out, _ = step(s)
    assert plan(out) == [("b", 32, False)]
    drive(s)
    assert b.output_token_ids == expected_outputs(b, 2)


def test_a_prompt_limit_paces_prompt_chunks_only_while_requests_decode():
    """schedule(prompt_limit): the prompt tokens of a step (all prompt chunks together) stay within
    the limit while some request decodes; decodes are never held back; with nothing decoding the
    limit does not apply; a paced prompt resumes where it stopped, and every request still gets
    the outputs it gets unpaced."""
    s = make(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_chunk=64)
    a = Request("a", [5] * 40, 6)
    s.add(a)
    out = s.schedule(prompt_limit=8)             # nothing decodes yet: the whole prompt
    assert plan(out) == [("a", 40, True)]
    s.update(out, {"a": token(a)})
    b, c = Request("b", [6] * 30, 3), Request("c", [7] * 20, 3)
    s.add(b)
    s.add(c)
    seen = []
    while s.has_unfinished:
        out = s.schedule(prompt_limit=8)
        decoding = [x for x in out.scheduled if x.request.num_output_tokens and x.num_new_tokens == 1]
        prompt = sum(x.num_new_tokens for x in out.scheduled if x not in decoding)
        if any(r.num_output_tokens and r.num_new_tokens_to_compute == 1 for r in s.running):
            assert prompt <= 8
        seen.append(plan(out))
        s.update(out, {x.request.request_id: token(x.request) for x in out.scheduled if x.samples})
        s.kv.check_invariants()
    assert seen[0] == [("a", 1, True), ("b", 8, False)]      # a decodes every step, b's prompt is paced
    assert all(any(rid == "a" for rid, _, _ in p) for p in seen[:5])
    for r, n in ((a, 6), (b, 3), (c, 3)):
        assert r.output_token_ids == expected_outputs(r, n)


def test_pacer_learns_decode_time_and_per_token_cost():
    from hetero.engine.pacing import MIN_PROMPT_TOKENS, Pacer

    off = Pacer(None)
    off.record(0.1, 0, 2)
    assert off.limit(2) is None
    p = Pacer(0.2)
    assert p.limit(0) is None                   # nothing decodes: no limit
    assert p.limit(3) == 0                      # a step of decodes alone, to time
    p.record(5.0, 500, 0)                       # a prompt alone teaches nothing
    assert not p.alone and not p.mixed
    for n in (2, 4, 2, 4):
        p.record(0.06 + 0.01 * n, 0, n)         # decode steps: 60 ms + 10 ms a token
    base, slope = p.decode_line()
    assert abs(base - 0.06) < 1e-9 and abs(slope - 0.01) < 1e-9
    assert p.limit(3) == MIN_PROMPT_TOKENS      # the time per prompt token is not measured yet
    for n, tokens in ((2, 16), (4, 40), (2, 100)):
        p.record(0.06 + 0.01 * n + 0.002 * tokens, tokens, n)      # 2 ms a prompt token
    assert abs(p.per_prompt_token(p.decode_line()) - 0.002) < 1e-9
    assert p.limit(3) in (54, 55)               # (0.2 - 0.09) / 0.002, give or take a rounding
    assert p.limit(12) == MIN_PROMPT_TOKENS     # a bigger batch leaves room for 10: the floor
    q = Pacer(0.2)
    for n in (2, 4, 2, 4):
        q.record(0.3, 0, n)                     # noisy decode steps, slower than the ones with prompts
    q.record(0.1, 16, 2)
    assert q.per_prompt_token(q.decode_line()) == 0 and q.limit(3) == 32     # not unlimited: twice 16
    q.record(0.25, 32, 2)                       # past the target: what stayed within it counts
    assert q.limit(3) == 32


@pytest.mark.parametrize("backlog_at", [1, 20])
def test_a_steady_backlog_keeps_its_paced_chunks(backlog_at):
    """Under a backlog of prompts every step carries one: the pacer still learns (it asks for two
    steps of decodes alone), and does not forget after its window of steps (decode-alone and
    mixed steps are kept apart), so chunks stay at what the target allows, not the floor.
    A synthetic machine: 20 ms a step + 2 ms a decode token + 0.4 ms a prompt token, target 0.1 s."""
    from hetero.engine.pacing import WINDOW, Pacer
    from hetero.engine.scheduler import is_decoding

    s = make(n_blocks=4000, max_num_seqs=64, max_num_batched_tokens=512, long_prefill_chunk=512)
    pacer = Pacer(0.1)
    s.add(Request("long", [5] * 10, 100000))
    paced = []
    for i in range(1000):
        if i == backlog_at:
            for k in range(60):
                s.add(Request(f"p{k}", [6 + k] * 400, 2))
        backlog = bool(s.waiting) or not all(map(is_decoding, s.running))
        if i > backlog_at and not backlog:
            break
        out = s.schedule(pacer.limit(sum(map(is_decoding, s.running))))
        dec = sum(is_decoding(x.request) for x in out.scheduled)
        pacer.record(0.02 + 0.002 * dec + 0.0004 * (out.num_tokens - dec), out.num_tokens - dec, dec)
        if i > backlog_at + 8 and s.waiting:
            paced.append(out.num_tokens - dec)
        s.update(out, {x.request.request_id: 3 for x in out.scheduled if x.samples})
    assert len(paced) > WINDOW + 20
    # room: (0.1 - 0.02 - 0.002 * decodes) / 0.0004 = 200 - 5 * decodes prompt tokens, a few decoding
    assert min(paced) >= 150 and max(paced) <= 200, (min(paced), max(paced))
