"""A transformers `Cache` whose storage is the shared-memory KV arena of a KVSession.

`update()` hands the new k/v to the session (prefill: offload to the arena;
decode: stage for the workers) and returns only the new k/v, which is all the
attention function needs. Mask sizes report the padded length, as DynamicCache
does, so transformers builds the same masks as for its own cache.
"""
from transformers.cache_utils import Cache, CacheLayerMixin

from hetero.errors import UnsupportedModelError


class UpdateOrder:
    """The session side of HeteroCache's contract: one attention call per KV update, of the same
    layer, right after it, or refuse (a layer reusing cache slots, attention called twice).
    `pending` [layers]: the layer's cache was updated and its attention has not read it yet."""

    pending: list

    def note_update(self, layer):
        """HeteroLayer.update of `layer` ran: its attention call comes next."""
        if self.pending[layer]:
            raise UnsupportedModelError(f"layer {layer}'s KV cache was updated twice without an attention call "
                                        "between (a layer reusing cache slots?); not supported")
        self.pending[layer] = True

    def take_update(self, layer, module):
        """The attention call of `layer` (module.layer_idx): it must follow that layer's cache update."""
        if layer is None or not 0 <= layer < len(self.pending) or not self.pending[layer]:
            raise UnsupportedModelError(
                f"{type(module).__name__} (layer {layer}) calls attention without a KV cache update of its own "
                "layer just before it (attention called twice per layer, KV shared across layers, or cache "
                "slots other than the layer index); not supported")
        self.pending[layer] = False


class HeteroLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = False

    def __init__(self, session, layer_idx, sliding):
        super().__init__()
        self.session, self.layer_idx, self.is_sliding = session, layer_idx, sliding
        self.seen = 0  # positions seen, left pads included

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.session.note_update(self.layer_idx)
        if self.session.prefilled:
            self.session.stage_kv(key_states, value_states)
        else:
            self.session.store_prefill(self.layer_idx, key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length):
        return self.seen + query_length, 0

    def get_seq_length(self):
        return self.seen

    def get_max_length(self):
        return -1

    def reset(self):
        raise NotImplementedError("a HeteroCache lives for one generate call and cannot be reset")


class HeteroCache(Cache):
    def __init__(self, session):
        spec = session.spec
        super().__init__(layers=[HeteroLayer(session, i, spec.sliding[i]) for i in range(spec.layers)])
        self.session = session

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("beam search, cropping and batch reshuffling are not supported by the hetero KV cache")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported
