"""`bench/layer_major.py`'s prototype (a layer-major reverse pass, measured against segmented replay in
docs/agents.md) takes the gradient the unmodified model takes over the whole trajectory (the project's detached-mode
oracle, `longstraw.model.oracles.cache_reference_logprobs`): the memory and time quoted for it are those of the right
computation."""

import sys
from pathlib import Path

import pytest
import torch

from longstraw.tools.compare import bench_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from layer_major import layer_major_backward, prompt_kv, whole_backward  # noqa: E402


@pytest.mark.parametrize("store", [(1, 1), (1, 2), (2, 3)])
def test_layer_major_prototype_equals_the_whole_trajectory_through_the_model(store):
    """The dense benchmark model (4 layers, LoRA), a 64-token prompt, 200 trajectory tokens in 5 chunks; the hidden
    states of every layer kept, of every other, of 2 in 3 (the others recomputed). Bound: fp32 epsilon (1.2e-7) × 100
    of the largest gradient — both sum the same terms (≤ 263 keys a query, 200 positions a weight) in other orders."""
    model = bench_model("dense")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (64,), generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (200,), generator=g)
    mask = (torch.rand(200, generator=g) < 0.5).float()
    kv = prompt_kv(model, prompt)
    ref_loss = whole_backward(model, prompt, tokens, mask)
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = layer_major_backward(model, kv, prompt, tokens, mask, chunk=48, store=store, head_chunk=32)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys() and len(ref) > 0
    scale = max(float(t.abs().max()) for t in ref.values())
    worst = max(float((got[n] - ref[n]).abs().max()) for n in ref)
    assert abs(loss - ref_loss) <= 100 * 1.2e-7 * abs(ref_loss)
    assert worst <= 100 * 1.2e-7 * scale, (worst, scale)
