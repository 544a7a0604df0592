"""Trajectories that grow after the prompt: a `Branch` forked from the prompt state (extend by tool output, sample
the next turn) and segmented replay (one segment at a time, the whole trajectory's gradient), held to the unmodified
model: its full-sequence log-probs and gradients, and its own cache filled under `no_grad` over the prompt with the
whole trajectory after it differentiated (`longstraw.model.oracles.cache_reference_logprobs`, the detached
objective). One model per layer kind."""

import pytest
import torch

import longstraw
from longstraw.model.oracles import cache_reference_logprobs, full_sequence_logprobs, segmented_reference_logprobs
from longstraw.replay.segments import replay_segments, segments
from longstraw.testing.memory import LiveBytes
from longstraw.testing.models import tiny_model

from ..conftest import make_model, tie_free_tokens, tokens
from ..test_equivalence import FP32_GRAD_TOL

#: one tiny model per layer kind: full attention, sliding window, chunked attention, attention sinks, gated DeltaNet,
#: KDA, short convolution, Mamba-2 with mixer-less layers, Jamba's Mamba, Zamba2's shared attention, MLA, DSA,
#: DeepSeek-V4's compressed attention
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
    "glm_moe_dsa",
    "deepseek_v4",
]

#: three policy turns around two tool outputs, the last one longer than the capture chunk
MASK = torch.tensor([1] * 3 + [0] * 5 + [1] * 4 + [0] * 7 + [1] * 2, dtype=torch.float32)


def _grad_errors(params, got, ref):
    idx = [i for i, g in enumerate(ref) if g is not None]
    assert len(idx) >= len(params) // 2 and all(got[i] is not None for i in idx)
    err = [(got[i] - ref[i]).norm().item() for i in idx]
    norm = [ref[i].norm().item() for i in idx]
    return err, norm


@pytest.mark.parametrize("arch", KINDS)
def test_segmented_replay_equals_the_detached_reference_of_the_whole_trajectory(arch):
    """Log-probs of the policy tokens equal the full-sequence forward's (float32: 4 × eps32 of log-probs of O(1-10));
    the accumulated gradient of Σ w·mask·log-probs equals the detached reference's within `FP32_GRAD_TOL` (the
    model's cache filled under `no_grad` over the prompt, the whole trajectory after it with grad: through the earlier
    turns and the tool output; as `test_equivalence` holds replay to it); environment tokens get log-prob 0."""
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

    out = replay_segments(state, response, MASK, loss)
    policy = [slice(s.start, s.end) for s in segments(MASK) if s.policy]
    assert sorted(seen, key=lambda sl: sl.start) == policy  # each policy segment's loss taken once
    with torch.no_grad():
        full = full_sequence_logprobs(model, prompt, response)
    on = MASK > 0
    assert (out.logprobs - full)[on].abs().max().item() <= 4 * 2**-23 * max(full.abs().max().item(), 1.0) * 4
    assert bool((out.logprobs[~on] == 0).all())
    err, norm = _grad_errors(params, [p.grad for p in params], g_ref)
    scale = max(norm)
    assert all(e <= FP32_GRAD_TOL * max(n, 1e-3 * scale) for e, n in zip(err, norm)), max(
        e / max(n, 1e-3 * scale) for e, n in zip(err, norm)
    )


def test_segmented_replay_equals_whole_replay_and_not_the_per_turn_gradient():
    """Segmented = whole replay of the trajectory (`PromptState.replay`), the same detached objective, within
    `FP32_GRAD_TOL`; and the per-turn truncated gradient (each turn with the earlier turns as constants,
    `segmented_reference_logprobs`) is far from it, so the test above tells the two apart."""
    model = make_model("llama", False)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 19, MASK.numel(), seed=3)
    w = torch.linspace(-1.0, 1.5, MASK.numel()) * MASK
    state = longstraw.capture(model, prompt, chunk_size=5)
    whole = torch.autograd.grad((w * state.replay(response).logprobs).sum(), params)
    for p in params:
        p.grad = None
    replay_segments(state, response, MASK, lambda sl, out: (w[sl] * out.logprobs).sum())

    def rel(got):
        return (sum((a - g).pow(2).sum() for a, g in zip(got, whole)) / sum(g.pow(2).sum() for g in whole)).sqrt()

    assert rel([p.grad for p in params]) <= FP32_GRAD_TOL
    turns = segmented_reference_logprobs(model, prompt, response, MASK)
    per_turn = torch.autograd.grad(sum((w[sl] * lp).sum() for sl, lp in turns), params)
    assert rel(per_turn) > 100 * FP32_GRAD_TOL


