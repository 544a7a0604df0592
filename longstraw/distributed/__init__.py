"""Scale-out over torch.distributed: the prompt's state split by position over the ranks of a process group.

    state = longstraw.capture(model, prompt_ids, chunk_size=4096, group=pg)   # collective: same prompt on every rank
    out = state.replay(my_response)      # collective: each rank its own branch; out.logprobs [R_mine], with grad
    (-(adv * out.logprobs).sum()).backward()    # collective too (the backward exchanges query gradients)
    torch.distributed.all_reduce(p.grad) ...    # parameter gradients: each rank holds those of its own branch

Status (this module grows with issue 13): context-parallel capture and detached replay for models whose decoder layers
are full attention, MLA, DSA, sliding-window attention and linear attention (`KVState`, `LatentState`,
`IndexedLatentState`, `SlidingKVState`, `RecurrentState`: llama, qwen3, deepseek_v3, deepseek_v32, glm_moe_dsa, gemma3,
gpt_oss, qwen3_next, ...; tested: llama, deepseek_v3, glm_moe_dsa, gemma3_text, gpt_oss, qwen3_next); attention sinks
fold in as one more key of score `sink` and value 0 after the last merge (the replay's backward gives the sinks their
gradient). Refused by name (NotImplementedError, the same on every rank): other layer kinds (compressed, chunked,
hybrid-parallel, short conv), `prompt_grad="exact"` for models with sinks, `state_device`. `state_dtype` (8-bit K/V and
latents, detached mode) slices the prompt in whole blocks of 64 positions and quantizes each slice once at the end of
capture; during capture the ranks read each other's slices in full precision, so the result is not bitwise one
process's (whose later chunks read the earlier chunks' 8-bit state) but no less accurate. Exact mode works for every
served layer kind (not with sinks). FSDP2 for the weights: `shard` (`longstraw.distributed.fsdp`; in the trainer:
`fsdp: true`). The trainer on N processes (torchrun, `longstraw train --nproc N`) is `longstraw.distributed.ranks`.

What each rank holds
--------------------
- The model's weights (a full copy, or with `shard` 1/N of each decoder layer's, `longstraw.distributed.fsdp`) and the
  prompt's last token (replicated).
- The captured positions [0, P − 1) in N contiguous slices, rank r holding [s_r, e_r): slices differ by at most one
  position (the first (P − 1) mod N ranks hold one more). For every full-attention layer rank r keeps the post-RoPE
  K/V of its slice only (`SliceKVState`): 1/N of the single-process state, the sum over ranks exactly that state.
- The O(1) states are kept where they are read: a sliding-window layer's last W − 1 K/V and a linear-attention
  layer's final conv + recurrent state belong to the end of the prompt, i.e. to every rank's replay, so every rank
  holds them alike (`ContextParallelState.replicated_nbytes`; `sliced_nbytes` is its share of the K/V). Replays read
  them locally, without a collective.
- For every MLA layer rank r keeps the latents `[c | k_rot]` of its slice (`SliceLatentState`, 1/N of the
  single-process latents): MLA in latent space is multi-query attention with the latent as its one key head and as
  its values, so it runs through the same exchanges as K/V with keys and values one tensor (sent once).
- For every DSA layer rank r also keeps the indexer keys of its slice (`SliceIndexedLatentState`; GLM-5's "shared"
  layers none). The selection is computed where the keys are: each rank scores every branch's indexer queries
  against its slice and returns its local top-k (score, position) pairs to the branch's owner, which merges them in
  slice order with a stable sort, ties to the earlier position, so the selection does not depend on N; the sparse
  attention then sends the queries with their selected positions to every rank, which returns (out, lse) over the
  selected keys in its slice (`longstraw.distributed.sparse`, which also gives the costs). Detached mode only.

Capture (collective)
--------------------
Every rank runs the unmodified decoder over its whole slice in one forward, so all ranks are at the same layer at the
same time (layer-synchronous, as in ring attention). What reads nothing of the other ranks runs `chunk_size` positions
at a time within that forward, so its intermediates are a chunk's: every layer's feed-forward module
(`longstraw.model.prepare.ChunkedFeedForward`) and the recurrent (linear-attention) decoder layers, whose only input
from earlier positions is their state (relayed from rank r − 1, below, then carried chunk to chunk). In each
full-attention layer rank r attends with the queries of its slice to its own slice (causal, local) and to the slices of
ranks j < r. Each such cross block (rank r's n queries × rank j's n keys) is shared by its two ranks so that the work is
even:
- keys to queries, for the first half of rank r's query rows: the ranks all-gather their K/V `chunk_size` positions
  per step (step c: positions [c·C, (c+1)·C) of every slice, padded) and rank r folds its first-half rows against
  each earlier slice's chunk, in the order (step, rank);
- queries to keys, for the second half: the ranks all-gather C of their second-half query rows per step, each rank
  j computes (out, lse) of every later rank's rows against its whole slice, and an all-to-all returns the partials
  to their owners, which fold them in slice order.
Both run in the same steps (step s all-gathers chunk s of the keys and chunk s of the queries, then each rank
computes its share of both), so no rank idles through the other's half; rows of the two halves are disjoint, so
each row's partials fold in the same order either way.
The merged output goes on through the layer; the slice's K/V become the durable state. Sliding-window layers
all-gather the last W − 1 K/V of every slice once (all any later query reads; every rank then also holds the
prompt's final window). Linear-attention layers relay their conv + recurrent state: rank r waits for the state at
the end of rank r − 1's slice before its decoder layer runs (point-to-point, a forward pre-hook on the decoder
layer) and sends its own end state to rank r + 1 afterwards; the last rank broadcasts the final state.

Costs, per full-attention layer, slice length n ≈ P/N, C = chunk_size:
- communication: ⌈n/C⌉ all-gathers of N·C positions of K/V (2·Hkv·D values each, in the model's dtype) and
  ⌈n/(2C)⌉ all-gathers of N·C query rows (H·D) plus all-to-alls of their float32 partials (H·(Dv + 1)): per rank
  about P positions of K/V and P/2 query rows per layer.
- memory, transient: the slice's activations of one layer (O(n · (hidden + intermediate)); unlike the chunked
  single-process capture this is not bounded by chunk_size: chunking the slice inside each layer needs a K/V
  projection pass ahead of the attention and is later work), one step's N·C gathered K/V or queries and partials,
  the slice's float32 accumulators (n · H · (Dv + 1)).
- compute: even. Rank r does its causal n²/2 plus half of each of its r cross blocks and half of each of the
  N − 1 − r blocks against its keys: N/2 · n², the single process's (N·n)²/2 split N ways. Projections and MLP
  split evenly. Measured (bench/context_parallel.py, P = 16,384, dense benchmark model, 1 thread per rank): CPU
  time per rank 2.7 s and 2.7 s against 5.1 s on one rank.
- sliding window: one all-gather of N·(W − 1) K/V per layer. Linear attention: serial across ranks — rank r's
  layer l starts when rank r − 1's is done, so the linear-attention work (O(P) in total, not repeated) takes as long
  as on one rank; consecutive linear layers pipeline across ranks (rank r − 1 runs layer l + 1 while rank r runs
  layer l) and the next attention layer's collective joins them again. Composing per-slice transitions (each rank
  scans its slice from a zero state in parallel, then corrects by the incoming state) would remove this for
  gated DeltaNet, whose state update is affine in the incoming state; later work.

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

Exact mode (collective; every layer kind served above, sinks not yet)
--------------------------------------------------------------------
Replays: the replay attention's backward also computes, on each rank, dK/dV of its slice for every rank's queries
(summed in rank order) and accumulates them in the slice's K/V leaves: each rank holds the state gradient of its own
slice (1/N of the buffer). `state.backward()`: every rank recomputes its slice with autograd (the capture's forward,
layer-synchronous, `CaptureAttention`) and back-propagates the slice's accumulated gradient in one backward; the
attention backward runs the forward's exchanges again with gradients travelling back (dK/dV of an earlier slice's
chunk to its owner by all-to-all, dq of a later rank's rows to theirs). Every part's backward reads the merged
output and the log-sum-exp over all keys, so no per-part (out, lse) is kept. The parameter gradients summed over the
ranks equal one process's exact-mode gradient (≤ 1.4e-6 relative measured). MLA latents are one leaf read as keys
and as values. Linear-attention layers: the replays' gradient of the replicated final states is summed over the
ranks (one all-gather per layer, summed in rank order) and enters the last rank's recomputed end state; the
recompute relays the states forward as capture does, and in backward each layer's state gradient travels back rank
r + 1 → r (point to point, `_RelayOut` on the layer's output, `_RelayIn` on its input), serially per layer as the
forward relay is. Sliding-window layers: the gradient of the window before a slice (the tails of earlier ranks it
read) goes back to their owners by one all-to-all of W − 1 rows per rank (`SlidingCaptureAttention`), and the
replays' gradient of the replicated final window, summed over the ranks, enters the rows of the slices holding those
positions. DSA layers: the replay's sparse backward also returns the gradient of each slice's selected latents to
their owner (summed in rank order), and the reverse pass runs the capture's sparse exchange again with gradients
travelling back (`longstraw.distributed.sparse.SparseCaptureAttention`); the indexer gets no gradient, as in one
process. Memory: the slice's whole graph (every layer's activations over P/N tokens), unlike the single process's
one chunk: a per-layer checkpointed recompute is the next step. Not yet: attention sinks in the reverse pass.

Sampling (collective)
---------------------
`state.sample(...)`: every rank decodes all `num` sequences alike (the same arguments and generator state, checked
first; the sampled tokens are compared at the end), so every rank returns the same samples as one process would,
and the trainer can spread their replays over the ranks. The queries are then already on every rank: per decode step
and full-attention layer each rank computes (out, lse) of all rows against its slice, one all-gather of
N·rows·H·(Dv + 1) float32 values brings every slice's partials to every rank, and each folds them in slice order —
bitwise the same everywhere, so the ranks never diverge. The attention against the prompt (what grows with P) is
split N ways; the rest of a decode step (projections, MLP, LM head, the own K/V) is repeated on every rank.

Results do not depend on N except by rounding (the fold order is fixed: slice 0 first); measured ≤ 1e-6 in float32
against the single-process replay (tests/distributed/test_distributed.py).

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
from .fsdp import gradient_sync, replicated_parameters, shard, sharded_layers

__all__ = [
    "CollectiveError",
    "ContextParallelState",
    "Group",
    "MismatchError",
    "gradient_sync",
    "replicated_parameters",
    "shard",
    "sharded_layers",
    "slice_bounds",
]
