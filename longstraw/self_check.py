"""The self-check: capture + replay against the unmodified model on a short random prompt.

`check(model)` runs a random prompt (at least `MIN_CHECK_PROMPT` tokens, longer than any sliding window or
attention chunk) and response through the unmodified transformers model, and through `capture` of the prompt's first
tokens + `replay` of its last `CHECK_TAIL` tokens and the response (the replay reads the captured state as a later
capture chunk would), and compares, at the replayed positions,
- the log-probs (max abs difference; fp32/fp64 ≤ 1e-4; bf16/fp16 see below),
- each decoder layer's output at the response positions (relative to its largest value), which names
  the first layer, and its layer kind, that reads its state wrongly,
- the detached-mode gradient of a weighted sum of the response log-probs with respect to each decoder layer's input
  and each token mixer's (attention, linear attention, SSM) input at the response positions, against the same
  full-sequence forward with its layer inputs at the prompt positions detached (the values unchanged, the prompt's
  share of the gradient cut as a captured state cuts it); the worst relative error of any of them, and the deepest
  layer over the tolerance, which is the layer whose backward is off. What longstraw computes in a backward (the
  split attention's query and key/value gradients, the state's) reaches the mixer's input gradient; the weights'
  gradients are the model's own modules applied to these, so none is computed, no parameter needs to be trainable,
  and the cost is that of activation gradients only.
It never changes the model's weights, gradients or training state (it uses `torch.autograd.grad`, runs
in eval mode and puts the mode back, and forks the RNG).

Cost: the reference's full-sequence forward, one capture chunk and one replay forward, and two backward passes (the
replay's over the replayed positions; the reference's through each layer over the whole sequence, cut at the layer
inputs of the prompt positions) — 0.6–1.3× one training forward + backward of the same tokens
on the real models, 1.6–2.1× on tiny ones, whose passes are mostly per-call overhead (`bench/self_check_cost.py`).

In half precision two correct paths differ from each other by about as much as either differs from float32, so a
fixed bound between them refuses correct models. A bf16 / fp16 model is checked on two signals, both against a
float32 copy of the same (rounded) weights, the exact function the half model approximates:
- the half-precision paths: transformers' own half forward and longstraw's are both measured against the copy, and
  longstraw passes when its error is within `HALF_FACTOR` × transformers' own (mean and 90th percentile over
  `HALF_RESPONSE` response tokens; the detached gradients' worst relative error likewise), plus one rounding of the
  dtype (`torch.finfo(dtype).eps`) for models whose half-precision error is about zero. This catches what only the
  half-precision kernels do wrong, but its allowance is the rounding's size: on a tiny random model, whose attention
  is nearly uniform, a prompt read one token shifted moves the log-probs by less than one bf16 rounding;
- the same capture and replay of the float32 copy against the copy's own forward, at the float32 tolerances. How
  longstraw reads a prompt state (windows, positions, which layer holds what) does not depend on the dtype, so a
  misread shows here at float32's resolution, whatever the half-precision rounding hides.
The float32 copy costs twice the model's half-precision weights in memory, once, during the check, and its capture
and replay one more float32 forward and backward of the check's tokens.

`capture` runs it once per model configuration outside the tested families (`longstraw.archs`),
cached for the process (`verify=False` skips it, `verify=True` runs it for tested families too), and
raises `UnsupportedArchitectureError` with the report when it fails.
"""

from __future__ import annotations

import copy
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .errors import UnsupportedArchitectureError
from .hf.parts import base_model
from .model.capability import attention_module, layer_plan, model_parts
from .model.oracles import full_sequence_logprobs
from .model.positions import position_limit
from .prompt_state import capture_local

