"""Replay log-probs and gradients against the unmodified transformers model, for every architecture."""

import pytest
import torch

import longstraw
from longstraw.model.oracles import STEPWISE_REFERENCE, cache_reference_logprobs, full_sequence_logprobs
from longstraw.model.capability import layer_plan

from .conftest import ARCHS, make_model, tie_free_tokens, tokens

# (P, R, chunk_size): P not a multiple of chunk, P < chunk, P = 1, R = 1, chunk = 1
SHAPES = [
    pytest.param(23, 6, 5, id="P23-R6-C5"),
    pytest.param(9, 4, 64, id="P<C"),
    pytest.param(1, 5, 4, id="P1"),
    pytest.param(12, 1, 5, id="R1"),
    pytest.param(7, 3, 1, id="C1"),
]


@pytest.mark.parametrize("use_lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("p,r,chunk", SHAPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_equals_full_sequence(arch, use_lora, p, r, chunk):
    model = make_model(arch, use_lora)
    prompt, response = tie_free_tokens(model, p, r, seed=1)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=chunk, block_size=4) as state:
            out = state.replay(response).logprobs
    assert out.shape == (r,)
    assert (out - ref).abs().max().item() <= FP32_LOGPROB_TOL


#: fp32 log-probs, absolute: float32's epsilon × 2^10 (as the self-check's `FULL_TOLERANCE`)
FP32_LOGPROB_TOL = 1e-4
#: fp32 gradients, relative: DESIGN.md's fp32 bound, float32's epsilon (1.19e-7) × 2^10 — a thousand roundings
#: adding up coherently through these tiny models' depth and sums
FP32_GRAD_TOL = 1e-4
#: fp64 gradients, relative, of a model whose arithmetic is float64 throughout (measured 1e-16 to 2e-15): float64's
#: epsilon (2.2e-16) × 2^10 as above is 2.3e-13; 1e-9 keeps a margin for growth on other machines while an algorithmic
#: error (1e-3 and up) stays six orders of magnitude above it
FP64_GRAD_TOL = 1e-9
#: how much of the model's own rounding floor (below) longstraw's path may show: it reorders the same float32
#: islands once more. Measured ratios to the floor (largest per parameter whose floor is above `FP64_GRAD_TOL` × its
#: norm, fp64 detached cases, AMD EPYC): 1.0 for most families, nemotron_h 1.6, jamba 2.0 (3.3 with LoRA), gemma2 2.9
#: (3.1 with LoRA); the distributed tests'
#: ratios to transformers' float32 floor ≤ 2.0. Two float32 roundings of the same sums, each of the floor's size,
#: differ by up to twice it; 4 leaves 1.2× over the largest measured
FLOOR_FACTOR = 4
#: layer kinds whose mixer is recurrent (Mamba and attention hybrids, gated DeltaNet, short convolutions)
RECURRENT_KINDS = frozenset({"hybrid", "linear_attention", "conv"})


