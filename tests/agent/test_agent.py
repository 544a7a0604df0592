"""Multi-turn agent rollouts through an environment (`longstraw.agent`): trajectories grown on their own branches by
tool replies, scored by the environment, replayed turn by turn. The tiny word-level model calls a tool by writing a
key (`k3`) and answers by writing a value (`v5`); `parse_keys` reads its turns."""

import pytest
import torch

from longstraw.agent import AgentSettings, EnvironmentRollout, ToolCall, parse_tool_calls, tool_message_ids
from longstraw.agent.environment import call_tool, environment_tools
from longstraw.model.oracles import cache_reference_logprobs, full_sequence_logprobs
from longstraw.replay.layer_major import LayerMajor
from longstraw.replay.segments import segments
from longstraw.train.config import TrainConfig
from longstraw.train.rollout import TurnSampler
from longstraw.train.trainer import Trainer
from longstraw.train.update import loss_mask

from ..test_equivalence import FP32_GRAD_TOL

FILLER = " ".join(f"f{i % 32}" for i in range(40))


def length_reward(prompts, completions, completion_ids, **kw):
    """Differs between trajectories, so that advantages (and gradients) are not zero."""
    return [float(len(ids) % 7) for ids in completion_ids]


def parse_keys(text: str) -> list[ToolCall]:
    """A turn naming a key calls `lookup` on it (the first key); a turn without one is the answer."""
    keys = [w for w in text.split() if w.startswith("k")]
    return [ToolCall("lookup", {"key": keys[0]})] if keys else []


class LookupEnv:
    """`lookup(key)` replies with the key's value buried in 40 filler words; the reward is 1 when the final answer
    holds the value of k1."""

    mode = "ok"

    def reset(self, **columns):
        self.answer = None
        self.looked = []

    def lookup(self, key: str) -> str:
        self.looked.append(key)
        if self.mode == "raise":
            raise KeyError(key)
        if self.mode == "none":
            return None
        return f"{FILLER} {key} = v{int(key[1:]) % 8} {FILLER}"

    def get_reward(self) -> float:
        return float(len(self.looked))


class RaisingEnv(LookupEnv):
    mode = "raise"


class EmptyEnv(LookupEnv):
    mode = "none"


def _trainer(tmp_path, env="tests.agent.test_agent:LookupEnv", **kw):
    cfg = dict(model="llama", output_dir=str(tmp_path / "run"), prompt_length=12, num_steps=1, num_generations=3,
               max_completion_length=160, max_turns=4, max_turn_tokens=3, max_tool_tokens=64, lora=False,
               progress=False, threads=1, environment=env, tool_parser="tests.agent.test_agent:parse_keys",
               reward_funcs=["environment_reward"], task_options={"num_pairs": 4, "num_values": 8}, seed=3)
    cfg.update(kw)
    return Trainer(TrainConfig(**cfg))


def test_rollout_grows_each_trajectory_by_tool_replies(tmp_path):
    """Each trajectory alternates policy turns (mask 1, the sampler's old log-probs equal to the full-sequence
    forward's over the whole trajectory) and tool replies (mask 0, old log-prob 0); the environment's reward and the
    turn counts reach the reward functions."""
    trainer = _trainer(tmp_path)
    rollout = trainer.rollout(0)
    group = rollout.groups[0]
    seen_tool = False
    for r in group.responses:
        assert r.tokens.numel() <= 160 and r.extra["turns"] >= 1
        on = r.mask > 0
        seen_tool |= bool((~on).any())
        assert bool((r.old_logprobs[~on] == 0).all())
        with torch.no_grad():
            full = full_sequence_logprobs(trainer.model, group.prompt_ids, r.tokens)
        assert (full - r.old_logprobs)[on].abs().max().item() <= 16 * 2**-23 * max(full.abs().max().item(), 1.0)
        assert r.extra["tool_calls"] == r.extra["environment_reward"]  # one lookup per call
        assert r.extra["stopped"] in ("answer", "max_turns", "budget", "no_stop")
    assert seen_tool, "no trajectory called the tool: the test would not test tool replies"
    m = trainer.grpo_step(0)  # the step's metrics say how the trajectories went
    assert m["agent/turns"] >= 1 and m["agent/tool_calls"] > 0
    assert torch.equal(rollout.per_function[:, 0], torch.tensor([r.extra["tool_calls"] for r in group.responses],
                                                                 dtype=torch.float32))


