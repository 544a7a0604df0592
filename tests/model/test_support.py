"""Support by capability: the self-check at first use, refusals, `prepare`, and the LM-head logit transforms."""

import json
import time

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import longstraw
from longstraw import self_check
from longstraw.model import capability
from longstraw.errors import UnsupportedArchitectureError
from longstraw.testing.models import tiny_model
from longstraw.ops.logprobs import chunked_logprobs, reference_logprobs
from longstraw.model.oracles import full_sequence_logprobs

from ..conftest import lora, tokens
from ..test_equivalence import FP32_GRAD_TOL

#: float64 log-probs, entropies and their gradients written out by hand vs chunked: float64's epsilon (2.2e-16)
#: × 2^10, the fp32 bound's growth factor (a thousand roundings adding up coherently; the sums here are over 50
#: logits in chunks of 16, measured ≤ 1.3 eps)
FP64_TOL = 2**10 * torch.finfo(torch.float64).eps

#: model types outside the tested families that longstraw serves through the self-check (dense,
#: sliding window, parallel blocks with partial rotary, attention sinks)
UNTESTED = ["glm4", "helium", "phi", "gpt_neox", "exaone4", "mimo_v2_flash"]


def untested_model(model_type: str, seed: int = 0, **fields):
    """A tiny random model of a family longstraw has no spec for (the common tiny fields its config knows)."""
    from longstraw.archs.base import TINY_COMMON, TINY_MOE, _has

    defaults = CONFIG_MAPPING[model_type]()
    kw = {k: v for k, v in {**TINY_COMMON, **TINY_MOE}.items() if _has(defaults, k)}
    kw.update(fields)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        default = getattr(defaults, name, None)
        if name not in fields and isinstance(default, int) and default >= kw["vocab_size"]:
            kw[name] = None
    if getattr(defaults, "sliding_window", None):
        kw["sliding_window"] = 5
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**kw)).eval()


@pytest.fixture(autouse=True)
def _fresh_verification_cache(monkeypatch):
    monkeypatch.setattr(self_check, "_VERIFIED", {})


@pytest.mark.parametrize("model_type", UNTESTED)
def test_untested_family_is_served_after_the_self_check(model_type, monkeypatch):
    """capture runs the self-check once per configuration, then replays equal the full-sequence forward."""
    runs = []
    real = self_check.check
    monkeypatch.setattr(self_check, "check", lambda model, **kw: runs.append(1) or real(model, **kw))
    model = untested_model(model_type)
    prompt, response = tokens(17, 1), tokens(5, 2)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        for _ in range(2):
            with longstraw.capture(model, prompt, chunk_size=4) as state:
                out = state.replay(response).logprobs
            assert (out - ref).abs().max().item() <= FP32_GRAD_TOL  # the fp32 bound (tests/test_equivalence.py)
    assert runs == [1]


def test_tested_families_skip_the_self_check_unless_asked(monkeypatch):
    runs = []
    real = self_check.check
    monkeypatch.setattr(self_check, "check", lambda model, **kw: runs.append(1) or real(model, **kw))
    model = tiny_model("qwen2")
    longstraw.capture(model, tokens(9, 1))
    assert runs == []
    longstraw.capture(model, tokens(9, 1), verify=True)
    assert runs == [1]


def _scaled_logits(model):
    """A causal LM that multiplies its logits by 1.5 in its own forward, with nothing in its config saying so."""
    cls = type(model)
    forward = cls.forward

    def scaled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 1.5
        return out

    return type(f"Scaled{cls.__name__}", (cls,), {"forward": scaled})