#: max abs log-prob difference allowed in float32 / float64 (float32's epsilon × 2^10)
FULL_TOLERANCE = 1e-4
#: worst relative error of one layer's or mixer's input gradient allowed in float32 / float64: float32's epsilon ×
#: 2^13 (≈ 9.8e-4). A backward through tens of layers rounds more than the forward: Gemma 3 270M measures 3.8e-4 in
#: float32 and 2e-15 in float64 (rounding, not an error); a misread gradient is off by 2e-3 and more
GRAD_TOLERANCE = 2.0**13 * torch.finfo(torch.float32).eps
#: in bfloat16 / float16: longstraw's error against the float32 copy may be this multiple of transformers' own.
#: The bf16 tests hold 1.5× over 512 tokens; the check's 32 tokens make each path's quantile a noisier draw of the
#: same rounding, hence 2×. A misread state can stay under it (Gemma 3 270M with a window one key short: 0.28 nats at
#: the 90th percentile against a bound of 0.35), which is why the float32 copy is also checked at `FULL_TOLERANCE`
#: (that misread: 3.1e-3; tests/test_self_check_half.py)
HALF_FACTOR = 2.0
#: response tokens of a half-precision check: enough for the mean and the 90th percentile to be quantiles of the
#: rounding, not one token's luck (a top-k router flip moves one token by ~1e-2)
HALF_RESPONSE = 32


@dataclass
class CheckReport:
    """Outcome of `check`: `.ok`, the worst errors, and per-layer-kind detail."""

    ok: bool
    model_type: str
    dtype: str
    #: (log-prob, gradient) tolerance; in half precision HALF_FACTOR × transformers' own error (+ the dtype's eps)
    tolerance: tuple[float, float]
    prompt_length: int
    chunk_size: int
    response_length: int
    #: max abs difference of the response log-probs
    logprob_error: float = float("nan")
    #: worst relative error of the detached-mode gradient with respect to each decoder layer's input, and each
    #: token mixer's, at the response positions (None: gradients not checked)
    grad_error: float | None = None
    #: the decoder layer whose backward is off: the deepest one whose input gradient is over the tolerance
    backward_bad_layer: int | None = None
    #: layer kind → worst relative error of that kind's layer outputs at the response positions
    layer_errors: dict[str, float] = field(default_factory=dict)
    #: the first decoder layer whose output is off by more than the tolerance, and its kind
    first_bad_layer: int | None = None
    worst_kind: str | None = None
    #: half precision: errors against the float32 copy of the same weights, longstraw's and transformers' own —
    #: log-prob (mean, 90th percentile, max) and the detached gradient's relative error
    half: dict | None = None
    #: half precision: longstraw's capture and replay of the float32 copy against the copy's own forward — max abs
    #: log-prob error and the detached gradient's worst relative error (None: not run), held to the float32 tolerances
    float32_error: float | None = None
    float32_grad_error: float | None = None
    #: what capture / replay raised, if anything (an attention variant longstraw does not implement, ...)
    error: str | None = None
    #: whether the prompt reached past every sliding window / attention chunk (False: a window longer than
    #: `MAX_CHECK_PROMPT`, whose edge the check did not exercise)
    covers_windows: bool = True
    seconds: float = 0.0

    def __str__(self) -> str:
        head = (
            f"longstraw self-check of {self.model_type} ({self.dtype}, P={self.prompt_length}, "
            f"chunk={self.chunk_size}, R={self.response_length}): {'ok' if self.ok else 'FAILED'}"
        )
        lines = [head]
        if self.error is not None:
            lines.append(f"  error: {self.error}")
        else:
            if self.half is not None:
                h = self.half
                lines.append(
                    f"  against a float32 copy, response log-probs mean / p90 / max abs error: longstraw "
                    f"{h['longstraw'][0]:.2e} / {h['longstraw'][1]:.2e} / {h['longstraw'][2]:.2e}, "
                    f"transformers {h['transformers'][0]:.2e} / {h['transformers'][1]:.2e} / "
                    f"{h['transformers'][2]:.2e} (bound {HALF_FACTOR:g}× transformers' + {h['eps']:.1e})"
                )
                if self.grad_error is not None:
                    lines.append(
                        f"  detached gradient (worst layer or mixer input) against the float32 copy: "
                        f"relative error {self.grad_error:.2e}, transformers {h['transformers_grad']:.2e} "
                        f"(tolerance {self.tolerance[1]:.2e})"
                    )
                if self.float32_error is not None:
                    grad = (
                        ""
                        if self.float32_grad_error is None
                        else f", gradient relative error {self.float32_grad_error:.2e} (tolerance {GRAD_TOLERANCE:.1e})"
                    )
                    lines.append(
                        f"  the float32 copy through longstraw: log-prob max abs error {self.float32_error:.2e} "
                        f"(tolerance {FULL_TOLERANCE:.0e}){grad}"
                    )
            else:
                lines.append(
                    f"  response log-probs: max abs error {self.logprob_error:.2e} (tolerance {self.tolerance[0]:.0e})"
                )
                if self.grad_error is not None:
                    lines.append(
                        f"  detached gradient (worst layer or mixer input): relative error "
                        f"{self.grad_error:.2e} (tolerance {self.tolerance[1]:.1e})"
                    )
            for kind, err in sorted(self.layer_errors.items()):
                lines.append(f"  {kind} layers: worst relative output error {err:.2e}")
            if self.first_bad_layer is not None:
                lines.append(f"  first layer off: {self.first_bad_layer} ({self.worst_kind})")
            if self.backward_bad_layer is not None:
                lines.append(f"  layer whose backward is off: {self.backward_bad_layer}")
        if not self.covers_windows:
            lines.append("  note: the prompt did not reach past the longest sliding window / attention chunk")
        lines.append(f"  {self.seconds:.2f} s")
        return "\n".join(lines)


