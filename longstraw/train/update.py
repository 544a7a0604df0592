"""Update: gradients of one step's loss, accumulated response by response (the optimizer step is the caller's).

GRPO (`policy_update`): the loss normalizer comes first, from every response's count of policy tokens
(mask = 1, and 0 for a truncated response when `mask_truncated_completions`); then each context's state
(the prefix its rows share, `longstraw.train.sharing`: kept by the rollout, or captured again) serves its rows'
G responses in the run's replay order (`longstraw.replay.order`: k at a time, one at a time, by segments, or layer
by layer): replay with autograd after the row's own suffix, each response's share of the batch loss, `backward()`,
free the graph. In exact mode `state.backward()` then pushes the state gradient accumulated
over all the context's rows through the shared prefix, once. The sum of the shares is the batched
GRPO loss of TRL 1.16 (`longstraw.losses`), so the accumulated gradient is its gradient.

Entropy bonus (TRL 1.16): − entropy_coef · Σ mask·H / Σ mask over the whole step's policy tokens,
whatever the loss type's normalizer.

Supervised warm-up (`sft_update`): − mean log-prob of the answer tokens (and the stop token).

Memory: the state of one context plus one row suffix and the graphs of the responses replayed together.

On N processes the stage is handed its rank's part of the step (`share`, a
`longstraw.distributed.parallelize.StepShare`): each prompt is captured context parallel among `share.context`,
this rank replays the responses `share.replays(G)` of each group (padded with weight-0 replays: a replay is a
collective); the normalizer and advantages are the whole step's on every rank; the loss metrics are summed by the
share, the gradients by the trainer. Supervised steps split their prompts over the ranks (full sequence) or replay
each prompt's answer on its owner rank (replayed, context parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from ..api import capture
from ..branch import Branch
from ..distributed.parallelize import StepShare
from ..losses import GRPOLoss
from ..losses.base import TokenStats
from ..losses.sampler_correction import SamplerCorrection
from ..model.capability import model_parts
from ..model.chunking import AUTO_REPLAY_BUDGET
from ..ops.logprobs import chunked_logprobs
from ..prompt_state import PromptState
from ..replay.layer_major import LayerMajor
from ..replay.order import ReplayOrder, choose_order, replay_backward, replay_rows_backward, rows_together
from ..tasks import Example
from .memory import MemoryMeter
from .rollout import Policy, Response, Rollout
from .staleness import StateStore


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
    #: replay a response with environment tokens one policy turn at a time (`longstraw.replay.segments`)
    segment_replay: bool = False
    #: replay every response one decoder layer at a time (`longstraw.replay.layer_major`; `replay_order: layers`)
    layer_major: LayerMajor | None = None
    #: an external sampler's importance-sampling correction (`rollout_backend: vllm`); None: none
    sampler_correction: SamplerCorrection | None = None
    #: responses of a row replayed together (`longstraw.replay.batched`): an int, or "auto" within `replay_memory`
    replay_batch: int | str = 1
    #: bytes the graphs of the responses replayed together may take with `replay_batch: auto`
    replay_memory: int = AUTO_REPLAY_BUDGET
    #: the run's replay order, chosen once (`choose`); None: chosen at each step
    order: ReplayOrder | None = None
    #: responses of advantage 0 not replayed (their loss and gradient are 0 with beta 0 and no entropy bonus)
    skip_zero_advantage: bool = False

    @classmethod
    def from_config(cls, cfg) -> UpdateSettings:
        correction = None
        if cfg.rollout_backend == "vllm" and cfg.vllm_importance_sampling_correction:
            correction = SamplerCorrection(
                cfg.vllm_importance_sampling_mode,
                cfg.vllm_importance_sampling_clip_min,
                cfg.vllm_importance_sampling_clip_max,
            )
        return cls(
            cfg.max_completion_length,
            cfg.temperature,
            cfg.mask_truncated_completions,
            cfg.entropy_coef,
            cfg.prompt_grad,
            cfg.chunk_size,
            cfg.checkpoint_layers,
            cfg.state_dtype,
            cfg.replays_segments,
            LayerMajor.parse(cfg.keep_hidden) if cfg.replay_order == "layers" else None,
            correction,
            cfg.replay_batch,
            int(cfg.replay_memory_mb * (1 << 20)),
            skip_zero_advantage=cfg.skip_zero_advantage,
        )

    def choose(self, model, responses: int, share: StepShare) -> ReplayOrder:
        """The replay order of these settings for `model`, at most `responses` responses replayed together (a
        document's rows share their batches) and this rank's `share`
        (`longstraw.replay.order.choose_order`): whole responses of a row `replay_batch` at a time ("auto": as many
        as `replay_memory` holds of one replay's graph at `max_completion_length`); on context-parallel ranks each
        rank's share k at a time, one collective per batch."""
        return choose_order(
            model,
            responses,
            self.replay_batch,
            self.replay_memory,
            self.max_completion_length,
            self.checkpoint_layers,
            self.segment_replay,
            self.layer_major,
            collective=share.collective,
            lockstep=share.lockstep,
        )


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
    #: the clipped tokens by side, TRL's `clip_ratio/low_mean` and `clip_ratio/high_mean`
    low: float = 0.0
    high: float = 0.0
    #: an external sampler's mismatch, summed over tokens (`SamplerCorrection.stats`); empty with the own sampler
    sampler: dict = field(default_factory=dict)


def policy_update(
    model,
    rollout: Rollout,
    loss_fn: GRPOLoss,
    settings: UpdateSettings,
    meter: MemoryMeter,
    share: StepShare | None = None,
    store: StateStore | None = None,
) -> dict:
    """Accumulate the gradient of the step's GRPO loss into the parameters; returns the step's loss metrics.
    `share`: this rank's part of the step on N processes (see the module doc; None: one process); its
    `before_last_backward` runs once, just before the step's last backward, at the same point on every rank. With
    several context-parallel groups each replays the contexts `rollout.own_contexts`. `store`: the prompt states kept
    across steps (`recapture_every`, `longstraw.train.staleness`), which the update reads and leaves to the store."""
    share = StepShare() if share is None else share
    masks = [loss_mask(r, settings) for r in rollout.responses]
    lengths = [int(m.sum()) for m in masks]
    norm = loss_fn.normalizer(lengths, rollout.group_ids, settings.max_completion_length)
    entropy_scale = settings.entropy_coef / max(sum(lengths), 1)
    totals = _Totals()
    offsets = [0]  # where each group's responses start in the step's
    for group in rollout.groups:
        offsets.append(offsets[-1] + len(group.responses))
    own = range(len(rollout.contexts)) if rollout.own_contexts is None else rollout.own_contexts
    last_context = own[-1] if len(own) else -1
    # the replay order (`longstraw.replay.order`): the trainer's, chosen once for the run, or one for this step
    most = max((sum(len(rollout.groups[b].responses) for b in ctx.rows) for ctx in rollout.contexts), default=1)
    order = settings.order or settings.choose(model, most, share)
    for c in own:
        ctx = rollout.contexts[c]
        head = rollout.groups[ctx.rows[0]]
        state = head.state
        if state is None:
            with meter.stage("capture"):

                def fresh(prefix=head.prompt_ids[: ctx.length]) -> PromptState:
                    return capture(
                        model,
                        prefix,
                        chunk_size=settings.chunk_size,
                        prompt_grad=settings.prompt_grad,
                        state_dtype=settings.state_dtype,
                        group=share.group,
                    )

                # a later iteration of the batch (`num_iterations`): a kept state, if it is still young enough
                state = fresh() if store is None else store.get(head.prompt_ids[: ctx.length], fresh)
        with meter.stage("replay"):
            exact = state.prompt_grad == "exact"
            rows: list[tuple[PromptState | Branch, torch.Tensor | None, Branch | None, _RowLoss]] = []
            for b in ctx.rows:
                group = rollout.groups[b]
                suffix: torch.Tensor | None = group.prompt_ids[ctx.length :]  # the row's own tokens after the prefix
                row_state: PromptState | Branch = state
                branch: Branch | None = None
                if suffix is not None and suffix.numel() and not exact:
                    # detached: the row's question read once, into its own branch, which each response replays after
                    branch = state.fork()
                    with torch.no_grad():
                        branch.extend(suffix)
                    row_state, suffix = branch, None
                turns = share.replays(len(group.responses))
                if settings.skip_zero_advantage and not (share.collective or share.lockstep):
                    # a response of advantage 0 adds 0 to the loss and the gradient (beta 0, no entropy bonus); its
                    # old log-probs are the sampler's (a first replay would have to set them otherwise)
                    turns = [
                        k
                        for k in turns
                        if k is None
                        or float(rollout.advantages[offsets[b] + k]) != 0.0
                        or group.responses[k].old_logprobs is None
                    ]
                row = _RowLoss(
                    group.responses,
                    [None if k is None else offsets[b] + k for k in turns],
                    [k or 0 for k in turns],
                    masks,
                    rollout.advantages,
                    norm,
                    entropy_scale,
                    loss_fn,
                    settings,
                    order,
                    totals,
                )
                rows.append((row_state, suffix, branch, row))
            last = share.before_last_backward if c == last_context and not exact else None
            branches = [row_state if branch is None else branch for row_state, _, branch, _ in rows]
            listed = [row.listed for *_, row in rows]
            if rows_together(order, branches, listed):  # the document's rows share the batches
                for (*_, row), entropies in zip(
                    rows,
                    replay_rows_backward(
                        branches,
                        listed,
                        [row.loss_of for *_, row in rows],
                        order,
                        temperature=settings.temperature,
                        checkpoint_layers=settings.checkpoint_layers,
                        before_last_backward=last,
                        prefixes=[suffix for _, suffix, _, _ in rows],
                    ),
                ):
                    row.finish(entropies)
            else:
                for r, (row_state, suffix, _, row) in enumerate(rows):
                    entropies = replay_backward(
                        row_state,
                        row.listed,
                        row.loss_of,
                        order,
                        temperature=settings.temperature,
                        checkpoint_layers=settings.checkpoint_layers,
                        prefix_ids=suffix,
                        before_last_backward=last if r == len(rows) - 1 else None,
                    )
                    row.finish(entropies)
            for _, _, branch, _ in rows:
                if branch is not None:
                    branch.release()
            if exact and c == last_context and share.before_last_backward is not None:
                share.before_last_backward()
            state.backward()  # exact mode: the shared prompt's gradient, summed over its rows (nothing when detached)
            if store is None or not store.owns(state):
                state.release()
        for b in ctx.rows:
            rollout.groups[b].state = None
    sums = share.sum_floats(
        "policy_update: loss metrics",
        [totals.loss, totals.kl, totals.clipped, totals.entropy, totals.tokens, totals.low, totals.high],
    )
    sampler = totals.sampler
    totals = _Totals(sums[0], sums[1], sums[2], sums[3], int(sums[4]), low=sums[5], high=sums[6])
    if settings.sampler_correction is not None:  # every rank, whether it replayed a sampled response or not
        keys = ("abs_diff", "kl", "weight", "changed", "tokens")
        summed = share.sum_floats("policy_update: sampler metrics", [float(sampler.get(k, 0)) for k in keys])
        worst = share.max_floats("policy_update: sampler max", [float(sampler.get("max_abs_diff", 0.0))])
        if summed[-1] > 0:
            totals.sampler = {**dict(zip(keys, summed)), "max_abs_diff": worst[0]}
    n = max(totals.tokens, 1)
    metrics = dict(loss=totals.loss, entropy=totals.entropy / n, clip_ratio=totals.clipped / n)
    metrics["clip_ratio/low_mean"] = totals.low / n
    metrics["clip_ratio/high_mean"] = totals.high / n
    if totals.sampler:  # TRL's sampling/* metrics of an external sampler
        t = max(totals.sampler["tokens"], 1)
        metrics.update(
            {
                "sampling/sampling_logp_difference/mean": totals.sampler["abs_diff"] / t,
                "sampling/sampling_logp_difference/max": totals.sampler["max_abs_diff"],
                "sampling/kl": totals.sampler["kl"] / t,
                "sampling/importance_sampling_ratio/mean": totals.sampler["weight"] / t,
                "sampling/corrected_frac": totals.sampler["changed"] / t,
            }
        )
    if loss_fn.beta > 0:
        metrics["kl"] = totals.kl / n
    return metrics


class _RowLoss:
    """This rank's responses of one row (`responses[which[j]]`, at `indices[j]` in the step; None: a replay of weight 0
    that keeps the ranks in step): each one's share of the batch loss (`loss_of`, what `replay_backward` calls), and
    its statistics added to `totals` once replayed (`finish`). A response replayed in pieces gets each piece's share
    (the token-level surrogate is a sum over tokens, so the shares add up to the response's)."""

    def __init__(
        self, responses, indices, which, masks, advantages, norm, entropy_scale, loss_fn, settings, order, totals
    ):
        self.items = [responses[k] for k in which]
        self.indices, self.masks, self.advantages, self.norm = indices, masks, advantages, norm
        self.entropy_scale, self.loss_fn, self.settings, self.order, self.totals = (
            entropy_scale,
            loss_fn,
            settings,
            order,
            totals,
        )
        self.kept: list[list] = [[] for _ in self.items]  # per response: (slice, loss value, token stats) of each piece
        # a weight-0 replay goes whole unless every forward is a collective (its pieces in step with the others')
        self.listed = [
            (r.tokens, r.mask if i is not None or order.collective else None) for r, i in zip(self.items, indices)
        ]

    def loss_of(self, j: int, sl: slice, out) -> torch.Tensor:
        i, response = self.indices[j], self.items[j]
        if i is None:
            return out.logprobs.sum() * 0.0
        masks, settings, loss_fn = self.masks, self.settings, self.loss_fn
        if sl.start == 0 and sl.stop == response.tokens.numel() and not self.order.in_pieces(response.mask):
            loss, st = _response_loss(
                out,
                response,
                masks[i],
                float(self.advantages[i]),
                self.norm[i],
                self.entropy_scale,
                loss_fn,
                settings,
                self.totals,
            )
        else:
            if response.old_logprobs is None:
                raise ValueError(
                    "a response holding environment tokens from an external sampler (rollout_backend: vllm) has no "
                    "old log-probs to replay segments against: multi-turn rollouts use the own sampler"
                )
            ref = None if response.ref_logprobs is None else response.ref_logprobs[sl]
            loss, st = loss_fn.response_loss(
                out.logprobs,
                response.old_logprobs[sl],
                float(self.advantages[i]),
                self.norm[i],
                ref_logps=ref,
                mask=masks[i][sl],
            )
            if self.entropy_scale > 0:
                loss = loss - self.entropy_scale * (out.entropy * masks[i][sl]).sum()
        self.kept[j].append((sl, loss.item(), st))
        return loss

    def finish(self, entropies: list[torch.Tensor]) -> None:
        """Add the replayed responses' statistics (`entropies[j]`: the j-th response's, detached) to `totals`."""
        for j, i in enumerate(self.indices):
            if i is None:
                continue
            n = self.masks[i].numel()
            low, high = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)
            kl = torch.zeros(n) if self.loss_fn.beta > 0 else None
            for sl, _, st in self.kept[j]:
                low[sl] = st.low_clipped.expand(sl.stop - sl.start)
                high[sl] = st.high_clipped.expand(sl.stop - sl.start)
                if kl is not None and st.kl is not None:
                    kl[sl] = st.kl.expand(sl.stop - sl.start)
            loss = sum(v for _, v, _ in self.kept[j])
            _add_totals(self.totals, loss, self.masks[i], entropies[j], TokenStats(low, high, kl))


def _response_loss(
    out,
    response: Response,
    mask: torch.Tensor,
    advantage: float,
    scale: float,
    entropy_scale: float,
    loss_fn: GRPOLoss,
    settings: UpdateSettings,
    totals: _Totals,
):
    """(the response's share of the batch loss, its token statistics) from its replay `out`: the old log-probs of an
    external sampler's response taken from this first replay, its importance-sampling correction applied."""
    if response.old_logprobs is None:
        # another program sampled it (vLLM): the trainer's old log-probs are this first replay's, at the weights the
        # batch was drawn at (TRL recomputes them likewise); later iterations (`num_iterations`) read them back
        response.old_logprobs = out.logprobs.detach().clone()
    weight = None
    if response.sampler_logprobs is not None and settings.sampler_correction is not None:
        weight = settings.sampler_correction.weights(response.old_logprobs, response.sampler_logprobs, mask)
        for key, value in settings.sampler_correction.stats(
            response.old_logprobs, response.sampler_logprobs, mask
        ).items():
            totals.sampler[key] = (
                max(totals.sampler.get(key, 0.0), value)
                if key.startswith("max")
                else (totals.sampler.get(key, 0) + value)
            )
    loss, st = loss_fn.response_loss(
        out.logprobs,
        response.old_logprobs,
        advantage,
        scale,
        ref_logps=response.ref_logprobs,
        mask=mask,
        is_weight=weight,
    )
    if entropy_scale > 0:
        loss = loss - entropy_scale * (out.entropy * mask).sum()
    return loss, st


def _add_totals(totals: _Totals, loss: float, mask: torch.Tensor, entropy: torch.Tensor, st) -> None:
    on = mask > 0
    totals.loss += loss
    totals.tokens += int(on.sum())
    totals.entropy += float(entropy.detach()[on].sum())
    totals.clipped += float((st.low_clipped | st.high_clipped).expand_as(mask)[on].sum())
    totals.low += float(st.low_clipped.expand_as(mask)[on].sum())
    totals.high += float(st.high_clipped.expand_as(mask)[on].sum())
    if st.kl is not None:
        totals.kl += float(st.kl.expand_as(mask)[on].sum())


def sft_update(
    policy: Policy,
    examples: list[Example],
    settings: UpdateSettings,
    full_sequence: bool,
    meter: MemoryMeter,
    share: StepShare | None = None,
) -> dict:
    """Supervised: − mean log-prob of the answer tokens (and the stop token) over the step's prompts.

    `full_sequence`: ordinary forwards of [prompt + answer] with grad, so the prompt positions learn too
    (what retrieval needs from a random start); examples of equal length go in one batch. Otherwise each
    prompt is captured and its answer replayed (detached, like GRPO).

    `share` (N processes, see `policy_update`) in `lockstep` (sharded layers, spread experts: every forward a
    collective): every rank runs one full-sequence forward per shape of the step's prompts (the same shapes on every
    rank), its round-robin share of them padded with weight-0 rows to ⌈n / N⌉.
    """
    share = StepShare() if share is None else share
    eos = torch.tensor([policy.eos_token_id])
    for ex in examples:
        if ex.answer is None:
            raise ValueError(f"{ex.source or 'an example'}: the supervised warm-up needs an `answer`")
    # every answer is a str: checked above
    pairs = [(policy.encode(ex.prompt), torch.cat([policy.encode(cast(str, ex.answer)), eos])) for ex in examples]
    n_tok = sum(a.numel() + len(ex.supervised) for (_, a), ex in zip(pairs, examples))
    tokens = sum(p.numel() + a.numel() for p, a in pairs)
    if full_sequence:  # data parallel: whole prompts per rank (in lockstep when every rank must run every forward)
        loss = _sft_full_sequence(policy.model, pairs, examples, n_tok, meter, share)
        durable = 0
    else:
        loss, durable = _sft_replayed(policy.model, pairs, n_tok, settings.chunk_size, meter, share)
    loss = share.sum_floats("sft_update: loss", [loss])[0]
    return dict(loss=loss, durable_bytes=durable, tokens=tokens, **prompt_length_metrics([p.numel() for p, _ in pairs]))


def prompt_length_metrics(lengths: list[int]) -> dict:
    """A step's prompt token counts as metrics: `prompt_length` (mean, rounded), `prompt_length_min` / `_max`."""
    return dict(
        prompt_length=round(sum(lengths) / len(lengths)), prompt_length_min=min(lengths), prompt_length_max=max(lengths)
    )


def _sft_batch_loss(model, group: list, n_tok: int, weights: list[float] | None = None) -> torch.Tensor:
    """− Σ log-prob of the targets / n_tok for a batch of (prompt, answer, supervised prompt positions) of one
    shape: one forward of [prompt + answer] with grad; `weights`: one per row (None: all 1)."""
    parts = model_parts(model)
    plen, alen = group[0][0].numel(), group[0][1].numel()
    seqs = torch.stack([torch.cat([p, a]) for p, a, _ in group])  # [B, P + A]
    # positions whose token is a target: the supervised prompt positions, then the answer
    pos = torch.tensor([list(sup) + list(range(plen, plen + alen)) for _, _, sup in group])
    targets = seqs.gather(1, pos)
    hidden = parts.decoder(input_ids=seqs).last_hidden_state
    hidden = hidden.gather(1, (pos - 1)[..., None].expand(-1, -1, hidden.shape[-1]))
    lp, _ = chunked_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        parts.lm_head,
        targets.reshape(-1),
        softcap=parts.final_logit_softcapping,
        scale=parts.logit_scale,
    )
    if weights is not None:
        lp = lp.view(len(group), -1) * torch.tensor(weights, dtype=lp.dtype, device=lp.device)[:, None]
    return -lp.sum() / n_tok


