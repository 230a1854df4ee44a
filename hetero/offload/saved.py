"""Saved contexts: a Context's KV in a memory-mappable file (Context.save, HeteroGenerator.load_context).

File layout (little-endian):
  MAGIC (16 bytes) | header length (8 bytes) | header (JSON) | zero padding to a multiple of ALIGN |
  payload: for each layer, K then V of its stored rows as [Hkv, rows, D] in the storage dtype
The header holds the format version, the model's fingerprint, the tokens, each layer's row range
(a sliding-window layer keeps only the rows its window still sees), the payload's byte count and
its CRC-32. Loading checks all of them before it copies anything into a new arena, and closes that
arena on any error: a truncated, corrupted or mismatched file raises and leaves nothing behind.
"""
import hashlib
import json
import os
import zlib

import numpy as np
import torch

from hetero.cpu_attention.simd import BK
from hetero.errors import ContextFileError

MAGIC = b"HETERO-CONTEXT\n\0"
VERSION = 1
ALIGN = 4096


def fingerprint(model, spec):
    """What must match between the model that saved a context and the one loading it: the
    attention shape (hetero's ModelSpec) and a hash of every attention projection (shape and a
    sample of 64 values from each end: a different checkpoint changes them, reading all the
    weights would take seconds for a large model)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if "attn" in name and name.endswith("weight") and p.ndim == 2:
            flat = p.detach().reshape(-1)
            h.update(f"{name}:{tuple(p.shape)}".encode())
            h.update(torch.cat([flat[:64], flat[-64:]]).to("cpu", torch.float32).numpy().tobytes())
    return {"model_type": spec.model_type, "layers": spec.layers, "q_heads": spec.q_heads,
            "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "dtype": str(spec.dtype),
            "windows": list(spec.windows or ()), "attention_weights_sha256": h.hexdigest()}


def layer_start(n, window):
    """The first row a layer stores of n: all, or (a sliding window) from the whole block holding
    the oldest row the next query still sees (as KVSession.store_prefill)."""
    return max(0, n - window + 1) // BK * BK if window else 0


def _layer_bytes(session, layers):
    """Each layer's K and V bytes, in file order (copies out of the arena, one layer at a time)."""
    for i, lay in enumerate(layers):
        for t in session.read_rows(i, 0, lay["rows"], lay["start"]):           # [Hkv, rows, D]
            t = t.contiguous()
            yield (t if t.dtype == torch.float32 else t.view(torch.uint16)).numpy().tobytes()


def save(ctx, path):
    """Write ctx (a Context) to `path` atomically (a temporary file, then rename). Two passes over
    the arena: the CRC-32 goes in the header, which precedes the payload."""
    s = ctx.session
    n = ctx.length
    layers = [{"start": layer_start(n, s.ring_window[i]), "rows": n} for i in range(s.spec.layers)]
    crc = payload = 0
    for raw in _layer_bytes(s, layers):
        crc, payload = zlib.crc32(raw, crc), payload + len(raw)
    header = json.dumps({
        "version": VERSION, "fingerprint": fingerprint(ctx.generator.model, s.spec),
        "tokens": ctx.token_ids.tolist(), "pending": ctx.pending.tolist(), "length": n,
        "layers": layers, "payload_bytes": payload, "crc32": crc}).encode()
    head = MAGIC + len(header).to_bytes(8, "little") + header
    head += b"\0" * (-len(head) % ALIGN)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for raw in _layer_bytes(s, layers):
                f.write(raw)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_header(path):
    """The header of a saved context, checked for format and size (not yet for the model)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic, n = f.read(len(MAGIC)), f.read(8)
            if magic != MAGIC or len(n) != 8:
                raise ContextFileError(f"{path} is not a saved hetero context (bad magic)")
            n = int.from_bytes(n, "little")
            if n > size:
                raise ContextFileError(f"{path}: corrupted header (length {n} > file size {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ContextFileError(f"cannot read saved context {path}: {e}") from e
    except ValueError as e:
        raise ContextFileError(f"{path}: corrupted header ({e})") from e
    if header.get("version") != VERSION:
        raise ContextFileError(f"{path}: format version {header.get('version')}, this hetero reads {VERSION}")
    header["offset"] = -(-(len(MAGIC) + 8 + n) // ALIGN) * ALIGN
    if size != header["offset"] + header["payload_bytes"]:
        raise ContextFileError(f"{path} is truncated or padded: {size} bytes, the header says "
                               f"{header['offset'] + header['payload_bytes']}")
    if len(header["tokens"]) != header["length"] or len(header["layers"]) == 0:
        raise ContextFileError(f"{path}: corrupted header (token count and length disagree)")
    return header


def check_model(header, model, spec, path):
    want, have = header["fingerprint"], fingerprint(model, spec)
    diff = [k for k in have if want.get(k) != have[k]]
    if diff:
        raise ContextFileError(f"{path} was saved from another model: {', '.join(diff)} differ "
                               f"(saved {[want.get(k) for k in diff]}, this model {[have[k] for k in diff]})")


def fill(session, header, path):
    """Copy the payload into `session`'s arena (batch 1), checking the CRC as it reads."""
    spec = session.spec
    itemsize = torch.empty(0, dtype=spec.dtype).element_size()
    np_dtype = np.float32 if spec.dtype == torch.float32 else np.uint16
    expected = sum(2 * spec.kv_heads * (lay["rows"] - lay["start"]) * spec.head_dim * itemsize
                   for lay in header["layers"])
    if expected != header["payload_bytes"] or any(lay["rows"] != header["length"] for lay in header["layers"]):
        raise ContextFileError(f"{path}: corrupted header (its row ranges need {expected} bytes of KV, it "
                               f"says {header['payload_bytes']})")
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=header["offset"], shape=(header["payload_bytes"],))
    try:
        off, crc = 0, 0
        for i, lay in enumerate(header["layers"]):
            rows = lay["rows"] - lay["start"]
            nbytes = spec.kv_heads * rows * spec.head_dim * itemsize
            kv = []
            for _ in range(2):
                raw = mm[off:off + nbytes]
                crc = zlib.crc32(raw, crc)
                arr = torch.from_numpy(np.array(raw).view(np_dtype).reshape(spec.kv_heads, rows, spec.head_dim))
                kv.append(arr if spec.dtype == torch.float32 else arr.view(spec.dtype))
                off += nbytes
            session.write_rows(i, 0, kv[0], kv[1], lay["start"])
        if crc != header["crc32"]:
            raise ContextFileError(f"{path} is corrupted: payload CRC-32 {crc:#010x}, the header says "
                                   f"{header['crc32']:#010x}")
    finally:
        del mm