def _reach(cfg, plan: list[str] | None = None) -> int:
    """The longest window or attention chunk of any layer (0: none); `plan`: the model's layer plan (None: the
    config's)."""
    plan = plan or layer_plan(cfg)
    reach = 0
    if "sliding_attention" in plan and getattr(cfg, "sliding_window", None):
        reach = max(reach, int(cfg.sliding_window))
    if "chunked_attention" in plan:
        reach = max(reach, int(cfg.attention_chunk_size))
    return reach


#: longest self-check prompt: past the sliding windows (4,096 for Mistral 7B) and attention chunks (8,192
#: for Llama 4) of the models people train, at the cost of one such forward and backward, once
MAX_CHECK_PROMPT = 16384
#: shortest self-check prompt: long enough that the check's passes cost the model's arithmetic, not the per-call
#: overhead of a few tokens (at 24 tokens a tiny model's check took 3.5× one forward + backward of its own tokens,
#: the real SmolLM2 + LoRA 2.3×; at 512, 1.6× and 1.3×: `bench/self_check_cost.py`)
MIN_CHECK_PROMPT = 512
#: the prompt's last tokens, which the check's replay runs over before the response: the replay reads the captured
#: state as the capture's next chunk would (the same branch view of the state), without the extra pass over the
#: weights that a second capture chunk costs (what a chunk adds, folding itself into the state, depends on the layer
#: kind only, not the model, and the equivalence tests hold it for every kind)
CHECK_TAIL = 8


def check_shape(cfg, max_prompt: int = MAX_CHECK_PROMPT, plan: list[str] | None = None) -> tuple[int, int]:
    """(prompt length P, captured length C): the capture takes the prompt's first C tokens (C − 1 of them folded into
    the state in one chunk), the replay continues over the last `CHECK_TAIL` and the response; the state holds more
    than the longest window or attention chunk, so the replay reads a window's edge. Within `max_prompt` tokens."""
    limit = position_limit(cfg) or max_prompt + HALF_RESPONSE
    p = min(max(MIN_CHECK_PROMPT, _reach(cfg, plan) + CHECK_TAIL + 2), max_prompt, limit - HALF_RESPONSE)
    return p, max(2, p - CHECK_TAIL)


@contextmanager
def _untouched(model):
    """Eval mode for the block (dropout off), then the model's own mode; the RNG as it was."""
    was_training = [(m, m.training) for m in model.modules()]
    model.eval()
    devices = sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, mode in was_training:
            m.training = mode


def _layer_outputs(decoder, positions: slice | None):
    """Hooks collecting each decoder layer's output `[T, hidden]` (at `positions`) in a list."""
    outputs: list[torch.Tensor] = []

    def hook(module, args, out):
        h = out[0] if isinstance(out, (tuple, list)) else out
        h = h[0].detach().float()
        outputs.append(h if positions is None else h[positions])

    return outputs, [layer.register_forward_hook(hook) for layer in decoder.layers]