def test_a_model_longstraw_would_answer_wrongly_is_refused():
    """An output transform longstraw does not implement: the self-check sees the log-probs differ and capture
    refuses the model, naming what differed (without the self-check the replay would be silently wrong)."""
    model = untested_model("glm4")
    model.__class__ = _scaled_logits(model)
    with pytest.raises(UnsupportedArchitectureError, match="response log-probs: max abs error"):
        longstraw.capture(model, tokens(17, 1))
    # the same model with verification off replays, and is wrong
    prompt, response = tokens(17, 1), tokens(5, 2)
    with torch.no_grad():
        out = longstraw.capture(model, prompt, verify=False).replay(response).logprobs
        # 100 × the fp32 bound (measured 0.14): an error, not rounding
        assert (out - full_sequence_logprobs(model, prompt, response)).abs().max().item() > 100 * FP32_GRAD_TOL


def test_an_attention_argument_longstraw_does_not_implement_is_refused(monkeypatch):
    """An attention module that passes an argument the split attention does not implement (monkeypatched in,
    like an ALiBi bias) is refused through the self-check, naming the argument."""
    model = untested_model("helium")
    attn_cls = type(model.model.layers[0].self_attn)
    forward = attn_cls.forward
    import transformers.models.helium.modeling_helium as helium

    real_sdpa = helium.ALL_ATTENTION_FUNCTIONS["sdpa"]
    # the capability check reads the attention class's source once per class (`capability._uses_attention_interface`):
    # let it read the unpatched class, as it would a class that passes the argument in its own source (whichever
    # test of this worker meets the class first)
    capability._uses_attention_interface(attn_cls)

    def with_bias(self, *args, **kwargs):
        return forward(self, *args, **{**kwargs, "alibi_slopes": torch.ones(4)})

    monkeypatch.setattr(attn_cls, "forward", with_bias)
    monkeypatch.setitem(helium.ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa",
                        lambda *a, alibi_slopes=None, **k: real_sdpa(*a, **k))
    with pytest.raises(UnsupportedArchitectureError, match="alibi_slopes"):
        longstraw.capture(model, tokens(17, 1))


def test_check_report_names_the_layer_kind_that_reads_its_state_wrongly(monkeypatch):
    """A sliding-window layer that keeps one key too few: the report names the first sliding layer."""
    from longstraw.kinds import SlidingKVState

    monkeypatch.setattr(SlidingKVState, "_keep", lambda self: self.window - 2)
    report = longstraw.check(tiny_model("ministral"))
    assert not report.ok
    assert report.first_bad_layer == 0 and report.worst_kind == "sliding_attention"
    assert report.layer_errors["sliding_attention"] > 10 * FP32_GRAD_TOL  # 10 × the fp32 bound (measured 0.19)
    assert "sliding_attention" in str(report)


@pytest.mark.parametrize(
    "model_type,fields,match",
    [
        pytest.param("minimax", {}, "MiniMaxCache", id="own-cache"),
        pytest.param("qwen3_next", {"layer_types": ["linear_attention", "window_attention"]}, "'window_attention'",
                     id="unknown-layer-type"),
    ],
)
def test_models_longstraw_cannot_represent_are_refused_before_any_state(model_type, fields, match, monkeypatch):
    from longstraw import prompt_state as state_module

    allocated = []
    monkeypatch.setattr(state_module, "layer_states", lambda *a: allocated.append(1))
    model = untested_model(model_type, **fields)
    with pytest.raises(UnsupportedArchitectureError, match=match) as err:
        longstraw.capture(model, tokens(9, 1))
    assert "tested families: bamba, cohere" in str(err.value)
    assert not allocated


def test_remote_code_models_are_refused():
    model = tiny_model("llama")
    cls = type(model)
    model.__class__ = type(cls.__name__, (cls,), {"__module__": "transformers_modules.someone.modeling_custom"})
    with pytest.raises(UnsupportedArchitectureError, match="remote code"):
        longstraw.capture(model, tokens(9, 1))


def test_self_check_is_fast_and_leaves_the_model_untouched():
    """< 2 s for a 4-layer model; weights, gradients, training mode and the RNG are as before."""
    model = lora(tiny_model("qwen3_next", num_hidden_layers=4)).train()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    start = time.perf_counter()
    report = longstraw.check(model)
    assert time.perf_counter() - start < 2.0
    assert report.ok and report.grad_error is not None and report.grad_error <= FP32_GRAD_TOL
    assert set(report.layer_errors) == {"linear_attention", "full_attention"}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in params)
    assert all(m.training for m in model.modules())
    assert torch.equal(rng, torch.get_rng_state())


