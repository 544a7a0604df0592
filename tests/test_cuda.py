"""longstraw on a CUDA device, against the unmodified transformers model on the same device: replay log-probs
(fp32 and bf16), detached gradients, exact mode, the sampler, the host-offloaded state, the LM head, a
trainer step, and flash-linear-attention's fused gated-DeltaNet kernels where installed.

Marked `cuda`: skipped without a GPU (CI); `bench/gpu.sh` runs them on one."""

import math
import os

import pytest
import torch

import longstraw
import longstraw.testing.models
from longstraw.ops.logprobs import chunked_logprobs, reference_logprobs
from longstraw.model.oracles import _response_logprobs, cache_reference_logprobs, full_sequence_logprobs

from .conftest import assert_grads_close, lora, rel_err, tie_free_tokens, tokens

pytestmark = pytest.mark.cuda
#: LONGSTRAW_TEST_DEVICE=cpu rehearses these tests' logic on the CPU (no GPU-only checks then)
CUDA = torch.device(os.environ.get("LONGSTRAW_TEST_DEVICE", "cuda"))
GPU = CUDA.type == "cuda"
FAMILIES = ["llama", "qwen3_next", "deepseek_v3", "gemma3_text", "gpt_oss"]

EPS = torch.finfo(torch.float32).eps
#: against the unmodified model in float32, absolute on log-probs and relative on gradients: the suite's fp32 bound
#: (tests/test_equivalence.py), float32's epsilon × 2^10 = 1.2e-4 taken as 1e-4: a thousand roundings adding up
#: coherently through a tiny model's depth and sums, on logits of order 1
FP32_TOL = 1e-4
#: longstraw's bf16 error may be this multiple of transformers' own bf16 error (tests/test_bf16.py's rule)
BF16_BOUND = 1.5
#: the host-offloaded against the on-device state: the same kernels over the same values, read from host memory, so
#: at most the order of their float32 sums differs, as for a replay over an 8-bit state against one over its
#: dequantized copy (tests/ops/test_quant.py's `REPLAY_TOL`, float32's epsilon × 2^6 on log-probs); × 4 for gradients
OFFLOAD_TOL = EPS * 2**6
OFFLOAD_GRAD_TOL = OFFLOAD_TOL * 4
#: the LM head, chunked against the plain log-softmax in the same dtype. float32: epsilon × 2^5 for values, logits
#: over H = 64 and sums over V = 1,000 blocked differently (√(64 + 1000) ≈ 33 at random), × 4 for gradients (as in
#: tests/ops/test_logprobs.py). bf16: each path rounds each logit to bf16 once (≤ 2^-8, after sums blocked differently),
#: carried by z_t and log Σ e^z: 4 × 2^-8 = epsilon × 2; gradients × 2 for their own bf16 rounding
HEAD_TOL = {torch.float32: (EPS * 2**5, EPS * 2**7),
            torch.bfloat16: (torch.finfo(torch.bfloat16).eps * 2, torch.finfo(torch.bfloat16).eps * 4)}
#: TF32 (flash-linear-attention's fused kernels): matrix products on 10-bit mantissas, epsilon 2^-10
TF32_EPS = 2**-10


def _model(arch, dtype=torch.float32, use_lora=False):
    model = longstraw.testing.models.tiny_model(arch)
    model = (lora(model) if use_lora else model).to(CUDA)
    return model.to(dtype) if dtype != torch.float32 else model


@pytest.mark.parametrize("arch", FAMILIES)
def test_replay_equals_full_sequence_fp32(arch):
    model = _model(arch)
    prompt, response = tie_free_tokens(model, 70, 9, seed=1)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=16, block_size=8) as state:
            out = state.replay(response).logprobs
    assert out.device.type == CUDA.type
    assert (out - ref).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v3"])