def check(
    model: torch.nn.Module,
    *,
    prompt_length: int | None = None,
    chunk_size: int | None = None,
    response_length: int = 5,
    gradients: bool = True,
    seed: int = 0,
) -> CheckReport:
    """Self-check of `model` (see the module docstring). Raises `UnsupportedArchitectureError` only for a model
    whose layers longstraw cannot represent at all; a numeric disagreement is reported, not raised."""
    start = time.perf_counter()
    parts = model_parts(model)
    cfg = parts.config
    plan = list(parts.plan)
    p_auto, c_auto = check_shape(cfg, plan=plan)
    p = prompt_length or p_auto
    c = c_auto if prompt_length is None else max(2, p - CHECK_TAIL)  # captured: the prompt's first c tokens
    chunk = chunk_size or c - 1  # one capture chunk unless asked otherwise
    param = next(parts.model.parameters())
    half = param.dtype in (torch.bfloat16, torch.float16)
    r = max(response_length, HALF_RESPONSE) if half else response_length
    report = CheckReport(
        ok=False,
        model_type=cfg.model_type,
        dtype=str(param.dtype).replace("torch.", ""),
        tolerance=(FULL_TOLERANCE, GRAD_TOLERANCE),
        prompt_length=p,
        chunk_size=chunk,
        response_length=r,
        covers_windows=c - 1 >= _reach(cfg, plan),
    )
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (p,), generator=gen).to(param.device)
    response = torch.randint(0, cfg.vocab_size, (r,), generator=gen).to(param.device)
    # captured: prompt[:c]; replayed and compared: the prompt's tail, then the response — `rest`, [P − C + R]
    head, rest = prompt[:c], torch.cat([prompt[c:], response])
    n = rest.numel()
    weights = torch.linspace(-1.0, 1.0, n, device=prompt.device)
    lp_ok = False
    with _untouched(parts.model):
        ref, ref_out, ref_grads = _reference(model, parts.decoder, head, rest, weights, gradients)
        if half:  # the exact function the half-precision model approximates: its own weights, in float32
            model32 = _float32_copy(model)
            ref32, ref32_out, ref32_grads = _reference(
                model32, model_parts(model32).decoder, head, rest, weights, gradients
            )
        try:
            got, got_out, got_grads = _replayed(model, head, rest, chunk, weights, gradients)
            if half:
                # the second signal: the same paths on the float32 copy, at the float32 tolerances
                got32, got32_out, got32_grads = _replayed(model32, head, rest, chunk, weights, gradients)
                del model32
                report.float32_error = (got32 - ref32).abs().max().item()
                f32_ok = report.float32_error <= FULL_TOLERANCE
                if gradients:
                    report.float32_grad_error = _grad_detail(report, got32_grads, ref32_grads, None)
                    f32_ok = f32_ok and report.float32_grad_error <= GRAD_TOLERANCE
                eps = torch.finfo(param.dtype).eps
                ls, hf = _abs_stats(got - ref32), _abs_stats(ref - ref32)
                report.logprob_error = ls[2]
                report.half = dict(longstraw=ls, transformers=hf, eps=eps)
                report.tolerance = (HALF_FACTOR * hf[1] + eps, report.tolerance[1])
                lp_ok = ls[0] <= HALF_FACTOR * hf[0] + eps and ls[1] <= HALF_FACTOR * hf[1] + eps and f32_ok
                if f32_ok:
                    layer_tol = [HALF_FACTOR * _rel_max(a, b) + eps for a, b in zip(ref_out, ref32_out)]
                    _layer_detail(report, plan, ref32_out, got_out, layer_tol)
                else:  # float32 names the first layer that reads its state wrongly, at its own resolution
                    _layer_detail(report, plan, ref32_out, got32_out, [FULL_TOLERANCE] * len(ref32_out))
                if gradients:
                    hf_grad = _grad_detail(report, ref_grads, ref32_grads, None)
                    report.half["transformers_grad"] = hf_grad
                    report.tolerance = (report.tolerance[0], HALF_FACTOR * hf_grad + eps)
                    _grad_detail(report, got_grads, ref32_grads, report.tolerance[1])
            else:
                report.logprob_error = (got - ref).abs().max().item()
                lp_ok = report.logprob_error <= FULL_TOLERANCE
                _layer_detail(report, plan, ref_out, got_out, [FULL_TOLERANCE] * len(ref_out))
                if gradients:
                    _grad_detail(report, got_grads, ref_grads, GRAD_TOLERANCE)
        except (NotImplementedError, RuntimeError, ValueError) as err:
            report.error = f"{type(err).__name__}: {err}"
    report.ok = (
        report.error is None and lp_ok and (report.grad_error is None or report.grad_error <= report.tolerance[1])
    )
    report.seconds = time.perf_counter() - start
    return report


