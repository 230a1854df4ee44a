"""Saved contexts: a Context's KV in a memory-mappable file (Context.save, HeteroGenerator.load_context).

File layout (little-endian):
  MAGIC (16 bytes) | header length (8 bytes) | header (JSON) | zero padding to a multiple of ALIGN |
  payload: for each layer, K then V of its stored rows as [Hkv, rows, D] in the storage dtype
The header holds the format version, the model's fingerprint (and the LoRA adapter's the context
was prefilled with), the tokens, each layer's row range
(a sliding-window layer keeps only the rows its window still sees), the payload's byte count and
a CRC-32 over the rest of the header and the payload. Loading checks all of them before it
copies anything into a new arena, and closes that arena on any error: a truncated, corrupted or
mismatched file raises and leaves nothing behind.
"""
import hashlib
import json
import os
import stat
import tempfile
import zlib

import numpy as np
import torch

from hetero.cpu_attention.simd import BK
from hetero.digest import weight_digest
from hetero.errors import ContextFileError

MAGIC = b"HETERO-CONTEXT\n\0"
VERSION = 4          # 2: the model config and a LoRA adapter in the fingerprint; 3: every weight's every element;
                     # 4: the CRC covers the whole header (a flipped adapter name or extra loaded silently)
ALIGN = 4096
# config fields that do not shape the KV: names, token ids, output switches, the attention kernel
IGNORED_CONFIG = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "attn_implementation",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "id2label", "label2id",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "tokenizer_class", "problem_type", "finetuning_task", "task_specific_params", "prefix",
    "chunk_size_feed_forward", "tie_word_embeddings"})


def model_config(model):
    """The model config's fields that shape its KV (RoPE, norms, windows, scaling ...), as JSON values."""
    fields = json.loads(json.dumps(model.config.to_dict(), default=str))
    return {k: v for k, v in sorted(fields.items()) if not k.startswith("_") and k not in IGNORED_CONFIG}


def fingerprint(model, spec, adapter=None):
    """What must match between the model that saved a context and the one loading it: the
    attention shape (hetero's ModelSpec), the config fields that shape the KV, and a hash of the
    weights (every parameter's name, shape, dtype and digest of every element, hetero.digest:
    any layer's weights shape the KV, and one retrained embedding row changes the KV of every
    context holding its token; computed once per weight version, a lookup after). peft's
    wrapping (`.base_layer`, `lora_` adapters) is left out, so a PeftModel's base matches the
    plain model; the device does not count. adapter: the LoRA adapter the context was prefilled
    with ({"name", "sha256"}: AdapterStore.digest), or None."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        h.update(f"{name.replace('.base_layer', '')}:{tuple(p.shape)}:{p.dtype}:{weight_digest(p):016x};".encode())
    return {"model_type": spec.model_type, "layers": spec.layers, "q_heads": spec.q_heads,
            "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "dtype": str(spec.dtype),
            "windows": list(spec.windows or ()), "weights_sha256": h.hexdigest(), "config": model_config(model),
            "adapter": adapter}


def _meta_crc(header: dict) -> int:
    """The CRC-32 the payload's continues from: every header field but the CRC itself (and the
    payload's offset, which read_header adds), so a flipped bit anywhere in it is found."""
    meta = {k: v for k, v in header.items() if k not in ("crc32", "offset")}
    return zlib.crc32(json.dumps(meta, sort_keys=True).encode())


def layer_start(n, window):
    """The first row a layer stores of n: all, or (a sliding window) from the whole block holding
    the oldest row the next query still sees (as KVSession.store_prefill)."""
    return max(0, n - window + 1) // BK * BK if window else 0


def payload_bytes(spec, layers) -> int:
    """The KV bytes a file holds for these layers' row ranges (K and V, the storage dtype)."""
    itemsize = torch.empty(0, dtype=spec.dtype).element_size()
    return sum(2 * spec.kv_heads * (lay["rows"] - lay["start"]) * spec.head_dim * itemsize for lay in layers)


def _layer_bytes(session, layers):
    """Each layer's K and V bytes, in file order (copies out of the arena, one layer at a time)."""
    for i, lay in enumerate(layers):
        for t in session.read_rows(i, 0, lay["rows"], lay["start"]):           # [Hkv, rows, D]
            t = t.contiguous()
            yield (t if t.dtype == torch.float32 else t.view(torch.uint16)).numpy().tobytes()


