"""One forward per engine step over the scheduled requests, packed into one sequence.

The step's tokens (each request's chunk: the rest of a prompt, or the token sampled last) go
through the model as one row, input_ids [1, N] with each token's own position, as
transformers' continuous batching packs them: the dense layers do not mix tokens, and
attention is hetero's (hetero.attention routes it here while the forward runs). Per layer:

  - decode tokens (one new token after a request's cached rows): one job on the CPU workers,
    posted first (PagedKV.post_decode): they append the token's row and attend through the
    request's block table, reading blocks shared by several requests once for all of them;
  - prefill chunks (several tokens): written into the pool through their tables, and attended
    on the model's device over their cached rows (read back through the table) and their own
    (sdpa, or eager for soft-capped logits and attention sinks), while the workers run;
  - then the decode job's partials are merged and every output row is in place.

Logits are computed only for the rows that sample (logits_to_keep as a tensor of indices).

A prompt longer than one chunk would read its earlier chunks' rows back from the pool at every
later chunk and layer: on a GPU a gather on the host and a copy over PCIe, quadratic in the
prompt. PrefillStage keeps them on the model's device instead, between the request's chunks,
within a memory budget (EngineConfig.prefill_stage_memory); a request that does not fit reads
back as before. The pool stays the only home of the KV: the stage is a copy, dropped once the
prompt is done (or the request preempted or gone). A chunk that continues a prefix found in the
prefix cache (a question over a pinned or cached document) takes its rows from PrefixRows
(hetero.engine.prefix_rows), kept there for a pinned prefix or one seen before, instead of
reading them back.

  object        written by                          read by
  StepAttention  ModelRunner.execute (per step)      hetero.attention (per layer of the forward)
  its _new      HeteroCache.update (stage_kv)        attend (the same layer, next)
  PrefillStage   attend (a chunk's rows, per layer)  attend (the request's next chunk);
                 entries: ModelRunner.execute        entries dropped by execute
  PrefixRows     attend (a prefix's rows, per layer, chunks over the same prefix, any step
                 and each chunk's rows in its room)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetero import attention, cpu_linear
from hetero.adapters.hooks import LoraBatch, active_batch
from hetero.compat import forward_cache_kwarg
from hetero.engine.kv_pool import BLOCK_SIZE, request_hashes
from hetero.engine.paged import PagedKV
from hetero.engine.prefix_rows import PrefixRows, _Rows
from hetero.engine.request import RequestStatus
from hetero.engine.scheduler import SchedulerOutput
from hetero.offload.cache import HeteroCache, UpdateOrder

CPU_STAGE = 256 << 20       # PrefillStage's default bytes on the CPU
CPU_PREFIX_ROWS = 512 << 20   # PrefixRows' default bytes on the CPU (a 4K document of SmolLM2-135M: 94 MB in bf16)


@dataclass
class _Chunk:
    offset: int           # first row in the packed sequence
    start: int            # the request's first new row (its cached rows before it)
    n: int
    table: torch.Tensor   # int64 block table (CPU)
    first: int = 0        # the first cached row it reads (a ring's: its blocks before are given back)
    wtable: torch.Tensor | None = None   # the windowed layers' table when they have a pool of their own
    wfirst: int = 0                      # and the first row it holds
    stage: _Staged | None = None   # the request's rows kept on the device (PrefillStage)
    staged: bool = False           # stage holds rows 0..start-1 already (else: read them from the pool)
    prefix: _Rows | None = None    # rows 0..start-1 kept on the device (a cached prefix: PrefixRows)


class _Staged:
    """One request's rows on the device: per layer (K, V) [Hkv, size, D], allocated at first use."""

    def __init__(self, size: int, preemptions: int):
        self.size = size                  # the rows its prompt (and, resumed, its outputs) will have
        self.rows = 0                     # rows 0..rows-1 are written (every layer, after a step)
        self.preemptions = preemptions    # the request's count when staged: a preemption drops its rows
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class PrefillStage:
    """Chunked prompts' rows kept on the model's device between their chunks (a bytes budget)."""

    def __init__(self, spec, budget: int):
        self.budget, self.used = budget, 0
        self.row_bytes = 2 * spec.layers * spec.kv_heads * spec.head_dim * torch.finfo(spec.dtype).bits // 8
        self.entries: dict = {}           # Request -> _Staged

    def prune(self) -> None:
        """Drop the entries of requests no longer running, or preempted since they were staged."""
        for r in [r for r, e in self.entries.items()
                  if r.status is not RequestStatus.RUNNING or r.num_preemptions != e.preemptions]:
            self.drop(r)

    def chunk(self, request, start: int, n: int) -> tuple[_Staged | None, bool]:
        """(entry, whether it holds rows 0..start-1 already) for the chunk of `request` at rows
        start..start+n-1: its entry when it holds exactly the rows before; a new one when more
        chunks follow and it fits the budget; else None (attend over rows read from the pool)."""
        e = self.entries.get(request)
        if e is not None and e.rows == start and start + n <= e.size:
            return e, True
        self.drop(request)
        size = request.num_tokens
        if start + n >= size or self.used + size * self.row_bytes > self.budget:
            return None, False
        self.used += size * self.row_bytes
        e = self.entries[request] = _Staged(size, request.num_preemptions)
        return e, False

    def drop(self, request) -> None:
        e = self.entries.pop(request, None)
        if e is not None:
            self.used -= e.size * self.row_bytes

    def clear(self) -> None:
        """Every entry dropped (a failed step, the engine closing)."""
        self.entries.clear()
        self.used = 0


