"""A call's arguments, resolved and checked as transformers would take them.

Owns: the generation settings hetero refuses (UNSUPPORTED_SETTINGS) and the ones it passes through;
how max_new_tokens / max_length / generation_config= resolve against the model's generation_config
(resolve_lengths, with_generation_config, default_new_tokens, generation_settings); the attention
mask transformers would infer (inferred_mask); and the checks of input_ids, attention_mask and
positions against the model (check_inputs, check_positions, rope_ok, one_pass_only). Plain
functions over the model and its ModelSpec: nothing here holds state.
"""
import copy
import numbers

import torch
from transformers import GenerationConfig, MaxTimeCriteria, StoppingCriteriaList, WatermarkingConfig
from transformers.generation import GenerationMode

from hetero.context import Context
from hetero.errors import CapacityError, UnsupportedModelError

PASS_THROUGH = ("streamer", "logits_processor", "stopping_criteria", "tokenizer")  # objects, not GenerationConfig fields
DEFAULT_NEW_TOKENS = 20  # transformers' default when the model's generation_config sets no max_length


class _ModelDefault:
    """generate()'s max_new_tokens when omitted (None given sets the model's aside, as in transformers)."""

    def __repr__(self):
        return "<the model's generation_config>"


MODEL_DEFAULT = _ModelDefault()
# generation settings hetero does not run, refused by name whether the call or the model's
# generation_config sets them: beam search, several sequences per prompt, no KV cache, classifier-
# free guidance, assisted and contrastive decoding, attention / hidden-state outputs
UNSUPPORTED_SETTINGS = {
    "num_beams": lambda v: v is not None and v > 1,
    "num_beam_groups": lambda v: v is not None and v > 1,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "use_cache": lambda v: v is False,
    "guidance_scale": lambda v: v is not None and v != 1,
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "penalty_alpha": lambda v: v is not None and v > 0,
    "output_attentions": bool,
    "output_hidden_states": bool,
    "assistant_early_exit": lambda v: v is not None,
    "use_mtp": bool,
    "dola_layers": lambda v: v is not None,
    "constraints": lambda v: v is not None,
    "force_words_ids": lambda v: v is not None,
    "prefill_chunk_size": lambda v: v is not None,      # HF's own chunked prefill (HeteroConfig.prefill_chunk is ours)
    "token_healing": bool,                              # rewrites the prompt's tail inside generate
}
GC_FIELDS = tuple(k for k in vars(GenerationConfig()) if not k.startswith("_") and k != "transformers_version")

# why a model has a position limit (ModelSpec.position_limit)
_LIMIT_WHY = "; hetero runs past it only a rotary (RoPE) model whose rope does not rescale with the length"


