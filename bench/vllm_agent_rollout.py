"""Agent rollouts through vLLM: a row's G trajectories at once (the server batches their turns) vs one after another.

SmolLM2-135M-Instruct in float32 served by vLLM (`longstraw.train.vllm_server`), the lookup environment of
tests/agent/test_agent.py (every turn without the value calls `lookup`), G = 8 trajectories of up to 4 turns of 16
tokens; each mode twice, alternating, after a warm-up. Writes `bench/results/vllm_agent_rollout.{json,md}`.

    python bench/vllm_agent_rollout.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test environment and tool parser are named by import path


def main() -> int:
    from longstraw.tools.real_models import model_path
    from longstraw.train import vllm_client, vllm_server
    from longstraw.train.config import TrainConfig
    from longstraw.train.trainer import Trainer

    folder = model_path("smollm2")
    out = ROOT / "bench" / "out" / "vllm_agent_rollout"
    out.mkdir(parents=True, exist_ok=True)
    server = vllm_server.start(folder, dtype="float32", lora_rank=16, log_path=out / "server.log")
    rows = []
    try:
        data = out / "rows.jsonl"
        data.write_text(json.dumps({"prompt": "Look up the key k1 with the lookup tool, then tell me its value."}) + "\n")
        cfg = TrainConfig(model=str(folder), dataset=str(data), eval_fraction=0.0, reward_funcs=["environment_reward"],
                          lora=True, lora_r=8, lora_alpha=16, num_generations=8, prompts_per_step=1, num_steps=1,
                          max_completion_length=128, max_turns=4, max_turn_tokens=16, max_tool_tokens=32, threads=2,
                          output_dir=str(out / "run"), eval_at_start=False, rollout_backend="vllm",
                          vllm_url=server.url, environment="tests.agent.test_agent:LookupEnv",
                          tool_parser="tests.train.test_vllm_backend:lookup_until_answered", save_every=100)
        trainer = Trainer(cfg)
        trainer.rollout_stage.collect(trainer.examples(0), 0, trainer.meter)  # warm-up
        split = vllm_client.VLLMSampler.split
        for mode in ("together", "one after another") * 2:
            if mode != "together":  # without `split` the agent rollout runs the trajectories in turn
                del vllm_client.VLLMSampler.split
            try:
                t0 = time.perf_counter()
                r = trainer.rollout_stage.collect(trainer.examples(0), 0, trainer.meter)
                seconds = time.perf_counter() - t0
            finally:
                vllm_client.VLLMSampler.split = split
            rows.append(dict(mode=mode, seconds=seconds, turns=sum(x.extra["turns"] for x in r.responses),
                             policy_tokens=sum(int(x.mask.sum()) for x in r.responses),
                             tool_tokens=sum(int((x.mask == 0).sum()) for x in r.responses)))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    results = ROOT / "bench" / "results"
    (results / "vllm_agent_rollout.json").write_text(json.dumps(dict(model="smollm2", G=8, rows=rows), indent=1))
    best = {m: min(r["seconds"] for r in rows if r["mode"] == m) for m in ("together", "one after another")}
    lines = ["# Agent rollouts through vLLM (SmolLM2, G = 8, lookup tool)", "",
             "| mode | seconds (each run) | turns | policy tokens | tool tokens |", "|---|---|---:|---:|---:|"]
    for m in best:
        rs = [r for r in rows if r["mode"] == m]
        each = ", ".join("%.2f" % r["seconds"] for r in rs)
        lines.append(f"| {m} | {each} | {rs[0]['turns']} | "
                     f"{rs[0]['policy_tokens']} | {rs[0]['tool_tokens']} |")
    lines += ["", f"together: {best['one after another'] / best['together']:.1f}× faster (best runs)"]
    (results / "vllm_agent_rollout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