def _reference_and_floor(model, prompt, response, adv, params, chunk: int) -> tuple[list, list]:
    """The float64 cache reference's gradients and their rounding floor per parameter (absolute norms).

    transformers computes parts of a float64 model in float32 whatever its dtype (5.24: RMSNorms cast to float32, the
    gated-DeltaNet decay and Mamba scans `.float()`, MoE routers, eager softmaxes, DeepSeek-V4's compressor). Two
    orders of the same float64 computation then differ by float32 rounding wherever those islands see other shapes or
    code paths; where the model is float64 throughout they agree to float64 rounding. The floor is the largest
    difference of the reference from itself reordered: prefilled in longstraw's chunks instead of one forward (the
    reorder longstraw's capture makes), and, where that finds a float32 island or the model has a recurrent mixer
    (`RECURRENT_KINDS`), with the response read one token per forward (the islands' reductions in other shapes, and
    transformers' single-token paths: the recurrent mixers' float32 scans take another route there, as longstraw's
    continuation of a captured state does; without it the Mamba families' floor would be 0 where both paths round in
    float32). On a model whose prompt reorder finds float64 rounding only it would set a float32-level floor, 6e-8 to
    1e-7 relative on cohere, gemma, gemma3_text, gemma4_text, where longstraw's error is float64 rounding: left out there.
    It finds the float32 islands from the model, not from its type; per parameter it may never exceed the fp32 bound,
    so a broken variant cannot excuse an error.
    """
    def grads(**kw):
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            ref = cache_reference_logprobs(model, prompt, response, **kw)
            return torch.autograd.grad((adv * ref).sum(), params, allow_unused=True)

    ref = grads()
    variants = [grads(prefill_chunk=chunk)]
    islands = any(b is not None and (v - b).norm() > FP64_GRAD_TOL * b.norm() for v, b in zip(variants[0], ref))
    if islands or RECURRENT_KINDS & set(layer_plan(model.config.get_text_config())):
        # the response read token by token rounds a float32 island in other shapes: where the prompt's reorder
        # already found one, or a recurrent mixer's (its continuation after a captured state takes transformers'
        # single-token path); a model computed in float64 throughout gets no float32-level floor from it
        variants.append(grads(stepwise_response=True))
    if model.config.get_text_config().model_type in STEPWISE_REFERENCE:
        # its reference reads the prompt token by token: one forward from the empty cache is the other path (for
        # every other family that forward is the reference itself, no variant)
        variants.append(grads(prefill_chunk=prompt.numel()))
    floor = [None if b is None else max((v[i] - b).norm().item() for v in variants) for i, b in enumerate(ref)]
    # each parameter's floor at most the fp32 bound for that parameter (the fp32 test's rule: relative, a parameter
    # below 1e-3 of the largest norm held at that scale), so a broken variant cannot excuse an error
    scale = max(b.norm().item() for b in ref if b is not None)
    caps = [None if b is None else FP32_GRAD_TOL * max(b.norm().item(), 1e-3 * scale) for b in ref]
    over = [(i, f / c) for i, (f, c) in enumerate(zip(floor, caps)) if f is not None and c is not None and f > c]
    assert not over, f"the reordered reference differs beyond the fp32 bound (parameter, ratio): {over}: not rounding"
    return ref, floor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_detached_gradients_equal_cache_reference(arch, use_lora, dtype):
    """fp32: every parameter gradient within `FP32_GRAD_TOL` relative of the reference. A parameter whose gradient
    is tiny next to the others (e.g. 4e-5 against O(1), from cancellation) only carries rounding noise: those below
    1e-3 of the largest gradient norm are held to the bound × 1e-3 of that norm instead, and the concatenated
    gradient to the bound relative.

    fp64: every parameter gradient within `FP64_GRAD_TOL` relative + `FLOOR_FACTOR` × the model's own rounding floor
    for that parameter (`_reference_and_floor`), and the concatenated gradient likewise.
    """
    model = make_model(arch, use_lora).to(dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")  # grouped_mm (the default) has no float64 kernel
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 19, 7, seed=3)
    adv = torch.linspace(-1.0, 1.5, 7, dtype=dtype)
    if dtype == torch.float32:
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            ref = cache_reference_logprobs(model, prompt, response)
            g_ref = torch.autograd.grad((adv * ref).sum(), params, allow_unused=True)
    else:
        g_ref, floor = _reference_and_floor(model, prompt, response, adv, params, chunk=5)
    state = longstraw.capture(model, prompt, chunk_size=5, block_size=4)
    out = state.replay(response).logprobs
    g_out = torch.autograd.grad((adv * out).sum(), params, allow_unused=True)
    idx = [i for i, b in enumerate(g_ref) if b is not None]
    assert all(g_out[i] is not None for i in idx) and len(idx) >= len(params) // 2
    err = [(g_out[i] - g_ref[i]).norm().item() for i in idx]
    norm = [g_ref[i].norm().item() for i in idx]
    whole_err = (sum(e * e for e in err) ** 0.5) / (sum(n * n for n in norm) ** 0.5)
    if dtype == torch.float32:
        scale = max(norm)
        assert all(e <= FP32_GRAD_TOL * max(n, 1e-3 * scale) for e, n in zip(err, norm))
        assert whole_err <= FP32_GRAD_TOL
    else:
        fl = [floor[i] for i in idx]
        assert all(e <= FP64_GRAD_TOL * n + FLOOR_FACTOR * f for e, n, f in zip(err, norm, fl)), \
            [(e, n, f) for e, n, f in zip(err, norm, fl) if e > FP64_GRAD_TOL * n + FLOOR_FACTOR * f]
        whole_floor = (sum(f * f for f in fl) ** 0.5) / (sum(n * n for n in norm) ** 0.5)
        assert whole_err <= FP64_GRAD_TOL + FLOOR_FACTOR * whole_floor


