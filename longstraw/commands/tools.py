"""The commands about a model rather than a run, each behind a tool (`longstraw.tools`) or the self-check:
`longstraw compare`, `check`, `plan`, `real` and `vllm-serve`."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import longstraw
from longstraw.model.oracles import full_sequence_logprobs
from longstraw.testing.models import TINY_CONFIGS, TINY_MULTIMODAL, tiny_model
from longstraw.tools.compare import bench_model, format_table, measure_in_fresh_process
from longstraw.tools.planner import PlanConfig, plan
from longstraw.tools.step_time import calibrate, predict_time, published_rates

from ..model.positions import coverage, position_note
from ..tools.real_models import model_path
from ..train import vllm_server
from ..train.vllm_client import save_untied


def cmd_compare(args) -> int:
    print(
        f"one GRPO step on the tiny {args.model} model (P={args.P} prompt tokens, G={args.G} responses of "
        f"R={args.R}, LoRA, {args.threads} thread(s)), each method in a fresh process; "
        "step memory = peak RSS during the step - RSS before it.\n"
    )
    rows = []
    for method in ("naive_batched", "naive_serial", "longstraw"):
        print(f"  measuring {method} ...", flush=True)
        rows.append(
            measure_in_fresh_process(
                args.model,
                method,
                args.P,
                args.G,
                args.R,
                args.threads,
                limit_gb=args.limit_gb if method.startswith("naive") else None,
            )
        )
    print()
    print(format_table(rows))
    ok = {r["method"]: r for r in rows if "step_mem_mb" in r}
    if "longstraw" in ok and "naive_serial" in ok:
        ls, ns = ok["longstraw"], ok["naive_serial"]
        print(
            f"\nlongstraw vs naive serial: {ns['step_mem_mb'] / max(ls['step_mem_mb'], 0.1):.1f}x less step memory, "
            f"{ns['wall_s'] / ls['wall_s']:.1f}x faster."
        )
    model = bench_model(args.model).eval()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (min(args.P, 2048),), generator=g)
    response = torch.randint(0, model.config.vocab_size, (args.R,), generator=g)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=512) as state:
            diff = (state.replay(response).logprobs - ref).abs().max().item()
    print(f"check: replay log-probs vs one full-sequence forward (P={prompt.numel()}): max |diff| = {diff:.2e}")
    return 0 if len(ok) == len(rows) else 1


def cmd_check(args) -> int:
    """Self-check of a local model folder (or a built-in tiny family) against the unmodified model."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.model in TINY_CONFIGS or args.model in TINY_MULTIMODAL:
        model = tiny_model(args.model, dtype=dtype)
    else:
        path = Path(args.model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} is neither a model folder with a config.json nor a built-in tiny "
                f"family ({', '.join(longstraw.tested_families())})"
            )
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    model = model.to(args.device).eval()
    if not args.gradients:
        model.requires_grad_(False)
    try:
        report = longstraw.check(model)
    except longstraw.UnsupportedArchitectureError as err:
        print(f"longstraw check: refused: {err}")
        return 1
    print(report)
    c = coverage(model.config)
    if c.native is not None:
        scaled = f", RoPE scaling {c.rope_type} × {c.factor:g} covering {c.covered:,}" if c.factor > 1 else ""
        print(f"  positions: pretrained {c.native:,}{scaled}")
    note = position_note(model.config, args.P) if args.P else None
    if note is not None:
        print(f"  note: {note}")
    return 0 if report.ok else 1


def cmd_plan(args) -> int:
    """Per-rank memory breakdown of a run from a model's config (see `longstraw.tools.planner`)."""
    pc = PlanConfig(
        args.model,
        args.P,
        num_generations=args.G,
        completion_length=args.R,
        prompt_grad=args.prompt_grad,
        dtype=args.dtype,
        state_dtype=args.state_dtype,
        state_offload=args.offload,
        lora_rank=args.lora_rank,
        chunk_size=args.chunk_size,
        context_parallel=args.context_parallel,
        fsdp=args.fsdp,
        expert_parallel=args.expert_parallel,
        checkpoint_layers=args.checkpoint_layers,
        device_memory_gib=args.device_memory_gib,
        row_suffix=args.row_suffix,
        replay_batch=args.replay_batch,
    )
    result = plan(pc)
    timed = None
    if args.time or args.gpu or args.Q or args.recapture_every or args.steps:
        # the time of the same run; the state read from device memory (offloaded or not: it is read each step)
        timed = _plan_time(args, dataclasses.replace(pc, state_offload=False))
    if args.json:
        data = json.loads(result.to_json())
        if timed is not None:
            data["time"] = json.loads(timed.to_json())
        print(json.dumps(data, indent=1))
    else:
        print(result)
        if timed is not None:
            print(timed)
    return 1 if result.fits is False else 0


def _plan_time(args, pc: PlanConfig):
    """`longstraw plan`'s time prediction: this machine's rates (measured once, cached) or a GPU's published ones."""
    if args.gpu:
        rates = published_rates(args.gpu)
    else:
        print("longstraw: this machine's rates (measured once for these widths, then cached) ...", file=sys.stderr)
        rates = calibrate(args.model, args.dtype, overheads=not args.products_only)
        if "busy machine" in rates.source:
            print(
                f"longstraw: warning: {rates.source}: the times below are not this machine's; run again on quiet "
                "cores (the rates are not cached)",
                file=sys.stderr,
            )
    return predict_time(pc, rates, args.Q or 1, args.recapture_every or 1, args.steps or 1)


def cmd_real(args) -> int:
    try:
        print(model_path(args.name))
    except RuntimeError as err:
        print(f"longstraw: error: {err}", file=sys.stderr)
        return 1
    return 0


def cmd_vllm_serve(args) -> int:
    """Create the vLLM environment if needed; with a model, serve it on 127.0.0.1 until interrupted."""
    vllm_server.ensure_environment()
    print(f"longstraw: the vLLM environment is {vllm_server.environment()}")
    if args.setup:
        return 0
    if args.model is None or not Path(args.model).is_dir():
        print("longstraw: error: vllm-serve needs a local model folder (or --setup)", file=sys.stderr)
        return 2
    model = Path(args.model)
    if not args.lora_rank:  # full fine-tuning: the weights are reloaded every step, into an untied copy
        if getattr(AutoConfig.from_pretrained(model), "tie_word_embeddings", False):
            untied = model.parent / f"{model.name}-untied"
            print(f"longstraw: {model} ties its embeddings: serving an untied copy written to {untied}", flush=True)
            save_untied(AutoModelForCausalLM.from_pretrained(model), untied, AutoTokenizer.from_pretrained(model))
            model = untied
    print(f"longstraw: starting vLLM on {model} (the first start compiles for a minute or more) ...", flush=True)
    server = vllm_server.start(
        model,
        port=args.port,
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        max_model_len=args.max_model_len,
        kv_cache_gb=args.kv_cache_gb,
    )
    print(f"longstraw: vLLM serves {args.model} at {server.url} (log {server.log_path}); set vllm_url: {server.url}")
    # SIGTERM (a job scheduler's stop) ends the wait as Ctrl-C does; the caller's handler is back on return
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while server.alive():
            time.sleep(1.0)
        print(f"longstraw: the vLLM server exited; its log ends:\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if previous is not None:  # None: a handler set outside Python, which Python cannot put back
            signal.signal(signal.SIGTERM, previous)
        server.stop()
