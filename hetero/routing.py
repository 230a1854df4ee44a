"""Routing a call's attention to hetero's KV session, one call at a time.

Owns: the call lock (CallLock: one call per generator at a time, whose worker pool has one
control block, and one per model across generators, since a call sets the model's attention
implementation; calls from other threads wait their turn);
the decode transport a session gets on a CUDA model (choose_transport); and, for the length of
a call, the model's attention routed to the session (routed: hetero's attention implementation,
the forward pre-hook that starts each forward, and for a family whose generate drops its cache,
the generic input preparation: keeping_cache). Plain functions and one small class; the
generator passes in what they act on.
"""
import contextlib
import threading
import time
import weakref

from hetero import attention, cpu_linear
from hetero.errors import UnsupportedModelError
from hetero.ipc.cuda_transport import CudaTransport
from hetero.ipc.transport import PinnedTransport
from hetero.offload.cache import HeteroCache

_MODEL_LOCKS = weakref.WeakKeyDictionary()    # model -> [the lock of the one call it serves (across generators),
                                              # the thread holding it]
_MODELS_LOCK = threading.Lock()


class CallLock:
    """A generator's lock: one generate (or adapter load, or context close, or engine step) at a
    time, the pool having one control block. Reentrant so a call can close its own context (a
    failed call's recovery); `busy` refuses a nested call (a streamer or logits processor calling
    back). A call from another thread waits its turn (exclusive(wait=True)); concurrent
    generate() calls that the engine batches join its running batch instead (hetero.engine.calls)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.busy = False
        self.owner = None                 # the thread inside the call (busy)
        self.waiters = 0                  # calls blocked in exclusive(): the engine lets them in first (turn)
        self._count = threading.Lock()

    def refuse_nested(self, what):
        """Under the lock: this thread is not inside a call (a streamer calling back)."""
        if self.busy:
            raise RuntimeError(f"{what} called from inside a call of the same HeteroGenerator; not supported")

    @contextlib.contextmanager
    def exclusive(self, model, wait=True):
        """A call over `model`: this generator's lock and the model's, waiting for a call in another
        thread (wait=False: RuntimeError at once). A call made from inside a call (this thread
        holds the lock: a streamer calling back) raises."""
        if not self.lock.acquire(blocking=False):
            if not wait:
                raise RuntimeError("this HeteroGenerator is already generating (in another thread)")
            with self._count:
                self.waiters += 1
            try:
                self.lock.acquire()
            finally:
                with self._count:
                    self.waiters -= 1
        try:
            if self.busy:
                raise RuntimeError("generate/prefill called from inside a call of the same HeteroGenerator "
                                   "(a streamer or logits processor?); not supported")
            with _MODELS_LOCK:
                model_lock, owner = _MODEL_LOCKS.setdefault(model, [threading.Lock(), None])
            if owner == threading.get_ident():
                raise RuntimeError("another HeteroGenerator over the same model is running the call this one is "
                                   "made from (a streamer or logits processor?); a model serves one call at a time")
            if not model_lock.acquire(blocking=wait):     # a call sets the model's attention implementation
                raise RuntimeError("another HeteroGenerator over the same model is running a call (in another "
                                   "thread); a model serves one call at a time")
            _MODEL_LOCKS[model][1] = self.owner = threading.get_ident()
            self.busy = True
            try:
                yield
            finally:
                self.busy, self.owner = False, None
                _MODEL_LOCKS[model][1] = None
                model_lock.release()
        finally:
            self.lock.release()


    @property
    def busy_here(self):
        """This thread is inside a call (a streamer calling back)."""
        return self.busy and self.owner == threading.get_ident()

    @property
    def busy_elsewhere(self):
        """A call runs in another thread (one made from inside this thread's call is nested)."""
        return self.busy and self.owner != threading.get_ident()

    def turn(self, model, poll=0.001):
        """exclusive(model) for an engine step, after every call waiting for the lock had its turn
        (a lock is not fair: the engine's loop would take it again first)."""
        while self.waiters:
            time.sleep(poll)
        return self.exclusive(model)


@contextlib.contextmanager
def routed(model, spec, hooks, session, lora, choose_transport):
    """For one call: pick the session's transport (choose_transport(session, pool, lora)), route
    the model's attention to it and yield a HeteroCache over it; restore the model's attention
    implementation afterwards. hooks: the generator's LoraHooks."""
    patched = spec.drops_cache           # the generic input preparation: the cache stays (calls checked: rope_ok)
    keeping = keeping_cache(model) if patched else None
    choose_transport(session, session.pool, lora)
    if lora is not None:                 # peft layers not served here run their base layer (under the lock)
        hooks.route_peft_layers()
    token = attention.active_session.set(session)
    previous = model.config._attn_implementation
    hook = None
    linear = model.device.type == "cpu" and cpu_linear.install(model)   # fp32 linear layers: torch.mm at 1-5 rows, oneDNN past
    fast = cpu_linear.ACTIVE.set(linear)
    try:
        if patched:                      # on the instance, which has none of its own (keeping_cache)
            model.prepare_inputs_for_generation = keeping
        hook = model.register_forward_pre_hook(lambda *_: session.begin_forward())
        model.set_attn_implementation(attention.NAME)
        yield HeteroCache(session)
    finally:
        try:
            if hook is not None:
                hook.remove()
            model.set_attn_implementation(previous)
        finally:
            cpu_linear.ACTIVE.reset(fast)
            if linear:
                cpu_linear.uninstall(model)
            attention.active_session.reset(token)
            if patched:
                model.__dict__.pop("prepare_inputs_for_generation", None)


def choose_transport(model, want, session, pool, lora=None):
    """A CUDA model's decode round trip: the CUDA extension where HeteroConfig.transport (`want`)
    and the batch allow (see hetero.ipc.transport), else host copies through page-locked buffers
    (PinnedTransport). With `lora` (the call's LoraBatch), its decode deltas go through the
    CUDA transport too."""
    dev = model.device
    if dev.type != "cuda":
        return
    gpus = {p.device for p in model.parameters() if p.device.type == "cuda"}
    if len(gpus) > 1:          # a device_map over several GPUs: the transports serve one device
        raise UnsupportedModelError(f"the model is spread over {len(gpus)} GPUs ({sorted(map(str, gpus))}); "
                                    "hetero runs a model on one GPU (its KV lives in host memory)")
    store = None if lora is None else lora.store         # None: no adapter loaded (every request base)
    t = None if want == "host" else CudaTransport.open(pool, session, dev, quiet=want == "cuda", lora=store)
    if t is None and want == "cuda":
        raise UnsupportedModelError(f"HeteroConfig.transport='cuda': the CUDA extension is unavailable "
                                    f"({CudaTransport.why})")
    session.use_transport(t or PinnedTransport(dev))
    if t is not None and store is not None:
        lora.use_transport(t)


def keeping_cache(model):
    """`model`'s prepare_inputs_for_generation without its family's override that drops the cache
    (CACHE_DROPPING_MODEL_TYPES): the method of the next class in its MRO."""
    own = [c for c in type(model).__mro__ if "prepare_inputs_for_generation" in c.__dict__]
    on_instance = model.__dict__.get("prepare_inputs_for_generation")
    user = "the model instance has its own" if on_instance is not None and \
        not getattr(on_instance, "_hetero_keeping_cache", False) else \
        None if own[0].__module__.startswith("transformers.") else f"{own[0].__name__} overrides"
    if user is not None:                   # hetero's replacement would skip the user's override
        raise UnsupportedModelError(
            f"{user} prepare_inputs_for_generation of a {model.config.model_type} model, whose "
            "transformers version drops the KV cache past original_max_position_embeddings; hetero replaces "
            "that method during a call and would skip the override")
    cls = next(c for c in own if c.__module__.startswith("transformers.models."))
    generic = super(cls, model).prepare_inputs_for_generation

    def keeping_cache(*args, **kwargs):
        return generic(*args, **kwargs)

    keeping_cache._hetero_keeping_cache = True     # hetero's own, put on the instance during a call (routed)
    return keeping_cache
