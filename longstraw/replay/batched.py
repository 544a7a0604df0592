"""Batched replay: k responses of one prompt state (a row's G samples) in one forward and one backward.

`PromptState.replay` runs one response `[1, R]` against the state: each replay reads every weight and the whole
prompt state once, for R tokens. `replay_batch` runs k responses of the same state as one batch `[k, R_max]`:
responses shorter than the longest are padded at their end (causal attention: no real token reads a padding one,
and the padding's own log-probs are never taken), all rows at the same positions. The prompt part of every
attention layer is read once for the k rows (their queries folded into one row block, `SplitAttention`); each row's
own K/V, recurrent states and loss stay its own. So the replay of a row's G responses costs one pass over the
weights and the prompt state instead of G, and the matrix products are k times taller.

The log-probs are those of k `PromptState.replay` calls (`replay_batch(state, [r])` is one; tests/replay/
test_batched.py holds k > 1 equal to serial replay, both gradient modes, after a row's own prefix). With
`prompt_grad="exact"` the gradient reaching the prompt state is the sum of the k rows', as k serial replays
accumulate it.

Memory: the prompt state (read, never copied) + k responses' graphs (each what one replay's is) + the LM head's
chunk (`longstraw.ops.logprobs`): independent of P, k times one replay's; `batch_size` chooses k from a budget.
A context-parallel state replays a batch as a collective (`ContextParallelState.checked_batch`): every rank k
responses of its own, each slice read once for every rank's batch (`ReplayAttention`); DSA layers there replay one
response per rank (`batches_replays`), refused by name.

`replay_branches` goes one step further: the responses of several branches of one prompt state (the rows of a
context, each after its own question, detached) in one batch. The branches' own K/V are stacked right-aligned as a
ragged decode batch stacks them (`longstraw.ragged.stack_layers`), each row at its own positions, and the attention
is the ragged one with autograd (`longstraw.ops.ragged_attention`): one pass over the weights and the prompt state
for all the rows, products as tall as all their responses together. Served where every layer is plain attention
(full, sliding window, attention chunk: `stacks_for_replay`); elsewhere a row's responses go together, rows one
after another.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..branch import Branch
from ..hf.cache import BranchCache
from ..hf.decoder import run_decoder
from ..kinds import AttentionBranchLayer, MixerlessBranchLayer, branch_layers
from ..ops.logprobs import chunked_logprobs
from ..prompt_state import PromptState, Replay, TokenIds, as_ids
from ..ragged import stack_layers, stackable


def replay_batch(
    state: PromptState | Branch,
    responses: Sequence[TokenIds],
    temperature: float = 1.0,
    checkpoint_layers: bool = False,
    prefix_ids: TokenIds | None = None,
    prefixes: Sequence[TokenIds] | None = None,
) -> list[Replay]:
    """`state.replay(r, temperature, checkpoint_layers, prefix_ids)` for every `r` of `responses`, as one batch (see
    the module doc): a `Replay` per response, `[R_i]` log-probs and entropies with grad.

    `state`: a `PromptState` or a `Branch` of one (a row after its own question); `prefix_ids` `[L]`: tokens between
    the state and every response (a row's question), read once without autograd (detached) or in the batch's forward
    (exact), as `PromptState.replay` reads them. `prefixes`: instead, one prefix per response (the rows of a document,
    each after its own question, in one batch): exact mode only, each in the batch's forward with its response (the
    detached rows of a document go together through `replay_branches`)."""
    if not responses:
        return []
    if prefixes is not None:
        if prefix_ids is not None:
            raise ValueError("replay_batch: give prefix_ids (one for all) or prefixes (one per response), not both")
        if len(prefixes) != len(responses):
            raise ValueError(f"replay_batch: one prefix per response ({len(responses)}); got {len(prefixes)}")
        if state.prompt_grad != "exact" or isinstance(state, Branch):
            raise ValueError(
                "replay_batch: prefixes (one per response) are read in the batch's forward, the exact replay of a "
                "PromptState; detached rows after their own questions go through replay_branches"
            )
    parts = state.parts
    vocab = parts.config.vocab_size
    device = state.last_token.device
    prefix = (
        torch.zeros(0, dtype=torch.long, device=device)
        if prefix_ids is None
        else as_ids(prefix_ids, "prefix_ids", vocab, device, allow_empty=True)
    )
    skip = prefix.numel()
    own = (
        [prefix] * len(responses)
        if prefixes is None
        else [as_ids(x, "prefixes", vocab, device, allow_empty=True) for x in prefixes]
    )
    skips = [x.numel() for x in own]
    if skip and state.prompt_grad == "detached":  # the prefix read once, into a branch all k replay after
        fork = state.fork()
        try:
            with torch.no_grad():
                fork.extend(prefix)
            return replay_batch(fork, responses, temperature, checkpoint_layers)
        finally:
            fork.release()
    if isinstance(state, Branch) and state.prompt_grad != "detached":
        raise ValueError(
            "replay_batch after a Branch reads the branch as constants: that is the detached replay; with "
            "prompt_grad='exact' pass the branch's tokens as prefix_ids to the PromptState"
        )
    prompt = state.state if isinstance(state, Branch) else state  # the captured prompt, which checks a response
    length = state.length if isinstance(state, Branch) else state.prompt_length
    rows = []
    for x, r in zip(own, responses):
        ids = as_ids(r, "response_ids", vocab, device)
        rows.append(torch.cat([x, ids]) if x.numel() else ids)
    rows = prompt.checked_batch(rows, checkpoint_layers, length)
    k = len(rows)
    width = max(r.numel() for r in rows)
    inputs = torch.zeros(k, width, dtype=torch.long, device=device)  # padding after each row's end: read by no token
    inputs[:, 0] = state.last_token
    for i, r in enumerate(rows):
        inputs[i, 1 : r.numel()] = r[:-1]
    positions = torch.arange(length - 1, length - 1 + width, device=device)
    # the state's layers, batch k: the prompt part shared, the own parts per row (context parallel: read across the
    # ranks, each with a batch of k)
    cache = prompt.replay_cache(state if isinstance(state, Branch) else None, k)
    hidden = run_decoder(parts, inputs, positions, cache, checkpoint_layers=checkpoint_layers)  # [k, width, h]
    # every row's positions that predict a response token, in one LM head pass: [Σ (R_i − skip_i), h]
    picked = torch.cat([hidden[i, n : r.numel()] for i, (n, r) in enumerate(zip(skips, rows))])
    targets = torch.cat([r[n:] for n, r in zip(skips, rows)])
    logprobs, entropy = chunked_logprobs(
        picked,
        parts.lm_head,
        targets,
        temperature=temperature,
        softcap=parts.final_logit_softcapping,
        scale=parts.logit_scale,
    )
    sizes = [r.numel() - n for n, r in zip(skips, rows)]
    return [Replay(lp, h) for lp, h in zip(logprobs.split(sizes), entropy.split(sizes))]


def stacks_for_replay(branches: Sequence[PromptState | Branch]) -> bool:
    """Whether `replay_branches` replays these branches' responses in one batch: branches of one detached prompt
    state (or the state itself, a row without a question of its own) that a ragged decode stacks
    (`longstraw.ragged.stackable`), every layer plain attention or without a mixer (recurrent and hybrid layers'
    stacked states are a decode's only)."""
    if (
        not branches
        or not stackable(branches)
        or any(getattr(b, "state", b).prompt_grad != "detached" for b in branches)
    ):
        return False
    probe = branches[0].branch_cache(1)
    return all(
        type(layer) is AttentionBranchLayer or isinstance(layer, MixerlessBranchLayer) for layer in branch_layers(probe)
    )


def replay_branches(
    branches: Sequence[PromptState | Branch],
    responses: Sequence[Sequence[TokenIds]],
    temperature: float = 1.0,
    checkpoint_layers: bool = False,
) -> list[list[Replay]]:
    """`branches[i].replay(r, temperature, checkpoint_layers)` for every `r` of `responses[i]`, all in one batch (see
    the module doc; `stacks_for_replay(branches)` must hold): per branch, a `Replay` per response, `[R]` log-probs
    and entropies with grad.

    Memory: the branches' own K/V stacked once (padded to the longest), the responses' graphs (each what one replay's
    is) and the LM head's chunk: independent of P."""
    if len(responses) != len(branches):
        raise ValueError(f"replay_branches: one list of responses per branch ({len(branches)}); got {len(responses)}")
    if not stacks_for_replay(branches):
        raise ValueError(
            "replay_branches: these branches are not stacked in one replay (see stacks_for_replay); replay each "
            "branch's responses with replay_batch"
        )
    parts = branches[0].parts
    vocab = parts.config.vocab_size
    device = branches[0].last_token.device
    rows: list[torch.Tensor] = []
    starts: list[int] = []
    firsts: list[torch.Tensor] = []
    for b, rs in zip(branches, responses):
        for r in rs:
            ids = as_ids(r, "response_ids", vocab, device)
            prompt = b.state if isinstance(b, Branch) else b  # the captured prompt, which checks a response
            rows.append(prompt.checked_response(ids, checkpoint_layers, b.prompt_length))
            starts.append(b.prompt_length - 1)
            firsts.append(b.last_token)
    if not rows:
        return [[] for _ in branches]
    counts = [len(rs) for rs in responses]
    kept = [i for i, n in enumerate(counts) if n]
    width = max(r.numel() for r in rows)
    inputs = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # padding after each row's end
    for i, (first, r) in enumerate(zip(firsts, rows)):
        inputs[i, 0] = first[0]
        inputs[i, 1 : r.numel()] = r[:-1]
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)[None, :]
    with torch.no_grad():  # the branches' own K/V, constants, stacked right-aligned: rows of branch i together
        caches = [branches[i].branch_cache(1) for i in kept]
        block = caches[0].block
        layers = [
            stack_layers([c.layers[j] for c in caches], [counts[i] for i in kept]) for j in range(len(caches[0].layers))
        ]
    del caches
    hidden = run_decoder(
        parts, inputs, positions, BranchCache(layers, block=block), checkpoint_layers=checkpoint_layers
    )
    picked = torch.cat([hidden[i, : r.numel()] for i, r in enumerate(rows)])  # [Σ R_i, h]
    logprobs, entropy = chunked_logprobs(
        picked,
        parts.lm_head,
        torch.cat(rows),
        temperature=temperature,
        softcap=parts.final_logit_softcapping,
        scale=parts.logit_scale,
    )
    flat = [
        Replay(lp, h)
        for lp, h in zip(logprobs.split([r.numel() for r in rows]), entropy.split([r.numel() for r in rows]))
    ]
    out, at = [], 0
    for n in counts:
        out.append(flat[at : at + n])
        at += n
    return out


def batch_size(setting: int | str, graph_bytes: int, budget_bytes: int | None, responses: int) -> int:
    """k, the responses replayed together: `setting` an int (≥ 1) as given, or "auto": as many as `budget_bytes`
    holds of `graph_bytes` each (one replay's graph, `longstraw.tools.planner`), at least 1 and at most `responses`
    (all of them when no budget is set)."""
    if setting != "auto":
        k = int(setting)
        if k < 1:
            raise ValueError(f"replay_batch must be 'auto' or an integer >= 1; got {setting!r}")
        return max(1, min(k, responses))
    if budget_bytes is None:
        return max(1, responses)
    return max(1, min(responses, budget_bytes // max(graph_bytes, 1)))
