"""How long a run takes: a GRPO step's stages from the model's arithmetic and this machine's measured rates.

`predict_time(PlanConfig, Rates, questions=Q, recapture_every=k, steps=n)` counts, from a transformers config alone,
the matrix-product FLOPs of each stage and divides them by the rate this machine reaches on that stage's products:

- `capture` (the document, P tokens, once per `recapture_every` steps): the decoder's linear layers, 2 FLOPs per
  weight and token (`linear_per_token`), and attention, 4 × query width per (query, key) pair, each query seeing every
  earlier key on a full-attention layer and `window` keys on a sliding one (`keys_seen`); no LM head;
- `sample` (Q questions × G responses decoded together, R steps): per step the linear layers and the LM head of the
  Q·G rows, their attention over P + t keys (at the rate of the kernel the decode uses: `gemm_cpu` up to 256 query
  rows per key head, the SIMD kernel above, `sample_wide`), and one read of the prompt state (its bytes at the copy
  rate: a decode step reads the whole state once, whatever its arithmetic);
- `replay` (the Q·G responses with autograd): forward and backward of the linear layers with frozen base weights
  (2 × forward: the input gradient only), the LM head three times (forward, the chunked log-probs' recompute, the
  input gradient), attention forward (4 per pair) and its query-only backward (6 per pair: the scores again, dP, dQ);
- `optimizer`: AdamW over the trainable parameters (a read and write of weights, gradients and two moments).

`step` = capture / recapture_every + sample + replay + optimizer; `run` = steps × step. The rates (`Rates`) come from
`calibrate()`: `torch.mm` on each stage's linear shape and longstraw's own attention kernels
(`longstraw.ops.attention.prompt_forward` / `prompt_backward`) on the stage's attention shape at the model's widths,
and `Tensor.copy_` for memory — a few seconds, cached per machine, threads, dtype and widths
(`~/.cache/longstraw/rates/`). `published_rates("h100")` gives a GPU's published peak rates instead: its times are
an estimate (a lower bound: real kernels reach a fraction of the peak). Layers without attention over the prompt
(linear attention, state-space) count their projections only. What a step spends outside the products (Python,
small ops) is not counted: measured stages ran 1.2–3× these floors before the kernels reached them
(`bench/step_anatomy.py`); `bench/plan_time.py` compares predictions with measured runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from ..api import capture
from ..model.capability import layer_plan
from ..model.chunking import auto_chunk_size, config_value, dimensions
from ..ops.attention import Part, prompt_backward, prompt_forward
from ..ops.kernels.gemm import GEMM_MAX_ROWS
from ..paths import cache_dir
from ..ragged import sample_branches
from ..replay.batched import replay_batch
from .planner import PlanConfig, load_config, plan

STAGES = ("capture", "sample", "replay")


@dataclass(frozen=True)
class Rates:
    """FLOP/s of the linear layers' products (`matmul`) and of attention (`attention`; `attention_backward` for the
    replay's query-only backward) per stage, and bytes/s of a memory copy. `source`: where they come from."""

    matmul: dict
    attention: dict
    attention_backward: float
    copy: float
    source: str
    measured: bool = True
    #: seconds outside the matrix products, measured on the model itself (`measure_overheads`): per prompt token
    #: (`capture`), per replayed token (`replay`), per decode step (`decode_step`), per decode step and row
    #: (`decode_row`) and per question read into its row's branch (`question`); None: not counted
    overheads: dict | None = None

    def __post_init__(self):
        for name in ("matmul", "attention"):
            got = getattr(self, name)
            # attention may add `sample_wide`: a decode of more than GEMM_MAX_ROWS query rows per key head
            extra = set(got) - set(STAGES) - ({"sample_wide"} if name == "attention" else set())
            if not set(STAGES) <= set(got) or extra or not all(v > 0 for v in got.values()):
                raise ValueError(f"Rates.{name} needs a positive rate for each of {STAGES}; got {got}")
        if not (self.attention_backward > 0 and self.copy > 0):
            raise ValueError("Rates: attention_backward and copy must be > 0")


