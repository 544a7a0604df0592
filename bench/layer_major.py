"""A layer-major reverse pass for one trajectory after a constant prompt: a measured prototype, not the library's.

longstraw's segmented replay (`longstraw.trajectory`) goes segment-major: each segment through every layer, then a
reverse pass over the segments that accumulates the gradient of the earlier segments' own keys and values. Its peak
holds every layer's own K/V and that gradient: 2 × the own K/V (docs/agents.md, "Cost"). This prototype goes
layer-major instead, to measure what that order costs and saves:

1. forward, one layer at a time over the whole trajectory (in chunks of `chunk` positions, in order, against the
   prompt's keys and values and the layer's own so far), keeping the hidden states entering k of every n layers
   (`store` (k, n): layers i with i % n < k) and no keys or values beyond the current layer's;
2. the log-probs' gradient with respect to the last hidden states, chunk by chunk;
3. layers last to first: the hidden states entering the layer (kept, or recomputed from the last kept below), its
   own keys and values again (the projections only: the layer run up to its cache update), then its chunks last to
   first, each re-run with autograd and back-propagated with the gradient the layer above sent to its output and the
   gradient later chunks sent to its own keys and values (accumulated per layer).

Per trajectory position it holds the kept hidden states, the current layer's input and output gradient (2 more), and
one layer's own keys, values and their gradients (4 × one layer's K/V), not every layer's. SmolLM2-135M (30 layers,
hidden 576, 3 × 64 K/V heads: 11,520 own K/V floats a position): `store` 1/1 keeps 29 hidden states,
(29 + 2) × 576 + 4 × 384 = 19,392 floats (1.68 × the own K/V); 2/3 keeps 19: 13,632 (1.18 ×); 1/2 keeps 14: 10,752
(0.93 ×). A shallow model gains little: the 4-layer dense benchmark model (hidden 128 against 128 K/V floats a
layer) 2.25 × at 1/1 and 1.75 × at 1/2, against segmented replay's 2 ×. Time: one forward, the recomputation
(1 − k / n of a forward), one more forward under autograd, and the backward; with 1/1, the work of segmented replay.

Scope of the prototype: decoder layers called one at a time as the model's forward calls them (transformers 5.24's
`layer(hidden, attention_mask=, position_ids=, cache=, position_embeddings=)`; attention reading its keys and values
through `cache.update`; `sdpa` with an explicit mask, grouped keys and values read grouped), one shared rotary
embedding (`decoder.rotary_emb`), full causal attention (no windows, no recurrent layers), the prompt a constant (its
keys and values from transformers' own `DynamicCache`). `python bench/layer_major.py` checks its gradient against the
whole trajectory's through the unmodified model (`tests/tools/test_layer_major_bench.py` too);
`bench/agent_turns.py --methods layer_major --store 1/2` measures it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


class _Stop(Exception):
    """Raised by `_Grab` once the layer has made its keys and values: the rest of the layer is not run."""


class _Grab:
    """A cache that keeps the keys and values a layer's attention hands to it and stops the layer there."""

    kv: tuple[torch.Tensor, torch.Tensor]

    def update(self, k, v, *args, **kwargs):
        self.kv = (k, v)
        raise _Stop


class _Reads:
    """A cache for one chunk of one layer: what the attention reads is the prompt's keys and values, the trajectory's
    own before the chunk, then the chunk's own (kept in `own`: what a backward sends the later chunks' gradient to)."""

    def __init__(self, before_k: list[torch.Tensor], before_v: list[torch.Tensor]):
        self.before = (before_k, before_v)
        self.own: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, k, v, *args, **kwargs):
        self.own = (k, v)
        return torch.cat([*self.before[0], k], 2), torch.cat([*self.before[1], v], 2)


def _parts(model):
    from longstraw.hf.parts import base_model, decoder_of

    # transformers 5.24's sdpa path repeats grouped keys and values per query head whenever a mask is given
    # (`use_gqa_in_sdpa`); torch's CPU flash kernel reads them grouped with a mask, as longstraw's kernel does
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    base = base_model(model)
    base.set_attn_implementation("sdpa")
    return decoder_of(base), base.get_output_embeddings()


