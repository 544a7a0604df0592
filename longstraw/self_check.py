"""The self-check: capture + replay against the unmodified model on a short random prompt.

`check(model)` runs a prompt of several chunks (longer than any sliding window or attention chunk,
with a chunk size that does not divide it) through the unmodified transformers model and through
`capture` + `replay`, and compares
- the response log-probs (max abs difference; fp32/fp64 ≤ 1e-4, bf16/fp16 ≤ `HALF_TOLERANCE`),
- each decoder layer's output at the response positions (relative to its largest value), which names
  the first layer, and its layer kind, that reads its state wrongly,
- when parameters are trainable, the detached-mode gradient against transformers' own cache reference
  (`longstraw.reference.cache_reference_logprobs`; relative error of all gradients together).
It never changes the model's weights, gradients or training state (it uses `torch.autograd.grad`, runs
in eval mode and puts the mode back, and forks the RNG).

`capture` runs it once per model configuration outside the tested families (`longstraw.archs`),
cached for the process (`verify=False` skips it, `verify=True` runs it for tested families too), and
raises `UnsupportedArchitectureError` with the report when it fails.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .models import UnsupportedArchitectureError, base_model
from .support import layer_plan, model_parts

#: max abs log-prob difference, and relative gradient error, allowed in float32 / float64
FULL_TOLERANCE = 1e-4
#: in bfloat16 / float16 (log-probs, gradient): over the tiny models of the tested families two correct
#: orders of summation differ by up to 2.3e-2 nats and 0.18 relative gradient error (DSA, whose top-k
#: flips under rounding; 0.02 and 0.07 elsewhere); a model that misreads its prompt state is off by
#: 0.02–0.4 nats in float32, so bf16 checks are weaker and fp32 checks are the ones to trust
HALF_TOLERANCE = (0.05, 0.25)


@dataclass
class CheckReport:
    """Outcome of `check`: `.ok`, the worst errors, and per-layer-kind detail."""

    ok: bool
    model_type: str
    dtype: str
    #: (log-prob, gradient) tolerance
    tolerance: tuple[float, float]
    prompt_length: int
    chunk_size: int
    response_length: int
    #: max abs difference of the response log-probs
    logprob_error: float = float("nan")
    #: relative error of the detached gradient (None: no trainable parameter or gradients not checked)
    grad_error: float | None = None
    #: layer kind → worst relative error of that kind's layer outputs at the response positions
    layer_errors: dict[str, float] = field(default_factory=dict)
    #: the first decoder layer whose output is off by more than the tolerance, and its kind
    first_bad_layer: int | None = None
    worst_kind: str | None = None
    #: what capture / replay raised, if anything (an attention variant longstraw does not implement, ...)
    error: str | None = None
    #: whether the prompt reached past every sliding window / attention chunk (False: a window longer than
    #: `MAX_CHECK_PROMPT`, whose edge the check did not exercise)
    covers_windows: bool = True
    seconds: float = 0.0

    def __str__(self) -> str:
        head = (f"longstraw self-check of {self.model_type} ({self.dtype}, P={self.prompt_length}, "
                f"chunk={self.chunk_size}, R={self.response_length}): {'ok' if self.ok else 'FAILED'}")
        lines = [head]
        if self.error is not None:
            lines.append(f"  error: {self.error}")
        else:
            lines.append(f"  response log-probs: max abs error {self.logprob_error:.2e} (tolerance {self.tolerance[0]:.0e})")
            if self.grad_error is not None:
                lines.append(f"  detached gradient: relative error {self.grad_error:.2e} (tolerance {self.tolerance[1]:.0e})")
            for kind, err in sorted(self.layer_errors.items()):
                lines.append(f"  {kind} layers: worst relative output error {err:.2e}")
            if self.first_bad_layer is not None:
                lines.append(f"  first layer off: {self.first_bad_layer} ({self.worst_kind})")
        if not self.covers_windows:
            lines.append("  note: the prompt did not reach past the longest sliding window / attention chunk")
        lines.append(f"  {self.seconds:.2f} s")
        return "\n".join(lines)


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(log-prob, gradient) tolerance for a model of `dtype`."""
    return (FULL_TOLERANCE, FULL_TOLERANCE) if dtype in (torch.float32, torch.float64) else HALF_TOLERANCE


def _reach(cfg) -> int:
    """The longest window or attention chunk of any layer (0: none)."""
    plan = layer_plan(cfg)
    reach = 0
    if "sliding_attention" in plan and getattr(cfg, "sliding_window", None):
        reach = max(reach, int(cfg.sliding_window))
    if "chunked_attention" in plan:
        reach = max(reach, int(cfg.attention_chunk_size))
    return reach


#: longest self-check prompt: past the sliding windows (4,096 for Mistral 7B) and attention chunks (8,192
#: for Llama 4) of the models people train, at the cost of one such forward and backward, once
MAX_CHECK_PROMPT = 16384