def _replay_peak(model, state, turns: int, turn: int = 2, tool: int = 48) -> tuple[int, int]:
    """The peak bytes of tensors the segmented replay of a `turns`-turn trajectory holds, and its length."""
    mask = torch.tensor(([1.0] * turn + [0.0] * tool) * (turns - 1) + [1.0] * turn)
    response = tokens(mask.numel(), seed=2)
    for p in model.parameters():
        p.grad = None
    with LiveBytes() as live:
        replay_segments(state, response, mask, lambda sl, out: out.logprobs.sum())
    return live.peak, mask.numel()


def test_segmented_replay_back_propagates_every_segment_once():
    """Work: one backward per segment up to the last policy turn (counted where every backward ends, the input
    embedding's gradient accumulation), the earlier policy turns' losses taken in the reverse pass with the gradient
    later turns sent to them; the count is the mask's (seen failing with the policy turns back-propagated on the first
    pass as well: 7 for 5)."""
    model = make_model("llama", False)
    prompt, response = tie_free_tokens(model, 19, MASK.numel(), seed=3)
    state = longstraw.capture(model, prompt, chunk_size=5, block_size=4)
    backwards = []
    embedding = model.get_input_embeddings().weight
    handle = embedding.register_post_accumulate_grad_hook(lambda p: backwards.append(1))
    try:
        replay_segments(state, response, MASK, lambda sl, out: out.logprobs.sum())
    finally:
        handle.remove()
    last_policy = max(i for i, seg in enumerate(segments(MASK)) if seg.policy)
    assert len(backwards) == last_policy + 1


def test_segmented_replay_memory_grows_by_the_own_kv_and_its_gradient():
    """Memory at the floor: from 2 to 16 turns (2 policy tokens and 48 tool tokens a turn) the peak of the tensor
    memory the replay holds (`LiveBytes`: bytes of live tensors, exact, not RSS) grows by at most
    (2 + 1.5 / L) × what the trajectory's own K/V grows by, that computed from the config (L layers × K and V × Hkv ×
    D × 4 bytes a token): the own K/V and the gradient the whole trajectory's objective accumulates on them, one
    layer's gradient of what a segment read (the kernel's dK and dV, one of them copied into the read's strides), and
    32 bytes a token for the per-token results (log-prob, entropy, input id, mask). A replay that holds more than one
    segment's graph grows with the trajectory's activations and fails it (seen: replayed whole, 25×)."""
    layers = 4
    model = tiny_model("llama", num_hidden_layers=layers)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    own_per_token = layers * 2 * cfg.num_key_value_heads * head_dim * 4
    state = longstraw.capture(model, tokens(19, seed=1), chunk_size=8)
    peak2, length2 = _replay_peak(model, state, 2)
    peak16, length16 = _replay_peak(model, state, 16)
    grown = (length16 - length2) * own_per_token
    bound = (2 + 1.5 / layers) * grown + 32 * (length16 - length2)
    assert peak16 - peak2 <= bound, (peak16 - peak2) / grown


@pytest.mark.parametrize("arch", KINDS)
def test_branch_grows_by_tool_output_and_samples_the_next_turn(arch):
    """A branch extended by tool output and sampled greedily: each sampled token's log-prob is the full-sequence
    forward's over [prompt + everything the branch holds] (float32 rounding as above), the chosen token is that
    forward's argmax up to the same rounding, and the prompt state is left as it was (its replay unchanged, bit for
    bit)."""
    model = make_model(arch, False)
    prompt, tool = tie_free_tokens(model, 19, 11, seed=5)
    state = longstraw.capture(model, prompt, chunk_size=5, block_size=4)
    with torch.no_grad():
        before = state.replay(tool[:4]).logprobs
        branch = state.fork(chunk_size=4)
        first = branch.sample(3, temperature=0)
        branch.extend(tool)  # 11 tokens in forwards of 4
        second = branch.sample(4, temperature=0)
        assert branch.length == prompt.numel() + first.tokens[0].numel() + tool.numel() + second.tokens[0].numel()
        trajectory = torch.cat([first.tokens[0], tool, second.tokens[0]])
        logits = model(input_ids=torch.cat([prompt, trajectory])[None]).logits[0, prompt.numel() - 1 : -1].float()
        lp = torch.log_softmax(logits, -1)
        chosen = torch.cat([torch.arange(3), torch.arange(3 + 11, trajectory.numel())])
        got = torch.cat([first.logprobs[0], second.logprobs[0]])
        want = lp[chosen].gather(-1, trajectory[chosen, None])[:, 0]
        tol = 16 * 2**-23 * max(want.abs().max().item(), 1.0)
        assert (got - want).abs().max().item() <= tol
        assert bool((lp[chosen].max(-1).values - want <= tol).all())
        assert torch.equal(state.replay(tool[:4]).logprobs, before)
        assert branch.nbytes > 0
    branch.release()
    with pytest.raises(RuntimeError, match="released"):
        branch.extend(tool)