def prompt_kv(model, prompt: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values `[1, Hkv, P - 1, D]` of the prompt but its last token (the replay's first input),
    from transformers' own cache, without autograd."""
    from transformers import DynamicCache

    decoder, _ = _parts(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        decoder(input_ids=prompt[None, :-1], cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


class _Run:
    """One trajectory's inputs `[1, T]`, positions, chunks, and per chunk its mask `[1, 1, C, P - 1 + end]` and
    rotary embeddings."""

    def __init__(self, decoder, prompt_kv, prompt: torch.Tensor, tokens: torch.Tensor, chunk: int):
        self.decoder = decoder
        self.kv = prompt_kv
        self.inputs = torch.cat([prompt[-1:], tokens[:-1]])[None]
        self.start = prompt.numel() - 1
        T = tokens.numel()
        self.positions = torch.arange(self.start, self.start + T)[None]
        self.chunks = [(s, min(s + chunk, T)) for s in range(0, T, chunk)]

    def mask(self, s: int, e: int) -> torch.Tensor:
        q = torch.arange(self.start + s, self.start + e)[:, None]
        return (torch.arange(self.start + e)[None, :] <= q)[None, None]

    def layer(self, i: int, h: torch.Tensor, s: int, e: int, before_k, before_v):
        """Layer i over chunk [s, e) of the trajectory (its input `h` `[1, e - s, hidden]`), reading the prompt's
        keys and values and `before_k` / `before_v` (the own ones before s); the output and the chunk's own K/V."""
        pk, pv = self.kv[i]
        reads = _Reads([pk, *before_k], [pv, *before_v])
        pos = self.positions[:, s:e]
        out = self.decoder.layers[i](
            h,
            attention_mask=self.mask(s, e),
            position_ids=pos,
            cache=reads,
            position_embeddings=self.decoder.rotary_emb(h, pos),
        )
        assert reads.own is not None
        return out, reads.own

    def own_kv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's own keys and values `[1, Hkv, T, D]` over the whole trajectory (input `h`), without its
        attention or MLP."""
        grab = _Grab()
        try:
            self.decoder.layers[i](
                h,
                position_ids=self.positions,
                cache=grab,
                position_embeddings=self.decoder.rotary_emb(h, self.positions),
            )
        except _Stop:
            return grab.kv
        raise RuntimeError(f"layer {i} did not hand its keys and values to the cache")

    def forward_layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer i's output over the whole trajectory, chunk by chunk in order, without autograd."""
        out = torch.empty_like(h)
        k_all = v_all = None
        for s, e in self.chunks:
            before = ([k_all[:, :, :s]], [v_all[:, :, :s]]) if k_all is not None else ([], [])
            o, (k, v) = self.layer(i, h[:, s:e], s, e, *before)
            if k_all is None:
                k_all = k.new_empty(*k.shape[:2], h.shape[1], k.shape[-1])
                v_all = v.new_empty(*v.shape[:2], h.shape[1], v.shape[-1])
            k_all[:, :, s:e], v_all[:, :, s:e] = k, v
            out[:, s:e] = o
        return out


def parse_store(text: str) -> tuple[int, int]:
    """`store` from its command-line form "k/n"."""
    k, n = (int(x) for x in text.split("/"))
    return k, n


def layer_major_backward(
    model,
    prompt_kv,
    prompt: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    chunk: int = 128,
    store: tuple[int, int] = (1, 2),
    head_chunk: int = 64,
) -> float:
    """Back-propagate the masked log-prob sum of `tokens` `[T]` after `prompt` (its keys and values `prompt_kv`, a
    constant) into the model's parameters, layer-major (see the module doc); the loss. `store` (k, n): the hidden
    states entering layers i with i % n < k are kept from the forward, the others recomputed from the last kept one
    below; `head_chunk`: positions per chunk of the log-probs (their `[C, vocab]` logits and log-softmax)."""
    keep, of = store
    if not 1 <= keep <= of:
        raise ValueError(f"store must be (k, n) with 1 <= k <= n; got {store}")
    decoder, lm_head = _parts(model)
    run = _Run(decoder, prompt_kv, prompt, tokens, chunk)
    n = len(decoder.layers)
    kept: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        h = decoder.embed_tokens(run.inputs)
        for i in range(n):
            if i % of < keep and i > 0:
                kept[i] = h
            h = run.forward_layer(i, h)
    # the log-probs' gradient with respect to the last hidden states, chunk by chunk
    grad = torch.empty_like(h)
    total = 0.0
    T = tokens.numel()
    for s, e in [(s, min(s + head_chunk, T)) for s in range(0, T, head_chunk)]:
        hc = h[:, s:e].detach().requires_grad_(True)
        logp = torch.log_softmax(lm_head(decoder.norm(hc)).float(), -1)[0]
        loss = (logp.gather(-1, tokens[s:e, None])[:, 0] * mask[s:e]).sum()
        loss.backward()
        grad[:, s:e] = hc.grad
        total += float(loss.detach())
    del h
    block: dict[int, torch.Tensor] = {}
    for i in range(n - 1, -1, -1):
        if i not in kept and i not in block and i > 0:  # this block's hidden states, from the last kept below
            low = i - i % of + keep - 1
            with torch.no_grad():
                x = decoder.embed_tokens(run.inputs) if low == 0 else kept[low]
                for j in range(low, i):
                    x = run.forward_layer(j, x)
                    block[j + 1] = x
        x = kept.pop(i, None)
        if x is None:
            x = block.pop(i) if i > 0 else decoder.embed_tokens(run.inputs).detach()
        with torch.no_grad():
            k_all, v_all = run.own_kv(i, x)
        g_k, g_v = torch.zeros_like(k_all), torch.zeros_like(v_all)
        for s, e in reversed(run.chunks):
            hc = x[:, s:e].detach().requires_grad_(True)
            kb = k_all[:, :, :s].detach().requires_grad_(s > 0)
            vb = v_all[:, :, :s].detach().requires_grad_(s > 0)
            out, (k, v) = run.layer(i, hc, s, e, [kb] if s else [], [vb] if s else [])
            torch.autograd.backward([out, k, v], [grad[:, s:e], g_k[:, :, s:e], g_v[:, :, s:e]])
            grad[:, s:e] = hc.grad  # (this chunk's output gradient is spent)
            if s > 0:
                g_k[:, :, :s] += kb.grad
                g_v[:, :, :s] += vb.grad
        del x, k_all, v_all, g_k, g_v
    if decoder.embed_tokens.weight.requires_grad:
        decoder.embed_tokens(run.inputs).backward(grad)
    return total


def whole_backward(model, prompt: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> float:
    """The reference: the project's detached-mode oracle (`longstraw.model.oracles.cache_reference_logprobs`: the
    unmodified model's own cache over the prompt, then the whole trajectory with autograd), its masked log-prob sum
    back-propagated; the loss."""
    from longstraw.model.oracles import cache_reference_logprobs

    loss = (cache_reference_logprobs(model, prompt, tokens) * mask).sum()
    loss.backward()
    return float(loss.detach())


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dense", choices=["dense", "smollm2"])
    ap.add_argument("--P", type=int, default=256)
    ap.add_argument("--T", type=int, default=700)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument(
        "--store", nargs="+", default=["1/1", "1/2", "2/3", "1/3"], help="k/n: layer_major_backward's store"
    )
    args = ap.parse_args()
    from agent_turns import _model

    torch.manual_seed(0)
    model = _model(args.model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.P,), generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (args.T,), generator=g)
    mask = (torch.rand(args.T, generator=g) < 0.5).float()
    kv = prompt_kv(model, prompt)
    ref_loss = whole_backward(model, prompt, tokens, mask)
    ref = _grads(model)
    scale = max(float(t.abs().max()) for t in ref.values())
    for store in args.store:
        loss = layer_major_backward(model, kv, prompt, tokens, mask, chunk=args.chunk, store=parse_store(store))
        got = _grads(model)
        assert got.keys() == ref.keys(), sorted(set(ref) ^ set(got))
        worst = max(float((got[n] - ref[n]).abs().max()) for n in ref)
        print(
            f"{args.model}, store {store}: loss {loss:.6f} vs {ref_loss:.6f}; "
            f"max |grad − whole| {worst:.2e} of max |grad| {scale:.2e} ({worst / scale:.1e})"
        )


if __name__ == "__main__":
    main()
