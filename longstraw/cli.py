"""Command line: `longstraw demo` (memory and time of one GRPO step, three ways, side by side)."""

from __future__ import annotations

import argparse
import sys


def demo(args) -> int:
    import warnings

    import torch

    # peft 0.21 reads a property that transformers 5.24 deprecates; nothing for a demo user to act on
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing.*")

    import longstraw
    from longstraw.compare import bench_model, format_table, measure_in_fresh_process
    from longstraw.reference import full_sequence_logprobs

    print(f"longstraw {longstraw.__version__} demo: one GRPO step on the tiny {args.model} model "
          f"(P={args.P} prompt tokens, G={args.G} responses of R={args.R}, LoRA, {args.threads} thread(s)).")
    print("Each method runs in a fresh process; step memory = peak RSS during the step - RSS before it.\n")
    rows = []
    for method in ("naive_batched", "naive_serial", "longstraw"):
        print(f"  measuring {method} ...", flush=True)
        rows.append(measure_in_fresh_process(args.model, method, args.P, args.G, args.R, args.threads))
    print()
    print(format_table(rows))
    ok = {r["method"]: r for r in rows if "step_mem_mb" in r}
    if "longstraw" in ok and "naive_serial" in ok:
        ls, ns = ok["longstraw"], ok["naive_serial"]
        print(f"\nlongstraw vs naive serial: {ns['step_mem_mb'] / max(ls['step_mem_mb'], 0.1):.1f}x less step memory, "
              f"{ns['wall_s'] / ls['wall_s']:.1f}x faster.")
    if "longstraw" in ok and "naive_batched" in ok:
        ls, nb = ok["longstraw"], ok["naive_batched"]
        print(f"longstraw vs naive batched: {nb['step_mem_mb'] / max(ls['step_mem_mb'], 0.1):.1f}x less step memory.")
    # the numbers are only worth it if the log-probs are the same
    torch.manual_seed(0)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="longstraw", description="GRPO on very long prompts: capture once, replay branches.")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="memory and time of one GRPO step: naive batched, naive serial, longstraw")
    d.add_argument("--model", choices=["dense", "hybrid"], default="dense", help="built-in tiny model (default dense)")
    d.add_argument("--P", type=int, default=4096, help="prompt tokens (default 4096)")
    d.add_argument("--G", type=int, default=8, help="responses per prompt (default 8)")
    d.add_argument("--R", type=int, default=64, help="tokens per response (default 64)")
    d.add_argument("--threads", type=int, default=1, help="torch threads per measurement (default 1)")
    args = ap.parse_args(argv)
    for name in ("P", "G", "R", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    return {"demo": demo}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