def test_branch_refuses_bad_input_and_the_position_limit():
    model = make_model("llama", False)
    limit = model.config.max_position_embeddings = 40  # a short model: the limit is reached in a few tokens
    prompt, _ = tie_free_tokens(model, 10, 1, seed=1)
    state = longstraw.capture(model, prompt)
    branch = state.fork()
    with pytest.raises(ValueError, match="outside"):
        branch.extend([model.config.vocab_size])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        branch.extend(torch.zeros(limit, dtype=torch.long))
    branch.extend(torch.zeros(limit - branch.length - 2, dtype=torch.long))
    out = branch.sample(50, temperature=0)  # cut to the positions left
    assert out.tokens[0].numel() == 2 and branch.length == limit
    with pytest.raises(ValueError, match="nothing more can be sampled"):
        branch.sample(1)


#: the layer kinds exact segmented replay serves: full attention, sliding window, chunked attention, sinks, gated
#: DeltaNet + attention, KDA + MLA, short convolution, Mamba-2 with mixer-less layers, Jamba, Zamba2, Falcon-H1 (hybrid
#: layers), MLA, MLA + DSA
EXACT_KINDS = [
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
    "falcon_h1",
    "deepseek_v3",
    "glm_moe_dsa",
]


@pytest.mark.parametrize("arch", EXACT_KINDS)
@pytest.mark.parametrize("mask", [MASK, torch.tensor([0.0] * 6 + [1.0] * 3)], ids=["turns", "tool-first"])
def test_exact_segmented_replay_equals_naive_full_sequence(arch, mask):
    """prompt_grad='exact': the gradient of Σ w·mask·log-probs, through the prompt, the tool output and the earlier
    turns, equals one full-sequence forward + backward of the unmodified model within `FP32_GRAD_TOL` per parameter
    (the tolerance `test_exact` holds the prompt's exact gradient to)."""
    model = make_model(arch, False)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 19, mask.numel(), seed=3)
    w = torch.linspace(-1.0, 1.5, mask.numel()) * mask
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        full = full_sequence_logprobs(model, prompt, response)
        ref = torch.autograd.grad((w * full).sum(), params, allow_unused=True)
    state = longstraw.capture(model, prompt, chunk_size=5, block_size=4, prompt_grad="exact")
    for p in params:
        p.grad = None
    out = replay_segments(state, response, mask, lambda sl, r: (w[sl] * r.logprobs).sum())
    state.backward()
    on = mask > 0
    assert (out.logprobs - full.detach())[on].abs().max().item() <= 16 * 2**-23 * max(full.abs().max().item(), 1.0)
    err, norm = _grad_errors(params, [p.grad for p in params], ref)
    scale = max(norm)
    assert all(e <= FP32_GRAD_TOL * max(n, 1e-3 * scale) for e, n in zip(err, norm)), max(
        e / max(n, 1e-3 * scale) for e, n in zip(err, norm)
    )