#: published dense peak rates (FLOP/s for bf16 tensor cores, bytes/s of HBM) of the GPUs a plan can be asked about
PUBLISHED = {
    "h100": (989e12, 3.35e12, "NVIDIA H100 SXM, published bf16 dense peak 989 TFLOP/s, HBM3 3.35 TB/s"),
    "h200": (989e12, 4.8e12, "NVIDIA H200, published bf16 dense peak 989 TFLOP/s, HBM3e 4.8 TB/s"),
    "a100": (312e12, 2.0e12, "NVIDIA A100 80GB, published bf16 dense peak 312 TFLOP/s, HBM2e 2.0 TB/s"),
}


def published_rates(gpu: str) -> Rates:
    """A GPU's published peak rates for every stage: times from them are estimates (lower bounds)."""
    if gpu not in PUBLISHED:
        raise ValueError(f"unknown GPU {gpu!r}; known: {sorted(PUBLISHED)}")
    flops, bw, what = PUBLISHED[gpu]
    every = {s: flops for s in STAGES}
    return Rates(every, dict(every), flops, bw, f"{what} (estimate: peak rates)", measured=False)


# ----------------------------------------------------------------------------------------------- the arithmetic


def linear_per_token(cfg) -> int:
    """Weights of the decoder's linear layers one token passes through (MoE: the routed experts it uses and the
    shared ones), summed over layers: a token's forward costs 2 FLOPs per weight."""
    d = dimensions(cfg)
    attn = 2 * d["h"] * d["q"] + 2 * d["h"] * d["kv"]
    return d["layers"] * (attn + 3 * d["h"] * d["i"])


def windows(cfg) -> list[int | None]:
    """Per layer: None for attention over every earlier key, an int for a window of that many keys, 0 for a layer
    that reads no keys (linear attention, state-space: its cost is its projections)."""
    out: list[int | None] = []
    window = config_value(cfg, "sliding_window", None)
    for kind in layer_plan(cfg):
        if kind in ("sliding_attention", "sliding_attention_sinks"):
            out.append(int(window) if window else None)
        elif "attention" in kind or kind in ("mla", "dsa", "compressed_attention"):
            out.append(None)
        else:
            out.append(0)
    return out


def keys_seen(cfg, first: int, last: int) -> int:
    """Σ over layers and over queries at positions first..last − 1 of the keys each sees (itself included)."""
    total = 0
    for w in windows(cfg):
        if w == 0:
            continue
        full = (last * (last + 1) - first * (first + 1)) // 2
        if w is None:
            total += full
        else:
            # positions below w see p + 1 keys, the rest w
            ramp_end = min(max(first, w - 1), last)
            ramp = ((ramp_end * (ramp_end + 1)) - first * (first + 1)) // 2 if ramp_end > first else 0
            total += ramp + w * (last - max(first, ramp_end))
    return total


@dataclass
class StepTime:
    """Predicted seconds per stage, per step and per run, with the FLOPs they came from."""

    capture: float
    sample: float
    replay: float
    optimizer: float
    step: float
    run: float
    flops: dict
    rates: str
    estimate: bool
    settings: dict

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def __str__(self) -> str:
        label = "estimate from published peak rates" if self.estimate else "this machine's measured rates"
        k, n = self.settings["recapture_every"], self.settings["steps"]
        lines = [
            f"{'time':>34}: {label} ({self.rates})",
            f"{'capture (once per document)':>34}: {_span(self.capture)}",
            f"{'sample':>34}: {_span(self.sample)}",
            f"{'replay':>34}: {_span(self.replay)}",
            f"{'optimizer':>34}: {_span(self.optimizer)}",
            f"{f'step (capture every {k})':>34}: {_span(self.step)}",
            f"{f'run ({n} steps)':>34}: {_span(self.run)}",
        ]
        return "\n".join(lines)


def _span(s: float) -> str:
    if s < 1:
        return f"{s * 1000:10.2f} ms"
    if s < 120:
        return f"{s:10.2f} s"
    if s < 7200:
        return f"{s / 60:10.1f} min"
    return f"{s / 3600:10.2f} h"


