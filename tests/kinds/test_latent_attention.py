"""MLA / DSA: latent-space attention and blockwise top-k against their plain references and the full model.

Tie-free inputs: the DSA indexer scores Σ_h w_h · relu(q_h · k); where every head's q_h · k is ≤ 0
the score is exactly 0, and several keys tied at 0 around the top-k boundary make the selection
ambiguous (two correct implementations may pick different keys). The tiny configs use 16 indexer
heads, so an exact zero needs 16 negative dot products at once (≈ 2⁻¹⁶ per pair), and every model
test below first asserts, from the indexer's own inputs in the full-sequence forward, that each
query's k-th and (k+1)-th visible scores differ by more than 1e-4 relative and 1e-7 absolute (scores are
O(1e-2) in these models; float32 rounding of them is O(1e-9); `assert_tie_free` in conftest.py derives the margin)
(`_assert_tie_free`): the expected selection is unique and robust to float rounding.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import longstraw
import longstraw.testing.models
from longstraw.ops.latent_attention import (
    absorb_query,
    absorbed_weights,
    expand_output,
    latent_attention,
    reference_latent_attention,
    reference_topk,
    select_topk,
    sparse_latent_attention,
)
from longstraw.model.oracles import cache_reference_logprobs, full_sequence_logprobs

from ..conftest import assert_tie_free as _assert_tie_free
from ..conftest import lora, rel_err, tokens

MLA_ARCHS = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_linear"]
DSA_ARCHS = ["deepseek_v32", "glm_moe_dsa"]

#: latent against expanded attention in the same dtype, norm-wise relative (float64, float32): epsilon × 2^4 for
#: the values. The latent path rounds sums of 6 + 16 + 17 + 17 + 12 = 68 terms in a row (the absorbed query over
#: the nope dims, scores over r + dr, softmax and probabilities × latents over T = 17 keys, the W_v expansion), the
#: expanded one 56: rounding errors adding at random grow as √68 ≈ 8 ≤ 2^4
GROWTH = 2**4
#: gradients: 4 × more. The backward chains the same reductions again (√2 at random, rounded up) and
#: dS = P ∘ (dP − rowsum(dO ∘ O)) cancels (× 2)
GRAD_GROWTH = GROWTH * 4
#: bf16, values and gradients: epsilon × 4 = 8 roundings of ≤ 2^-8: each path rounds ≤ 4 intermediates to bf16 (the
#: absorbed query or the expanded K / V, the probabilities, the output, its expansion or projection)
BF16_TOL = torch.finfo(torch.bfloat16).eps * 4
#: replay against the unmodified model in float32, absolute on log-probs and relative on gradients: the suite's fp32
#: bound (tests/test_equivalence.py), float32's epsilon × 2^10 = 1.2e-4 taken as 1e-4: a thousand roundings adding
#: up coherently through a tiny model's depth and sums, on logits of order 1
FP32_TOL = 1e-4


def _model(arch, use_lora=False, **overrides):
    model = longstraw.testing.models.tiny_model(arch, **overrides)
    return lora(model) if use_lora else model


# ---------------------------------------------------------------------------------------------- kernels


def _mla_tensors(b=2, h=4, s=5, t=17, r=12, dr=4, dn=6, dv=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    kv_b = torch.nn.Linear(r, h * (dn + dv), bias=False).to(dtype)
    with torch.no_grad():
        kv_b.weight.copy_(rnd(h * (dn + dv), r) * 0.3)
    return rnd(b, h, s, dn), rnd(b, h, s, dr), rnd(b, 1, t, r + dr), kv_b


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("split", [0, 9, 12], ids=["no-prompt", "prompt9", "prompt12"])
def test_absorbed_latent_attention_equals_expanded(dtype, split):
    """Latent-space split attention (prompt latents batch 1, shared) = expand with kv_b_proj, then attention."""
    b, h, s, t, r, dn, dv = 2, 4, 5, 17, 12, 6, 5
    q_nope, q_rot, lat, kv_b = _mla_tensors(b, h, s, t, r, 4, dn, dv, dtype)
    prompt = lat[:1, :, :split].clone().requires_grad_(True)  # one prompt shared by both rows
    own = lat[:, :, split:].clone().requires_grad_(True)
    for x in (q_nope, q_rot):
        x.requires_grad_(True)
    full = torch.cat([prompt.expand(b, -1, -1, -1), own], dim=2)
    q_start = t - s
    want = reference_latent_attention(q_nope, q_rot, full, kv_b, h, dn, dv, r, q_start=q_start, scale=0.3)
    w_k, w_v = absorbed_weights(kv_b, h, dn, dv)
    got = expand_output(latent_attention(absorb_query(q_nope, q_rot, w_k), own, prompt if split else None, r,
                                         q_start=q_start, own_start=split, scale=0.3, block=4), w_v)
    eps = torch.finfo(dtype).eps
    tol, grad_tol = (BF16_TOL, BF16_TOL) if dtype == torch.bfloat16 else (eps * GROWTH, eps * GRAD_GROWTH)
    assert rel_err(got, want) <= tol
    g = torch.randn_like(want)
    leaves = (q_nope, q_rot, own, kv_b.weight) + ((prompt,) if split else ())
    grads_want = torch.autograd.grad((want * g).sum(), leaves)
    grads_got = torch.autograd.grad((got * g).sum(), leaves)
    for a, w in zip(grads_got, grads_want):
        assert rel_err(a, w) <= grad_tol


@pytest.mark.parametrize("topk", [3, 8, 40], ids=["top3", "top8", "top>T"])
@pytest.mark.parametrize("batch", [1, 3])
def test_blockwise_topk_and_sparse_attention_equal_reference(topk, batch):
    """Running top-k over prompt blocks + own keys = top-k of the full score matrix; sparse latent attention
    over the selection = expanded attention under the selection mask (values and gradients, fp64)."""
    dtype = torch.float64
    h, s, p, r, dn, dv, hi, di = 4, 6, 23, 12, 6, 5, 16, 8
    g = torch.Generator().manual_seed(1)
    q_nope, q_rot, lat, kv_b = _mla_tensors(batch, h, s, p + s, r, 4, dn, dv, dtype, seed=2)
    prompt = lat[:1, :, :p].clone().requires_grad_(True)  # one prompt shared by all rows
    own = lat[:, :, p:].clone().requires_grad_(True)
    iq = torch.randn(batch, s, hi, di, generator=g, dtype=dtype)
    ik = torch.randn(batch, p + s, di, generator=g, dtype=dtype)
    ik[:, :p] = ik[:1, :p]
    iw = torch.rand(batch, s, hi, generator=g, dtype=dtype) - 0.3
    for x in (q_nope, q_rot):
        x.requires_grad_(True)
    sel = select_topk(iq, iw, 0.4, ik[:1, :p], ik[:, p:], topk, q_start=p, own_start=p, block=5)
    chosen = reference_topk(iq, iw, ik, 0.4, topk, q_start=p)
    if sel.indices is None:
        assert topk >= p + s
    else:
        mine = torch.zeros_like(chosen).scatter(-1, sel.indices, sel.valid)
        assert torch.equal(mine, chosen)
    full = torch.cat([prompt.expand(batch, -1, -1, -1), own], dim=2)
    want = reference_latent_attention(q_nope, q_rot, full, kv_b, h, dn, dv, r, q_start=p, scale=0.3, allowed=chosen)
    w_k, w_v = absorbed_weights(kv_b, h, dn, dv)
    got = expand_output(sparse_latent_attention(absorb_query(q_nope, q_rot, w_k), own, prompt, sel,
                                                r, q_start=p, own_start=p, scale=0.3, block=5), w_v)
    eps = torch.finfo(dtype).eps
    assert rel_err(got, want) <= eps * GROWTH
    gout = torch.randn_like(want)
    leaves = (q_nope, q_rot, prompt, own, kv_b.weight)
    for a, w in zip(torch.autograd.grad((got * gout).sum(), leaves), torch.autograd.grad((want * gout).sum(), leaves)):
        assert rel_err(a, w) <= eps * GRAD_GROWTH


# ------------------------------------------------------------------------------------------------ models


@pytest.mark.parametrize("use_lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("index_topk", [6, 1000], ids=["topk<P", "topk>P"])
@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_dsa_forward_equals_full_sequence(arch, index_topk, use_lora):
    """P = 31 with chunks of 7 (not a multiple), R = 9; top-k 6 (sparse everywhere past the first keys) and
    1000 (dense): replay log-probs = one full-sequence forward of the unmodified model ≤ `FP32_TOL`."""
    model = _model(arch, use_lora, index_topk=index_topk)
    prompt, response = tokens(31, 11), tokens(9, 12)
    sparse = _assert_tie_free(model, torch.cat([prompt, response]))
    assert (sparse > 0) == (index_topk < 40)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=7, block_size=4) as state:
            out = state.replay(response).logprobs
    assert (out - ref).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_mla_detached_gradients_equal_cache_reference(arch):
    """Prompt under no_grad with the model's own cache, response with grad: ≤ `FP32_TOL` relative (fp32)."""
    model = _model(arch, index_topk=5) if arch in DSA_ARCHS else _model(arch)
    prompt, response = tokens(26, 13), tokens(8, 14)
    if arch in DSA_ARCHS:
        _assert_tie_free(model, torch.cat([prompt, response]))
    params = [p for p in model.parameters() if p.requires_grad]
    adv = torch.linspace(-1.0, 1.5, 8)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        ref = cache_reference_logprobs(model, prompt, response)
        g_ref = torch.autograd.grad((adv * ref).sum(), params, allow_unused=True)
    state = longstraw.capture(model, prompt, chunk_size=6, block_size=4)
    g_out = torch.autograd.grad((adv * state.replay(response).logprobs).sum(), params, allow_unused=True)
    pairs = [(a, b) for a, b in zip(g_out, g_ref) if b is not None]
    assert len(pairs) >= len(params) // 2
    got = torch.cat([a.flatten() for a, _ in pairs])
    want = torch.cat([b.flatten() for _, b in pairs])
    assert rel_err(got, want) <= FP32_TOL


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa", "deepseek_v3"])
def test_nbytes_is_the_latent_formula(arch):
    """nbytes = layers × (P − 1) × (kv_lora_rank + qk_rope_head_dim + index_head_dim) × 4 bytes (fp32).

    The documented constants: the last prompt token is not captured (it is replayed, so P − 1), GLM-5's
    `"shared"` layers keep no indexer keys (they reuse the previous layer's selection), and MLA without
    DSA keeps no indexer keys at all."""
    model = _model(arch)
    cfg = model.config
    p = 45
    with longstraw.capture(model, tokens(p, 15), chunk_size=16) as state:
        per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if arch == "deepseek_v3":
            expected = cfg.num_hidden_layers * (p - 1) * per_token * 4
        else:
            shared = sum(t == "shared" for t in getattr(cfg, "indexer_types", None) or [])
            expected = (cfg.num_hidden_layers * (p - 1) * (per_token + cfg.index_head_dim) * 4
                        - shared * (p - 1) * cfg.index_head_dim * 4)
            assert shared == (1 if arch == "glm_moe_dsa" else 0)
        assert state.nbytes == expected


