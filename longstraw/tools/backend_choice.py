"""Which rollout backend to pick for a run: the own sampler or a vLLM server (`rollout_backend`).

Both sample the same responses; the trainer captures the prompt for its replay either way. What differs is the
sampling itself:
- the own sampler decodes from the captured state: nothing is prefilled again, but its decode loop is slower;
- vLLM prefills the prompt again (its prefix cache shares it over the G samples) and decodes faster, and it holds
  the whole prompt's K/V in one process of its own (not split over context-parallel ranks).
So vLLM pays back when the responses are long enough that its faster decode outweighs the second prefill:
R > R*(P) = prefill(P) / (t_own(P) − t_vllm(P)), with t_*(P) the seconds of one decode step of the G rows at
context P. The three curves are fitted to `python bench/rollout_backends.py` (SmolLM2-135M float32, G = 8, 2 threads
of a 2-core CPU; bench/results/rollout_backends.md): decode steps from R = 32 and 256 at P = 2K and 6K (linear in
P), vLLM's prefill from its time at R = 0 (quadratic in P). R*(P) is 38 tokens at P = 2K, 55 at 6K, 130 at 32K:
the measured winners at the four measured points (and at 32K on Gemma 3, own 6.4 s against vLLM's 116 s at R = 32).
On another machine (a GPU: a much faster vLLM decode) R* is smaller; the memory condition below holds anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

#: seconds of one decode step of 8 rows at context P: a + b·P (own sampler, vLLM), and vLLM's prefill c·P + d·P²
_OWN = (0.0668, 5.84e-5)
_VLLM = (0.0419, 8.47e-6)
_PREFILL = (2.10e-3, 1.40e-7)


@dataclass(frozen=True)
class BackendChoice:
    """The recommended `rollout_backend` ("own" or "vllm") and why."""

    backend: str
    reason: str
    #: the response length past which vLLM's faster decode pays for its prefill (tokens)
    break_even: float
    #: what a vLLM server holds for the run (its weights + the prompt's and the samples' K/V), bytes
    vllm_bytes: int


def break_even_tokens(prompt_length: int) -> float:
    """R*(P) (see the module doc)."""
    p = float(prompt_length)
    prefill = _PREFILL[0] * p + _PREFILL[1] * p * p
    saved = (_OWN[0] - _VLLM[0]) + (_OWN[1] - _VLLM[1]) * p
    return prefill / saved


def choose_backend(
    prompt_length: int, completion_length: int, vllm_bytes: int, device_bytes: int | None = None
) -> BackendChoice:
    """`vllm_bytes`: what the server would hold (weights + K/V of the prompt and the G samples, unsplit);
    `device_bytes`: the device's memory (None: unknown, the time rule alone)."""
    r_star = break_even_tokens(prompt_length)
    if device_bytes is not None and vllm_bytes > device_bytes:
        return BackendChoice(
            "own",
            f"a vLLM server would hold {vllm_bytes / 2**30:.1f} GiB (weights + the whole prompt's K/V, not split "
            f"over ranks), more than the device's {device_bytes / 2**30:.0f} GiB",
            r_star,
            vllm_bytes,
        )
    if completion_length > r_star:
        return BackendChoice(
            "vllm",
            f"R = {completion_length} > R* ≈ {r_star:.0f} tokens at P = {prompt_length:,}: vLLM's faster decode pays "
            "for its second prefill of the prompt (fitted on a 2-core CPU: bench/results/rollout_backends.md)",
            r_star,
            vllm_bytes,
        )
    return BackendChoice(
        "own",
        f"R = {completion_length} ≤ R* ≈ {r_star:.0f} tokens at P = {prompt_length:,}: decoding from the captured "
        "state costs less than vLLM's second prefill of the prompt (fitted on a 2-core CPU: "
        "bench/results/rollout_backends.md)",
        r_star,
        vllm_bytes,
    )