def predict_time(
    pc: PlanConfig, rates: Rates, questions: int = 1, recapture_every: int = 1, steps: int = 1
) -> StepTime:
    """Seconds of each stage of a GRPO step of `pc` (one document, `questions` rows of it, G responses each; see the
    module docstring) at `rates`."""
    if questions < 1 or recapture_every < 1 or steps < 1:
        raise ValueError("plan: questions, recapture_every and steps must be >= 1")
    cfg = load_config(pc.model)
    d = dimensions(cfg)
    p, r, g = pc.prompt_length, pc.completion_length, pc.num_generations
    rows = questions * g
    lin = linear_per_token(cfg)
    ranks = pc.context_parallel * pc.fsdp
    # capture: the prompt's linear layers and attention (context parallel: each rank a 1 / CP slice)
    cap_lin = 2 * lin * p
    cap_att = 4 * d["q"] * keys_seen(cfg, 0, p)
    capture = (cap_lin / rates.matmul["capture"] + cap_att / rates.attention["capture"]) / pc.context_parallel
    # sampling: R decode steps of Q·G rows (the questions' own tokens read first, as a short capture of each)
    suffix = pc.row_suffix * questions
    dec_lin = 2 * lin * rows * r + 2 * d["h"] * d["vocab"] * rows * r + 2 * lin * suffix
    pairs = rows * keys_seen(cfg, p + pc.row_suffix, p + pc.row_suffix + r)
    dec_att = 4 * d["q"] * (pairs + keys_seen(cfg, p, p + pc.row_suffix) * questions)
    planned = plan(pc)  # the durable state's and the optimizer's bytes
    state = planned.durable_state
    # the decode's prompt part: `gemm_cpu` up to GEMM_MAX_ROWS query rows per key head, the SIMD kernel above
    # (`longstraw.ops.kernels`), each at its own rate where the calibration measured both
    group = max(1, d["q"] // max(d["kv"], 1))
    wide = rows * group > GEMM_MAX_ROWS and "sample_wide" in rates.attention
    att_rate = rates.attention["sample_wide" if wide else "sample"]
    sample = (dec_lin / rates.matmul["sample"] + dec_att / att_rate + r * state / rates.copy) / ranks
    # replay: forward and input-gradient backward of every response
    tokens = rows * r
    rep_lin = 2 * (2 * lin * tokens) + 3 * (2 * d["h"] * d["vocab"] * tokens)
    batches = math.ceil(rows / max(1, pc.replay_batch))
    replay = (
        rep_lin / rates.matmul["replay"]
        + 4 * d["q"] * pairs / rates.attention["replay"]
        + 6 * d["q"] * pairs / rates.attention_backward
        + 2 * batches * state / rates.copy
    ) / ranks
    if rates.overheads is not None:  # what is not a matrix product: per token, decode step and row
        o = rates.overheads
        capture += o["capture"] * p / pc.context_parallel
        sample += (r * (o["decode_step"] + o["decode_row"] * rows) + o["capture"] * suffix) / ranks
        if pc.row_suffix:  # each question read by a forward of its own (fork + extend): the weights read once each
            sample += questions * o.get("question", 0.0) / ranks
        replay += o["replay"] * tokens / ranks
    trainable = planned.optimizer  # bytes of the trainable weights, their gradients and moments
    optimizer = 2 * trainable / rates.copy
    step = capture / recapture_every + sample + replay + optimizer
    settings = {
        "questions": questions,
        "recapture_every": recapture_every,
        "steps": steps,
        "prompt_length": p,
        "num_generations": g,
        "completion_length": r,
        "replay_batch": pc.replay_batch,
    }
    flops = {"capture": cap_lin + cap_att, "sample": dec_lin + dec_att, "replay": rep_lin + 10 * d["q"] * pairs}
    return StepTime(
        capture, sample, replay, optimizer, step, steps * step, flops, rates.source, not rates.measured, settings
    )


# ----------------------------------------------------------------------------------------------- the calibration


def _best(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(model, dtype: str = "fp32", cache: bool = True, keys: int = 8192, overheads: bool = False) -> Rates:
    """This machine's rates at `model`'s widths (a config, folder or tiny family name) in `dtype`, with torch's
    current threads: `torch.mm` on each stage's linear shape (capture: a chunk of tokens; sample: the Q·G = 64 rows
    of a decode step, through the LM head; replay: 8 × 16 response tokens) and the attention kernels on `keys` prompt
    keys (capture: a 1,024-query chunk; sample: 64 rows of one query; replay: 8 × 16 queries, forward and the
    query-only backward); `Tensor.copy_` of 256 MiB. Cached in `cache_dir("rates")` by CPU, threads, torch, dtype and
    widths."""
    cfg = load_config(model)
    d = dimensions(cfg)
    heads = config_value(cfg, "num_attention_heads", 1)
    head_dim = d["q"] // heads
    kv_heads = max(1, d["kv"] // head_dim)
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    threads = torch.get_num_threads()
    widths = "-".join(str(d[n]) for n in ("h", "q", "kv", "i", "vocab", "layers"))
    source = str(Path(model).resolve()) if isinstance(model, (str, Path)) and Path(model).exists() else str(model)
    # the overheads are the model's own: its folder (or its family's name) is in the key
    key = f"{_cpu_name()}|{threads}|{torch.__version__}|{dtype}|{widths}|{keys}|{overheads and source}|sample_wide"
    path = cache_dir("rates") / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json") if cache else None
    if path is not None and path.is_file():
        got = json.loads(path.read_text())
        if got.get("key") == key:
            return Rates(**got["rates"])
    wall0, cpu0 = time.perf_counter(), time.process_time()

    def mm(m, k, n):
        a, b = torch.randn(m, k, dtype=tdtype), torch.randn(k, n, dtype=tdtype)
        return 2 * m * k * n / _best(lambda: torch.mm(a, b))

    chunk = min(auto_chunk_size(cfg, 4 * keys, dtype), 2048)
    matmul = {
        "capture": mm(chunk, d["h"], d["i"]),
        "sample": mm(64, d["h"], min(d["vocab"], 65536)),
        "replay": mm(128, d["h"], d["i"]),
    }
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, kv_heads, keys, head_dim, generator=g).to(tdtype)
    v = torch.randn(1, kv_heads, keys, head_dim, generator=g).to(tdtype)
    scale = head_dim**-0.5

    def att(b, q_rows, backward=False):
        q = torch.randn(b, heads, q_rows, head_dim, generator=g).to(tdtype)
        part = Part(
            q_start=keys,
            k_start=0,
            window=None,
            softcap=None,
            scale=scale,
            block=1024,
            q_period=q_rows if b > 1 else None,
        )
        flops = 4 * b * heads * q_rows * keys * head_dim
        if not backward:
            return flops / _best(lambda: prompt_forward(q, k, v, part))
        out, lse = prompt_forward(q, k, v, part)
        grad = torch.randn_like(out)
        return 1.5 * flops / _best(lambda: prompt_backward(grad, q, k, v, out, lse, part, False, None))

    with torch.no_grad():
        # decode: 64 rows, and rows enough for more than GEMM_MAX_ROWS query rows per key head (another kernel)
        wide_rows = GEMM_MAX_ROWS // max(1, heads // kv_heads) + 64
        attention = {
            "capture": att(1, 1024),
            "sample": att(64, 1),
            "sample_wide": att(wide_rows, 1),
            "replay": att(8, 16),
        }
        attention_backward = att(8, 16, backward=True)
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    copy = src.numel() * 4 / _best(lambda: dst.copy_(src))
    rates = Rates(
        matmul,
        attention,
        attention_backward,
        copy,
        f"{_cpu_name()}, {threads} threads, torch {torch.__version__}, {dtype}, measured",
    )
    if overheads:
        rates = replace(rates, overheads=measure_overheads(model, cfg, dtype, rates))
    busy = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    if threads > 1 and busy < BUSY_FRACTION * threads:
        # other processes had the cores: these rates are not this machine's; said, and not cached
        return replace(rates, source=f"{rates.source} on a busy machine ({busy:.1f} CPU s per s of {threads} threads)")
    if path is not None:
        path.write_text(json.dumps({"key": key, "rates": asdict(rates)}, indent=1))
    return rates


#: a calibration whose process got less than this fraction of its threads' CPU time shared the cores with others
BUSY_FRACTION = 0.75


#: the prompt, decode and replay sizes `measure_overheads` runs the model at
OVERHEAD_PROMPT, OVERHEAD_STEPS, OVERHEAD_ROWS, OVERHEAD_REPLAY = 2048, 16, (1, 8), (8, 16)
#: G of the decode: each of OVERHEAD_ROWS questions (branches of the prompt) decodes this many rows
OVERHEAD_G = 8
#: a model of more parameters than this is not run from its config alone (its overheads are not counted)
OVERHEAD_MAX_PARAMS = 1_000_000_000


def _overhead_model(source, cfg, dtype: str):
    """The model `measure_overheads` runs: a local folder's weights, else random weights from the config (a tiny
    family, a config.json), LoRA r 16 on every linear layer (the trainer's default); None where it cannot be built
    here or is too large to build from a config."""
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    try:
        if isinstance(source, (str, Path)) and (Path(source) / "config.json").exists():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=tdtype)
        else:
            d = dimensions(cfg)
            if 2 * d["vocab"] * d["h"] + linear_per_token(cfg) > OVERHEAD_MAX_PARAMS:
                return None
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, dtype=tdtype)
        return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    except Exception:  # a config transformers cannot build from alone (a multimodal wrapper, a remote class)
        return None