def save(ctx, path):
    """Write ctx (a Context) to `path` atomically (a temporary file, then rename)."""
    s = ctx.session
    write(path, s, ctx.length, ctx.token_ids.tolist(), ctx.pending.tolist(),
          fingerprint(ctx.generator.model, s.spec, ctx.generator._adapter_id(ctx)))


def write(path, source, n, tokens, pending, fp, extra=None):
    """Write n rows of KV read from `source` (read_rows(layer, 0, rows, start), ring_window, spec:
    a KVSession, or an engine's pinned blocks) with their tokens and fingerprint to `path`
    atomically. Two passes over the rows: the CRC-32 goes in the header, which precedes the
    payload. extra: a JSON object kept in the header (hetero serve: a context's name, messages)."""
    layers = [{"start": layer_start(n, source.ring_window[i]), "rows": n} for i in range(source.spec.layers)]
    payload = payload_bytes(source.spec, layers)
    meta = {"version": VERSION, "fingerprint": fp, "tokens": tokens, "pending": pending, "length": n,
            "layers": layers, "payload_bytes": payload, **({"extra": extra} if extra else {})}
    meta = json.loads(json.dumps(meta))            # as a reader will see it (tuples as lists, ...)
    crc = _meta_crc(meta)
    for raw in _layer_bytes(source, layers):
        crc = zlib.crc32(raw, crc)
    header = json.dumps({**meta, "crc32": crc}).encode()
    head = MAGIC + len(header).to_bytes(8, "little") + header
    head += b"\0" * (-len(head) % ALIGN)
    path = os.fspath(path)
    # a temporary file of its own (two saves to one path, from two threads, never share one), then rename
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            for raw in _layer_bytes(source, layers):
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_header(path):
    """The header of a saved context, checked for format and size (not yet for the model)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):      # a FIFO's open would wait for a writer, a device's read forever
            raise ContextFileError(f"{path} is not a regular file ({_file_kind(st.st_mode)}); a saved context is one")
        size = st.st_size
        with open(path, "rb") as f:
            magic, n = f.read(len(MAGIC)), f.read(8)
            if magic != MAGIC or len(n) != 8:
                raise ContextFileError(f"{path} is not a saved hetero context (bad magic)")
            n = int.from_bytes(n, "little")
            if n > size:
                raise ContextFileError(f"{path}: corrupted header (length {n} > file size {size})")
            header = json.loads(f.read(n))
    except ContextFileError:
        raise                                 # a ValueError itself: named above already
    except OSError as e:
        raise ContextFileError(f"cannot read saved context {path}: {e}") from e
    except ValueError as e:
        raise ContextFileError(f"{path}: corrupted header ({e})") from e
    version = header.get("version") if isinstance(header, dict) else "?"
    if version != VERSION:
        older = isinstance(version, int) and version < VERSION
        raise ContextFileError(f"{path}: saved context format version {version}, this hetero reads version {VERSION}"
                               + (" only (an older hetero saved it: prefill the context and save it again)"
                                  if older else ""))
    try:
        header["offset"] = -(-(len(MAGIC) + 8 + n) // ALIGN) * ALIGN
        ints = lambda xs: all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)  # noqa: E731
        ok = (ints(header["tokens"]) and ints(header["pending"]) and ints([header["length"], header["payload_bytes"],
              header["crc32"]]) and len(header["tokens"]) == header["length"] > 0 and header["layers"]
              and all(ints([lay["start"], lay["rows"]]) for lay in header["layers"])
              and isinstance(header["fingerprint"], dict) and isinstance(header["fingerprint"].get("config"), dict)
              and "adapter" in header["fingerprint"] and isinstance(header.get("extra", {}), dict))
    except (KeyError, TypeError) as e:
        raise ContextFileError(f"{path}: corrupted header (missing or wrong field: {e})") from e
    if not ok:
        raise ContextFileError(f"{path}: corrupted header (fields of the wrong type or disagreeing)")
    if size != header["offset"] + header["payload_bytes"]:
        raise ContextFileError(f"{path} is truncated or padded: {size} bytes, the header says "
                               f"{header['offset'] + header['payload_bytes']}")
    return header


def _file_kind(mode):
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a plain file"


def check_model(header, model, spec, path, adapter_digest):
    """Raise ContextFileError unless the file was saved from this model (config fields that one
    side lacks, as another transformers version may, are not compared); its adapter must be
    loaded with the same weights (adapter_digest(name): the loaded one's AdapterStore.digest, or None).
    Returns the adapter's name, or None."""
    want, have = header["fingerprint"], fingerprint(model, spec)
    diff = [k for k in have if k not in ("config", "adapter") and want.get(k) != have[k]]
    if diff:
        raise ContextFileError(f"{path} was saved from another model: {', '.join(diff)} differ "
                               f"(saved {[want.get(k) for k in diff]}, this model {[have[k] for k in diff]})")
    cw, ch = want["config"], have["config"]
    diff = sorted(k for k in set(cw) & set(ch) if cw[k] != ch[k])
    if diff:
        raise ContextFileError(f"{path} was saved from a model of another config: "
                               + ", ".join(f"{k} (saved {cw[k]!r}, this model {ch[k]!r})" for k in diff))
    adapter = want.get("adapter")
    if adapter is None:
        return None
    if not isinstance(adapter, dict) or not isinstance(adapter.get("name"), str):
        raise ContextFileError(f"{path}: corrupted header (its adapter entry)")
    loaded = adapter_digest(adapter["name"])
    if loaded is None:
        raise ContextFileError(f"{path} was prefilled with LoRA adapter {adapter['name']!r}, which this generator "
                               "has not loaded (load_adapter first)")
    if loaded["sha256"] != adapter.get("sha256"):
        raise ContextFileError(f"{path} was prefilled with another adapter named {adapter['name']!r} "
                               "(its weights differ from the one loaded)")
    return adapter["name"]


def fill(session, header, path):
    """Copy the payload into `session`'s arena (batch 1), checking the CRC as it reads."""
    spec = session.spec
    itemsize = torch.empty(0, dtype=spec.dtype).element_size()
    np_dtype = np.float32 if spec.dtype == torch.float32 else np.uint16
    expected = payload_bytes(spec, header["layers"])
    if expected != header["payload_bytes"] or any(lay["rows"] != header["length"] for lay in header["layers"]):
        raise ContextFileError(f"{path}: corrupted header (its row ranges need {expected} bytes of KV, it "
                               f"says {header['payload_bytes']})")
    windows = list(spec.windows or ()) or [0] * spec.layers
    if len(header["layers"]) != spec.layers or \
            any(lay["start"] > layer_start(lay["rows"], w) for lay, w in zip(header["layers"], windows)):
        raise ContextFileError(f"{path}: corrupted header (its {len(header['layers'])} layers' row ranges do not "
                               f"fit this model's {spec.layers} layers and windows)")
    try:             # read from one descriptor, not mapped: a file truncated meanwhile is a short read, not SIGBUS
        f = open(path, "rb")
    except OSError as e:                        # deleted since its header was read
        raise ContextFileError(f"cannot read saved context {path}: {e}") from e
    with f:
        f.seek(header["offset"])
        crc = _meta_crc(header)
        for i, lay in enumerate(header["layers"]):
            rows = lay["rows"] - lay["start"]
            nbytes = spec.kv_heads * rows * spec.head_dim * itemsize
            # this session may keep the layer as a smaller ring (another chunk size): its rows only;
            # an engine's pool (PoolRows) says which rows its blocks keep (first_row)
            keep = session.first_row(i) if hasattr(session, "first_row") else \
                layer_start(lay["rows"], session.ring_window[i])
            start = max(lay["start"], keep)
            kv = []
            for _ in range(2):
                raw = bytearray(nbytes)
                if f.readinto(raw) != nbytes:
                    raise ContextFileError(f"{path} is truncated: it changed since its header was read")
                crc = zlib.crc32(raw, crc)
                arr = torch.from_numpy(np.frombuffer(raw, np_dtype).reshape(spec.kv_heads, rows, spec.head_dim))
                arr = arr[:, start - lay["start"]:]
                kv.append(arr if spec.dtype == torch.float32 else arr.view(spec.dtype))
            session.write_rows(i, 0, kv[0], kv[1], start)
    if crc != header["crc32"]:
        raise ContextFileError(f"{path} is corrupted: CRC-32 {crc:#010x} over its header and payload, the "
                               f"header says {header['crc32']:#010x}")


def check_vocabulary(header, vocab, path):
    """After fill (the CRC covers the tokens): each token id within the model's vocabulary of
    `vocab` (None: not known), or ContextFileError."""
    bad = [t for t in header["tokens"] + header["pending"] if vocab is not None and t >= vocab]
    if bad:
        raise ContextFileError(f"{path} holds token id {bad[0]}, outside the model's vocabulary of {vocab} "
                               "(its CRC holds: it was written so): not a context of this model")