@pytest.mark.parametrize("prompt_grad", ["detached", "exact"])
def test_segmented_replay_of_a_kind_the_carry_does_not_serve_replays_whole(prompt_grad):
    """DeepSeek-V4's compressed attention: replayed whole, the same gradient as `PromptState.replay` of the
    trajectory (bit for bit: the same arithmetic)."""
    model = make_model("deepseek_v4", False)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 12, MASK.numel(), seed=2)
    w = torch.linspace(-1.0, 1.5, MASK.numel()) * MASK
    grads = []
    for segmented in (False, True):
        state = longstraw.capture(model, prompt, prompt_grad=prompt_grad)
        for p in params:
            p.grad = None
        if segmented:
            replay_segments(state, response, MASK, lambda sl, out: (w[sl] * out.logprobs).sum())
        else:
            (w * state.replay(response).logprobs).sum().backward()
        state.backward()
        grads.append([p.grad.clone() for p in params if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_reference_is_the_cache_reference_per_turn():
    """The reference helper itself: each policy segment's log-probs are `cache_reference_logprobs` over the prompt
    and the trajectory before it."""
    model = make_model("llama", False)
    prompt, response = tie_free_tokens(model, 12, MASK.numel(), seed=2)
    with torch.no_grad():
        ref = segmented_reference_logprobs(model, prompt, response, MASK)
        sl, lp = ref[1]
        assert sl == slice(8, 12)
        want = cache_reference_logprobs(model, torch.cat([prompt, response[:8]]), response[8:12])
        assert torch.equal(lp, want)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next", "deepseek_v3", "glm_moe_dsa"])
def test_segmented_replay_after_a_branch_reads_its_tokens_as_constants(arch):
    """A row's question read into a `Branch` of a shared document's state (sliding layers trimmed to their window),
    then its trajectory replayed in segments from the branch: the detached reference over [document + question]
    (`FP32_GRAD_TOL`), the question a constant as the document is."""
    model = make_model(arch, False)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tie_free_tokens(model, 19 + 9, MASK.numel(), seed=4)
    document, question = prompt[:19], prompt[19:]
    w = torch.linspace(-1.0, 1.5, MASK.numel()) * MASK
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        ref = cache_reference_logprobs(model, prompt, response)
        g_ref = torch.autograd.grad((w * ref).sum(), params, allow_unused=True)
    state = longstraw.capture(model, document, chunk_size=5, block_size=4)
    for p in params:
        p.grad = None
    with state.fork() as branch:
        with torch.no_grad():
            branch.extend(question)
        out = replay_segments(branch, response, MASK, lambda sl, r: (w[sl] * r.logprobs).sum())
    on = MASK > 0
    assert (out.logprobs - ref.detach())[on].abs().max().item() <= 16 * 2**-23 * max(ref.abs().max().item(), 1.0)
    err, norm = _grad_errors(params, [p.grad for p in params], g_ref)
    scale = max(norm)
    assert all(e <= FP32_GRAD_TOL * max(n, 1e-3 * scale) for e, n in zip(err, norm)), max(
        e / max(n, 1e-3 * scale) for e, n in zip(err, norm)
    )


@pytest.mark.parametrize("prompt_grad", ["detached", "exact"])
def test_segmented_replay_after_prefix_ids(prompt_grad):
    """`prefix_ids` (a row's own question after a shared document): detached, a constant as the prompt is (the
    reference's cache filled under `no_grad` over prompt + prefix); exact, in the gradient (the full-sequence
    forward). Seen failing when the detached prefix was replayed as an environment segment (in the gradient: 8 %
    off)."""
    model = make_model("llama", True)
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, rest = tie_free_tokens(model, 15, 4 + MASK.numel(), seed=5)
    prefix, response = rest[:4], rest[4:]
    w = torch.linspace(-1.0, 1.5, MASK.numel()) * MASK
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        if prompt_grad == "detached":
            ref = cache_reference_logprobs(model, torch.cat([prompt, prefix]), response)
        else:
            ref = full_sequence_logprobs(model, prompt, rest)[4:]
        g_ref = torch.autograd.grad((w * ref).sum(), params, allow_unused=True)
    state = longstraw.capture(model, prompt, chunk_size=5, block_size=4, prompt_grad=prompt_grad)
    for p in params:
        p.grad = None
    out = replay_segments(state, response, MASK, lambda sl, r: (w[sl] * r.logprobs).sum(), prefix_ids=prefix)
    state.backward()
    on = MASK > 0
    assert (out.logprobs - ref.detach())[on].abs().max().item() <= 16 * 2**-23 * max(ref.abs().max().item(), 1.0)
    err, norm = _grad_errors(params, [p.grad for p in params], g_ref)
    scale = max(norm)
    assert all(e <= FP32_GRAD_TOL * max(n, 1e-3 * scale) for e, n in zip(err, norm)), max(
        e / max(n, 1e-3 * scale) for e, n in zip(err, norm)
    )