def _sft_full_sequence(model, pairs, examples, n_tok: int, meter: MemoryMeter, share: StepShare) -> float:
    """One forward per shape of the prompts `pairs`; on N ranks, this rank's rows of a shape are `share.forwards` of
    that shape's prompts: in `lockstep` (the ranks must run the same forwards) every rank runs one forward per shape,
    its rows padded with weight-0 copies of the shape's first; otherwise a rank skips a shape it has no prompt of."""
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    for b, ((p, a), ex) in enumerate(zip(pairs, examples)):
        by_shape.setdefault((p.numel(), a.numel(), len(ex.supervised)), []).append(b)
    total = 0.0
    for g, idx in enumerate(by_shape.values()):
        rows = share.forwards(idx)
        if not rows:
            continue
        weights = None if None not in rows else [0.0 if b is None else 1.0 for b in rows]
        mine = [idx[0] if b is None else b for b in rows]
        with meter.stage("replay"):
            loss = _sft_batch_loss(
                model, [(pairs[b][0], pairs[b][1], examples[b].supervised) for b in mine], n_tok, weights
            )
            if share.before_last_backward is not None and g == len(by_shape) - 1:
                share.before_last_backward()
            loss.backward()
        total += loss.item()
    return total


def _sft_replayed(model, pairs, n_tok: int, chunk_size: int, meter: MemoryMeter, share: StepShare) -> tuple[float, int]:
    """Each prompt captured (context parallel on N ranks) and its answer replayed; on N ranks prompt b's owner
    (`share.owns(b)`) replays it with weight 1, the others with weight 0 (a replay is a collective)."""
    total, durable = 0.0, 0
    for b, (prompt, ans) in enumerate(pairs):
        with meter.stage("capture"):
            state = capture(model, prompt, chunk_size=chunk_size, group=share.group)
        durable = max(durable, state.nbytes)
        with meter.stage("replay"), state:
            weight = 1.0 if share.owns(b) else 0.0
            loss = -state.replay(ans).logprobs.sum() / n_tok * weight
            if share.before_last_backward is not None and b == len(pairs) - 1:
                share.before_last_backward()
            loss.backward()
        total += loss.item()
    return total, durable
