"""MLA and DSA layers over a process group: the slice's latents are read as one key head that is also the values
(`SliceLatentState`), DSA's indexer keys beside them (`SliceIndexedLatentState`); the branch layers are full
attention's with the latent's own-part reading, and DSA's selection and sparse attention run collectively
(`longstraw.distributed.context_parallel.sparse_attention`)."""

from __future__ import annotations

import torch

from ...kinds import base
from ...kinds.latent_attention import LatentOwn
from ...ops.quant import QuantizedTokens
from ..merge import fold as _fold
from .full_attention import CaptureBranchLayer, ReplayBranchLayer, SampleBranchLayer, SliceKVState
from .sparse_attention import (
    SparseCaptureAttention,
    SparseReplayAttention,
    as_selection,
    select,
    slice_partials,
    sparse_partial,
)


class SliceLatentState(SliceKVState):
    """Latents `[1, 1, end − start, kv_lora_rank + qk_rope_head_dim]` of one MLA layer for this rank's slice (built by
    the context-parallel capture in place of `LatentState`). The latent attention is multi-query attention with the
    latent as its one key head and as its values (`longstraw.ops.latent_attention`), so the slice is read as K/V with
    `keys` and `values` the same tensor, kept once."""

    def commit(self, branch_layer, n: int) -> None:
        latent = branch_layer.keys
        if n != self.end - self.start or latent.shape[-2] != n:
            raise RuntimeError(
                f"layer {self.layer_idx}: slice of {self.end - self.start} tokens, chunk of {n} "
                f"produced {latent.shape[-2]} latents"
            )
        self.keys = self.values = self._store(latent)
        self.length = self.end

    def tensors(self) -> list[torch.Tensor]:
        if self.keys is None:
            return []
        return self.keys.tensors() if isinstance(self.keys, QuantizedTokens) else [self.keys]

    def require_grad(self) -> None:
        assert isinstance(self.keys, torch.Tensor)  # committed at capture; exact mode refuses a quantized state
        self.keys.requires_grad_(True)


class SliceIndexedLatentState(SliceLatentState):
    """`SliceLatentState` of a DSA layer, plus the indexer keys `[1, end − start, index_head_dim]` of the slice (none on
    GLM-5's "shared" layers, which reuse the selection of the layer before)."""

    def __init__(self, config, layer_idx: int, start: int, end: int):
        super().__init__(config, layer_idx, start, end)
        types = getattr(config, "indexer_types", None)
        self.has_indexer = types is None or types[layer_idx] != "shared"
        self.index_keys: torch.Tensor | None = None

    def commit(self, branch_layer, n: int) -> None:
        super().commit(branch_layer, n)
        if self.has_indexer:
            keys = branch_layer.index_keys
            if keys is None or keys.shape[-2] != n:
                raise RuntimeError(f"layer {self.layer_idx}: the indexer produced no keys for the slice")
            self.index_keys = base.empty_state(keys, tuple(keys.shape))
            self.index_keys.copy_(keys)

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + ([] if self.index_keys is None else [self.index_keys])

    def release(self) -> None:
        super().release()
        self.index_keys = None


class _LatentOwn(LatentOwn):
    """What `longstraw.kinds.latent_attention.LatentAttention` reads of a branch layer, for the context-parallel branch
    layers of MLA layers: the branch's own latents are its keys and its values (one tensor), there is no local prompt
    part (`prompt` None: the slices are read through `attend`), and the absorbed up-projections are cached per branch.
    """

    values_alias = True

    def attend_latent(self, module, query, own, selection, rank, *, q_start, own_start, scale, block):
        """`LatentOwn.attend_latent` over the prompt's slices on the ranks: multi-query attention with the latents as
        the one key head and as the values (`CollectiveAttention.attend`), as `latent_attention` runs it locally."""
        if selection is not None:
            raise NotImplementedError(f"{type(self).__name__} serves dense latent attention only, not DSA")
        return self.attend(  # type: ignore[attr-defined]  # the attention branch layer this is mixed into
            module,
            query,
            own,
            own,
            q_start=q_start,
            own_start=own_start,
            scale=scale,
            window=None,
            softcap=None,
            sinks=None,
            block=block,
        )[..., :rank]


class _SparseOwn(_LatentOwn):
    """`_LatentOwn` of a DSA layer (`CollectiveSparseAttention`): the sparse attention goes through the layer's
    `attend_sparse`; capture, replay and sampling each have their own, and their own `select_keys` across the ranks."""

    def attend_latent(self, module, query, own, selection, rank, *, q_start, own_start, scale, block):
        if selection is None:
            return super().attend_latent(
                module, query, own, None, rank, q_start=q_start, own_start=own_start, scale=scale, block=block
            )
        return self.attend_sparse(  # type: ignore[attr-defined]  # each DSA branch layer below has its own
            query, own, selection, q_start=q_start, own_start=own_start, scale=scale, block=block
        )[..., :rank]


class LatentCaptureBranchLayer(_LatentOwn, CaptureBranchLayer):
    """`CaptureBranchLayer` of an MLA layer: the latents are the slice's keys and values."""