@pytest.mark.parametrize("arch", ARCHS)
def test_state_is_read_only_across_replays(arch):
    """Replay A, B, A (with backward in between) gives the same A; the durable tensors do not change."""
    model = make_model(arch, use_lora=True)
    state = longstraw.capture(model, tokens(17, 5), chunk_size=4)
    snapshot = [t.clone() for layer in state.layers for t in layer.tensors()]
    a, b = tokens(6, 6), tokens(9, 7)
    lp_a = state.replay(a).logprobs
    lp_a.sum().backward()
    state.replay(b).logprobs.sum().backward()
    lp_a2 = state.replay(a).logprobs
    assert torch.equal(lp_a.detach(), lp_a2.detach())
    after = [t for layer in state.layers for t in layer.tensors()]
    assert all(torch.equal(x, y) for x, y in zip(snapshot, after))


def _mamba2_nbytes(cfg) -> int:
    """fp32 bytes of a Mamba-2 layer's state, from its config fields (names per family, transformers 5.24): conv
    window of K inputs over [x | B | C] (heads · head_dim + 2 · groups · state channels) + SSM state heads × head_dim ×
    state."""
    def first(*names):
        return next(getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None)

    if cfg.model_type == "jamba":  # Mamba-1: conv window over d_inner + SSM state d_inner × d_state
        return 4 * cfg.mamba_expand * cfg.hidden_size * (cfg.mamba_d_conv + cfg.mamba_d_state)
    heads = first("mamba_num_heads", "mamba_n_heads", "n_mamba_heads")
    head_dim = first("mamba_head_dim", "mamba_d_head", "mamba_headdim")
    state = first("ssm_state_size", "mamba_d_state")
    groups = first("n_groups", "mamba_n_groups", "mamba_ngroups")
    kernel = first("conv_kernel", "mamba_d_conv")
    return 4 * ((heads * head_dim + 2 * groups * state) * kernel + heads * head_dim * state)


def _expected_nbytes(model, captured: int) -> int:
    cfg = model.config.get_text_config()
    total = 0
    for i, kind in enumerate(layer_plan(cfg)):
        layer_cfg = cfg.per_layer_config[i] if getattr(cfg, "per_layer_config", None) is not None else cfg  # Gemma 4
        kv = 2 * layer_cfg.num_key_value_heads * layer_cfg.head_dim * 4
        if kind in ("latent_attention", "indexed_attention"):  # MLA latent + rotary key [+ DSA indexer key]
            index = kind == "indexed_attention" and getattr(cfg, "indexer_types", ["full"] * (i + 1))[i] == "full"
            total += 4 * captured * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + (cfg.index_head_dim if index else 0))
        elif kind == "full_attention":
            total += kv * captured
        elif kind in ("compressed_sparse_attention", "heavily_compressed_attention"):  # DeepSeek-V4
            m, d, w = cfg.compress_rates[kind], cfg.head_dim, min(captured, cfg.sliding_window - 1)
            # window keys (K = V, once) + per stream: entries, raw tail kv + gate, CSA overlap kv + gate
            streams = [(d, 2 * d), (cfg.index_head_dim, 2 * cfg.index_head_dim)] if kind == "compressed_sparse_attention" \
                else [(d, d)]
            total += 4 * d * w
            for dim, width in streams:
                total += 4 * (captured // m * dim + 2 * (captured % m) * width)
                if kind == "compressed_sparse_attention" and captured >= m:
                    total += 4 * 2 * m * dim
        elif kind == "sliding_attention":
            total += kv * min(captured, cfg.sliding_window - 1)
        elif kind == "chunked_attention":
            total += kv * (captured % cfg.attention_chunk_size)
        elif kind in ("moe", "mlp"):  # no token mixer: nothing
            pass
        elif kind == "conv":  # LFM2 short convolution: the last kernel − 1 inputs
            total += 4 * cfg.hidden_size * (cfg.conv_L_cache - 1)
        elif kind == "hybrid":  # Falcon-H1 / Zamba2: attention K/V + Mamba-2 state
            heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            total += 2 * heads * cfg.head_dim * 4 * captured + _mamba2_nbytes(cfg)
        elif cfg.model_type == "kimi_linear":  # KDA: conv window over q, k, v + per-head d×d state
            d = cfg.linear_num_heads * cfg.linear_head_dim
            total += 4 * (3 * d * cfg.linear_conv_kernel_dim + cfg.linear_num_heads * cfg.linear_head_dim**2)
        elif not hasattr(cfg, "linear_num_key_heads"):  # Mamba-2 layers
            total += _mamba2_nbytes(cfg)
        else:  # linear attention: conv window + recurrent state, independent of P
            conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
            rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
            total += 4 * (conv_dim * cfg.linear_conv_kernel_dim + rec)
    return total


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("p", [2, 4, 40])
def test_nbytes_is_the_durable_state(arch, p):
    model = make_model(arch)
    with longstraw.capture(model, tokens(p, 8), chunk_size=16) as state:
        assert state.nbytes == _expected_nbytes(model, p - 1)
    with pytest.raises(RuntimeError, match="released"):
        state.replay(tokens(3, 9))


def test_same_result_for_any_chunk_and_block():
    model = make_model("qwen3_next")
    prompt, response = tokens(30, 10), tokens(5, 11)
    outs = []
    for chunk, block in [(1, 1024), (7, 3), (29, 16), (4096, 1024)]:
        with torch.no_grad(), longstraw.capture(model, prompt, chunk_size=chunk, block_size=block) as state:
            outs.append(state.replay(response).logprobs)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=2e-6, rtol=0)


