"""Compressed durable state (`capture(state_dtype=...)`): 8-bit values with per-block scales, read tile by tile."""

import copy

import pytest
import torch

import longstraw
import longstraw.testing.models
from longstraw.ops.attention import reference_attention, split_attention
from longstraw.ops.quant import QUANT_BLOCK, QuantizedTokens
from longstraw.model.oracles import full_sequence_logprobs

from ..conftest import make_model, tokens
from ..kinds.test_latent_attention import _Outputs

DTYPES = [pytest.param(torch.float8_e4m3fn, id="fp8"), pytest.param(torch.int8, id="int8")]
EPS = torch.finfo(torch.float32).eps
#: split attention over the 8-bit prompt against attention over its dequantized values (and the plain reference),
#: relative and absolute: float32's epsilon × 2^4 for values, as in tests/ops/test_attention.py (each side rounds
#: 16-term logit dot products and sums over 156 keys in its own order: √(16 + 156) ≈ 13 ≤ 2^4), × 4 for gradients
#: (three more reductions chained onto the probabilities, √4 = 2 at random, × 2 for dS = P ∘ (dP − rowsum)'s
#: cancellation)
ATTN_TOL, ATTN_GRAD_TOL = EPS * 2**4, EPS * 2**6
#: a replay over the 8-bit state against one over its dequantized copy, absolute on log-probs: the same arithmetic but
#: for the order of the attention kernels' float32 sums (8-bit tiles decoded in the kernel): logits of ≤ 40 terms
#: (MLA's latent width) and sums over ≤ 206 keys, √(40 + 206) ≈ 16 ≤ 2^4 epsilons per attention output, × 4 through
#: the later layers and the LM head onto log-probs of order 1 to 5
REPLAY_TOL = EPS * 2**6
#: sampled against replayed log-probs (decode steps against one forward over the response): the suite's fp32 bound
#: (tests/test_equivalence.py), float32's epsilon × 2^10 = 1.2e-4 taken as 1e-4
FP32_TOL = 1e-4
#: MoE routers and DSA top-k selections are discontinuous: the 8-bit state moves their scores by its rounding, and a
#: token sent to another expert or a key swapped at the top-k boundary moves a log-prob by up to ~4e-2, which is no
#: rounding. How close the 8-bit state keeps the log-probs is measured on the same families with dense FFNs and a
#: dense selection
CONTINUOUS = {"qwen3_next": dict(mlp_only_layers=[0, 1, 2]), "deepseek_v3": dict(first_k_dense_replace=3),
              "glm_moe_dsa": dict(index_topk=1000)}
#: the 8-bit state may move log-probs by up to this multiple of the unmodified model's own bf16 error on the same
#: tokens (`_bf16_floor`): about what bf16 arithmetic costs, × 2 since fp8 e4m3 rounds each prompt-state value to
#: 2^-4 relative (int8 to half a step of 1/127 of its block's absmax) where bf16 rounds every operand of every layer
#: to 2^-8
NEAR_BF16 = 2