def measure_overheads(source, cfg, dtype: str, rates: Rates) -> dict | None:
    """Seconds outside the matrix products per unit of each stage (`Rates.overheads`), measured on the model itself
    (`_overhead_model`) through longstraw's own code: it captures OVERHEAD_PROMPT tokens, decodes OVERHEAD_STEPS
    steps of 1 and of 8 questions × OVERHEAD_G rows (branches of the prompt, decoded together as the trainer does)
    and replays 8 responses of 16 tokens together with backward; each time less `predict_time`'s products for the
    same work, per prompt token (`capture`), decode step (`decode_step`) and step and row (`decode_row`), question
    read into its row's branch (`question`: a fork and an extend of 8 tokens, a forward that reads every weight for a
    few tokens), and replayed token (`replay`). None where the model cannot be run here."""
    model = _overhead_model(source, cfg, dtype)
    if model is None:
        return None
    vocab = min(dimensions(cfg)["vocab"], 32000)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (OVERHEAD_PROMPT,), generator=g)
    with torch.no_grad():
        cap_s = _best(lambda: capture(model, prompt).release(), reps=2)
    prompt_q = OVERHEAD_PROMPT + 8  # the decode reads the prompt and a question's 8 tokens
    base = PlanConfig(cfg, prompt_q, num_generations=OVERHEAD_G, completion_length=OVERHEAD_STEPS, dtype=dtype)
    bare = replace(rates, overheads=None)
    out = {"capture": max(0.0, cap_s - predict_time(base, bare).capture) / OVERHEAD_PROMPT}
    state = capture(model, prompt)
    try:
        per_step = []
        for q in OVERHEAD_ROWS:
            with contextlib.ExitStack() as stack, torch.no_grad():
                branches = [stack.enter_context(state.fork()) for _ in range(q)]
                for b in branches:  # each question's own tokens (not timed: the capture's cost per token)
                    b.extend(torch.randint(0, vocab, (8,), generator=g))
                took = _best(lambda bs=branches: sample_branches(bs, OVERHEAD_G, OVERHEAD_STEPS, generator=g), reps=3)
            products = predict_time(base, bare, questions=q).sample
            per_step.append(max(0.0, took - products) / OVERHEAD_STEPS)
        question = torch.randint(0, vocab, (8,), generator=g)

        def read_question():
            with state.fork() as branch, torch.no_grad():
                branch.extend(question)

        one = replace(base, row_suffix=8)
        question_products = predict_time(one, bare).sample - predict_time(base, bare).sample
        out["question"] = max(0.0, _best(read_question, reps=3) - question_products)
        (q1, q8), (r1, r8) = OVERHEAD_ROWS, per_step
        out["decode_row"] = max(0.0, (r8 - r1) / ((q8 - q1) * OVERHEAD_G))
        out["decode_step"] = max(0.0, r1 - out["decode_row"] * q1 * OVERHEAD_G)
        k, n = OVERHEAD_REPLAY
        responses = [torch.randint(0, vocab, (n,), generator=g) for _ in range(k)]

        def replay():
            outs = replay_batch(state, responses)
            torch.stack([o.logprobs.sum() for o in outs]).sum().backward()

        rep_s = _best(replay, reps=2)
        plan_k = replace(base, prompt_length=OVERHEAD_PROMPT, num_generations=k, completion_length=n, replay_batch=k)
        out["replay"] = max(0.0, rep_s - predict_time(plan_k, bare).replay) / (k * n)
    finally:
        state.release()
    return out