def _replayed(model, head, rest, chunk: int, weights, gradients: bool):
    """longstraw's side of the check: `head` captured in chunks of `chunk`, `rest` replayed after it; as `_graded`."""
    state = capture_local(model, head, chunk_size=chunk)
    try:
        decoder = model_parts(model).decoder
        return _graded(
            lambda: state.replay(rest).logprobs, decoder, 0, rest.numel(), slice(0, rest.numel()), weights, gradients
        )
    finally:
        state.release()


def _reference(model, decoder, prompt, response, weights, gradients: bool):
    """The unmodified model's response log-probs `[R]`, its decoder layers' outputs at the response positions and
    (`gradients`) the detached-mode gradient: d(Σ weights · log-probs) with respect to each decoder layer's and token
    mixer's input at the response positions, from one full-sequence forward whose layer inputs at the prompt
    positions are detached (the values are the plain forward's; only the prompt's share of the gradient is cut, as a
    captured state cuts it)."""
    p, r = prompt.numel(), response.numel()

    def logprobs():
        try:  # logits of the response positions only, where the model's forward takes `logits_to_keep`
            return full_sequence_logprobs(model, prompt, response, logits_to_keep=True)
        except TypeError:
            return full_sequence_logprobs(model, prompt, response)

    return _graded(logprobs, decoder, p - 1, r, slice(p - 1, p - 1 + r), weights, gradients)


def _graded(logprobs, decoder, start: int, length: int, positions: slice, weights, gradients: bool):
    """Run `logprobs()` with the decoder layers hooked: (log-probs `[R]`, each layer's output at `positions`, and
    with `gradients` the gradient of Σ weights · log-probs with respect to each layer's input at positions
    `start .. start + length`, the layer input elsewhere detached; else None). The gradient reaches no parameter
    (only the layer inputs are asked for, so no weight gradient is computed), and needs none to be trainable.

    transformers' linear-attention cache writes its recurrent state in place after reading it (5.24,
    `LinearAttentionLayer.update_recurrent_state`), which autograd refuses: such a forward runs again under
    `torch.autograd.graph.allow_mutation_on_saved_tensors()` (which clones a saved tensor before it is mutated,
    at the cost of a Python dispatch per operation, so only where it is needed)."""
    if not gradients:
        with torch.no_grad():
            outputs, handles = _layer_outputs(decoder, positions)
            try:
                return logprobs().detach(), outputs, None
            finally:
                for h in handles:
                    h.remove()
    try:
        return _graded_once(logprobs, decoder, start, length, positions, weights)
    except RuntimeError as err:
        if "inplace operation" not in str(err):
            raise
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        return _graded_once(logprobs, decoder, start, length, positions, weights)


def _graded_once(logprobs, decoder, start, length, positions, weights):
    outputs, out_handles = _layer_outputs(decoder, positions)
    inputs, in_handles = _layer_inputs(decoder, start, length)
    try:
        with torch.enable_grad():  # the caller may be under no_grad (a capture for sampling)
            lp = logprobs()
            tensors = [x for _, x in inputs]
            grads = torch.autograd.grad((weights * lp.float()).sum(), tensors, allow_unused=True)
    finally:
        for h in out_handles + in_handles:
            h.remove()
    return lp.detach(), outputs, [(i, torch.zeros_like(x) if g is None else g) for (i, x), g in zip(inputs, grads)]