def test_bf16_replay_error_within_transformers_own_bf16_error(arch):
    """bf16 capture + replay vs the fp32 full-sequence forward: ≤ `BF16_BOUND` × transformers' own bf16 forward's
    error (mean and max over the response), plus, where that error is near zero, the error of rounding the float32
    logits once to bf16 (measured here), which no bf16 model avoids (its LM head multiplies in bf16)."""
    model = _model(arch)
    prompt, response = tie_free_tokens(model, 300, 16, seed=2)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0, -response.numel() - 1 : -1]
        e_round = (_response_logprobs(logits.bfloat16(), response) - ref).abs()
        model.to(torch.bfloat16)
        hf = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=64) as state:
            ours = state.replay(response).logprobs
    e_hf, e_ours = (hf - ref).abs(), (ours - ref).abs()
    assert e_ours.mean() <= BF16_BOUND * e_hf.mean() + e_round.mean(), (e_ours.mean(), e_hf.mean(), e_round.mean())
    assert e_ours.max() <= BF16_BOUND * e_hf.max() + e_round.max(), (e_ours.max(), e_hf.max(), e_round.max())


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_detached_gradients_equal_cache_reference(arch):
    model = _model(arch, use_lora=True)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 40, 7, seed=3)
    adv = torch.linspace(-1.0, 1.5, 7, device=CUDA)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        ref = cache_reference_logprobs(model, prompt, response)
        g_ref = torch.autograd.grad((adv * ref).sum(), params, allow_unused=True)
    state = longstraw.capture(model, prompt, chunk_size=16, block_size=8)
    g_out = torch.autograd.grad((adv * state.replay(response).logprobs).sum(), params, allow_unused=True)
    pairs = [(a, b) for a, b in zip(g_out, g_ref) if b is not None]
    assert_grads_close([a for a, _ in pairs], [b for _, b in pairs], tol=FP32_TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_exact_mode_equals_naive_grpo(arch):
    model = _model(arch, use_lora=True)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt = tokens(33, 1).to(CUDA)
    responses = [tokens(n, 10 + n).to(CUDA) for n in (5, 8)]
    adv = [0.7, -1.2]

    def grads(fn):
        for p in params:
            p.grad = None
        fn()
        return [p.grad.clone() for p in params]

    def naive():
        for a, r in zip(adv, responses):
            (a * full_sequence_logprobs(model, prompt, r)).sum().backward()

    def exact():
        with longstraw.capture(model, prompt, chunk_size=8, prompt_grad="exact", block_size=4) as state:
            for a, r in zip(adv, responses):
                (a * state.replay(r).logprobs).sum().backward()
            state.backward()

    assert_grads_close(grads(exact), grads(naive), tol=FP32_TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_greedy_sampling_equals_generate(arch):
    """Greedy tokens equal `generate`'s up to the first step whose top-2 logit margin (full-sequence forward) is
    under 2 × `FP32_TOL`: every path's log-probs lie within `FP32_TOL` of the full-sequence forward's, so a wider
    margin picks the same token on each, and a narrower near-tie is decided by rounding, differently on every path."""
    model = _model(arch)
    prompt = tokens(19, 4).to(CUDA)
    with torch.no_grad():
        ref = model.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        ref = ref[0, prompt.numel():]
        logits = model(torch.cat([prompt, ref])[None]).logits[0, prompt.numel() - 1 : -1].float()
        top2 = logits.topk(2, -1).values
        ties = ((top2[:, 0] - top2[:, 1]) < 2 * FP32_TOL).nonzero()
        n = int(ties[0]) if ties.numel() else ref.numel()
        assert n >= 4, "the reference has near-ties in its first steps"
        state = longstraw.capture(model, prompt, chunk_size=7)
        got = state.sample(3, 12, temperature=0)
    for t in got.tokens:
        assert torch.equal(t[:n], ref[:n])
    g1, g2 = (torch.Generator(device=CUDA).manual_seed(5) for _ in range(2))
    a, b = state.sample(4, 8, generator=g1), state.sample(4, 8, generator=g2)
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))
    if GPU:
        with pytest.raises(ValueError, match="generator"):
            state.sample(2, 4, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("state_dtype", [None, "fp8"], ids=["bf16", "fp8"])
def test_host_offloaded_state_replays_and_samples_like_the_device_state(state_dtype):
    """`state_device="cpu"`: the full-attention K/V in pinned host memory, streamed tile by tile; log-probs and
    gradients equal the on-device state's, and the GPU holds no copy of it."""
    model = _model("llama", torch.bfloat16, use_lora=True)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tokens(3000, 6).to(CUDA), tokens(20, 7).to(CUDA)
    on = longstraw.capture(model, prompt, chunk_size=1024, state_dtype=state_dtype)
    lp_on = on.replay(response).logprobs
    g_on = torch.autograd.grad(lp_on.sum(), params)
    before = torch.cuda.memory_allocated() if GPU else 0
    off = longstraw.capture(model, prompt, chunk_size=1024, state_dtype=state_dtype, state_device="cpu")
    if GPU:
        held = torch.cuda.memory_allocated() - before
        assert held < on.nbytes / 4, (held, on.nbytes)  # tiles in flight and the unfinished last block, not the state
    lp_off = off.replay(response).logprobs
    g_off = torch.autograd.grad(lp_off.sum(), params)
    torch.testing.assert_close(lp_off, lp_on, atol=OFFLOAD_TOL, rtol=0)
    assert max(rel_err(a.float(), b.float()) for a, b in zip(g_off, g_on)) <= OFFLOAD_GRAD_TOL
    if GPU:
        with pytest.raises(ValueError, match="detached"):
            longstraw.capture(model, prompt, state_device="cpu", prompt_grad="exact")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lm_head_on_gpu(dtype):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False).to(CUDA, dtype)
    hidden = torch.randn(37, 64, generator=g).to(CUDA, dtype).requires_grad_()
    targets = torch.randint(0, 1000, (37,), generator=g).to(CUDA)
    lp, ent = chunked_logprobs(hidden, head, targets, token_chunk=8, vocab_chunk=300)
    rlp, rent = reference_logprobs(hidden, head, targets)
    tol, grad_tol = HEAD_TOL[dtype]
    torch.testing.assert_close(lp, rlp, atol=tol, rtol=tol)
    torch.testing.assert_close(ent, rent, atol=tol, rtol=tol)
    g1 = torch.autograd.grad((lp + 0.1 * ent).sum(), [hidden, head.weight])
    g2 = torch.autograd.grad((rlp + 0.1 * rent).sum(), [hidden, head.weight])
    for a, b in zip(g1, g2):
        assert rel_err(a.float(), b.float()) <= grad_tol


