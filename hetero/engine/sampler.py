"""Each request's next token, as HF `generate` would pick it for that request alone.

A request's settings (a GenerationConfig resolved as generate resolves it) become HF's own
logits processors and stopping criteria, built by transformers for that request's prompt
(`_get_logits_processor`, `_get_stopping_criteria`), and its own `torch.Generator` when it
samples with a seed. Per step each sampling row goes through its processors over the
request's tokens so far (prompt then outputs, kept in a tensor on the model's device), then
argmax or `torch.multinomial`, then its stopping criteria over the tokens with the new one, as
`GenerationMixin._sample` does. Requests with no processor and plain greedy decoding are
decided together in one argmax. End-of-sequence ids and max_new_tokens are the scheduler's
(Request.eos_token_ids, max_new_tokens); the other criteria (stop strings, max_time, a
user's) are evaluated here.

  state            written by                read by
  RequestSampler   Sampler.add (caller's     Sampler.sample (the engine thread, each step)
                   thread, before the
                   request is queued)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


@dataclass
class RequestSampler:
    do_sample: bool
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList            # besides eos and max_new_tokens (the scheduler's)
    eos: set[int]
    ids: torch.Tensor                         # [1, prompt + max_new_tokens] on the model's device
    n: int                                    # tokens in ids
    pad: int | None = None                    # generate's pad id (pad_token_id, else the first eos id)
    generator: torch.Generator | None = None
    keep_scores: bool = False
    scores: list[torch.Tensor] = field(default_factory=list)   # processed scores per step (output_scores)

    @property
    def plain(self) -> bool:
        """Greedy with nothing to apply: decided in the batch's one argmax."""
        return not self.do_sample and not self.processors and not self.criteria and not self.keep_scores


def build(model, prompt: list[int], settings: GenerationConfig, max_new_tokens: int, *,
          logits_processor=None, stopping_criteria=None, tokenizer=None, seed: int | None = None) -> RequestSampler:
    """A request's sampler from its resolved settings (hetero.settings.generation_settings),
    built as generate builds them for a batch of one with no padding."""
    gc = copy.deepcopy(settings)
    device = model.device
    ids = torch.empty(1, len(prompt) + max_new_tokens, dtype=torch.long, device=device)
    ids[0, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    prompt_ids = ids[:, :len(prompt)]
    model._prepare_special_tokens(gc, False, device=device, batch_size=1)
    gc.max_new_tokens = max_new_tokens
    gc.max_length = len(prompt) + max_new_tokens
    if gc.min_new_tokens is not None:
        gc.min_length = gc.min_new_tokens + len(prompt)
    processors = model._get_logits_processor(
        generation_config=gc, input_ids_seq_length=len(prompt), encoder_input_ids=prompt_ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(logits_processor or []),
        device=device, model_kwargs={})
    criteria = model._get_stopping_criteria(gc, StoppingCriteriaList(stopping_criteria or []), tokenizer=tokenizer)
    eos = set()
    rest = StoppingCriteriaList()
    for c in criteria:
        if type(c) is EosTokenCriteria:
            eos |= {int(t) for t in c.eos_token_id.flatten().tolist()}
        elif type(c) is not MaxLengthCriteria:          # max_new_tokens: the scheduler's
            rest.append(c)
    gen = None
    if gc.do_sample and seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed))
    pad = gc._pad_token_tensor
    return RequestSampler(do_sample=bool(gc.do_sample), processors=processors, criteria=rest, eos=eos, ids=ids,
                          n=len(prompt), pad=None if pad is None else int(pad.flatten()[0]), generator=gen,
                          keep_scores=bool(gc.output_scores))


def sample(samplers: list[RequestSampler], logits: torch.Tensor) \
        -> tuple[list[int | None], list[bool], list[Exception | None]]:
    """The next token of each request (logits [m, V] float32, row i for samplers[i]), whether a
    stopping criterion other than eos / max_new_tokens ends it, and the exception its own logits
    processors or stopping criteria raised (its token None then: that request alone fails)."""
    m = len(samplers)
    tokens: list[int | None] = [None] * m
    stopped = [False] * m
    errors: list[Exception | None] = [None] * m
    plain = [i for i, s in enumerate(samplers) if s.plain]
    if plain:
        best = logits[plain].argmax(-1).tolist()
        for i, t in zip(plain, best):
            tokens[i] = t
    for i, s in enumerate(samplers):
        if tokens[i] is not None:
            continue
        try:
            tokens[i], stopped[i] = _one(s, logits[i:i + 1])
        except Exception as e:               # the caller's processor or criterion: its request fails
            errors[i] = e
    for i, s in enumerate(samplers):
        if tokens[i] is not None and s.n < s.ids.shape[1]:
            s.ids[0, s.n] = tokens[i]
            s.n += 1
    return tokens, stopped, errors


def _one(s: RequestSampler, logits: torch.Tensor) -> tuple[int, bool]:
    """One request's token through its processors (logits [1, V]) and whether its criteria stop it."""
    ids = s.ids[:, :s.n]
    scores = s.processors(ids, logits.clone()) if s.processors else logits
    if s.do_sample:
        probs = torch.softmax(scores, dim=-1)
        token = int(torch.multinomial(probs, num_samples=1, generator=s.generator)[0, 0])
    else:
        token = int(scores[0].argmax())
    stop = False
    if s.criteria:
        s.ids[0, s.n] = token
        stop = bool(s.criteria(s.ids[:, :s.n + 1], scores)[0])
    if s.keep_scores:
        s.scores.append(scores[0].clone())
    return token, stop