def _step_error(tmp_path, reference_logprobs, **kw) -> float:
    """Relative error of the trainer's accumulated gradient over one step of multi-turn trajectories against the same
    GRPO loss computed on `reference_logprobs(model, prompt, response)` `[R]` (with grad) per trajectory."""
    trainer = _trainer(tmp_path, reward_funcs=["environment_reward", "tests.agent.test_agent:length_reward"],
                       prompts_per_step=2, **kw)
    rollout = trainer.rollout(0)
    assert any(bool((r.mask == 0).any()) for r in rollout.responses) and bool((rollout.advantages != 0).any())
    assert len(rollout.contexts) == (1 if kw.get("rows_per_context") else 2)
    params = trainer.params
    masks = [loss_mask(r, trainer.update_settings) for r in rollout.responses]
    norm = trainer.loss_fn.normalizer([int(m.sum()) for m in masks], rollout.group_ids,
                                      trainer.update_settings.max_completion_length)
    total = 0.0
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        for i, (r, m) in enumerate(zip(rollout.responses, masks)):
            lp = reference_logprobs(trainer.model, rollout.groups[rollout.group_ids[i]].prompt_ids, r)
            loss, _ = trainer.loss_fn.response_loss(lp, r.old_logprobs, float(rollout.advantages[i]), norm[i], mask=m)
            total = total + loss
        ref = torch.autograd.grad(total, params, allow_unused=True)
    for p in params:
        p.grad = None
    trainer.update(rollout)
    num = sum((p.grad - g).pow(2).sum() for p, g in zip(params, ref) if g is not None)
    den = sum(g.pow(2).sum() for g in ref if g is not None)
    assert den > 0
    return (num / den).sqrt().item()


def _detached_reference(model, prompt, r):
    """The detached objective: the model's cache filled under `no_grad` over the row's prompt, the whole trajectory
    after it with grad (through the earlier turns and the tool output)."""
    return cache_reference_logprobs(model, prompt, r.tokens)


#: two questions of one document per step (`rows_per_context`): the rows share its capture, each trajectory forks
#: from its row's branch (`longstraw.train.sharing`)
SHARED = dict(rows_per_context=2, min_shared_prefix=4)


@pytest.mark.parametrize("shared", [False, True], ids=["own-prompts", "shared-document"])
def test_update_replays_turn_by_turn_and_equals_the_reference(tmp_path, shared):
    """The trainer's accumulated gradient over a step of multi-turn trajectories, replayed in segments (the default
    with an environment), equals the same GRPO loss computed on the detached reference's log-probs over each row's
    whole prompt, the whole trajectory differentiated (`FP32_GRAD_TOL` relative)."""
    assert _step_error(tmp_path, _detached_reference, **(SHARED if shared else {})) <= FP32_GRAD_TOL


@pytest.mark.parametrize("shared", [False, True], ids=["own-prompts", "shared-document"])
def test_exact_mode_update_equals_naive_full_sequence_grpo(tmp_path, shared):
    """prompt_grad='exact' with turn-by-turn replay: the step's gradient equals the same GRPO loss on one full-sequence
    forward per trajectory (tool tokens masked out of the loss, read by what follows), `FP32_GRAD_TOL` relative."""
    full = lambda model, prompt, r: full_sequence_logprobs(model, prompt, r.tokens)  # noqa: E731
    assert _step_error(tmp_path, full, prompt_grad="exact", **(SHARED if shared else {})) <= FP32_GRAD_TOL


