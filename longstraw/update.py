"""Update: gradients of one step's loss, accumulated response by response (the optimizer step is the caller's).

GRPO (`policy_update`): the loss normalizer comes first, from every response's count of policy tokens
(mask = 1, and 0 for a truncated response when `mask_truncated_completions`); then each prompt's state
(kept by the rollout, or captured again) serves its G responses one at a time: replay with autograd,
the response's share of the batch loss, `backward()`, free the graph. In exact mode `state.backward()`
then pushes the accumulated state gradient through the prompt. The sum of the shares is the batched
GRPO loss of TRL 1.16 (`longstraw.losses`), so the accumulated gradient is its gradient.

Entropy bonus (TRL 1.16): − entropy_coef · Σ mask·H / Σ mask over the whole step's policy tokens,
whatever the loss type's normalizer.

Supervised warm-up (`sft_update`): − mean log-prob of the answer tokens (and the stop token).

Memory: the state of one prompt plus one response's graph at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import capture
from .logprobs import chunked_logprobs
from .losses import GRPOLoss
from .memory import MemoryMeter
from .models import model_parts
from .rollout import Policy, Response, Rollout
from .tasks import Example


@dataclass(frozen=True)
class UpdateSettings:
    """The update's options (`TrainConfig`'s fields of the same names)."""

    max_completion_length: int
    temperature: float = 1.0
    mask_truncated_completions: bool = False
    entropy_coef: float = 0.0
    prompt_grad: str = "detached"
    chunk_size: int = 1024
    checkpoint_layers: bool = False
    state_dtype: str | None = None

    @classmethod
    def from_config(cls, cfg) -> "UpdateSettings":
        return cls(cfg.max_completion_length, cfg.temperature, cfg.mask_truncated_completions, cfg.entropy_coef,
                   cfg.prompt_grad, cfg.chunk_size, cfg.checkpoint_layers, cfg.state_dtype)


def loss_mask(response: Response, settings: UpdateSettings) -> torch.Tensor:
    """`[R]` 1 where a token counts in the loss, the ratio and the normalizer."""
    if response.truncated and settings.mask_truncated_completions:
        return torch.zeros_like(response.mask)
    return response.mask


@dataclass
class _Totals:
    loss: float = 0.0
    kl: float = 0.0
    clipped: float = 0.0
    entropy: float = 0.0
    tokens: int = 0


def policy_update(model, rollout: Rollout, loss_fn: GRPOLoss, settings: UpdateSettings, meter: MemoryMeter) -> dict:
    """Accumulate the gradient of the step's GRPO loss into the parameters; returns the step's loss metrics."""
    masks = [loss_mask(r, settings) for r in rollout.responses]
    lengths = [int(m.sum()) for m in masks]
    norm = loss_fn.normalizer(lengths, rollout.group_ids, settings.max_completion_length)
    entropy_scale = settings.entropy_coef / max(sum(lengths), 1)
    totals, i = _Totals(), 0
    for group in rollout.groups:
        state = group.state
        if state is None:
            with meter.stage("capture"):
                state = capture(model, group.prompt_ids, chunk_size=settings.chunk_size,
                                prompt_grad=settings.prompt_grad, state_dtype=settings.state_dtype)
        with meter.stage("replay"):
            for response in group.responses:
                _response_backward(state, response, masks[i], float(rollout.advantages[i]), norm[i], entropy_scale,
                                   loss_fn, settings, totals)
                i += 1
            state.backward()  # exact mode: the prompt's share of the gradient (nothing when detached)
            state.release()
        group.state = None
    n = max(totals.tokens, 1)
    metrics = dict(loss=totals.loss, entropy=totals.entropy / n, clip_ratio=totals.clipped / n)
    if loss_fn.beta > 0:
        metrics["kl"] = totals.kl / n
    return metrics


def _response_backward(state, response: Response, mask: torch.Tensor, advantage: float, scale: float,
                       entropy_scale: float, loss_fn: GRPOLoss, settings: UpdateSettings, totals: _Totals) -> None:
    """Replay one response, back-propagate its share of the batch loss, free its graph."""
    out = state.replay(response.tokens, temperature=settings.temperature, checkpoint_layers=settings.checkpoint_layers)
    loss, st = loss_fn.response_loss(out.logprobs, response.old_logprobs, advantage, scale,
                                     ref_logps=response.ref_logprobs, mask=mask)
    if entropy_scale > 0:
        loss = loss - entropy_scale * (out.entropy * mask).sum()
    loss.backward()
    on = mask > 0
    totals.loss += loss.item()
    totals.tokens += int(on.sum())
    totals.entropy += float(out.entropy.detach()[on].sum())
    totals.clipped += float((st.low_clipped | st.high_clipped).expand_as(mask)[on].sum())
    if st.kl is not None:
        totals.kl += float(st.kl.expand_as(mask)[on].sum())


def sft_update(policy: Policy, examples: list[Example], settings: UpdateSettings, full_sequence: bool,
               meter: MemoryMeter) -> dict:
    """Supervised: − mean log-prob of the answer tokens (and the stop token) over the step's prompts.

    `full_sequence`: ordinary forwards of [prompt + answer] with grad, so the prompt positions learn too
    (what retrieval needs from a random start); examples of equal length go in one batch. Otherwise each
    prompt is captured and its answer replayed (detached, like GRPO).
    """
    eos = torch.tensor([policy.eos_token_id])
    for ex in examples:
        if ex.answer is None:
            raise ValueError(f"{ex.source or 'an example'}: the supervised warm-up needs an `answer`")
    pairs = [(policy.encode(ex.prompt), torch.cat([policy.encode(ex.answer), eos])) for ex in examples]
    n_tok = sum(a.numel() + len(ex.supervised) for (_, a), ex in zip(pairs, examples))
    tokens = sum(p.numel() + a.numel() for p, a in pairs)
    if full_sequence:
        loss = _sft_full_sequence(policy.model, pairs, examples, n_tok, meter)
        durable = 0
    else:
        loss, durable = _sft_replayed(policy.model, pairs, n_tok, settings.chunk_size, meter)
    return dict(loss=loss, durable_bytes=durable, tokens=tokens)


def _sft_full_sequence(model, pairs, examples, n_tok: int, meter: MemoryMeter) -> float:
    parts = model_parts(model)
    by_shape: dict[tuple[int, int, int], list] = {}
    for (p, a), ex in zip(pairs, examples):
        by_shape.setdefault((p.numel(), a.numel(), len(ex.supervised)), []).append((p, a, ex.supervised))
    total = 0.0
    for (plen, alen, _), group in by_shape.items():
        with meter.stage("replay"):
            seqs = torch.stack([torch.cat([p, a]) for p, a, _ in group])  # [B, P + A]
            # positions whose token is a target: the supervised prompt positions, then the answer
            pos = torch.tensor([list(sup) + list(range(plen, plen + alen)) for _, _, sup in group])
            targets = seqs.gather(1, pos)
            hidden = parts.decoder(input_ids=seqs).last_hidden_state
            hidden = hidden.gather(1, (pos - 1)[..., None].expand(-1, -1, hidden.shape[-1]))
            lp, _ = chunked_logprobs(hidden.reshape(-1, hidden.shape[-1]), parts.lm_head, targets.reshape(-1),
                                     softcap=parts.final_logit_softcapping, scale=parts.logit_scale)
            loss = -lp.sum() / n_tok
            loss.backward()
        total += loss.item()
    return total


def _sft_replayed(model, pairs, n_tok: int, chunk_size: int, meter: MemoryMeter) -> tuple[float, int]:
    total, durable = 0.0, 0
    for prompt, ans in pairs:
        with meter.stage("capture"):
            state = capture(model, prompt, chunk_size=chunk_size)
        durable = max(durable, state.nbytes)
        with meter.stage("replay"), state:
            loss = -state.replay(ans).logprobs.sum() / n_tok
            loss.backward()
        total += loss.item()
    return total, durable