def check_shape(cfg, max_prompt: int = MAX_CHECK_PROMPT) -> tuple[int, int]:
    """(prompt length, chunk size): several chunks, past every window, a chunk that does not divide the
    captured length, within `max_prompt` tokens."""
    p = min(max(24, _reach(cfg) + 9), max_prompt)
    captured = p - 1
    chunk = max(2, captured // 3 + 1)
    while captured % chunk == 0:
        chunk += 1
    return p, chunk


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


def check(model, *, prompt_length: int | None = None, chunk_size: int | None = None, response_length: int = 5,
          gradients: bool = True, seed: int = 0) -> CheckReport:
    """Self-check of `model` (see the module docstring). Raises `UnsupportedArchitectureError` only for a model
    whose layers longstraw cannot represent at all; a numeric disagreement is reported, not raised."""
    from .reference import cache_reference_logprobs, full_sequence_logprobs
    from .state import capture

    start = time.perf_counter()
    parts = model_parts(model)
    cfg = parts.config
    p_auto, c_auto = check_shape(cfg)
    p = prompt_length or p_auto
    chunk = chunk_size or c_auto
    param = next(parts.model.parameters())
    tol = _tolerance(param.dtype)
    report = CheckReport(ok=False, model_type=cfg.model_type, dtype=str(param.dtype).replace("torch.", ""),
                         tolerance=tol, prompt_length=p, chunk_size=chunk, response_length=response_length,
                         covers_windows=p > _reach(cfg) + 1)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (p,), generator=gen).to(param.device)
    response = torch.randint(0, cfg.vocab_size, (response_length,), generator=gen).to(param.device)
    plan = layer_plan(cfg)
    with _untouched(parts.model):
        with torch.no_grad():
            ref_out, handles = _layer_outputs(parts.decoder, slice(p - 1, p - 1 + response_length))
            try:
                ref = full_sequence_logprobs(model, prompt, response)
            finally:
                for h in handles:
                    h.remove()
        try:
            state = capture(model, prompt, chunk_size=chunk, verify=False)
            with torch.no_grad():
                got_out, handles = _layer_outputs(parts.decoder, None)
                try:
                    got = state.replay(response).logprobs
                finally:
                    for h in handles:
                        h.remove()
            # capture's chunks ran through the hooks' layers too: keep the replay's outputs (the last ones)
            got_out = got_out[-len(ref_out):]
            report.logprob_error = (got - ref).abs().max().item()
            _layer_detail(report, plan, ref_out, got_out, tol[0])
            trainable = [q for q in model.parameters() if q.requires_grad]
            if gradients and trainable:
                report.grad_error = _grad_error(model, state, prompt, response, trainable, cache_reference_logprobs)
            state.release()
        except (NotImplementedError, RuntimeError, ValueError) as err:
            report.error = f"{type(err).__name__}: {err}"
    report.ok = (report.error is None and report.logprob_error <= tol[0]
                 and (report.grad_error is None or report.grad_error <= tol[1]))
    report.seconds = time.perf_counter() - start
    return report


def _layer_detail(report: CheckReport, plan, ref_out, got_out, tol: float) -> None:
    worst_kind, worst = None, -1.0
    for i, (kind, a, b) in enumerate(zip(plan, got_out, ref_out)):
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        report.layer_errors[kind] = max(report.layer_errors.get(kind, 0.0), err)
        if err > tol and report.first_bad_layer is None:
            report.first_bad_layer, report.worst_kind = i, kind
        if err > worst:
            worst_kind, worst = kind, err
    if report.worst_kind is None:
        report.worst_kind = worst_kind


def _grad_error(model, state, prompt, response, params, reference) -> float:
    weights = torch.linspace(-1.0, 1.0, response.numel(), device=prompt.device)
    with torch.enable_grad():  # the caller may be under no_grad (a capture for sampling)
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            ref = reference(model, prompt, response)
            g_ref = torch.autograd.grad((weights * ref).sum(), params, allow_unused=True)
        got = state.replay(response).logprobs
        g_got = torch.autograd.grad((weights * got).sum(), params, allow_unused=True)
    flat_got, flat_ref = [], []
    for a, b in zip(g_got, g_ref):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        flat_got.append(a.flatten().double())
        flat_ref.append(b.flatten().double())
    if not flat_ref:
        return 0.0
    got_all, ref_all = torch.cat(flat_got), torch.cat(flat_ref)
    return ((got_all - ref_all).norm() / ref_all.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------ at first use

_VERIFIED: dict[tuple, CheckReport] = {}


def configuration_key(model) -> tuple:
    """What makes two models the same configuration for the self-check: class, config, dtype, device, adapters."""
    base = base_model(model)
    param = next(base.parameters())
    cfg = json.dumps(base.config.to_dict(), sort_keys=True, default=str)
    adapters = type(model).__name__ if model is not base else None
    return type(base).__qualname__, cfg, str(param.dtype), param.device.type, adapters


def ensure_verified(model) -> CheckReport:
    """The self-check of this configuration, run once per process; `UnsupportedArchitectureError` if it fails."""
    key = configuration_key(model)
    report = _VERIFIED.get(key)
    if report is None:
        report = _VERIFIED[key] = check(model)
    if not report.ok:
        raise UnsupportedArchitectureError(
            f"{report.model_type}: longstraw does not reproduce this model (worst layer kind: {report.worst_kind}).\n"
            f"{report}")
    return report
