"""The peak memory of one replay batch against what the planner prices it at, in a fresh process per configuration.

    python bench/replay_peak.py          # → bench/results/replay_peak.{json,md}

Each configuration (model, document length P, k responses of R tokens) runs in its own process with glibc's mmap
threshold fixed at 128 KiB (`MALLOC_MMAP_THRESHOLD_`: freed temporaries return to the system instead of staying in
RSS): capture the document (the many-questions task's, fp32, LoRA r 16 on every linear layer, 2 threads), one warm-up
replay of 2 responses with backward, then `replay_batch` of k random responses of R tokens, forward and backward.
Measured: the peak resident memory above what the process held before the batch (its graphs, the LM head's tile, the
adapters' gradients; the prompt state and the weights were there already), after the forward and after the backward.
Beside it: `k × replay_graph_bytes` (`longstraw.model.chunking`), what `replay_batch: auto` fits within
`replay_memory_mb`. The same k at two P shows whether the peak depends on the prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
#: (model, P, k): the trainer's widest batch at Q = 8, G = 8, R = 16 (bench/step_anatomy.py), Gemma 3 at two lengths
CONFIGS = [("smollm2", 6144, 22), ("gemma3", 16384, 32), ("gemma3", 32768, 32)]


def one(model: str, length: int, k: int, r: int) -> dict:
    """Measure one configuration in this process (see the module doc)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import longstraw
    from longstraw.model.capability import layer_plan
    from longstraw.model.chunking import replay_graph_bytes
    from longstraw.replay.batched import replay_batch
    from longstraw.tools.real_models import model_path
    from longstraw.train.memory import peak_rss_mb, reset_peak, rss_mb, trim_heap

    sys.path.insert(0, str(HERE))
    from _bench import document_rows

    torch.set_num_threads(2)
    torch.manual_seed(0)
    folder = model_path(model)
    tok = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    net = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    row = document_rows(tok, length, 1, seed=0, name="doc")[0]
    ids = (
        tok.apply_chat_template(row["messages"], add_generation_prompt=True, return_dict=False)
        if "messages" in row
        else tok(row["prompt"])["input_ids"]
    )
    ids = torch.tensor(ids["input_ids"] if isinstance(ids, dict) else ids)
    state = longstraw.capture(net, ids)
    vocab = net.config.vocab_size
    responses = [torch.randint(0, vocab, (r,)) for _ in range(k)]
    outs = replay_batch(state, responses[:2])  # warm-up: first-call allocations, the adapters' gradients
    torch.stack([o.logprobs.sum() for o in outs]).sum().backward()
    del outs
    trim_heap()
    rss0 = rss_mb()
    reset_peak()
    outs = replay_batch(state, responses)
    forward = peak_rss_mb() - rss0
    torch.stack([o.logprobs.sum() for o in outs]).sum().backward()
    del outs
    peak = peak_rss_mb() - rss0
    graph = replay_graph_bytes(net.config, layer_plan(net.config), 4, r, r, False)
    return dict(model=model, P=int(ids.numel()), k=k, R=r, forward_peak_mib=forward, peak_mib=peak,
                planned_mib=k * graph / 2**20, graph_mib_each=graph / 2**20, state_mib=state.nbytes / 2**20)


def table(rows: list[dict]) -> str:
    lines = ["`python bench/replay_peak.py`", "",
             "| model | P | k × R | peak after forward (MiB) | peak, forward + backward (MiB) | planned: k × replay_graph_bytes "
             "(MiB) | peak / planned | state (MiB) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in rows:
        lines.append(f"| {x['model']} | {x['P']:,} | {x['k']} × {x['R']} | {x['forward_peak_mib']:.0f} | "
                     f"{x['peak_mib']:.0f} | {x['planned_mib']:.0f} | {x['peak_mib'] / x['planned_mib']:.2f} | "
                     f"{x['state_mib']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--R", type=int, default=16)
    ap.add_argument("--one", nargs=3, default=None, help=argparse.SUPPRESS)  # model P k: measure in this process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), int(a.one[2]), a.R)), flush=True)
        return 0
    rows = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for model, length, k in CONFIGS:
        got = subprocess.run([sys.executable, __file__, "--R", str(a.R), "--one", model, str(length), str(k)], env=env,
                             check=True, capture_output=True, text=True)
        rows.append(json.loads(got.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    out = RESULTS / "replay_peak"
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    raise SystemExit(main())