class StepAttention(UpdateOrder):
    """What hetero_attention calls during an engine step's forward (a KVSession's interface:
    spec, prefilled, note_update/stage_kv through HeteroCache, take_update, attend)."""

    prefilled = True          # every forward attends here (hetero_mask builds no mask)

    def __init__(self, kv: PagedKV, spec, decode_rows: torch.Tensor | None, chunks: list[_Chunk]):
        self.kv, self.spec = kv, spec
        self.decode_rows, self.chunks = decode_rows, chunks
        self.pending = [False] * spec.layers
        self._new = None
        self.masks = {}                          # the chunks' masks, made at the first layer (chunk_attention)

    def begin_forward(self):
        pass

    def stage_kv(self, key, value):
        self._new = (key, value)                 # [1, Hkv, N, D]: this layer's new rows

    def attend(self, layer, query, window, scale, softcap, sinks=None):
        """query [1, Hq, N, D] -> [1, N, Hq, D]."""
        key, value = self._new
        self._new = None
        q, k, v = query[0], key[0], value[0]     # [Hq, N, D], [Hkv, N, D]
        out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=query.dtype, device=query.device)
        d = self.decode_rows
        if d is not None:                        # the workers run while the chunks are attended here
            # [n, H, D] gathered contiguous (one copy each: the GPU's copy-out reads them as they are)
            self.kv.post_decode(layer, q.transpose(0, 1)[d], k.transpose(0, 1)[d], v.transpose(0, 1)[d],
                                window or 0, scale, softcap or 0.0)
        ringed = self.kv.ringed[layer]            # a windowed layer in a pool of its own
        for c in self.chunks:
            rows = slice(c.offset, c.offset + c.n)
            kc, vc = k[:, rows], v[:, rows]
            table, first = (c.wtable, c.wfirst) if ringed else (c.table, c.first)
            if c.stage is not None and not ringed:
                kc, vc = self._staged(layer, c, kc, vc)
            elif c.prefix is not None and not ringed:
                kc, vc = self._prefixed(layer, c, kc, vc)
            elif c.start:
                kc, vc = self.kv.read_rows(layer, table, c.start, first, new=(kc, vc))
            self.kv.write_rows(layer, table, c.start, k[:, rows], v[:, rows])
            out[rows] = chunk_attention(q[:, rows], kc, vc, c.start, window or 0, scale, softcap, sinks, first,
                                        self.masks)
        if d is not None:
            out[d] = self.kv.finish_decode(sinks).to(out.device, out.dtype)
        return out.unsqueeze(0)

    def _staged(self, layer, c: _Chunk, kc, vc):
        """The chunk's keys/values over rows first..start+n-1 from its stage, its new rows added
        (the earlier rows read from the pool once, when the stage is new). The pool keeps the
        model's dtype (STORAGE_CODES), so staged rows equal rows read back."""
        st = c.stage.layers.get(layer)
        if st is None:
            Hkv, _, D = kc.shape
            st = c.stage.layers[layer] = (kc.new_empty(Hkv, c.stage.size, D), vc.new_empty(Hkv, c.stage.size, D))
        K, V = st
        end = c.start + c.n
        if c.start > c.first and not c.staged:
            if c.prefix is not None:
                ck, cv = (t[:, :c.start] for t in self._prefix(layer, c, kc))
            else:
                ck, cv = self.kv.read_rows(layer, c.table, c.start, c.first)
            K[:, c.first:c.start], V[:, c.first:c.start] = ck, cv
        K[:, c.start:end], V[:, c.start:end] = kc, vc
        return K[:, c.first:end], V[:, c.first:end]

    def _prefix(self, layer, c: _Chunk, kc):
        """c's cached prefix's buffers in PrefixRows, (K, V) [Hkv, start + room, D] on the device, rows
        0..start-1 filled: read back from the pool by the first chunk over them at this layer."""
        st = c.prefix.layers.get(layer)
        if st is None:
            k, v = self.kv.read_rows(layer, c.table, c.start)
            st = c.prefix.fill(layer, k, v, like=kc)
        return st

    def _prefixed(self, layer, c: _Chunk, kc, vc):
        """The chunk's keys/values over rows 0..start+n-1: its cached prefix's rows and, in the room
        after them, its own (one view); a chunk longer than the room: a copy of both."""
        K, V = self._prefix(layer, c, kc)
        end = c.start + c.n
        if end > c.prefix.size:
            return torch.cat([K[:, :c.start], kc], 1), torch.cat([V[:, :c.start], vc], 1)
        K[:, c.start:end], V[:, c.start:end] = kc, vc
        return K[:, :end], V[:, :end]


