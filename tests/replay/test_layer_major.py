"""Layer-major replay (`longstraw.replay.layer_major`): a trajectory's gradient one decoder layer at a time, held to the
unmodified model (its full-sequence log-probs and gradients, and its own cache filled under `no_grad` over the
prompt with the whole trajectory after it differentiated: `longstraw.model.oracles.cache_reference_logprobs`, the
detached objective), one model per layer kind; its memory held to a bound computed from the config."""

import pytest
import torch

import longstraw
from longstraw.model.oracles import cache_reference_logprobs, full_sequence_logprobs
from longstraw.replay.layer_major import LayerMajor
from longstraw.replay.segments import replay_segments, segments
from longstraw.testing.memory import LiveBytes
from longstraw.testing.models import tiny_model

from ..conftest import make_model, tie_free_tokens, tokens
from ..test_equivalence import FP32_GRAD_TOL
from .test_segments import EXACT_KINDS, MASK, _grad_errors

#: every layer kind the carry serves (DeepSeek-V4's compressed attention replays whole whatever the order, and GLM's
#: DSA decoder hands its indexer's top-k from layer to layer: refused below)
KINDS = [
    "llama",
    "gemma3_text",
    "llama4_text",
    "gpt_oss",
    "qwen3_next",
    "kimi_linear",
    "lfm2",
    "nemotron_h",
    "jamba",
    "zamba2",
    "deepseek_v3",
]


def _worst(params, ref) -> float:
    err, norm = _grad_errors(params, [p.grad for p in params], ref)
    scale = max(norm)
    return max(e / max(n, 1e-3 * scale) for e, n in zip(err, norm))


@pytest.mark.parametrize("arch", KINDS)
def test_layer_major_replay_equals_the_detached_reference_of_the_whole_trajectory(arch):
    """Log-probs of the policy tokens equal the full-sequence forward's (float32: 4 × eps32 × 4 of log-probs of
    O(1-10)); the gradient of Σ w·mask·log-probs equals the detached reference's within `FP32_GRAD_TOL` per parameter
    (as segmented replay is held to it), 4 positions per layer call (several chunks per layer), 1 of every 2 layers'
    inputs kept (the others recomputed); each policy segment's loss taken once, in order."""
    model = make_model(arch, False)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 19, MASK.numel(), seed=3)
    w = torch.linspace(-1.0, 1.5, MASK.numel()) * MASK
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        ref = cache_reference_logprobs(model, prompt, response)
        g_ref = torch.autograd.grad((w * ref).sum(), params, allow_unused=True)
    state = longstraw.capture(model, prompt, chunk_size=5, block_size=4)
    for p in params:
        p.grad = None
    seen = []

    def loss(sl, out):
        seen.append(sl)
        return (w[sl] * out.logprobs).sum()

    out = replay_segments(state, response, MASK, loss, layer_major=LayerMajor(1, 2, chunk=4))
    assert seen == [slice(s.start, s.end) for s in segments(MASK) if s.policy]
    with torch.no_grad():
        full = full_sequence_logprobs(model, prompt, response)
    on = MASK > 0
    assert (out.logprobs - full)[on].abs().max().item() <= 4 * 2**-23 * max(full.abs().max().item(), 1.0) * 4
    assert bool((out.logprobs[~on] == 0).all())
    assert _worst(params, g_ref) <= FP32_GRAD_TOL


@pytest.mark.parametrize("keep", [(1, 1), (2, 3), (1, 3), (1, 4)])
def test_every_store_gives_the_same_gradient(keep):
    """A 6-layer model, each way of keeping layer inputs (all; 2 of 3; 1 of 3; 1 of 4: recomputed from layer 0's, the
    embeddings) and 3 positions per layer call: the detached reference's gradient within `FP32_GRAD_TOL`."""
    model = tiny_model("llama", num_hidden_layers=6)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 11, MASK.numel(), seed=5)
    w = torch.linspace(-1.0, 1.5, MASK.numel()) * MASK
    ref = cache_reference_logprobs(model, prompt, response)
    g_ref = torch.autograd.grad((w * ref).sum(), params)
    state = longstraw.capture(model, prompt, chunk_size=5)
    replay_segments(state, response, MASK, lambda sl, o: (w[sl] * o.logprobs).sum(), layer_major=LayerMajor(*keep, 3))
    assert _worst(params, g_ref) <= FP32_GRAD_TOL


