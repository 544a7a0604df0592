"""Compressed durable state (`capture(state_dtype=...)`): 8-bit values with per-block scales, read tile by tile."""

import pytest
import torch

import longstraw
from longstraw.attention import reference_attention, split_attention
from longstraw.quant import QUANT_BLOCK, QuantizedTokens

from .conftest import make_model, tokens
from .test_latent_attention import _Outputs

DTYPES = [pytest.param(torch.float8_e4m3fn, id="fp8"), pytest.param(torch.int8, id="int8")]


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
    assert (err <= bound * (1 + 1e-6)).all()
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
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    w = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad((out * w).sum(), [q, ko, vo]), torch.autograd.grad((want * w).sum(), [q, ko, vo])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _dequantized_copy(state):
    """The same state with every compressed tensor replaced by its dequantized values (the reference)."""
    for layer in state.layers:
        for name in ("keys", "values", "latent"):
            value = getattr(layer, name, None)
            if isinstance(value, QuantizedTokens):
                setattr(layer, name, value.dequantize())
                layer.state_dtype = None
    return state


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v3", "glm_moe_dsa"])
def test_replay_with_a_compressed_state(arch, dtype):
    """Replay equals a replay over the dequantized state (≤ 1e-5) and stays near the full-precision replay;
    the state is smaller; sampled log-probs equal replayed ones under the compressed state."""
    model = make_model(arch)
    prompt, response = tokens(200, 1), tokens(6, 2)
    with torch.no_grad():
        full = longstraw.capture(model, prompt, chunk_size=45)
        small = longstraw.capture(model, prompt, chunk_size=45, state_dtype=dtype)
        got = small.replay(response).logprobs
        sampled = small.sample(num=3, max_new_tokens=5, generator=torch.Generator().manual_seed(0))
        for toks, lps in zip(sampled.tokens, sampled.logprobs):
            torch.testing.assert_close(small.replay(toks).logprobs, lps, atol=1e-4, rtol=0)
        ref = _dequantized_copy(longstraw.capture(model, prompt, chunk_size=45, state_dtype=dtype)).replay(response)
        exact = full.replay(response).logprobs
    torch.testing.assert_close(got, ref.logprobs, atol=1e-5, rtol=0)
    assert (got - exact).abs().max().item() < (3e-2 if arch == "glm_moe_dsa" else 5e-3)
    assert small.nbytes < full.nbytes


def test_nbytes_at_a_whole_number_of_blocks():
    """P − 1 = 1024 captured tokens, head_dim 16: 16 bytes + a 4-byte scale per 64 tokens, per head, for K and V."""
    model = make_model("llama")
    with torch.no_grad():
        full = longstraw.capture(model, tokens(1025, 3), chunk_size=300)
        small = longstraw.capture(model, tokens(1025, 3), chunk_size=300, state_dtype="fp8")
    cfg = model.config
    per_layer = 2 * cfg.num_key_value_heads * (1024 * cfg.head_dim + 1024 // QUANT_BLOCK * 4)
    assert small.nbytes == cfg.num_hidden_layers * per_layer
    assert small.nbytes / full.nbytes <= 0.27


def test_no_full_precision_copy_of_the_compressed_state(monkeypatch):
    """At P = 700 with key blocks and CPU tiles of 32, no floating-point tensor other than the state has a dimension
    spanning the 640 quantized prompt tokens, in capture or in a replay with backward: the state is dequantized one
    tile at a time, never whole (tiles hold `CPU_TILE_ELEMENTS` keys × heads × dims, 2M by default: at this size the
    whole state would be one tile)."""
    import longstraw.kernels.fused as fused

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
    from longstraw.config import TrainConfig
    from longstraw.trainer import Trainer

    def run(name, **kw):
        cfg = TrainConfig(model="llama", output_dir=str(tmp_path / name), prompt_length=300, num_steps=2,
                          task_options={"num_pairs": 4, "num_values": 8}, num_generations=2,
                          max_completion_length=2, progress=False, threads=1, lora=True, **kw)
        return Trainer(cfg).train()

    full, small = run("full"), run("fp8", state_dtype="fp8")
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