class DsaCaptureBranchLayer(_SparseOwn, LatentCaptureBranchLayer):
    """`LatentCaptureBranchLayer` of a DSA layer: the selection and the sparse attention of this rank's slice, its
    rows `chunk` at a time (every rank steps alike), against the earlier slices collectively (`longstraw.distributed.
    sparse`) and its own keys locally. No gradient: detached capture only."""

    def steps(self):
        lengths = [e - s for s, e in self.bounds]
        me = self.group.rank
        for step, lo in enumerate(range(0, max(lengths), self.chunk)):
            counts = [max(0, min(self.chunk, n - lo)) for n in lengths]
            yield step, lo, lo + counts[me], counts

    def select_keys(self, q, weights, scale, own_keys, topk, *, q_start, own_start, block):
        limits = [s for s, _ in self.bounds]
        pos = []
        for step, lo, hi, counts in self.steps():
            q_pos = torch.arange(q_start + lo, q_start + hi, device=q.device)
            sel = select(
                self.group,
                f"capture layer {self.layer_idx}: sparse selection, step {step}",
                q[:, lo:hi],
                weights[:, lo:hi],
                scale,
                own_keys,
                own_start,
                q_pos,
                topk,
                block,
                slice_keys=own_keys,
                slice_bounds=self.bounds[self.group.rank],
                lengths=counts,
                limits=limits,
            )
            pos.append(torch.where(sel.valid, sel.indices, torch.full_like(sel.indices, -1)))
        return as_selection(torch.cat(pos, dim=1), own_start)

    def attend_sparse(self, query, own, selection, *, q_start, own_start, scale, block):
        if torch.is_grad_enabled():  # exact mode's reverse pass
            return SparseCaptureAttention.apply(query, own, selection.indices, selection.valid, own_start, scale, self)
        return self.sparse_forward(query, own, selection, scale)[0].to(query.dtype)

    def sparse_forward(self, query, own, selection, scale):
        """(out, lse) float32 of this rank's rows (see the class)."""
        limits = [s for s, _ in self.bounds]
        outs, lses = [], []
        for step, lo, hi, counts in self.steps():
            q = query[:, :, lo:hi]
            idx, valid = selection.indices[:, lo:hi], selection.valid[:, lo:hi]
            sel = type(selection)(idx, valid, selection.prompt_length)
            acc = slice_partials(
                self.group,
                f"capture layer {self.layer_idx}: sparse attention, step {step}",
                q,
                sel,
                scale,
                slice_latents=own,
                slice_start=selection.prompt_length,
                lengths=counts,
                limits=limits,
            )
            out, lse = _fold(acc, sparse_partial(q, own, selection.prompt_length, idx, valid, scale))
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


class LatentReplayBranchLayer(_LatentOwn, ReplayBranchLayer):
    """`ReplayBranchLayer` of an MLA layer."""

    def adopt(self, grown) -> LatentReplayBranchLayer:
        """`ReplayBranchLayer.adopt`: the branch's own latents (and DSA indexer keys); the absorbed up-projections
        are recomputed by the replay (with autograd)."""
        super().adopt(grown)
        self.index_keys = grown.index_keys
        return self


class LatentSampleBranchLayer(_LatentOwn, SampleBranchLayer):
    """`SampleBranchLayer` of an MLA layer."""


class DsaReplayBranchLayer(_SparseOwn, LatentReplayBranchLayer):
    """`LatentReplayBranchLayer` of a DSA layer: the branch's selection over every slice (merged on its owner) and
    the sparse attention as a collective autograd function (`SparseReplayAttention`)."""

    def select_keys(self, q, weights, scale, own_keys, topk, *, q_start, own_start, block):
        info = self.info
        return _select_after_slices(
            "replay", info.group, info.layer, q, weights, scale, own_keys, topk, q_start, own_start, block, info.lengths
        )

    def attend_sparse(self, query, own, selection, *, q_start, own_start, scale, block):
        if query.shape[0] != 1:
            raise NotImplementedError("context-parallel replay runs one branch per rank (query batch 1)")
        return SparseReplayAttention.apply(query, own, self.info.layer.keys, selection, scale, self.info)


class DsaSampleBranchLayer(_SparseOwn, LatentSampleBranchLayer):
    """`LatentSampleBranchLayer` of a DSA layer: every rank has all the rows, so the slices' candidates and partials
    are all-gathered and merged alike on every rank."""

    def select_keys(self, q, weights, scale, own_keys, topk, *, q_start, own_start, block):
        g = self.group
        return _select_after_slices(
            "sample", g, self.layer, q, weights, scale, own_keys, topk, q_start, own_start, block,
            [q.shape[1]] * g.size, replicated=True,
        )  # fmt: skip

    def attend_sparse(self, query, own, selection, *, q_start, own_start, scale, block):
        layer, g = self.layer, self.group
        acc = slice_partials(
            g,
            f"sample layer {layer.layer_idx}: sparse attention",
            query,
            selection,
            scale,
            slice_latents=layer.keys,
            slice_start=layer.start,
            lengths=[query.shape[2]] * g.size,
            limits=[own_start] * g.size,
            replicated=True,
        )
        out, _ = _fold(acc, sparse_partial(query, own, own_start, selection.indices, selection.valid, scale))
        return out.to(query.dtype)


def _select_after_slices(
    what: str,
    g,
    layer,
    q,
    weights,
    scale,
    own_keys,
    topk: int,
    q_start: int,
    own_start: int,
    block: int,
    lengths: list[int],
    replicated: bool = False,
):
    """DSA's selection for rows after the whole prompt (a replay's or a sampler's; `what` names it): every slice's
    candidates (`layer`'s indexer keys, this rank's slice) and the rows' own keys from `own_start`, merged
    (`longstraw.distributed.context_parallel.sparse_attention.select`). `lengths`: each rank's rows; `replicated`:
    every rank has every row."""
    q_pos = torch.arange(q_start, q_start + q.shape[1], device=q.device)
    return select(
        g, f"{what} layer {layer.layer_idx}: sparse selection", q, weights, scale, own_keys, own_start, q_pos, topk,
        block, slice_keys=layer.index_keys, slice_bounds=(layer.start, layer.end), lengths=lengths,
        limits=[own_start] * g.size, replicated=replicated,
    )  # fmt: skip
