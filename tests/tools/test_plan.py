"""The planner: its durable-state formulas equal what capture keeps; its verdicts and errors."""

import pytest
import torch

import longstraw
import longstraw.testing.models
from longstraw.kinds import state_bytes
from longstraw.tools.planner import PlanConfig, plan
from longstraw.model.capability import layer_plan

from ..conftest import ARCHS, make_model, tokens


@pytest.mark.parametrize("state_dtype", [None, "int8"], ids=["fp32", "int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_state_formulas_equal_the_captured_state(arch, state_dtype):
    """Per layer kind, from the config alone: exactly `PromptState.nbytes` (P − 1 = 130: two 64-token scale blocks
    and a tail); and the planner's durable state is the same number."""
    model = make_model(arch)
    cfg = model.config.get_text_config()
    with torch.no_grad():
        state = longstraw.capture(model, tokens(131, 1), chunk_size=50, state_dtype=state_dtype)
    q = None if state_dtype is None else torch.int8
    predicted = sum(state_bytes(k, cfg, i, 130, 4, q if getattr(layer, "supports_compression", False) else None)
                    for (i, k), layer in zip(enumerate(layer_plan(cfg)), state.layers))
    assert predicted == state.nbytes
    if state_dtype is None and arch not in ("gemma3", "qwen3_5"):
        assert plan(PlanConfig(cfg, 131, dtype="fp32")).durable_state == state.nbytes


def test_verdict_and_knobs():
    cfg = longstraw.testing.models.tiny_config("llama", num_hidden_layers=16, num_key_value_heads=8, head_dim=128,
                                       num_attention_heads=32, hidden_size=4096, intermediate_size=14336)
    big = plan(PlanConfig(cfg, 2_097_152, dtype="bf16", device_memory_gib=80))
    assert big.durable_state == 16 * 2 * 8 * 128 * 2 * 2_097_151
    assert big.fits is False and any("state_dtype='fp8'" in s for s in big.suggestions)
    # 8 ranks: the state fits, but each rank runs its whole 262,144-position slice through an attention layer at
    # capture (its feed-forward a chunk at a time)
    split = plan(PlanConfig(cfg, 2_097_152, dtype="bf16", context_parallel=8, state_dtype="fp8",
                            device_memory_gib=48))
    # an eighth of the positions at 1 byte a value (bf16's half) + a float32 scale per 64 positions × KV head
    # (4 B per 64 × 128 B: +0.05%)
    assert split.durable_state < big.durable_state / 8 / 1.9
    assert split.fits is False and split.capture_transient > 4 * split.durable_state
    assert any("context_parallel=16" in s and "chunk_size bounds only" in s for s in split.suggestions)
    assert not any(s.startswith("chunk_size=") for s in split.suggestions)
    wider = plan(PlanConfig(cfg, 2_097_152, dtype="bf16", context_parallel=16, state_dtype="fp8",
                            device_memory_gib=48))
    # twice the ranks halve the slice's terms; the chunk-bounded feed-forward and the attention tile stay (0.3% here)
    assert 0.45 * split.capture_transient < wider.capture_transient < 0.55 * split.capture_transient
    assert wider.fits is True and wider.suggestions == []
    assert "fits" in str(wider)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param(dict(prompt_length=0), "prompt_length", id="P0"),
        pytest.param(dict(prompt_length=8, dtype="fp64"), "dtype", id="dtype"),
        pytest.param(dict(prompt_length=8, state_dtype="fp8", prompt_grad="exact"), "quantized", id="exact-fp8"),
        pytest.param(dict(prompt_length=8, context_parallel=0), "context_parallel", id="cp0"),
    ],
)
def test_bad_plan_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanConfig("llama", **kwargs)


