"""Byte layouts shared by the parent and the CPU workers for LoRA (numpy only: workers import it).

Adapter segment (one per loaded adapter; written once by the parent at load, read by workers):
  words [0]                  number of entries E
  words [8 + 8e : 16 + 8e]   entry e: site, in, out, r, offset of A, offset of BT (bytes), scaling (f64 bits), 0
  A  [r, in]   f32           lora_A weight of site `site`
  BT [r, out]  f32           lora_B weight, transposed (rows contiguous along out: the expand is an axpy)
A *site* is one adapted linear module of the model (an index into the generator's site table).

Staging segment (one per generator; who writes / who reads):
  hdr    [16] int64          main (before GO)   workers    rows, in of this job; a GPU-posted job
                             or the GPU                    (CMD_LORA_GPU): rows, in, site, out, parts
  rowslot [ROWS] int64       main (per call)    workers    GPU-posted jobs: request b's adapter slot (-1: none)
  counts [NW] int64          main               workers    units of worker w
  units  [NW, 2*ROWS, 6] i64 main               workers    (slot, site, row0, row1, c0, c1)
  scale  [NW, 2*ROWS] f64    main               workers    LoRA scaling of each unit
  x      [ROWS, IN] f32      main               workers    activations, rows = request-major tokens
  delta  [ROWS, OUT] f32     workers (own units) main      scaling * x A^T B^T for the adapted rows
"""
import numpy as np

from hetero.ipc import shm

ALIGN = 64
HEADER_WORDS = 8           # per adapter entry
STAGING_BYTES = 64 << 20   # x and delta together: a whole prompt's rows per job where they fit


def staging_rows(max_in, max_out):
    """Activation rows per LoRA job (longer inputs go in chunks): 256..4096, within STAGING_BYTES."""
    return int(min(4096, max(256, STAGING_BYTES // (4 * (max_in + max_out)) // 64 * 64)))


def _round(n, a=ALIGN):
    return (n + a - 1) // a * a


def adapter_offsets(entries):
    """entries: [(site, in, out, r)] -> ([(offA, offBT)], total bytes)."""
    off = _round(8 * (8 + HEADER_WORDS * len(entries)))
    out = []
    for _, i, o, r in entries:
        a = off
        off = _round(off + 4 * r * i)
        out.append((a, off))
        off = _round(off + 4 * r * o)
    return out, off


def read_adapter(segment):
    """Worker side: {site: (A [r, in], BT [r, out], scaling)} views of an adapter segment."""
    n = int(segment.array(0, (1,), np.int64)[0])
    hdr = segment.array(64, (n, HEADER_WORDS), np.int64)
    out = {}
    for site, i, o, r, oa, ob, sbits, _ in hdr.tolist():
        scaling = float(np.int64(sbits).view(np.float64))
        out[site] = (segment.array(oa, (r, i), np.float32), segment.array(ob, (r, o), np.float32), scaling)
    return out


def staging(nworkers, max_in, max_out):
    """The staging segment's shm.pack layout (ROWS = staging_rows; a worker gets at most 2*ROWS
    units: a job holds at most ROWS pieces, a few of them cut in columns)."""
    rows = staging_rows(max_in, max_out)
    return shm.pack([
        ("hdr", (16,), np.int64),
        ("rowslot", (rows,), np.int64),
        ("counts", (nworkers,), np.int64),
        ("units", (nworkers, 2 * rows, 6), np.int64),
        ("scale", (nworkers, 2 * rows), np.float64),
        ("x", (rows, max_in), np.float32),
        ("delta", (rows, max_out), np.float32),
    ])


def run_units(rank, views, adapters):
    """Worker side of one LoRA job: delta[row0:row1, c0:c1] = s * (x A^T) BT[:, c0:c1] per unit."""
    rows, din = int(views["hdr"][0]), int(views["hdr"][1])
    x = views["x"][:rows, :din]
    delta = views["delta"]
    for k in range(int(views["counts"][rank])):
        slot, site, r0, r1, c0, c1 = views["units"][rank, k].tolist()
        A, BT, _ = adapters[slot][site]
        u = x[r0:r1] @ A.T                       # [n, r]   shrink
        u *= views["scale"][rank, k]
        delta[r0:r1, c0:c1] = u @ BT[:, c0:c1]  # [n, c1-c0]  expand


def column_range(dout, parts, rank):
    """Worker `rank` of `parts`: its output columns [c0, c1) (cuts on multiples of 16, as plan_units)."""
    cut = [j * dout // parts // 16 * 16 for j in range(parts)] + [dout]
    return cut[rank], cut[rank + 1]


def run_rows(rank, views, adapters):
    """Worker side of a GPU-posted LoRA job (CMD_LORA_GPU: one decode token per request, posted by
    the CUDA transport): for every request row b with an adapter (rowslot[b]) adapting this site,
    delta[b, c0:c1] = s * (x_b A^T) BT[:, c0:c1] on this worker's columns (column_range), as
    run_units computes it; zeros for the other rows (the GPU adds every row's delta)."""
    rows, din, site, dout, parts = (int(v) for v in views["hdr"][:5])
    c0, c1 = column_range(dout, parts, rank)
    x, delta = views["x"], views["delta"]
    for b in range(rows):
        entry = adapters.get(int(views["rowslot"][b]), {}).get(site)
        if entry is None:
            delta[b, c0:c1] = 0.0
            continue
        A, BT, scaling = entry
        u = x[b:b + 1, :din] @ A.T                   # [1, r]   shrink
        u *= np.float64(scaling)
        delta[b:b + 1, c0:c1] = u @ BT[:, c0:c1]     # [1, c1-c0]  expand
