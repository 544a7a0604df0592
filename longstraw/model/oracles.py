"""Plain references that longstraw's optimized paths are held equal to (tests) and compared with (bench).

All run the unmodified transformers model: no longstraw attention, no longstraw cache.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from ..hf.parts import base_model
from .capability import config_layer_types, model_layer_types


def _response_logprobs(logits: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, dim=-1).gather(-1, response[:, None]).squeeze(-1)


def full_sequence_logprobs(model, prompt: torch.Tensor, response: torch.Tensor, logits_to_keep: bool = False):
    """log p(response | prompt) `[R]` from one forward of `[prompt + response]` (with grad).

    `logits_to_keep=True` has the model compute logits of the last R + 1 positions only (as TRL does).
    """
    r = response.numel()
    kwargs = {"logits_to_keep": r + 1} if logits_to_keep else {}
    logits = model(input_ids=torch.cat([prompt, response])[None], **kwargs).logits[0]
    return _response_logprobs(logits[-r - 1 : -1], response)


#: model types whose multi-token forward with a cache ignores the cached SSM state (transformers 5.24: Jamba's
#: `mamba_selective_scan` takes no initial state); their cache reference feeds the response one token at a time,
#: the path where transformers does continue from the state
STEPWISE_REFERENCE = frozenset({"jamba"})


def _cache_config(model):
    """The config transformers' `DynamicCache` is built from: the model's own where it lists `layer_types` that say
    what the layers do; otherwise a copy whose `layer_types` do (`longstraw.model.capability.model_layer_types`).
    Without
    `layer_types` transformers 5.24's cache infers them from `sliding_window` / `attention_chunk_size`
    (`cache_utils.get_layer_types_and_kwargs`), so a field a Llama never reads would make it keep only that many
    keys."""
    cfg = base_model(model).config
    text = cfg.get_text_config(decoder=True)
    types = model_layer_types(model)
    if getattr(text, "layer_types", None) is not None and types == config_layer_types(text):
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.get_text_config(decoder=True).layer_types = types
    return cfg


def cache_reference_logprobs(
    model,
    prompt: torch.Tensor,
    response: torch.Tensor,
    prefill_chunk: int | None = None,
    stepwise_response: bool = False,
) -> torch.Tensor:
    """The detached-mode reference: the model's own cache over `prompt[:-1]` under `no_grad` (in one forward, or in
    forwards of `prefill_chunk` tokens), then `[prompt[-1]] + response[:-1]` with grad (in one forward, or one token
    per forward with `stepwise_response`). log-probs `[R]`. The options change only the order of the same arithmetic:
    tests use them to measure the model's own rounding floor.

    transformers' linear-attention cache writes its recurrent state in place after reading it
    (5.24, `LinearAttentionLayer.update_recurrent_state`), which autograd rejects: run the forward
    and the backward of hybrid models inside `torch.autograd.graph.allow_mutation_on_saved_tensors()`,
    under which torch clones a saved tensor before it is mutated. Models in `STEPWISE_REFERENCE` read the
    response one token per forward (and the prompt too, which their multi-token forward would restart, unless
    `prefill_chunk` covers the whole prompt: one forward from the empty cache needs no state to continue from).
    """
    cfg = base_model(model).config
    cache = DynamicCache(config=_cache_config(model))
    p = prompt.numel()
    stepwise = cfg.get_text_config().model_type in STEPWISE_REFERENCE
    if p > 1:
        with torch.no_grad():
            if stepwise and (prefill_chunk or 0) < p - 1:
                for i in range(p - 1):
                    model(
                        input_ids=prompt[None, i : i + 1], position_ids=torch.tensor([[i]]), cache=cache, use_cache=True
                    )
            else:
                step = prefill_chunk or p - 1
                for i in range(0, p - 1, step):
                    j = min(i + step, p - 1)
                    model(
                        input_ids=prompt[None, i:j],
                        position_ids=torch.arange(i, j, device=prompt.device)[None],
                        cache=cache,
                        use_cache=True,
                    )
    inputs = torch.cat([prompt[-1:], response[:-1]])
    positions = torch.arange(p - 1, p - 1 + inputs.numel(), device=inputs.device)
    if stepwise or stepwise_response:
        logits = torch.cat(
            [
                model(
                    input_ids=inputs[None, i : i + 1],
                    position_ids=positions[None, i : i + 1],
                    cache=cache,
                    use_cache=True,
                ).logits[0]
                for i in range(inputs.numel())
            ]
        )
    else:
        logits = model(input_ids=inputs[None], position_ids=positions[None], cache=cache, use_cache=True).logits[0]
    return _response_logprobs(logits, response)


def segmented_reference_logprobs(model, prompt: torch.Tensor, response: torch.Tensor, mask: torch.Tensor) -> list:
    """The per-turn truncated reference of a multi-turn trajectory: for each policy segment (a run of mask 1) its
    log-probs with grad from `cache_reference_logprobs` over [prompt + the trajectory before it] (the model's own cache
    filled under `no_grad`): [(slice, log-probs `[len]`)] in order. Its values are the model's; its gradient holds the
    earlier turns as constants, which is not the objective longstraw trains (the whole trajectory differentiated:
    `cache_reference_logprobs` over it): the tests use it to show the two apart."""
    m = torch.as_tensor(mask).reshape(-1)
    flips = (m[1:] != m[:-1]).nonzero().flatten().add(1).tolist()
    bounds = [0, *flips, m.numel()]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if m[a] > 0:
            out.append((slice(a, b), cache_reference_logprobs(model, torch.cat([prompt, response[:a]]), response[a:b])))
    return out