def chunk_attention(q, k, v, start, window, scale, softcap=None, sinks=None, first=0, masks=None):
    """Causal attention of q [Hq, n, D] (positions start..start+n-1) over k/v [Hkv, start+n-first, D]
    (rows first..start+n-1), with a sliding window of `window` keys (0: none) -> [n, Hq, D].
    masks: a dict keeping the masks made, for the step's other layers (every layer alike)."""
    n, total = q.shape[1], k.shape[1]
    eager = bool(softcap or sinks is not None)
    key = (start, n, first, total, window, q.dtype, q.device, eager)
    mask = masks.get(key) if masks is not None else None
    if mask is None:
        mask = _chunk_mask(q, start, n, first, total, window, eager)
        if masks is not None:
            masks[key] = mask
    if eager:
        o, _ = attention.eager_attention(None, q[None], k[None], v[None], mask, scale, softcap, sinks)
        return o[0]                                         # [n, Hq, D]
    G = q.shape[0] // k.shape[0]
    gqa = G > 1 and q.device.type == "cpu"
    if G > 1 and not gqa:
        # CUDA: keys repeated, the path measured on the GPU (with a mask and enable_gqa, sdpa may
        # fall back to its math kernel, which holds [Hq, n, start+n] scores). The CPU's flash
        # kernel takes enable_gqa and reads each key head once for its G query heads (a 4K-key
        # chunk's attention 3x faster than over repeated keys; equal bits)
        k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None and n > 1,
                                       scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _chunk_mask(q, start, n, first, total, window, eager):
    """The chunk's mask (None: plain causal): boolean for the eager path; on the CPU's sdpa additive
    (its flash kernel turns a boolean mask into this on every call: the same bits; a 16-row chunk
    over 1.7K keys 1.0 -> 0.8 ms in bf16 on the 2-core VM)."""
    mask = None
    if start or window:
        i = torch.arange(start, start + n, device=q.device)[:, None]
        j = torch.arange(first, first + total, device=q.device)[None, :]
        mask = j <= i
        if window:
            mask &= i - j < window
    if mask is not None and not eager and q.device.type == "cpu":
        mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    return mask