def test_self_check_runs_the_decoder_three_times_over_its_own_prompt():
    """The check's cost in passes over the weights: the reference's forward, one capture chunk, one replay over the
    prompt's tail and the response (two backward passes, one per graph, over the replayed positions only), each pass
    over tokens of the check's own prompt (`self_check.check_shape`: past every window, at least
    `MIN_CHECK_PROMPT` so that a pass costs the model's arithmetic more than its per-call overhead)."""
    model = tiny_model("ministral")
    longstraw.check(model)  # a first call also probes the model's attention calls once (`longstraw.prepare`)
    calls = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True
    )
    report = longstraw.check(model)
    handle.remove()
    assert report.ok, str(report)
    p, c = self_check.check_shape(model.config)
    assert p >= self_check.MIN_CHECK_PROMPT and c - 1 >= model.config.sliding_window and report.covers_windows
    rest = p - c + report.response_length
    assert calls == [p + report.response_length, c - 1, rest], calls


@pytest.mark.parametrize("wrong_call,layer", [(0, 3), (2, 1)], ids=["last-layer", "layer-1"])
def test_self_check_refuses_a_wrong_backward_and_names_its_layer(wrong_call, layer, monkeypatch):
    """A replay whose forward is right but whose attention backward is off in one layer (the query gradient of the
    prompt part scaled by 0.97) is refused by the gradient check alone, which names that layer; with nothing
    trainable the gradient is checked too (it is taken with respect to each layer's input, not the weights)."""
    from longstraw.ops.attention import SplitAttention

    real, calls = SplitAttention.backward, []

    def wrong(ctx, dout, dlse):
        grads = list(real(ctx, dout, dlse))
        if len(calls) == wrong_call:  # backward visits the layers last to first
            grads[0] = grads[0] * 0.97
        calls.append(1)
        return tuple(grads)

    model = tiny_model("llama", num_hidden_layers=4)
    for p in model.parameters():
        p.requires_grad_(False)
    good = longstraw.check(model)
    assert good.ok and good.grad_error is not None and good.grad_error <= FP32_GRAD_TOL, str(good)
    monkeypatch.setattr(SplitAttention, "backward", staticmethod(wrong))
    report = longstraw.check(model)
    assert report.logprob_error <= self_check.FULL_TOLERANCE and report.first_bad_layer is None
    assert not report.ok and report.grad_error > self_check.GRAD_TOLERANCE, str(report)
    assert report.backward_bad_layer == layer and "backward is off: " + str(layer) in str(report)


def test_prepared_model_works_normally_outside_longstraw(tmp_path):
    """After `prepare` (and a capture) the model's own forward, generate and save give what they gave before;
    `unprepare` restores its classes."""
    model = tiny_model("deepseek_v32")
    ids = tokens(12, 3)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    classes = [type(m) for m in model.modules()]
    keys = list(model.state_dict())
    longstraw.capture(model, tokens(9, 1)).replay(tokens(3, 2))
    assert longstraw.prepare.__module__ and any(type(m) is not c for m, c in zip(model.modules(), classes))
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), generated)
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    assert "longstraw" not in (tmp_path / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, logits)
    longstraw.unprepare(model)
    assert [type(m) for m in model.modules()] == classes