@pytest.mark.parametrize("arch", [a for a in EXACT_KINDS if a in KINDS + ["falcon_h1"]])
def test_exact_layer_major_replay_equals_naive_full_sequence(arch):
    """prompt_grad='exact': the gradient through the prompt (its share on the state's leaves, pushed on by
    `PromptState.backward()`), the tool output and the earlier turns equals one full-sequence forward + backward of
    the unmodified model within `FP32_GRAD_TOL` per parameter."""
    model = make_model(arch, False)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 19, MASK.numel(), seed=3)
    w = torch.linspace(-1.0, 1.5, MASK.numel()) * MASK
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        full = full_sequence_logprobs(model, prompt, response)
        ref = torch.autograd.grad((w * full).sum(), params, allow_unused=True)
    state = longstraw.capture(model, prompt, chunk_size=5, block_size=4, prompt_grad="exact")
    for p in params:
        p.grad = None
    out = replay_segments(state, response, MASK, lambda sl, r: (w[sl] * r.logprobs).sum(), layer_major=LayerMajor())
    state.backward()
    on = MASK > 0
    assert (out.logprobs - full.detach())[on].abs().max().item() <= 16 * 2**-23 * max(full.abs().max().item(), 1.0)
    assert _worst(params, ref) <= FP32_GRAD_TOL


@pytest.mark.parametrize("prompt_grad", ["detached", "exact"])
def test_layer_major_replay_after_a_branch_and_prefix_ids(prompt_grad):
    """After a branch's own tokens (a row's question after a shared document), and with `prefix_ids`: the same
    gradient as segmented replay of the same call (itself held to the references in `test_segments`), within
    `FP32_GRAD_TOL`."""
    model = make_model("gemma3_text", False)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 19, MASK.numel(), seed=3)
    question = tokens(6, seed=9)
    w = torch.linspace(-1.0, 1.5, MASK.numel()) * MASK
    grads = []
    for order in (None, LayerMajor(1, 2, chunk=4)):
        for p in params:
            p.grad = None
        state = longstraw.capture(model, prompt, chunk_size=5, prompt_grad=prompt_grad)
        if prompt_grad == "detached":
            with state.fork() as branch, torch.no_grad():
                branch.extend(question)
                with torch.enable_grad():
                    replay_segments(branch, response, MASK, lambda sl, o: (w[sl] * o.logprobs).sum(), layer_major=order)
        else:
            replay_segments(
                state, response, MASK, lambda sl, o: (w[sl] * o.logprobs).sum(), prefix_ids=question, layer_major=order
            )
        state.backward()
        grads.append([p.grad.clone() for p in params])
    err = sum((a - b).pow(2).sum() for a, b in zip(*grads)).sqrt() / sum(b.pow(2).sum() for b in grads[0]).sqrt()
    assert err <= FP32_GRAD_TOL


def _peak(model, state, turns: int, order: LayerMajor, turn: int = 2, tool: int = 48) -> tuple[int, int]:
    mask = torch.tensor(([1.0] * turn + [0.0] * tool) * (turns - 1) + [1.0] * turn)
    response = tokens(mask.numel(), seed=2)
    for p in model.parameters():
        p.grad = None
    with LiveBytes() as live:
        replay_segments(state, response, mask, lambda sl, out: out.logprobs.sum(), layer_major=order)
    return live.peak, mask.numel()


