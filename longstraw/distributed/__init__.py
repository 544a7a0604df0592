"""Scale-out over torch.distributed: the prompt's state split by position over the ranks of a process group.

    state = longstraw.capture(model, prompt_ids, chunk_size=4096, group=pg)   # collective: same prompt on every rank
    out = state.replay(my_response)      # collective: each rank its own branch; out.logprobs [R_mine], with grad
    (-(adv * out.logprobs).sum()).backward()    # collective too (the backward exchanges query gradients)
    torch.distributed.all_reduce(p.grad) ...    # parameter gradients: each rank holds those of its own branch

Status (this module grows with issue 13): context-parallel capture and detached replay for models whose decoder
layers are all full attention (llama-like); other layer kinds, `prompt_grad="exact"`, `state_dtype`, sampling,
attention sinks, FSDP2 and the N-process trainer are refused or not there yet.

What each rank holds
--------------------
- The model's weights (a full copy; FSDP2 sharding is later work) and the prompt's last token (replicated).
- The captured positions [0, P − 1) in N contiguous slices, rank r holding [s_r, e_r): slices differ by at most one
  position (the first (P − 1) mod N ranks hold one more). For every full-attention layer rank r keeps the post-RoPE
  K/V of its slice only (`SliceKVState`): 1/N of the single-process state, the sum over ranks exactly that state.
- Later (designed, not built): MLA latents and DSA indexer keys are sliced the same way; O(1) states (recurrent,
  conv, sliding window) are kept where they are read: a sliding-window layer's last W − 1 K/V and a linear-attention
  layer's final state belong to the end of the prompt, i.e. to the replay of every rank, so they are replicated
  (small, independent of P).

Capture (collective)
--------------------
Every rank runs the unmodified decoder over its whole slice in one forward, so all ranks are at the same layer at
the same time (layer-synchronous, as in ring attention). In each full-attention layer rank r attends with the
queries of its slice to
- its own slice (causal, local);
- the slices of ranks j < r: the ranks all-gather their K/V `chunk_size` positions per step (step c: positions
  [c·C, (c+1)·C) of every slice, padded), and rank r folds (out, lse) of its queries against each earlier slice's
  chunk by log-sum-exp, in the order (step, rank). Earlier slices' K/V are transient: one step's worth at a time.
The merged output goes on through the layer; the slice's K/V become the durable state.

Costs, per full-attention layer, slice length n ≈ P/N, C = chunk_size:
- communication: ⌈n/C⌉ all-gathers of N·C positions of K/V (2·Hkv·D values each, in the model's dtype): every rank
  receives about P positions of K/V per layer, over the whole capture as many bytes as the single-process state.
- memory, transient: the slice's activations of one layer (O(n · (hidden + intermediate)); unlike the chunked
  single-process capture this is not bounded by chunk_size: chunking the slice inside each layer needs a K/V
  projection pass ahead of the attention and is later work), one step's N·C gathered K/V, the queries' float32
  accumulators (n · H · (Dv + 1)).
- compute: projections and MLP split evenly; attention is not: rank r does its causal n²/2 plus r·n² cross terms,
  so the last rank does (N − ½)·n² of the single process's (N·n)²/2 (N = 2: 3/4 of it, a 1.33× speed-up of the
  attention). Balancing moves half of each cross block to the rank holding the keys (queries travel instead of keys);
  later work.

Replay (collective, one branch per rank, detached mode)
-------------------------------------------------------
Each rank runs its own branch `[prompt[-1]] + response[:-1]` (R_r tokens, lengths may differ) through the decoder
with autograd. In every full-attention layer (`ReplayAttention`):
- forward: the branches' queries are all-gathered (padded to R_max = max R_r); each rank computes (out, lse) of every
  rank's queries against its own slice (no mask: the whole prompt precedes every response token); an all-to-all
  returns each partial to the owner of the queries, which folds them in slice order 0..N−1 in float32 (the same
  order whichever rank computed what) and merges the result with its own causal part. The prompt K/V never move.
- backward: each owner sends (q, w_p·dO, merged out, prompt lse) to every rank (one all-gather); each rank computes
  dq of every branch's queries against its slice (detached: no dK/dV); an all-to-all returns them; the owner sums
  them in slice order and adds the gradient of its own part.
Costs per layer: two all-gathers of N·R_max·H·D values and two all-to-alls of N·R_max·H·(Dv + 1) float32 values
(queries and partials; the model's dtype for queries, float32 for partials); the attention against the prompt,
R_total·P, is split evenly (each rank R_total·P/N). Memory per rank: the graph of one branch as in one process
(q, own K/V, merged output, two lse per layer) plus transient N·R_max rows; independent of P/N beyond the slice.
Each rank's parameter gradients are those of its own branch; summed over ranks (all-reduce, or FSDP's
reduce-scatter) they are the single-process sum over the same branches.

Results do not depend on N except by rounding (the fold order is fixed: slice 0 first); measured ≤ 1e-6 in float32
against the single-process replay (tests/test_distributed.py).

Consistency and failures (`longstraw.distributed.collectives`)
--------------------------------------------------------------
- capture and every replay first all-gather a few hashes of their arguments (prompt, chunk/block sizes, modes, model
  config, trainable parameter names; for a replay: the captured state, the replay's sequence number, checkpointing,
  grad mode): a mismatch raises the same `MismatchError` on every rank before any data moves. Model weights are not
  compared.
- every message carries a tag of its collective's name: ranks out of step raise `CollectiveError` naming both.
- every collective has a name; a timeout (the group's, `init_process_group(timeout=...)`) or a broken connection is
  re-raised as `CollectiveError` naming the collective, this rank and the group size.
- gloo moves CPU tensors (how it is tested here: several 1-thread processes); NCCL device tensors.
"""

from .collectives import CollectiveError, Group, MismatchError
from .context_parallel import ContextParallelState, slice_bounds

__all__ = ["CollectiveError", "ContextParallelState", "Group", "MismatchError", "slice_bounds"]