def test_trainer_runs_on_cuda_in_bf16(tmp_path):
    from longstraw.train.config import TrainConfig
    from longstraw.train.trainer import Trainer

    cfg = TrainConfig(model="llama", output_dir=str(tmp_path / "run"), prompt_length=64, num_steps=2,
                      task_options={"num_pairs": 4, "num_values": 8}, num_generations=4, max_completion_length=2,
                      progress=False, threads=1, lora=True, train_embeddings=False, device="auto", dtype="auto")
    trainer = Trainer(cfg)
    rows = trainer.train()
    assert all(math.isfinite(r["loss"]) for r in rows)
    if GPU:
        assert next(trainer.model.parameters()).device.type == "cuda"
        assert any(p.dtype == torch.bfloat16 for p in trainer.model.parameters())


def test_flash_linear_attention_path_equals_torch_path():
    """With flash-linear-attention installed, transformers runs its fused gated-DeltaNet kernels: capture, replay,
    detached and exact-mode gradients (the latter through the gradient into each chunk's initial state) and greedy
    sampling through them equal the torch path (the fused kernels use TF32: log-probs within one TF32 rounding,
    `TF32_EPS` on logits of order 1; gradients within `TF32_EPS` × 2^3 relative: the chunked delta rule's backward
    chains several TF32 products per chunk, whose errors add)."""
    pytest.importorskip("fla")
    import transformers.models.qwen3_next.modeling_qwen3_next as mod

    names = ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"]
    fused = {n: getattr(mod, n) for n in names}
    if not all(hasattr(f, "__wrapped__") for f in fused.values()):
        pytest.skip("transformers did not wrap the gated delta rule")
    model = _model("qwen3_next", use_lora=True)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tokens(200, 8).to(CUDA), tokens(12, 9).to(CUDA)

    def run():
        out = {}
        state = longstraw.capture(model, prompt, chunk_size=64)
        lp = state.replay(response).logprobs
        out["lp"], out["detached"] = lp.detach(), torch.autograd.grad(lp.sum(), params)
        with torch.no_grad():
            out["greedy"] = state.sample(2, 8, temperature=0).tokens[0]
        for p in params:
            p.grad = None
        with longstraw.capture(model, prompt, chunk_size=64, prompt_grad="exact") as ex:
            ex.replay(response).logprobs.sum().backward()
            ex.backward()
        out["exact"] = [p.grad.clone() for p in params]
        return out

    with_fla = run()
    for n in names:
        setattr(mod, n, fused[n].__wrapped__)
    try:
        torch_path = run()
    finally:
        for n in names:
            setattr(mod, n, fused[n])
    assert (with_fla["lp"] - torch_path["lp"]).abs().max().item() <= TF32_EPS
    for key in ("detached", "exact"):
        assert max(rel_err(a, b) for a, b in zip(with_fla[key], torch_path[key])) <= TF32_EPS * 2**3, key
    assert torch.equal(with_fla["greedy"], torch_path["greedy"])