class _Outputs(TorchDispatchMode):
    """Records (shape, storage) of every floating-point op output (token ids and positions span the prompt)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.outputs.append((tuple(t.shape), t.untyped_storage().data_ptr()))
        return out

    def spanning(self, length: int, exempt) -> list:
        """Shapes with a dimension ≥ `length`, except views of the `exempt` tensors' storages."""
        ptrs = {t.untyped_storage().data_ptr() for t in exempt}
        return [s for s, p in self.outputs if p not in ptrs and any(d >= length for d in s)]


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_replay_never_expands_the_prompt(arch, monkeypatch):
    """At P = 700 (longer than every other dimension of the tiny model), no tensor but the durable state and
    its views has a dimension spanning the prompt: capture (chunks of 64) holds no P × P or chunk × P scores,
    and a replay (forward and backward) neither the expanded prompt K/V (heads × P × head_dim) nor R × P
    scores or indexer scores. The fused CPU kernel's dq-only backward reads the prompt in tiles of
    `CPU_TILE_ELEMENTS` keys × heads × dims (2M by default: the whole of this prompt), each tile's unused dK/dV
    as large as the tile: tiles of one key block here, so that a prompt-sized temporary would show."""
    import longstraw.ops.kernels.fused as fused

    monkeypatch.setattr(fused, "CPU_TILE_ELEMENTS", 1)
    model = _model(arch)
    p, r = 700, 8
    prompt, response = tokens(p, 16), tokens(r, 17)
    with _Outputs() as capture_mode:
        state = longstraw.capture(model, prompt, chunk_size=64, block_size=32)
    state_tensors = [t for layer in state.layers for t in layer.tensors()]
    assert capture_mode.spanning(p - 1, state_tensors) == []
    with _Outputs() as replay_mode:
        state.replay(response).logprobs.sum().backward()
    assert replay_mode.spanning(p - 1, state_tensors) == []


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_bf16_models_agree_loosely(arch):
    """bf16 weights: replay log-probs agree with the full-sequence forward to bf16's precision of the log-probs. Both
    accumulate attention and indexer scores in float32 but round projections differently (and so may select another
    key where DSA index scores nearly tie at bf16's rounding): each within its relative rounding 2^-8 of |log p|
    (≈ 5.5 here), the two within bf16's epsilon 2^-7 × the largest |log p| (≈ 0.045)."""
    model = longstraw.testing.models.tiny_model(arch, dtype=torch.bfloat16)
    prompt, response = tokens(40, 1), tokens(7, 2)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response).float()
        with longstraw.capture(model, prompt, chunk_size=6) as state:
            out = state.replay(response).logprobs
    assert (out - ref).abs().max().item() <= torch.finfo(torch.bfloat16).eps * ref.abs().max().item()


@pytest.mark.parametrize("overrides", [
    dict(rope_interleave=False),
    dict(q_lora_rank=None),
    dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "rope_theta": 10000.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
], ids=["half-split-rope", "no-q-lora", "yarn-mscale"])
def test_mla_variants_equal_full_sequence(overrides):
    """DeepSeek-V3 options the stand-in module must follow: half-split RoPE, a plain q_proj, YaRN with the
    softmax-scale correction; P = 40 in chunks of 6."""
    model = _model("deepseek_v3", **overrides)
    prompt, response = tokens(40, 1), tokens(7, 2)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=6) as state:
            out = state.replay(response).logprobs
    assert (out - ref).abs().max().item() <= FP32_TOL