def test_layer_major_memory_grows_below_the_own_kv():
    """Memory at the floor (issue 36's point 2): on a 16-layer model whose hidden size equals one layer's K/V (64
    floats a position each), from 2 to 16 turns (2 policy tokens and 48 tool tokens a turn, 32 positions per layer
    call) the peak of the tensor memory the replay holds (`LiveBytes`: bytes of live tensors, exact) grows by at most
    1.25 × what the trajectory's own K/V grows by (16 layers × K and V × Hkv × D × 4 bytes a token, from the config).
    By the design it holds per position at most the 7 kept layer inputs, the current layer's input and its output's
    gradient, one layer's K/V, their gradient and the attention kernel's gradient of one chunk's reads (≤ 4 × one
    layer's K/V): 13 × 64 floats against the own K/V's 16 × 64 (0.82 ×). Holding every layer's carried K/V and their
    gradient, as segmented replay does, fails it (seen: 2.2 ×)."""
    layers = 16
    model = tiny_model("llama", num_hidden_layers=layers)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_layer = 2 * cfg.num_key_value_heads * head_dim
    assert kv_layer == cfg.hidden_size == 64
    own_per_token = layers * kv_layer * 4
    state = longstraw.capture(model, tokens(19, seed=1), chunk_size=8)
    order = LayerMajor(1, 2, chunk=32)
    peak2, length2 = _peak(model, state, 2, order)
    peak16, length16 = _peak(model, state, 16, order)
    grown = (length16 - length2) * own_per_token
    assert peak16 - peak2 <= 1.25 * grown, (peak16 - peak2) / grown


def test_layer_major_refuses_what_it_does_not_run():
    """Clear errors: a store outside 1 ≤ keep ≤ every, a malformed "k/n", a non-positive chunk; FSDP2's hook before
    the last backward (one process); a decoder that hands more than hidden states from layer to layer (GLM's DSA
    indexer's top-k), named, before anything runs."""
    with pytest.raises(ValueError, match="keep <= every"):
        LayerMajor(3, 2)
    with pytest.raises(ValueError, match="keep/every"):
        LayerMajor.parse("half")
    with pytest.raises(ValueError, match="chunk"):
        LayerMajor(1, 2, chunk=0)
    assert LayerMajor.parse("2/3") == LayerMajor(2, 3)
    model = make_model("llama", False)
    state = longstraw.capture(model, tokens(9, seed=1))
    with pytest.raises(NotImplementedError, match="one process without FSDP2"):
        replay_segments(
            state,
            tokens(4, seed=2),
            torch.ones(4),
            lambda sl, o: o.logprobs.sum(),
            before_last_backward=lambda: None,
            layer_major=LayerMajor(),
        )
    model = make_model("glm_moe_dsa", False)
    state = longstraw.capture(model, tokens(9, seed=1))
    with pytest.raises(NotImplementedError, match="GlmMoeDsaModel cannot be run one layer at a time"):
        replay_segments(
            state, tokens(4, seed=2), torch.ones(4), lambda sl, o: o.logprobs.sum(), layer_major=LayerMajor()
        )
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])  # (gemma3: 9 s)
def test_layer_major_replay_of_a_real_model_equals_its_own_cache_in_float64(name, request):
    """The real models (SmolLM2-135M-Instruct: 30 layers; Gemma 3 270M: 18 layers, sliding and global layers with
    their own rotary embeddings, which the decoder hands each layer), LoRA on q/k/v/o, a 64-token prompt and a
    three-turn trajectory: layer-major replay (2 of 3 layer inputs kept, 16 positions per layer call) gives the
    detached reference's LoRA gradient (the model's own cache over the prompt, the whole trajectory differentiated)
    computed in float64, within `FP32_GRAD_TOL` per parameter (the float64 reference keeps the reference's own float32
    rounding out of the comparison, as `test_smollm2_exact_gradients_equal_naive_grpo_at_2048` does). Seen failing
    with the gradient later chunks send to a layer's own K/V dropped (0.55 relative on SmolLM2)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ..conftest import assert_grads_close

    path = request.getfixturevalue(f"real_{name}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(
        model,
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
        ),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    mask = torch.tensor([1.0] * 6 + [0.0] * 14 + [1.0] * 8 + [0.0] * 12 + [1.0] * 5)
    ids = tokens(64 + mask.numel(), seed=4, vocab=model.config.vocab_size)
    prompt, response = ids[:64], ids[64:]
    w = torch.linspace(-1.0, 1.5, mask.numel()) * mask
    state = longstraw.capture(model, prompt, chunk_size=32)
    replay_segments(
        state, response, mask, lambda sl, o: (w[sl] * o.logprobs).sum(), layer_major=LayerMajor(2, 3, chunk=16)
    )
    got = [p.grad.clone() for p in params]
    model.double()
    for p in params:
        p.grad = None
    (w.double() * cache_reference_logprobs(model, prompt, response)).sum().backward()
    want = [p.grad.float() for p in params]
    assert_grads_close(got, want, tol=FP32_GRAD_TOL)