@pytest.mark.parametrize("prompt_grad", ["detached", "exact"])
def test_layer_major_update_equals_the_reference(tmp_path, monkeypatch, prompt_grad):
    """`replay_order: layers` (every response one decoder layer at a time, 1 of 2 layer inputs kept): the step's
    gradient over multi-turn trajectories of two questions sharing a document equals the same GRPO loss on the
    detached reference (detached) or on one full-sequence forward per trajectory (exact), `FP32_GRAD_TOL` relative;
    every response went layer-major."""
    import longstraw.replay.segments as trajectory

    orders = []
    inner = trajectory.replay_layer_major

    def spy(*args, **kwargs):
        orders.append(args[-1])
        return inner(*args, **kwargs)

    monkeypatch.setattr(trajectory, "replay_layer_major", spy)
    if prompt_grad == "exact":
        reference = lambda model, prompt, r: full_sequence_logprobs(model, prompt, r.tokens)  # noqa: E731
    else:
        reference = _detached_reference
    err = _step_error(tmp_path, reference, prompt_grad=prompt_grad, replay_order="layers", keep_hidden="1/2",
                      **SHARED)
    assert err <= FP32_GRAD_TOL
    assert len(orders) == 2 * 3 and set(orders) == {LayerMajor(1, 2)}  # 2 rows × 3 responses


def test_config_refuses_a_layer_major_replay_it_cannot_run():
    """`replay_order` is 'segments' or 'layers'; `keep_hidden` reads 'k/n'; layer-major replay needs a token-level
    ratio, the own sampler and one process (no fsdp)."""
    with pytest.raises(ValueError, match="replay_order must be"):
        TrainConfig(replay_order="columns")
    with pytest.raises(ValueError, match="keep/every"):
        TrainConfig(replay_order="layers", keep_hidden="half")
    with pytest.raises(ValueError, match="keep <= every"):
        TrainConfig(replay_order="layers", keep_hidden="3/2")
    for bad in (dict(importance_sampling_level="sequence"), dict(fsdp=True)):
        with pytest.raises(ValueError, match="replay_order: layers needs"):
            TrainConfig(replay_order="layers", **bad)


@pytest.mark.parametrize("env,failures", [("RaisingEnv", True), ("EmptyEnv", False)])
def test_a_failing_or_silent_tool_is_an_observation_not_the_end_of_the_run(tmp_path, env, failures):
    trainer = _trainer(tmp_path, env=f"tests.agent.test_agent:{env}")
    rollout = trainer.rollout(0)
    calls = sum(r.extra["tool_calls"] for r in rollout.responses)
    assert calls > 0
    assert sum(r.extra["tool_failures"] for r in rollout.responses) == (calls if failures else 0)
    trainer.update(rollout)  # the step goes on


def test_tool_replies_are_cut_and_budgets_end_trajectories(tmp_path):
    """A reply longer than max_tool_tokens is cut (saying so); a policy that never stops within max_turn_tokens ends
    its trajectory as truncated; one that never calls a tool answers in one turn."""
    trainer = _trainer(tmp_path, max_tool_tokens=5)
    sampler = TurnSampler(__import__("longstraw").capture(trainer.model, trainer.encode(trainer.examples(0)[0].prompt)),
                          trainer.policy, trainer.rollout_stage.settings, torch.Generator().manual_seed(0))
    tok = trainer.tok
    rollout = EnvironmentRollout(LookupEnv, AgentSettings(max_turns=3, max_turn_tokens=3, max_tool_tokens=5),
                                 parse=lambda text: [ToolCall("lookup", {"key": "k1"})])
    r = rollout.trajectory(sampler, trainer.examples(0)[0])
    cut = rollout._cut(tok, " ".join(["f1"] * 20))
    assert cut.split()[:6] == ["f1"] * 5 + ["[cut:"] and "15 more tokens" in cut
    env = LookupEnv()
    env.reset()
    longest = len(tool_message_ids(tok, "lookup", rollout._cut(tok, env.lookup("k1"))))
    env_runs = [s.end - s.start for s in segments(r.mask) if not s.policy]
    assert r.extra["tool_calls"] >= 1 and env_runs and max(env_runs) <= longest < 40
    quiet = EnvironmentRollout(LookupEnv, AgentSettings(max_turns=3), parse=lambda text: [])
    r = quiet.trajectory(sampler, trainer.examples(0)[0])
    assert r.extra["turns"] == 1 and bool((r.mask == 1).all())
    assert r.extra["stopped"] in ("answer", "no_stop")