def resolve_lengths(model, max_new_tokens, kwargs):
    """generate()'s keywords checked and its lengths resolved: (max_new_tokens (None: resolved later,
    from the model or max_length), kwargs (generation_config= taken apart), model_new (the model's
    max_new_tokens applies: max_new_tokens was omitted), max_length (the call's, else MODEL_DEFAULT),
    from_max_length (max_new_tokens comes from a max_length: generate gets none then))."""
    unknown = sorted(set(kwargs) - set(GC_FIELDS) - set(PASS_THROUGH) - {"generation_config"})
    if unknown:                      # any GenerationConfig field is taken; UNSUPPORTED_SETTINGS refused by value
        raise TypeError(f"generate() got unsupported arguments {unknown}; supported: input_ids, attention_mask, "
                        f"max_new_tokens, generation_config, {', '.join(PASS_THROUGH)} and the fields of "
                        "transformers' GenerationConfig")
    max_new_tokens, kwargs = with_generation_config(max_new_tokens, kwargs)
    impl = kwargs.get("cache_implementation")     # the model's own (a checkpoint's "static") is set aside
    if impl is not None and impl != model.generation_config.cache_implementation:
        raise ValueError(f"cache_implementation={impl!r}: hetero's KV cache replaces transformers' caches; "
                         "leave it unset")
    model_new = max_new_tokens is MODEL_DEFAULT     # explicit None sets the model's max_new_tokens aside
    if model_new:
        max_new_tokens = None
    if "max_length" in kwargs:                    # a numpy integer or 0-d tensor, as transformers takes it
        kwargs["max_length"] = as_int(kwargs["max_length"])
    max_length = kwargs.get("max_length", MODEL_DEFAULT)          # the whole sequence, as in transformers
    if max_length is not None and max_length is not MODEL_DEFAULT and \
            (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
    gc = model.generation_config
    # hetero derives it (default_new_tokens) from a max_length, the call's or the model's: then
    # generate gets none and counts the same itself (given both, it warns that both were set)
    from_max_length = max_new_tokens is None and not (model_new and gc.max_new_tokens is not None) and \
        (gc.max_length if max_length is MODEL_DEFAULT else max_length) is not None
    return max_new_tokens, kwargs, model_new, max_length, from_max_length


def with_generation_config(max_new_tokens, kwargs):
    """(max_new_tokens, kwargs) with the call's generation_config= taken apart into keywords, which
    resolve as transformers resolves the object itself: each field it sets (not None) wins over the
    model's generation_config, a field it leaves None takes the model's, and the call's own
    keywords win over both. Its custom entries (no GenerationConfig field) are dropped: transformers
    keeps them inert on the config."""
    gc = kwargs.pop("generation_config", None)
    if gc is None:
        return max_new_tokens, kwargs
    if not isinstance(gc, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig, got {type(gc).__name__}")
    fields = {k: getattr(gc, k) for k in GC_FIELDS if getattr(gc, k, None) is not None}
    if max_new_tokens is MODEL_DEFAULT and "max_new_tokens" in fields:
        max_new_tokens = fields["max_new_tokens"]
    fields.pop("max_new_tokens", None)
    return max_new_tokens, {**fields, **kwargs}


def generation_settings(model, max_new_tokens, kwargs, started=None):
    """(the call's settings as transformers resolves them: the model's generation_config under the
    call's arguments, an explicit None included; the keywords for the model's generate). They go
    to generate as keywords, not as a generation_config, which transformers would refill from the
    model's wherever a field is None. hetero's cache replaces a cache_implementation the model's
    generation_config may carry (a checkpoint's "static"). max_time counts from `started` (the
    call's start, time.time()): hetero's chunked prefill and a context's continuation run before
    transformers' own clock would start. max_new_tokens None: generate counts from max_length."""
    call = dict(kwargs, max_new_tokens=max_new_tokens, cache_implementation=None)
    settings = copy.deepcopy(model.generation_config)
    if isinstance(settings.watermarking_config, dict):        # as transformers' own GenerationConfig(...)
        settings.watermarking_config = WatermarkingConfig.from_dict(settings.watermarking_config)
    for k, v in global_defaults().items():      # then the call's arguments, an explicit None included
        if getattr(settings, k, None) is None:
            setattr(settings, k, v)
    settings.update(**{k: v for k, v in call.items() if k not in PASS_THROUGH})
    if not settings.return_dict_in_generate:      # transformers returns the sequences alone: inert
        for k in ("output_attentions", "output_hidden_states"):
            if getattr(settings, k, None):
                setattr(settings, k, False)
                call[k] = False
    bad = {k: getattr(settings, k, None) for k, refused in UNSUPPORTED_SETTINGS.items()
           if refused(getattr(settings, k, None))}
    if "penalty_alpha" in bad and settings.get_generation_mode() != GenerationMode.CONTRASTIVE_SEARCH:
        del bad["penalty_alpha"]              # inert where transformers decodes greedily or samples
    if bad:
        raise ValueError(f"hetero's generate does not support {bad} (set in the call or in the model's "
                         "generation_config); it decodes one sequence per prompt over its own KV cache: "
                         "greedy or sampling, with logits processors and stopping criteria")
    given = call.get("stopping_criteria") or []
    if settings.max_time is not None and started is not None and \
            not any(type(c) is MaxTimeCriteria for c in given):        # a user's own takes precedence in HF
        stop = StoppingCriteriaList(given)
        stop.append(MaxTimeCriteria(settings.max_time, initial_timestamp=started))
        call.update(max_time=None, stopping_criteria=stop)
    return settings, call


def global_defaults() -> dict:
    """What generate fills into the fields that both the model's generation_config and the call
    leave None (transformers >= 5 keeps them None until then: top_k=50 among them), lengths
    aside (resolve_lengths counts them)."""
    fill = getattr(GenerationConfig, "_get_default_generation_params", None)
    return {} if fill is None else {k: v for k, v in fill().items() if k not in ("max_length", "min_length")}


def inferred_mask(model, input_ids, kwargs, context=None, owner=None):
    """No attention_mask: as transformers infers one, input_ids != pad where the pad id occurs
    in the prompt and is no eos id; else None (every token attended). hetero takes left pads
    only (none in a single context's new tokens): pad ids elsewhere are named, and so are pad
    ids among the tokens of the call's context(s) (those of `owner`, the generator called),
    which transformers would mask over the whole sequence while a context attends every token
    it holds."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64) \
            or input_ids.device != model.device or input_ids.ndim != 2:
        return None                          # check_inputs names the problem
    gc = model.generation_config
    pad = kwargs["pad_token_id"] if "pad_token_id" in kwargs else gc.pad_token_id
    eos = kwargs["eos_token_id"] if "eos_token_id" in kwargs else gc.eos_token_id
    pad = token_id(pad)
    if pad is None:
        return None
    if eos is not None and pad in torch.as_tensor(eos).flatten().tolist():
        return None
    held = [c for c in (context if isinstance(context, (list, tuple)) else [context])
            if isinstance(c, Context) and not c.closed and c.generator is owner]
    if any(bool((c.tokens == pad).any()) for c in held):
        raise ValueError(f"the context's tokens hold pad_token_id {pad} and no attention_mask was given: "
                         "transformers would mask those tokens over the whole sequence, while a context attends "
                         "every token it holds; pass attention_mask (torch.ones_like(input_ids) attends every "
                         "token) or a pad_token_id the context does not hold")
    single_context = isinstance(context, Context)
    pads = input_ids == pad
    if not bool(pads.any()):
        return None
    mask = (~pads).long()
    if single_context or bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(f"input_ids hold pad_token_id {pad} {'' if single_context else 'after a token '}and no "
                         "attention_mask was given: transformers would mask those tokens; hetero takes "
                         + ("no padding in a context's new tokens" if single_context else "left padding only")
                         + "; pass attention_mask (torch.ones_like(input_ids) attends every token)")
    return mask


def check_inputs(model, spec, input_ids, attention_mask, max_new_tokens, what="max_new_tokens", model_new=True,
                 max_length=MODEL_DEFAULT):
    """(attention_mask, max_new_tokens) checked; what: the name of the rows to add, for messages
    (prefill's and load_context's reserve); model_new, max_length: how None is resolved
    (default_new_tokens)."""
    device = model.device
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids (int64), got {input_ids.dtype}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}")
    if input_ids.device != device:
        raise ValueError(f"input_ids is on {input_ids.device} but the model is on {device}")
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside the model's "
                         f"vocabulary of {vocab}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    else:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match "
                             f"input_ids shape {tuple(input_ids.shape)}")
        if attention_mask.device != device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but the model is on {device}")
        if attention_mask.dtype.is_complex:
            raise TypeError(f"attention_mask must be a real tensor of 0/1, got {attention_mask.dtype}")
        m = attention_mask.long()                # a float mask of 0./1. as transformers takes it
        if attention_mask.dtype.is_floating_point and not torch.equal(m.to(attention_mask.dtype), attention_mask):
            raise ValueError("attention_mask may only hold 0 and 1")
        if ((m != 0) & (m != 1)).any():
            raise ValueError("attention_mask may only hold 0 and 1")
        if (m.sum(1) == 0).any():
            raise ValueError(f"empty prompt: rows {(m.sum(1) == 0).nonzero().flatten().tolist()} of attention_mask are all 0")
        if (m[:, 1:] < m[:, :-1]).any():
            raise ValueError("attention_mask must be left-padded (zeros only before the tokens of each row); "
                             "pass tokenizer(padding_side='left')")
        attention_mask = m
    if max_new_tokens is None:
        max_new_tokens = default_new_tokens(model, spec, input_ids.shape[1], model_new, max_length)
    max_new_tokens = as_int(max_new_tokens)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{what} must be a positive int, got {max_new_tokens!r}")
    # a left-padded row's positions count its own tokens (transformers numbers them from the mask)
    longest = input_ids.shape[1] if attention_mask is None else int(attention_mask.sum(1).max())
    check_positions(spec, longest, max_new_tokens, what)
    return attention_mask, max_new_tokens


def check_positions(spec, tokens, new, what=None):
    """CapacityError where `tokens` positions (a request's own, pads aside) and `new` more pass
    ModelSpec.position_limit (None: a rotary model runs past max_position_embeddings, as in
    transformers). what: the name of the rows added, for a prompt's message (None: a context's)."""
    limit = spec.position_limit
    # generate's last new token is chosen, never fed: it takes no position (a reserve's rows all do)
    fed = tokens + new - (what != "reserve")
    if limit is None or fed <= limit:
        return
    if what is None:
        raise CapacityError(f"{fed} positions exceed the model's max_position_embeddings ({limit}): {tokens} "
                            f"tokens and {new} new ones, the last never fed{_LIMIT_WHY}")
    if tokens >= limit + (what != "reserve"):
        raise CapacityError(f"the prompt ({tokens} positions) leaves no room in the model's "
                            f"max_position_embeddings ({limit}){_LIMIT_WHY}")
    last = "" if what == "reserve" else " (the last new token is never fed)"
    raise CapacityError(f"prompt ({tokens} positions) + {what} ({new}) needs {fed} positions{last}, more than "
                        f"the model's max_position_embeddings ({limit}){_LIMIT_WHY}")


def default_new_tokens(model, spec, prompt, model_new=True, max_length=MODEL_DEFAULT):
    """max_new_tokens when the call gives none, as transformers decides it: the model's
    generation_config.max_new_tokens (unless the call set it aside: model_new False); else what
    max_length (the call's, else the model's; prompt included) leaves after a `prompt`-token
    prompt; without one, 20 (within max_position_embeddings)."""
    gc = model.generation_config
    if model_new and gc.max_new_tokens is not None:
        return gc.max_new_tokens
    whose = "the model's generation_config.max_length" if max_length is MODEL_DEFAULT else "max_length"
    max_length = gc.max_length if max_length is MODEL_DEFAULT else max_length
    if max_length is not None:
        new, why = max_length - prompt, f"{whose} is {max_length}"
    else:
        limit = spec.max_positions
        new = DEFAULT_NEW_TOKENS if limit is None else min(DEFAULT_NEW_TOKENS, limit - prompt)
        why = f"max_position_embeddings is {limit}"
    if new < 1:
        raise ValueError(f"the prompt has {prompt} tokens and {why}: no room for new tokens")
    return new


def one_pass_only(spec, what):
    """The message refusing `what` on a model hetero runs as one-pass generate only."""
    return (f"{spec.one_pass_only}: hetero runs it as one-pass generate only; {what} would attend "
            "differently over the cache")


def rope_ok(spec, width, max_new_tokens, cached=(), keeps=False):
    """Whether a call computes every key with the LongRoPE factors transformers would use
    (ModelSpec.rope_switch N: a forward reaching past position N rotates with the long factors,
    and a family that drops its cache there (drops_cache: Phi-3) recomputes every key; hetero
    keeps its keys): no sequence passes N in the call (width + max_new_tokens <= N + 1); a
    prompt within N where the cache is kept (decode then passes N in the same forwards as
    transformers'), unless the call keeps its keys (`keeps`: it extends a context, which would then
    hold keys of both factors where later calls count on one); or every key computed above N in
    one forward: the prompt longer than N, and each context's cached rows (`cached`: their
    counts; 0 for a chunked prefill, whose first chunks lie below N) already past N."""
    N = spec.rope_switch
    if N is None or width + max_new_tokens <= N + 1 or (width <= N and not spec.drops_cache and not keeps):
        return True
    return width > N and all(c > N for c in cached)


def rope_refused(spec):
    """The error for a call rope_ok refuses."""
    N = spec.rope_switch
    return UnsupportedModelError(
        f"{spec.model_type}'s LongRoPE switches to its long factors once a sequence passes "
        f"original_max_position_embeddings={N} ("
        + ("its generate then recomputes every key" if spec.drops_cache else
           "transformers' one pass over a prompt past it rotates every key with them")
        + "); keys hetero keeps from below it would differ: keep "
        + (f"prompt + max_new_tokens <= {N + 1}" if spec.drops_cache else
           f"the prompt within {N} (a call extending a context: prompt + max_new_tokens <= {N + 1}, or "
           "extend_context=False)")
        + f", or give a prompt longer than {N} in one pass (prefill_chunk=None; a context prefilled in one "
        f"pass past {N} continues fine)")


def pad_id(settings):
    """The id a batch of contexts pads its sequences with (the resolved pad_token_id, else 0)."""
    pad = token_id(settings.pad_token_id)
    return 0 if pad is None else pad


def as_int(n):
    """A count given as transformers takes it (a numpy integer, a one-element integer tensor: see
    token_id) as an int; anything else as it was, for the caller's check to name."""
    v = token_id(n)
    return n if v is None else v


def token_id(v):
    """A token id as transformers takes one (an int, a numpy integer, a one-element integer tensor)
    -> int; anything else (None, a list) -> None."""
    if isinstance(v, torch.Tensor):
        return int(v) if v.numel() == 1 and not (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool) \
            else None
    return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else None