def test_plan_command(tmp_path, capsys):
    from longstraw.cli import main

    longstraw.testing.models.tiny_config("qwen3").save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--P", "65536", "--G", "8", "--device-memory-gib", "0.01"]) == 1
    out = capsys.readouterr().out
    assert "durable state" in out and "does NOT fit" in out
    assert main(["plan", str(tmp_path / "config.json"), "--P", "4096", "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["durable_state"] > 0
    assert main(["plan", str(tmp_path / "nothing"), "--P", "4096"]) == 2


def test_auto_chunk_size_is_the_largest_whose_capture_transient_fits():
    """No chunk_size given: `auto_chunk_size` takes the largest candidate whose one-chunk capture transient (as the
    plan estimates it) fits the budget, capped at the prompt; `capture` and `plan` use it."""
    from transformers import AutoConfig

    from longstraw.model.chunking import AUTO_CHUNK_BUDGET, AUTO_CHUNKS, auto_chunk_size
    from longstraw.model.capability import model_parts
    from longstraw.prompt_state import default_chunk_size

    small = AutoConfig.for_model("llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    big = AutoConfig.for_model("llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    assert auto_chunk_size(small, 100_000, "fp32") == 4096
    assert auto_chunk_size(small, 1000, "fp32") == 999  # the captured tokens, P − 1, in one chunk
    chunk = auto_chunk_size(big, 100_000, "bf16")
    assert chunk in AUTO_CHUNKS and chunk < 4096
    for c, want_fit in ((chunk, True), (chunk * 2, False)):
        p = plan(PlanConfig(big, 100_000, chunk_size=c, dtype="bf16", lora_rank=0))
        fits = p.capture_transient <= AUTO_CHUNK_BUDGET
        assert fits == want_fit, (c, p.capture_transient)
    assert plan(PlanConfig(big, 100_000, dtype="bf16")).config["chunk_size"] == chunk
    model = make_model("llama")
    assert default_chunk_size(model_parts(model), 300) == 299
    prompt = tokens(300, 1)
    with torch.no_grad():
        a = longstraw.capture(model, prompt).replay(tokens(5, 2)).logprobs
        b = longstraw.capture(model, prompt, chunk_size=299).replay(tokens(5, 2)).logprobs
    assert torch.equal(a, b)


def test_every_layer_kind_has_a_byte_formula():
    """The planner predicts each layer kind's durable state from the config alone (`LayerState.durable_bytes`, beside
    the kind's state): a kind registered without one is found, and a layer type no kind serves is a KeyError."""
    from longstraw.kinds import LayerState, layer_kind, registered_layer_types

    without = [t for t in registered_layer_types() if layer_kind(t).durable_bytes.__func__ is LayerState.durable_bytes.__func__]
    assert not without, without
    with pytest.raises(KeyError, match="no durable-state formula for layer kind 'unknown'"):
        state_bytes("unknown", None, 0, 1, 4)


def test_row_suffix_adds_one_branch_of_own_state():
    """Rows sharing a document (`row_suffix`): the durable state is the shared prefix's alone, and the sampler and the
    detached replay each hold one row's suffix more, exactly the bytes of a branch extended by it
    (`Branch.nbytes`, measured); exact mode replays the suffix with each response instead."""
    model = make_model("llama")
    cfg = model.config.get_text_config()
    with torch.no_grad():
        state = longstraw.capture(model, tokens(65, 1), chunk_size=32)
        with state.fork() as branch:
            branch.extend(tokens(20, 2))
            own = branch.nbytes
    base = plan(PlanConfig(cfg, 65, dtype="fp32"))
    shared = plan(PlanConfig(cfg, 65, dtype="fp32", row_suffix=20))
    assert shared.durable_state == base.durable_state == state.nbytes
    assert own > 0
    assert shared.sampler - base.sampler == own
    assert shared.replay_graph - base.replay_graph == own
    exact = plan(PlanConfig(cfg, 65, dtype="fp32", prompt_grad="exact", row_suffix=20))
    longer = plan(PlanConfig(cfg, 65, dtype="fp32", prompt_grad="exact", completion_length=256 + 20))
    assert exact.replay_graph == longer.replay_graph - 4 * 20 * min(cfg.vocab_size, 32768)


def test_the_backend_choice_picks_the_measured_winner():
    """`plan`'s rollout backend at the points `bench/rollout_backends.py` measured: the one whose sampling took less
    (the own sampler's `sample_s` against vLLM's `rollout_s`; the trainer captures for its replay either way) — the
    fitted rule read against the data it came from, kept in the repository; and the memory rule: a device too small
    for vLLM's copy of the prompt's K/V keeps the own sampler whatever R is."""
    import json
    from pathlib import Path

    from longstraw.tools.backend_choice import choose_backend

    rows = json.loads((Path(__file__).parents[2] / "bench/results/rollout_backends.json").read_text())["rows"]
    own = {(r["P"], r["R"]): r["sample_s"] for r in rows if r["backend"] == "own"}
    vllm = {(r["P"], r["R"]): r["rollout_s"] for r in rows if r["backend"] == "vllm"}
    assert len(own) == len(vllm) == 4
    for (p, r), t_own in own.items():
        winner = "own" if t_own < vllm[p, r] else "vllm"
        assert choose_backend(p, r, 2**30).backend == winner, (p, r, t_own, vllm[p, r])
    assert {("own" if own[k] < vllm[k] else "vllm") for k in own} == {"own", "vllm"}  # both sides occur
    small = choose_backend(2048, 4096, vllm_bytes=100 * 2**30, device_bytes=80 * 2**30)
    assert small.backend == "own" and "100.0 GiB" in small.reason
    plan_out = plan(PlanConfig("llama", 2048, num_generations=8, completion_length=256))
    assert plan_out.rollout_backend == "vllm" and "R*" in str(plan_out)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_expert_parallel_divides_the_routed_experts(lora_rank):
    """`expert_parallel`: the per-rank weights (and, fully fine-tuned, their optimizer state; with LoRA, the experts'
    adapters' moments) lose (EP − 1) / EP of the routed experts' own, counted on the model (its experts modules'
    3-D weights, and PEFT's adapters of them), not on the formula; nothing else changes but the dispatch buffers."""
    from peft import LoraConfig, get_peft_model

    from longstraw.distributed.expert_parallel import experts_modules

    model = longstraw.testing.models.tiny_model("mixtral")
    routed = sum(p.numel() for m in experts_modules(model) for p in m.parameters(recurse=False))
    adapters = 0
    if lora_rank:
        peft = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules="all-linear"))
        adapters = sum(p.numel() for n, p in peft.named_parameters() if p.requires_grad and ".experts." in n)
    one = plan(PlanConfig("mixtral", 256, dtype="fp32", lora_rank=lora_rank))
    for ep in (2, 4):
        spread = plan(PlanConfig("mixtral", 256, dtype="fp32", lora_rank=lora_rank, expert_parallel=ep))
        assert one.weights - spread.weights == routed * 4 * (ep - 1) // ep
        moments = adapters * 4 * 4 if lora_rank else routed * (4 + 8)
        assert one.optimizer - spread.optimizer == moments * (ep - 1) // ep
        assert spread.durable_state == one.durable_state and spread.sampler == one.sampler


def test_replay_batch_holds_k_graphs_whatever_the_prompt():
    """`replay_batch: k` holds k replay graphs, each what `replay_graph_bytes` gives for one response (its own K/V
    and activations), the LM head's float32 chunk once; none of it grows with the prompt."""
    from longstraw.model.chunking import ELEMENT_BYTES, dimensions, replay_graph_bytes
    from longstraw.tools.planner import load_config

    cfg = load_config("llama")
    one = replay_graph_bytes(cfg, layer_plan(cfg), ELEMENT_BYTES["bf16"], 256, 256)
    head = 4 * 256 * min(dimensions(cfg)["vocab"], 32768)
    for p in (4096, 65536):
        graphs = [plan(PlanConfig("llama", p, completion_length=256, replay_batch=k)).replay_graph for k in (1, 4)]
        assert graphs == [one, 4 * (one - head) + head]
    assert plan(PlanConfig("llama", 4096, num_generations=2, replay_batch=8)).replay_graph == 2 * (one - head) + head
