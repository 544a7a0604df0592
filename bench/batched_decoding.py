"""Decoding branches of one prompt together (`longstraw.ragged`) against one branch after another.

    python bench/batched_decoding.py                  # SmolLM2 float32: rows of a 6K document, an agent at 2K
    → bench/results/batched_decoding.{json,md,png}
    python bench/batched_decoding.py --model gemma3 --cases rows --length 4096 --Q 8 --R 16
    → bench/results/batched_decoding-gemma3.{json,md,png}   (Gemma 3 270M: sliding windows, a 262K vocabulary)

Two cases, each timed both ways twice (alternating, after a warm-up), in one process on 2 threads; both ways draw
the same tokens (checked: each row or trajectory has a generator of its own), so they do the same work:

- `rows`: Q questions of one document of about LENGTH tokens (`longstraw.tasks.documents`, in SmolLM2's chat
  template), the document captured once, each row's question read into a branch of its own, then G = 8 responses
  of exactly R tokens per row (`ignore_eos`): all Q · G sequences in one ragged batch (`sample_branches`) against
  `sample(branch, G, ...)` row after row (issue 35: what a step of Q rows of one document samples).
- `agent`: G = 8 trajectories of the lookup environment (tests/agent/test_agent.py; a turn without the value calls
  `lookup("k1")`) after a prompt of about AGENT_LENGTH tokens (the document's start + the instruction), up to 4 turns
  of 16 tokens: `EnvironmentRollout` decoding every round's turns in one batch against each turn on its own branch
  (stacking refused), the same rounds (issue 36: a row's trajectories).

Decode time only (the capture is shared and not timed). Memory is not compared here: decoding together holds the
Q · G (or G) sequences' own K/V at once, the same as the one-at-a-time path's largest batch times Q.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test environment and tool parser are named by import path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import document_rows, finish, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def rows_case(model, tok, length: int, q: int, G: int, R: int, out: Path, rows: list) -> None:
    import torch

    import longstraw
    from longstraw.ragged import sample_branches
    from longstraw.sampler import sample

    data = document_rows(tok, length, q, seed=0, name="doc")
    ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, return_dict=False) if "messages" in r
           else tok(r["prompt"])["input_ids"] for r in data]  # a base model's rows are text (`PLAIN_TEMPLATE`)
    ids = [torch.tensor(i["input_ids"] if isinstance(i, dict) else i) for i in ids]
    common = min(i.numel() for i in ids)
    for i in ids[1:]:  # the rows' common prefix: the document and the template before it
        diff = (i[:common] != ids[0][:common]).nonzero()
        if diff.numel():
            common = int(diff[0])
    state = longstraw.capture(model, ids[0][:common])
    branches = []
    for i in ids:
        b = state.fork()
        b.extend(i[common:])
        branches.append(b)

    def gens():
        return [torch.Generator().manual_seed(100 + k) for k in range(q)]

    def together():
        return sample_branches(branches, G, R, generator=gens())

    def alone():
        return [sample(b, G, R, generator=g) for b, g in zip(branches, gens())]

    together()  # warm-up
    seen = {}
    for mode, fn in (("together", together), ("row by row", alone)) * 2:
        seconds, outs = _timed(fn)
        tokens = [t for o in outs for t in o.tokens]
        if mode in seen:
            assert all(torch.equal(a, b) for a, b in zip(seen[mode], tokens))
        seen[mode] = tokens
        record(rows, dict(case="rows", model=model.config.model_type, mode=mode, Q=q, G=G, R=R, document_tokens=common,
                          suffix_tokens=[int(i.numel() - common) for i in ids], seconds=seconds,
                          sequences=len(tokens)), out)
    same = all(torch.equal(a, b) for a, b in zip(seen["together"], seen["row by row"]))
    rows[-1]["same_tokens"] = same
    record(rows, dict(case="rows", mode="check", Q=q, same_tokens=same), out)


def agent_case(model, tok, length: int, G: int, out: Path, rows: list) -> None:
    import torch

    import longstraw
    import longstraw.ragged as ragged
    from longstraw.agent import AgentSettings, EnvironmentRollout
    from longstraw.tasks import Example
    from longstraw.train.rollout import Policy, SamplingSettings, TurnSampler
    from tests.agent.test_agent import LookupEnv
    from tests.train.test_vllm_backend import lookup_until_answered

    doc = document_rows(tok, length, 1, seed=1, name="doc")[0]["messages"][0]["content"]
    text = doc + "\n\nLook up the key k1 with the lookup tool, then tell me its value."
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                     return_dict=False)
    prompt = torch.tensor(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    state = longstraw.capture(model, prompt)
    policy = Policy(model, tok, tok.eos_token_id)
    settings = SamplingSettings(G, 128, 1.0, 1.0, 0, False)
    rollout = EnvironmentRollout(LookupEnv, AgentSettings(max_turns=4, max_turn_tokens=16, max_tool_tokens=32),
                                 parse=lookup_until_answered)
    example = Example(prompt=text, answer=None)

    def run():
        return rollout(TurnSampler(state, policy, settings, torch.Generator().manual_seed(3)), example, G)

    stackable = ragged.stackable
    run()  # warm-up
    seen = {}
    for mode in ("together", "one at a time") * 2:
        if mode != "together":
            ragged.stackable = lambda branches: False
        try:
            seconds, responses = _timed(run)
        finally:
            ragged.stackable = stackable
        seen[mode] = [r.tokens for r in responses]
        record(rows, dict(case="agent", mode=mode, G=G, prompt_tokens=int(prompt.numel()), seconds=seconds,
                          turns=sum(r.extra["turns"] for r in responses),
                          policy_tokens=sum(int(r.mask.sum()) for r in responses),
                          tool_tokens=sum(int((r.mask == 0).sum()) for r in responses)), out)
    same = all(torch.equal(a, b) for a, b in zip(seen["together"], seen["one at a time"]))
    record(rows, dict(case="agent", mode="check", same_tokens=same), out)


def table(rows: list[dict]) -> str:
    lines = ["| case | Q | G | mode | seconds (each run) | speed-up (best runs) | same tokens |",
             "|---|---:|---:|---|---|---:|---|"]
    cases = sorted({(r["case"], r.get("Q", 1)) for r in rows}, key=lambda c: (c[0], c[1]))
    for case, q in cases:
        mine = [r for r in rows if r["case"] == case and r.get("Q", 1) == q]
        check = next((r["same_tokens"] for r in mine if r["mode"] == "check"), None)
        modes = [m for m in dict.fromkeys(r["mode"] for r in mine) if m != "check"]
        best = {m: min(r["seconds"] for r in mine if r["mode"] == m) for m in modes}
        for m in modes:
            each = ", ".join("%.2f" % r["seconds"] for r in mine if r["mode"] == m)
            g = next(r["G"] for r in mine if r["mode"] == m)
            speed = "" if m == modes[0] else f"{best[m] / best[modes[0]]:.2f}×"
            lines.append(f"| {case} | {q} | {g} | {m} | {each} | {speed} | {check} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["case"], r.get("Q", 1)) for r in rows if r["mode"] != "check"})
    labels, fast, slow = [], [], []
    for case, q in cases:
        mine = [r for r in rows if r["case"] == case and r.get("Q", 1) == q and r["mode"] != "check"]
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        labels.append(f"{case} Q={q}" if case == "rows" else case)
        fast.append(min(r["seconds"] for r in mine if r["mode"] == modes[0]))
        slow.append(min(r["seconds"] for r in mine if r["mode"] == modes[1]))
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], slow, 0.4, label="one branch at a time")
    ax.bar([i + 0.2 for i in x], fast, 0.4, label="together (ragged batch)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("decode seconds (best of 2)")
    ax.set_title(f"{rows[0].get('model', 'smollm2')} float32, 2 threads, G = 8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    ap.add_argument("--cases", nargs="+", default=["agent", "rows"], choices=["agent", "rows"])
    ap.add_argument("--length", type=int, default=6144, help="document tokens of the rows case")
    ap.add_argument("--Q", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--R", type=int, default=32)
    ap.add_argument("--agent-length", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--redraw", action="store_true")
    args = ap.parse_args()
    out = RESULTS / ("batched_decoding" if args.model == "smollm2" else f"batched_decoding-{args.model}")
    if args.redraw:
        rows = json.loads(out.with_suffix(".json").read_text())
        finish(rows, out, plot, table)
        return 0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longstraw.tools.real_models import model_path

    torch.set_num_threads(args.threads)
    folder = model_path(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows: list[dict] = []
    with torch.no_grad():
        if "agent" in args.cases:
            agent_case(model, tok, args.agent_length, 8, out, rows)
        if "rows" in args.cases:
            for q in args.Q:
                rows_case(model, tok, args.length, q, 8, args.R, out, rows)
    finish(rows, out, plot, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