def test_trajectory_budget_and_position_limit(tmp_path):
    trainer = _trainer(tmp_path, max_completion_length=40, ignore_eos=True)
    for r in trainer.rollout(0).responses:
        assert r.tokens.numel() <= 40
        assert r.extra["stopped"] in ("budget", "no_stop", "max_turns") and r.truncated in (True, False)


def test_tool_calls_are_parsed_from_the_chat_format():
    text = ('I will look. <tool_call>{"name": "open", "arguments": {"section": 3}}</tool_call> and '
            '<tool_call>not json</tool_call><tool_call>{"arguments": {}}</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("open", {"section": 3})
    assert calls[1].name == "" and "not valid JSON" in calls[1].arguments["error"]
    assert calls[2].name == "" and "name" in calls[2].arguments["error"]
    env = LookupEnv()
    tools = environment_tools(env)
    assert sorted(tools) == ["lookup"]
    assert call_tool(tools, ToolCall("nope", {}))[1] and "no tool named" in call_tool(tools, ToolCall("nope"))[0]
    assert call_tool(tools, ToolCall("lookup", {"wrong": 1}))[1]
    with pytest.raises(TypeError, match="reset"):
        environment_tools(object())

    class Shadowed:
        def reset(self, answer="", **kw):
            self.answer = answer  # an attribute named like a tool

        def answer(self, code):
            return f"got {code}"

    env = Shadowed()
    env.reset(answer="1234")
    assert call_tool(environment_tools(env), ToolCall("answer", {"code": "1"})) == ("got 1", False)


def test_tool_message_tokens_follow_the_chat_template():
    from transformers import AutoTokenizer

    from longstraw.tools.real_models import installed

    path = installed("smollm2")
    if path is None:
        pytest.skip("the real model is not installed (longstraw real smollm2)")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tool_message_ids(tok, "open", "section three")
    text = tok.decode(ids)
    assert "section three" in text and text.rstrip().endswith("assistant")


def test_config_refuses_a_sequence_ratio_with_segments(tmp_path):
    with pytest.raises(ValueError, match="importance_sampling_level: token"):
        TrainConfig(environment="a:B", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(environment="a:B", rollout_func="a:c")
    assert TrainConfig(environment="a:B", prompt_grad="exact", segment_replay=False).replays_segments is False


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_trajectories_decoded_together_equal_each_decoded_alone(tmp_path, monkeypatch, arch):
    """The G trajectories' turns decoded in one ragged batch (`longstraw.ragged`) equal the same rounds decoded one
    branch at a time (the branches' stacking refused): the same tokens, tool replies and turns, old log-probs within
    the sampler's fp32 bound. Sampled at temperature 1 (each trajectory draws from its own generator), so the
    trajectories differ in length and the batch is ragged."""
    import longstraw.ragged as ragged

    trainer = _trainer(tmp_path, model=arch, num_generations=4, max_turn_tokens=4)
    ex = trainer.examples(0)[0]
    state = __import__("longstraw").capture(trainer.model, trainer.encode(ex.prompt))
    # a turn whose text has an even length calls the tool, an odd one answers: trajectories end after 1-4 turns
    rollout = EnvironmentRollout(LookupEnv, AgentSettings(max_turns=4, max_turn_tokens=4),
                                 parse=lambda text: [] if len(text) % 2 else [ToolCall("lookup", {"key": "k1"})])

    def run():
        sampler = TurnSampler(state, trainer.policy, trainer.rollout_stage.settings, torch.Generator().manual_seed(5))
        return rollout(sampler, ex, 4)

    together = run()
    monkeypatch.setattr(ragged, "stackable", lambda branches: False)
    alone = run()
    assert len({r.tokens.numel() for r in together}) > 1, "the trajectories all have one length: nothing ragged"
    for a, b in zip(together, alone):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask) and a.extra == b.extra
        assert (a.old_logprobs - b.old_logprobs).abs().max() <= 2**-23 * 2**10