def gpu_budgets(free: int) -> tuple[int, int]:
    """(PrefillStage's, PrefixRows') default bytes on a GPU with `free` bytes free: a quarter, an eighth."""
    return free // 4, free // 8


class ModelRunner:
    """Runs a SchedulerOutput through the model: one forward, logits of the sampling rows."""

    def __init__(self, model, spec, kv: PagedKV, blocks, lora=None, stage_memory: int | None = None,
                 prefix_memory: int | None = None):
        """blocks: the BlockPool of the full-attention layers' pool (PrefixRows checks its born
        stamps). lora: a callable giving (AdapterStore, LoraHooks) or (None, None): the adapters
        requests name (hetero.engine.adapters). stage_memory: PrefillStage's budget in bytes,
        prefix_memory: PrefixRows' (None: gpu_budgets of a GPU's free memory; on the CPU,
        CPU_STAGE and CPU_PREFIX_ROWS)."""
        self.model, self.spec, self.kv, self.lora = model, spec, kv, lora
        self.device = model.device
        cuda = self.device.type == "cuda" and (stage_memory is None or prefix_memory is None)
        free = torch.cuda.mem_get_info(self.device)[0] if cuda else None
        # on the CPU the stage means a later chunk reads no cached rows back from the pool (a paced
        # step's 16-token chunk over a 1.5K document: 91 -> 80 ms on the 2-core VM)
        default = (CPU_STAGE, CPU_PREFIX_ROWS) if free is None else gpu_budgets(free)
        self.stage = PrefillStage(spec, default[0] if stage_memory is None else stage_memory)
        self.blocks = blocks
        self.prefix_rows = PrefixRows(spec, default[1] if prefix_memory is None else prefix_memory,
                                      layers=sum(not r for r in kv.ringed))
        self.keeps_logits = model._supports_logits_to_keep()
        self.cache_kwarg = forward_cache_kwarg(model.forward)
        # a CPU fp32 model's linear layers as torch.mm(W, X^T) at 1-5 rows and oneDNN past, in this runner's
        # steps; installed last: a raise above leaves no layer patched (release() is never called then)
        self._linear_installed = self.device.type == "cpu" and cpu_linear.install(model)
        self.fast_linear = self._linear_installed         # cpu_linear.ACTIVE in its steps (bench/cpu_linear.py A/B)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Logits [m, V] (float32) of the scheduled requests that sample, in plan order."""
        tokens, positions, decode, chunks, sample = [], [], [], [], []
        lengths, tables, rtables = [], [], []
        apart = any(self.kv.ringed)               # the windowed layers' pool kept apart
        off = 0
        self.stage.prune()
        self.prefix_rows.begin_step()
        for s in plan.scheduled:
            r, n = s.request, s.num_new_tokens
            tokens += r.tokens(s.start, s.start + n)
            positions += range(s.start, s.start + n)
            if n == 1:
                decode.append(off)
                lengths.append(s.start)
                tables.append(r.block_table)
                rtables.append(r.window_table)
            else:
                c = _Chunk(off, s.start, n, torch.tensor(r.block_table, dtype=torch.int64), r.ring_start * BLOCK_SIZE)
                if apart:
                    c.wtable, c.wfirst = torch.tensor(r.window_table, dtype=torch.int64), r.window_start * BLOCK_SIZE
                c.stage, c.staged = self.stage.chunk(r, s.start, n)
                k = s.start // BLOCK_SIZE
                if 0 < s.start <= r.num_cached_tokens and not s.start % BLOCK_SIZE and not c.first and \
                        self.prefix_rows.budget:
                    c.prefix = self.prefix_rows.find(r.block_hashes[k - 1], r.block_table[:k], self.blocks)
                chunks.append((r, c))
            if s.samples:
                sample.append(off + n - 1)
            off += n
        self.kv.ensure_open()
        self.kv.begin_decode(lengths, tables, rtables if apart else None)
        dev = self.device
        rows = torch.tensor(decode, device=dev) if decode else None
        step = StepAttention(self.kv, self.spec, rows, [c for _, c in chunks])
        keep = torch.tensor(sample or [off - 1], device=dev)
        kwargs = {"logits_to_keep": keep} if self.keeps_logits else {}
        token = attention.active_session.set(step)
        lora = active_batch.set(self._lora_batch(plan, sample, off))
        fast = cpu_linear.ACTIVE.set(self.fast_linear)
        try:
            out = self.model(input_ids=torch.tensor([tokens], device=dev),
                             position_ids=torch.tensor([positions], device=dev),
                             use_cache=True, return_dict=True, **{self.cache_kwarg: HeteroCache(step)}, **kwargs)
        finally:
            cpu_linear.ACTIVE.reset(fast)
            active_batch.reset(lora)
            attention.active_session.reset(token)
            self.kv.end_step()                   # a GPU's decode jobs: the step's one synchronization
        for r, c in chunks:                  # the stage holds the chunk's rows now; a finished prompt's go
            if c.stage is not None:
                c.stage.rows = c.start + c.n
                if c.stage.rows >= c.stage.size:
                    if r.pin_prompt and not c.first:
                        self._keep_pinned(r, c.stage)
                    self.stage.drop(r)
        logits = out.logits[0] if self.keeps_logits else out.logits[0, keep]
        return logits[:len(sample)].float()

    def _keep_pinned(self, r, st: _Staged) -> None:
        """A document being pinned, its prompt computed in several chunks: its whole blocks' rows,
        on the device in its stage, become its PrefixRows entry (its first question reads nothing
        back). The stage holds what the pool was written from: the same bits."""
        k = st.size // BLOCK_SIZE
        full = [i for i, ringed in enumerate(self.kv.ringed) if not ringed]
        if not k or not self.prefix_rows.budget or len(r.block_table) < k or min(r.block_table[:k]) < 0 or \
                sorted(st.layers) != full:
            return
        e = self.prefix_rows.adopt(request_hashes(r, k)[k - 1], r.block_table[:k], self.blocks)
        if e is None:
            return
        for layer, (K, V) in st.layers.items():
            e.fill(layer, K, V, like=K)

    def clear(self) -> None:
        """The rows kept on the device dropped (a failed step, the engine closing)."""
        self.stage.clear()
        self.prefix_rows.clear()

    def release(self) -> None:
        """The engine is done with the model (close): its linear layers as they were. Idempotent."""
        if self._linear_installed:
            self._linear_installed = self.fast_linear = False
            cpu_linear.uninstall(self.model)

    def shrink(self) -> tuple[int, int]:
        """The rows kept on the device dropped and their budgets halved (the device ran out of
        memory); the new budgets (stage, prefix rows)."""
        self.clear()
        self.stage.budget //= 2
        self.prefix_rows.budget //= 2
        return self.stage.budget, self.prefix_rows.budget

    def _lora_batch(self, plan: SchedulerOutput, sample: list[int], rows: int):
        """The step's packed LoraBatch: each request's rows with its adapter, and the rows the LM
        head sees (`sample`, the forward's logits_to_keep, else the last of `rows`) with theirs
        (None: no adapters)."""
        store, hooks = self.lora() if self.lora is not None else (None, None)
        if hooks is None:
            return None
        segs, off = [], 0
        for s in plan.scheduled:
            name = s.request.adapter
            segs.append((off, off + s.num_new_tokens, None if name is None else store.adapters[name]))
            off += s.num_new_tokens
        owner = {r1 - 1: a for _, r1, a in segs}                        # a request's last row -> its adapter
        kept = [(i, i + 1, owner[row]) for i, row in enumerate(sample or [rows - 1])] if self.keeps_logits else None
        return LoraBatch.packed(store, segs, owner=hooks, kept=kept)
