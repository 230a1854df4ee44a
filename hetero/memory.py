"""Memory accounting of a call's KV cache: the rows it allocates up front and whether they fit.

Owns: plan_cache (a session's rows per request from the prompt and max_new_tokens or a context's
reserve, checked against HeteroConfig.max_cache_tokens, the RAM available and the shared-memory
filesystem's free space) and default_reserve (a context's rows kept free for later calls). A
context's budget (HeteroConfig.context_memory) is the registry's (hetero.offload.registry).
Plain functions over the ModelSpec and the HeteroConfig.
"""
import psutil

from hetero.errors import CapacityError
from hetero.ipc import shm
from hetero.offload.arena import whole_blocks
from hetero.offload.session import KVSession

DEFAULT_RESERVE = 1024   # KV rows a context keeps free for later calls, unless prefill(reserve=) says


def plan_cache(spec, config, attention_mask, max_new_tokens, tmax=1, private=0, groups=0, what="max_new_tokens"):
    """(left pads, real lengths, rows per request) of a call's KV session, refused with
    CapacityError where it passes max_cache_tokens, the RAM available (ram_fraction) or the
    shared-memory filesystem's free space. what: the setting that asked for the max_new_tokens
    rows past the prompt (for messages): generate's new tokens (the last one's KV is never
    written) or a context's reserve."""
    real = attention_mask.sum(1).cpu()
    rows = int(real.max()) + max_new_tokens - (what != "reserve")
    cap = whole_blocks(rows)
    limit = config.max_cache_tokens
    if limit is not None and rows > limit:
        new = "reserved" if what == "reserve" else "new, the last one's never written"
        raise CapacityError(f"a request needs {rows} KV rows (prompt {int(real.max())} + {max_new_tokens} {new}) "
                            f"but the cache capacity is max_cache_tokens={limit}")
    s = spec
    layout = KVSession.layout_for(s, len(real), cap, tmax, private, groups)   # sliding layers: a ring of their window
    rings = f"; {layout.ring_layers} sliding layers keep {layout.ring} rows" if layout.ring_layers else ""
    what = (f"the KV cache for this batch needs {layout.nbytes / 2**30:.2f} GiB ({len(real)} requests x {cap} rows "
            f"x {s.layers} layers x 2 x {s.kv_heads} heads x {s.head_dim} x {s.dtype}{rings}; the rows are the "
            f"prompt's {int(real.max())} + {what}={max_new_tokens}, allocated up front: a smaller {what} needs less)")
    avail = psutil.virtual_memory().available
    if layout.nbytes > config.ram_fraction * avail:
        raise CapacityError(f"{what} but only {avail / 2**30:.2f} GiB of RAM is available "
                            f"(ram_fraction={config.ram_fraction})")
    shm_free = shm.free_bytes()     # a segment past the tmpfs's free space dies of SIGBUS on first touch
    if shm_free is not None and layout.nbytes > shm_free:
        raise CapacityError(f"{what} but the shared-memory filesystem {shm.SHM_DIR} has only "
                            f"{shm_free / 2**30:.2f} GiB free; enlarge it (docker run --shm-size=..., or "
                            f"mount -o remount,size=... {shm.SHM_DIR})")
    pads = attention_mask.shape[1] - real
    return pads.tolist(), real.tolist(), cap


def default_reserve(spec, config, n):
    """prefill/load_context's default reserve for a context of n tokens: DEFAULT_RESERVE rows,
    within the model's max positions and HeteroConfig.max_cache_tokens."""
    rooms = [limit - n for limit in (spec.position_limit, config.max_cache_tokens) if limit is not None]
    return max(1, min([DEFAULT_RESERVE] + rooms))