def _layer_inputs(decoder, start: int, length: int):
    """Pre-hooks making the input of each decoder layer, and of its token mixer (attention, linear attention or SSM
    module), at positions `start .. start + length` a tensor of the graph, collected as (layer index, tensor) in
    a list (a leaf at the first layer when nothing before it is trainable), and the input at every other position a
    constant: the values the modules see are unchanged. The mixer's input gradient is its own backward alone (the
    layer's also carries the residual stream's, which would dilute an error in the attention's gradient)."""
    inputs: list[tuple[int, torch.Tensor]] = []

    def hook_for(index: int, required: bool):
        def hook(module, args, kwargs):
            positional = bool(args) and torch.is_tensor(args[0])
            h = args[0] if positional else kwargs.get("hidden_states")
            if not torch.is_tensor(h) or h.dim() < 2 or h.shape[1] < start + length:
                if not required:
                    return None
                raise ValueError(
                    f"self-check: decoder layer {index}'s input is not [batch, sequence, ...] of at "
                    f"least {start + length} positions"
                )
            x = h[:, start : start + length]
            if not x.requires_grad:
                x = x.detach().requires_grad_()
            inputs.append((index, x))
            pieces = [h[:, :start].detach(), x, h[:, start + length :].detach()]
            new = torch.cat([t for t in pieces if t.shape[1]], 1) if x.shape[1] != h.shape[1] else x
            if positional:
                return (new, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": new}

        return hook

    handles = []
    for i, layer in enumerate(decoder.layers):
        handles.append(layer.register_forward_pre_hook(hook_for(i, True), with_kwargs=True))
        for mixer in {
            id(m): m for m in (attention_module(layer), getattr(layer, "linear_attn", None)) if m is not None
        }.values():
            handles.append(mixer.register_forward_pre_hook(hook_for(i, False), with_kwargs=True))
    return inputs, handles


def _float32_copy(model):
    """A float32 copy of `model` (adapters included) holding the same values as its half-precision weights."""
    return copy.deepcopy(model).float()


def _abs_stats(diff: torch.Tensor) -> tuple[float, float, float]:
    """(mean, 90th percentile, max) of |diff|."""
    a = diff.detach().abs().float()
    return a.mean().item(), torch.quantile(a, 0.9).item(), a.max().item()


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| relative to b's largest value."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _layer_detail(report: CheckReport, plan, ref_out, got_out, tol: list[float]) -> None:
    """Each layer kind's worst output error relative to the reference's largest value; the first layer over its
    `tol` (one bound per layer)."""
    worst_kind, worst = None, -1.0
    for i, (kind, a, b, bound) in enumerate(zip(plan, got_out, ref_out, tol)):
        err = _rel_max(a, b)
        report.layer_errors[kind] = max(report.layer_errors.get(kind, 0.0), err)
        if err > bound and report.first_bad_layer is None:
            report.first_bad_layer, report.worst_kind = i, kind
        if err > worst:
            worst_kind, worst = kind, err
    if report.worst_kind is None:
        report.worst_kind = worst_kind


def _grad_detail(
    report: CheckReport, got: list[tuple[int, torch.Tensor]], ref: list[tuple[int, torch.Tensor]], tol: float | None
) -> float:
    """The worst relative error (float64) of the (layer index, input gradient) pairs `got` against `ref`, one per
    layer and mixer input; with `tol`, records it as the report's `grad_error` and names the deepest layer over `tol`
    (a wrong backward in layer k corrupts the gradient of every layer input up to k, and none after it)."""
    if [i for i, _ in got] != [i for i, _ in ref] or any(a.shape != b.shape for (_, a), (_, b) in zip(got, ref)):
        raise ValueError("self-check: the replay's layers were not called as the model's own forward calls them")
    errors = [(i, _rel(a.double(), b.double())) for (i, a), (_, b) in zip(got, ref)]
    err = max(e for _, e in errors)
    if tol is not None:
        report.grad_error = err
        bad = [i for i, e in errors if e > tol]
        report.backward_bad_layer = max(bad) if bad else None
    return err


# ------------------------------------------------------------------------------------------ at first use

_VERIFIED: dict[tuple, CheckReport] = {}


def configuration_key(model) -> tuple:
    """What makes two models the same configuration for the self-check: class, config, dtype, device, adapters."""
    base = base_model(model)
    param = next(base.parameters())
    cfg = json.dumps(base.config.to_dict(), sort_keys=True, default=str)
    adapters = type(model).__name__ if model is not base else None
    attention = base.config._attn_implementation
    return type(base).__qualname__, cfg, attention, str(param.dtype), param.device.type, adapters


def ensure_verified(model) -> CheckReport:
    """The self-check of this configuration, run once per process; `UnsupportedArchitectureError` if it fails."""
    key = configuration_key(model)
    report = _VERIFIED.get(key)
    if report is None:
        report = _VERIFIED[key] = check(model)
    if not report.ok:
        raise UnsupportedArchitectureError(
            f"{report.model_type}: longstraw does not reproduce this model (worst layer kind: {report.worst_kind}).\n"
            f"{report}"
        )
    return report