def _filled(x: torch.Tensor, dtype, chunk: int) -> QuantizedTokens:
    q = QuantizedTokens(x[:, :, :1], x.shape[2], dtype)
    for s in range(0, x.shape[2], chunk):
        q.append(x[:, :, s : s + chunk])
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,chunk", [(200, 7), (128, 64), (40, 40)], ids=["tail-odd-chunks", "whole-blocks", "all-tail"])
def test_dequantized_values_are_within_the_format_rounding(dtype, n, chunk):
    """Each value within half an int8 step of its block scale, or fp8 e4m3's relative rounding (2^-4) plus its
    subnormal step; the unfinished last block is kept exactly."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, 3, n, 16, generator=g) * torch.linspace(0.1, 10, n)[None, None, :, None]
    q = _filled(x, dtype, chunk)
    deq = q.dequantize(torch.float32)
    assert q.length == n and q.quantized == n - n % QUANT_BLOCK
    scale = q.scales.repeat_interleave(QUANT_BLOCK, dim=2)[..., None]
    err = (deq[:, :, : q.quantized] - x[:, :, : q.quantized]).abs()
    xs = x[:, :, : q.quantized].abs()
    bound = 0.5 * scale if dtype == torch.int8 else 2**-4 * xs + scale * 2**-9
    # + the float32 roundings of x / scale and of value × scale, each ≤ half an epsilon of |x|, × 2 to spare
    assert (err <= bound + 2 * EPS * xs).all()
    assert torch.equal(deq[:, :, q.quantized :], x[:, :, q.quantized :])
    # a block read anywhere equals the same slice of the whole
    assert torch.equal(q.read(50, 30, torch.float32), deq[:, :, 50:80])
    idx = torch.tensor([[[0, n - 1, min(63, n - 1), min(64, n - 1)]]])
    assert torch.equal(_filled(x[:, :1], dtype, chunk).gather_rows(idx, torch.float32)[0, 0],
                       _filled(x[:, :1], dtype, chunk).dequantize(torch.float32)[0, 0][idx[0, 0]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,window", [(1, None), (3, None), (1, 9)], ids=["B1", "B3-shared-prompt", "window9"])
def test_split_attention_reads_the_compressed_prompt_as_its_dequantized_values(dtype, batch, window):
    """The kernel over the 8-bit prompt equals attention over the dequantized tensor (values and the gradients
    of the queries and the branch's own K/V), and the plain reference."""
    g = torch.Generator().manual_seed(3)
    p, r, h, hkv, d = 150, 6, 4, 2, 16
    kp, vp = torch.randn(1, hkv, p, d, generator=g), torch.randn(1, hkv, p, d, generator=g)
    qk, qv = _filled(kp, dtype, 37), _filled(vp, dtype, 37)
    dk, dv = qk.dequantize(torch.float32), qv.dequantize(torch.float32)
    q = torch.randn(batch, h, r, d, generator=g, requires_grad=True)
    ko = torch.randn(batch, hkv, r, d, generator=g, requires_grad=True)
    vo = torch.randn(batch, hkv, r, d, generator=g, requires_grad=True)
    kw = dict(q_start=p, own_start=p, window=window, block=32)
    out = split_attention(q, ko, vo, qk, qv, **kw)
    want = split_attention(q, ko, vo, dk, dv, **kw)
    ref = torch.cat([reference_attention(q[i : i + 1], torch.cat([dk, ko[i : i + 1]], 2),
                                         torch.cat([dv, vo[i : i + 1]], 2), p, 0, window=window)
                     for i in range(batch)])
    torch.testing.assert_close(out, want, atol=ATTN_TOL, rtol=ATTN_TOL)
    torch.testing.assert_close(out, ref, atol=ATTN_TOL, rtol=ATTN_TOL)
    w = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad((out * w).sum(), [q, ko, vo]), torch.autograd.grad((want * w).sum(), [q, ko, vo])):
        torch.testing.assert_close(a, b, atol=ATTN_GRAD_TOL, rtol=ATTN_GRAD_TOL)


def _dequantized_copy(state):
    """The same state with every compressed tensor replaced by its dequantized values (the reference)."""
    for layer in state.layers:
        for name in ("keys", "values", "latent"):
            value = getattr(layer, name, None)
            if isinstance(value, QuantizedTokens):
                setattr(layer, name, value.dequantize())
                layer.state_dtype = None
    return state


def _bf16_floor(model, prompt, response) -> float:
    """The unmodified model's own bf16 error on these tokens: its bf16 copy's full-sequence log-probs against that copy
    cast back to float32 (the same values, so the difference is bf16 arithmetic alone), max abs."""
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    m32 = copy.deepcopy(m16).to(torch.float32)
    with torch.no_grad():
        lp16, lp32 = full_sequence_logprobs(m16, prompt, response), full_sequence_logprobs(m32, prompt, response)
    return (lp16.float() - lp32).abs().max().item()


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v3", "glm_moe_dsa"])
def test_replay_with_a_compressed_state(arch, dtype):
    """Replay equals a replay over the dequantized state (≤ `REPLAY_TOL`) and stays near the full-precision replay
    (within `NEAR_BF16` × the model's own bf16 error, on the family's `CONTINUOUS` variant); the state is smaller;
    sampled log-probs equal replayed ones under the compressed state."""
    model = make_model(arch)
    prompt, response = tokens(200, 1), tokens(6, 2)
    with torch.no_grad():
        full = longstraw.capture(model, prompt, chunk_size=45)
        small = longstraw.capture(model, prompt, chunk_size=45, state_dtype=dtype)
        got = small.replay(response).logprobs
        sampled = small.sample(num=3, max_new_tokens=5, generator=torch.Generator().manual_seed(0))
        for toks, lps in zip(sampled.tokens, sampled.logprobs):
            torch.testing.assert_close(small.replay(toks).logprobs, lps, atol=FP32_TOL, rtol=0)
        ref = _dequantized_copy(longstraw.capture(model, prompt, chunk_size=45, state_dtype=dtype)).replay(response)
        exact = full.replay(response).logprobs
    torch.testing.assert_close(got, ref.logprobs, atol=REPLAY_TOL, rtol=0)
    assert small.nbytes < full.nbytes
    if arch in CONTINUOUS:
        model = longstraw.testing.models.tiny_model(arch, **CONTINUOUS[arch])
        with torch.no_grad():
            exact = longstraw.capture(model, prompt, chunk_size=45).replay(response).logprobs
            got = longstraw.capture(model, prompt, chunk_size=45, state_dtype=dtype).replay(response).logprobs
    assert (got - exact).abs().max().item() <= NEAR_BF16 * _bf16_floor(model, prompt, response)