def test_prepare_refuses_when_transformers_does_not_switch(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(type(model), "set_attn_implementation", lambda self, name: None)
    with pytest.raises(UnsupportedArchitectureError, match="did not switch"):
        longstraw.prepare(model)


@pytest.mark.parametrize("scale,softcap", [(0.5, None), (None, 3.0), (0.25, 2.0)], ids=["scale", "softcap", "both"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_applies_logit_scale_and_softcap(scale, softcap, temperature):
    """Against log_softmax(softcap(scale · W h) / T) written out here; gradients of hidden and weight."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False).double()
    targets = torch.randint(0, 50, (7,), generator=g)
    lp, ent = chunked_logprobs(hidden, head, targets, temperature=temperature, softcap=softcap, scale=scale,
                               token_chunk=3, vocab_chunk=16)
    z = hidden @ head.weight.t() * (scale or 1.0)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    ref_all = torch.log_softmax(z / temperature, -1)
    ref = ref_all.gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=FP64_TOL, rtol=FP64_TOL)
    torch.testing.assert_close(ent, -(ref_all.exp() * ref_all).sum(-1), atol=FP64_TOL, rtol=FP64_TOL)
    w = torch.randn(7, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((w * lp + w.flip(0) * ent).sum(), [hidden, head.weight])
    want = torch.autograd.grad((w * ref - w.flip(0) * (ref_all.exp() * ref_all).sum(-1)).sum(), [hidden, head.weight])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=FP64_TOL, rtol=FP64_TOL)
    module_lp, _ = reference_logprobs(hidden, head, targets, temperature=temperature, softcap=softcap, scale=scale)
    torch.testing.assert_close(module_lp, ref, atol=FP64_TOL, rtol=FP64_TOL)


def test_tested_family_table_covers_the_issue_list():
    wanted = {"qwen2", "qwen2_moe", "qwen3_moe", "mistral", "ministral", "ministral3", "mixtral", "phi3", "phimoe",
              "gemma", "gemma2", "gpt_oss", "olmo2", "olmo3", "olmoe", "cohere", "cohere2", "starcoder2", "stablelm",
              "smollm3", "granite", "granitemoe", "glm4_moe", "deepseek_v2", "minimax_m2", "gemma4_text", "llama4_text"}
    assert wanted <= set(longstraw.tested_families())
    assert json.dumps(longstraw.tested_families())


def test_check_command_on_a_local_folder(tmp_path, capsys):
    """`longstraw check PATH`: exit 0 and the report for a servable saved model; exit 1 for a refused one."""
    from longstraw.cli import main

    untested_model("exaone4").save_pretrained(tmp_path / "ok")
    assert main(["check", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "self-check of exaone4" in out and ": ok" in out and "sliding_attention layers" in out
    untested_model("minimax").save_pretrained(tmp_path / "refused")
    assert main(["check", str(tmp_path / "refused")]) == 1
    assert "MiniMaxCache" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "missing")]) == 2


def test_an_untested_family_trains_with_longstraw_train(tmp_path, monkeypatch):
    """A local folder of a family without a spec (Helium) trains through the CLI unchanged, LoRA, after its
    self-check ran once."""
    from longstraw import cli
    from longstraw.tasks import build_tokenizer

    runs = []
    real = self_check.check
    monkeypatch.setattr(self_check, "check", lambda model, **kw: runs.append(1) or real(model, **kw))
    tok = build_tokenizer(num_keys=16, num_values=8)
    model = untested_model("helium", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model.save_pretrained(tmp_path / "helium")
    tok.save_pretrained(tmp_path / "helium")
    rows = [{"prompt": f"k{i} v{i % 8} k{i + 1} v{(i + 3) % 8} ? k{i} =", "answer": f"v{i % 8}"} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tmp_path / 'helium'}\ndataset: {tmp_path / 'data.jsonl'}\neval_fraction: 0.25\n"
                      "reward_funcs: [exact_match]\nnum_generations: 4\nmax_completion_length: 2\nnum_steps: 2\n"
                      "prompts_per_step: 2\nprogress: false\nthreads: 1\nlora: true\n")
    assert cli.main(["train", str(config), "--output_dir", str(tmp_path / "run")]) == 0
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["phase"] for m in metrics] == ["grpo"] * 2
    assert all(m["loss"] == m["loss"] for m in metrics)  # finite, not NaN
    assert len(runs) >= 1
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()
