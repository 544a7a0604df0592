"""Does `longstraw plan` predict time? Its stage times beside the times measured by other benchmarks, same machine.

    python bench/plan_time.py            # → bench/results/plan_time.{json,md,png}

The measured times come from results already in bench/results (run on quiet cores, 2 threads, fp32, LoRA r 16):
- `step_anatomy-smollm2.json`, `step_anatomy-gemma3.json` (`bench/step_anatomy.py`): capture of the document,
  sampling of Q × G responses, their batched replay (a row's G together), at SmolLM2 6K and Gemma 3 16K;
- `long_context_curve.json` (`bench/long_context_curve.py`): Gemma 3's held-out captures at 32K / 64K / 128K and the
  GRPO steps at 64K (the trainer's own stage timers: `time_capture`, `time_sample`, `time_replay`), the rows recorded
  on a quiet machine only (1-minute load average ≤ QUIET_LOAD).
The predictions: `longstraw.tools.step_time.predict_time` at each measured configuration with this machine's rates
(`calibrate`, measured afresh here, 2 threads), i.e. what `longstraw plan MODEL --P P --G G --R R --Q Q --dtype fp32
--replay-batch k --time` prints. Run it on the machine and in the hour the measurements were made (quiet cores): rates
measured on another CPU or under load predict other times. Rows: predicted / measured per stage; the issue's bar is
within 25 %.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
#: rows recorded at a 1-minute load average above this (more runnable processes than the runs' 2 threads) are left out
QUIET_LOAD = 2.5
sys.path.insert(0, str(HERE))


def measured_points() -> list[dict]:
    """(model, P, row_suffix, Q, G, R, replay_batch, stage, seconds, source) of every measured stage."""
    out = []
    for model in ("smollm2", "gemma3"):
        path = RESULTS / f"step_anatomy-{model}.json"
        if not path.exists():
            continue
        for r in json.loads(path.read_text()):
            if r.get("replay") != "batched":
                continue
            base = dict(model=model, P=r["document_tokens"], row_suffix=r["suffix_tokens"] // r["Q"], Q=r["Q"],
                        G=r["G"], R=r["R"], replay_batch=r["G"], source=path.name)
            out += [
                dict(base, stage="capture", seconds=r["capture_prefix_s"]),
                dict(base, stage="sample", seconds=r["sample_s"]),
                dict(base, stage="replay", seconds=r["replay_s"]),
            ]
    for path in [RESULTS / "long_context_curve.json"]:
        if not path.exists():
            continue
        rows = [r for r in json.loads(path.read_text()) if r.get("load", 0.0) <= QUIET_LOAD]
        setup = next((r for r in rows if r.get("kind") == "setup"), {}).get("settings", {})
        for r in rows:
            if r.get("kind") == "doc":
                out.append(dict(model="gemma3", P=r["prompt_tokens"], row_suffix=0, Q=1, G=1, R=1, replay_batch=1,
                                stage="capture", seconds=r["capture_s"], source=f"{path.name} ({r['phase']} doc)"))
        steps = [r for r in rows if r.get("kind") == "step"]
        if steps:
            P = steps[0]["prompt_tokens"]
            base = dict(model="gemma3", P=P, row_suffix=0, Q=setup["Q"], G=setup["G"], R=setup["R"],
                        replay_batch=setup["G"], source=f"{path.name} (GRPO steps, mean)")
            caps = [r["time_capture"] for r in steps if r.get("captured") and r.get("time_capture")]
            if caps:
                out.append(dict(base, stage="capture", seconds=sum(caps) / len(caps)))
            for stage in ("sample", "replay"):
                got = [r[f"time_{stage}"] for r in steps if r.get(f"time_{stage}")]
                if got:
                    out.append(dict(base, stage=stage, seconds=sum(got) / len(got)))
    return out


def main() -> int:
    import torch

    from _bench import finish, record
    from longstraw.tools.planner import PlanConfig
    from longstraw.tools.real_models import model_path
    from longstraw.tools.step_time import calibrate, predict_time

    torch.set_num_threads(2)
    out = RESULTS / "plan_time"
    rows: list[dict] = []
    rates = {m: calibrate(str(model_path(m)), "fp32", cache=False) for m in ("smollm2", "gemma3")}
    for m, r in rates.items():
        record(rows, dict(kind="rates", model=m, matmul=r.matmul, attention=r.attention,
                          attention_backward=r.attention_backward, copy=r.copy, source=r.source), out)
    for p in measured_points():
        pc = PlanConfig(str(model_path(p["model"])), p["P"], num_generations=p["G"], completion_length=p["R"],
                        dtype="fp32", row_suffix=p["row_suffix"], replay_batch=p["replay_batch"])
        t = predict_time(pc, rates[p["model"]], questions=p["Q"])
        predicted = getattr(t, p["stage"])
        record(rows, dict(kind="point", **p, predicted=predicted, ratio=predicted / p["seconds"]), out)
    finish(rows, out, plot, table)
    return 0


def table(rows: list[dict]) -> str:
    lines = [
        "`python bench/plan_time.py`",
        "",
        "| model | P | Q × G, R | stage | measured s | predicted s | predicted / measured | source |",
        "|---|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["kind"] == "point":
            lines.append(
                f"| {r['model']} | {r['P']:,} | {r['Q']} × {r['G']}, {r['R']} | {r['stage']} | {r['seconds']:.2f} | "
                f"{r['predicted']:.2f} | {r['ratio']:.2f} | {r['source']} |"
            )
    pts = [r for r in rows if r["kind"] == "point"]
    if pts:
        inside = sum(0.75 <= r["ratio"] <= 1.25 for r in pts)
        lines += ["", f"{inside} of {len(pts)} predictions within 25 % of the measured time."]
    for r in rows:
        if r["kind"] == "rates":
            lines.append(
                f"Rates ({r['model']}): matmul {', '.join(f'{k} {v / 1e9:.0f}' for k, v in r['matmul'].items())} "
                f"GFLOP/s; attention {', '.join(f'{k} {v / 1e9:.0f}' for k, v in r['attention'].items())}, backward "
                f"{r['attention_backward'] / 1e9:.0f} GFLOP/s; copy {r['copy'] / 1e9:.1f} GB/s ({r['source']})."
            )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r["kind"] == "point"]
    fig, ax = plt.subplots(figsize=(6, 5))
    for stage, style in (("capture", "o"), ("sample", "s"), ("replay", "^")):
        got = [r for r in pts if r["stage"] == stage]
        ax.scatter([r["seconds"] for r in got], [r["predicted"] for r in got], marker=style, label=stage)
    if pts:
        lo = min(min(r["seconds"], r["predicted"]) for r in pts) * 0.8
        hi = max(max(r["seconds"], r["predicted"]) for r in pts) * 1.25
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [0.75 * lo, 0.75 * hi], [1.25 * lo, 1.25 * hi], color="k", alpha=0.08, label="±25 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds")
    ax.set_ylabel("predicted seconds (longstraw plan)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