def test_nbytes_at_a_whole_number_of_blocks():
    """P − 1 = 1024 captured tokens, head_dim 16: 16 bytes + a 4-byte scale per 64 tokens, per head, for K and V."""
    model = make_model("llama")
    with torch.no_grad():
        full = longstraw.capture(model, tokens(1025, 3), chunk_size=300)
        small = longstraw.capture(model, tokens(1025, 3), chunk_size=300, state_dtype="fp8")
    cfg = model.config
    per_layer = 2 * cfg.num_key_value_heads * (1024 * cfg.head_dim + 1024 // QUANT_BLOCK * 4)
    assert small.nbytes == cfg.num_hidden_layers * per_layer
    assert small.nbytes / full.nbytes <= 0.27  # (16 + 4 / 64) / (4 · 16) = 0.251 bytes per float32 byte


def test_no_full_precision_copy_of_the_compressed_state(monkeypatch):
    """At P = 700 with key blocks and CPU tiles of 32, no floating-point tensor other than the state has a dimension
    spanning the 640 quantized prompt tokens, in capture or in a replay with backward: the state is dequantized one
    tile at a time, never whole (tiles hold `CPU_TILE_ELEMENTS` keys × heads × dims, 2M by default: at this size the
    whole state would be one tile)."""
    import longstraw.ops.kernels.fused as fused

    monkeypatch.setattr(fused, "CPU_TILE_ELEMENTS", 1)
    model = make_model("llama", use_lora=True)
    with _Outputs() as capture_mode:
        state = longstraw.capture(model, tokens(700, 4), chunk_size=64, block_size=32, state_dtype="int8")
    exempt = [t for layer in state.layers for t in layer.tensors()]
    with _Outputs() as replay_mode:
        state.replay(tokens(8, 5)).logprobs.sum().backward()
    assert replay_mode.spanning(640, exempt) == []
    assert capture_mode.spanning(640, exempt) == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param({"state_dtype": "fp4"}, "state_dtype must be one of", id="unknown"),
        pytest.param({"state_dtype": torch.float16}, "state_dtype must be", id="not-8-bit"),
        pytest.param({"state_dtype": "fp8", "prompt_grad": "exact"}, "prompt_grad='exact'", id="exact"),
    ],
)
def test_bad_state_dtype(kwargs, match):
    with pytest.raises(ValueError, match=match):
        longstraw.capture(make_model("llama"), tokens(9, 0), **kwargs)


def test_trainer_with_a_compressed_state(tmp_path):
    """`state_dtype: fp8` in a run: the logged durable state is smaller than in the same run at full precision;
    exact prompt gradients with a quantized state are refused at configuration."""
    from longstraw.train.config import TrainConfig
    from longstraw.train.trainer import Trainer

    def run(name, **kw):
        cfg = TrainConfig(model="llama", output_dir=str(tmp_path / name), prompt_length=300, num_steps=2,
                          task_options={"num_pairs": 4, "num_values": 8}, num_generations=2,
                          max_completion_length=2, progress=False, threads=1, lora=True, **kw)
        return Trainer(cfg).train()

    full, small = run("full"), run("fp8", state_dtype="fp8")
    # 8-bit blocks take (D + 4 / 64) / 4D ≈ 1/4 of float32's bytes; the unfinished last block (43 of the 299
    # captured tokens) stays float32: (256 / 4 + 43) / 299 ≈ 0.36 < 0.5
    assert all(s["durable_bytes"] < 0.5 * f["durable_bytes"] for s, f in zip(small, full))
    assert all(s["loss"] == s["loss"] for s in small)
    with pytest.raises(ValueError, match="prompt_grad: detached"):
        TrainConfig(model="llama", state_dtype="fp8", prompt_grad="exact")


@pytest.mark.parametrize("start,n", [(0, 960), (64, 128), (10, 100), (0, 1000), (900, 100)])
def test_read_equals_values_times_their_block_scales(start, n):
    """`QuantizedTokens.read` over whole blocks (one broadcast product) and over partial ones (per-position scale
    index), with the unfinished tail: each position's 8-bit value times its block's scale, exactly."""
    x = torch.randn(1, 2, 1000, 16, generator=torch.Generator().manual_seed(0))
    q = QuantizedTokens(x, 1000, torch.int8)
    q.append(x)
    scaled = q.values[:, :, :q.quantized].float() * q.scales.repeat_interleave(QUANT_BLOCK, dim=2)[..., None]
    want = torch.cat([scaled, x[:, :, q.quantized:]], dim=2)[:, :, start:start + n]
    assert torch.equal(q.read(start, n, torch.float32), want)