def test_batched_shape_and_int32_ids_accepted():
    model = make_model("llama")
    prompt, response = tokens(10, 12), tokens(4, 13)
    with torch.no_grad():
        a = longstraw.capture(model, prompt[None]).replay(response[None].int()).logprobs
        b = longstraw.capture(model, prompt).replay(response).logprobs
    assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("arch", ARCHS)
def test_checkpointed_replay_gives_the_same_gradients(arch, mode):
    """`replay(checkpoint_layers=True)` (each decoder layer recomputed in backward against a snapshot of its
    branch cache layer) gives the gradients of the plain replay, two responses accumulated, LoRA."""
    model = make_model(arch, use_lora=True)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for checkpoint_layers in (False, True):
        state = longstraw.capture(model, tokens(23, 20), chunk_size=5, prompt_grad=mode)
        for seed, r in ((21, 7), (22, 4)):
            lp = state.replay(tokens(r, seed), checkpoint_layers=checkpoint_layers).logprobs
            (lp * torch.linspace(-1.0, 1.0, r)).sum().backward()
        state.backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in params])
        model.zero_grad(set_to_none=True)
    pairs = [(a, b) for a, b in zip(*grads) if b is not None]
    assert len(pairs) >= len(params) // 2 and all(a is not None for a, _ in pairs)
    for a, b in pairs:
        assert (a - b).norm().item() <= 1e-6 * max(b.norm().item(), 1e-12)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "glm_moe_dsa"])
def test_transformers_activation_checkpointing_is_replaced(arch):
    """With transformers' own activation checkpointing on (which would drop the cache: linear-attention layers
    would restart from a zero state), replay in training mode gives the gradients of a plain replay, and
    the model's flags are left as they were."""
    model = make_model(arch, use_lora=True)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for hf_checkpointing in (False, True):
        if hf_checkpointing:
            model.activation_checkpointing_enable()
        model.train()
        state = longstraw.capture(model, tokens(23, 30), chunk_size=5, prompt_grad="exact")
        lp = state.replay(tokens(7, 31)).logprobs
        (lp * torch.linspace(-1.0, 1.0, 7)).sum().backward()
        state.backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in params])
        model.zero_grad(set_to_none=True)
    layers = longstraw.hf.parts.base_model(model).model.layers
    assert all(layer.gradient_checkpointing for layer in layers)
    pairs = [(a, b) for a, b in zip(*grads) if b is not None]
    assert len(pairs) >= len(params) // 2 and all(a is not None for a, _ in pairs)
    for a, b in pairs:
        assert (a - b).norm().item() <= 1e-6 * max(b.norm().item(), 1e-12)
