"""One GRPO step of agent trajectories of exactly N turns, side by side: TRL 1.16's GRPOTrainer and longstraw's trainer.

    python bench/trl_agent_memory.py --turns 8 16 --threads 1    # → bench/results/trl_agent_memory.{json,md,png}
    python bench/trl_agent_memory.py --turns 2 --quick --out /tmp/trl_agent_quick    # a few minutes, small sizes

What is measured: the memory (and time) of one optimizer step over G = 8 multi-turn, tool-using trajectories of one
prompt, at N = 8 and 16 turns. SmolLM2-135M-Instruct (`longstraw real smollm2`), fp32, `--threads` (1 in the
results), LoRA r 16 alpha 32 on every linear layer, loss_type dapo, beta 0, the same reward (`varied_reward`, which
differs between trajectories so that the advantages are not 0). The prompt is one row of `longstraw.tasks.archive_tools`
with the document in the prompt (`write_archive_task(..., document_in_prompt=True)`: ~2K tokens at the defaults), the
same row in both steps.

How the turn count is controlled, the same way on both sides: every policy turn is exactly `--turn-tokens` tokens
(its stop token suppressed) and is read as one call of the environment's only tool, `read`, whose reply is the row's
fixed `reply` column (a text of `--tool-tokens` tokens, written into the row): a trajectory is N policy turns with
N − 1 tool replies between them (the N-th turn is the last: neither system calls tools after its turn budget).

- longstraw (`longstraw.train.trainer.Trainer`): `environment: FixedReplies`, `tool_parser: every_turn_reads` (every
  turn is a call), `max_turns: N`, `max_turn_tokens: T`, `ignore_eos: true`; `segment_replay` at its default (on with
  an environment): each trajectory replayed turn by turn, one trajectory at a time.
- TRL (`GRPOTrainer(environment_factory=FixedReplies, ...)`): its own tool loop (`GRPOTrainer._tool_call_loop`), with
  `max_tool_calling_iterations = N − 1` and `generation_kwargs = {min_new_tokens: T, max_new_tokens: T}` (each turn is
  one `generate` call of exactly T tokens). Two things SmolLM2 lacks for TRL's tool loop are given to its tokenizer:
  (1) a chat template that renders an assistant message's `tool_calls` (TRL's `supports_tool_calling`, called in
  `GRPOTrainer.__init__`, refuses SmolLM2's template, which drops them); it is SmolLM2's template with the calls
  written as `<tool_call>{...}</tool_call>` before `<|im_end|>`, and the worker checks that it renders the prompt and
  the tool reply (`GRPOTrainer._get_tool_suffix_ids`) to the same tokens as SmolLM2's template does for longstraw;
  (2) a `response_template` (transformers' response parsing, which `trl.chat_template_utils.parse_response` reads)
  that reads every turn as one call of `read` (`add_response_schema` knows no SmolLM2 format: "Unrecognized chat
  template"). Its defaults otherwise, as in `bench/real_trl_compare.py`: per_device_train_batch_size = G (the G
  trajectories in one forward and backward), gradient checkpointing on (GRPOConfig's default).

The trajectory tokens each side trained on (prompt, policy and tool tokens per trajectory) are recorded from the step
itself (TRL: `_generate`'s prompt ids, completion ids and tool mask; longstraw: the rollout's responses and masks).

How: each (method, turns) runs in a fresh process for two optimizer steps and the second is measured (the first pays
one-time initialisation): step memory = peak RSS during that step − RSS before it (`longstraw.train.memory`; the
longstraw trainer's own `step_mem_mb`, the maximum over its stages, each measured from the step's start; TRL: from
`on_step_begin` to `on_step_end`, with `bench/real_trl_compare.py`'s `_measure` after a `malloc_trim`), and the wall
time of the step. TRL's generation peak (`trl_generate_mem_mb`: the peak up to the end of `_generate`) is kept too.
Every process is capped at `--limit-gb` of address space (24 GB machine, no swap): a step that needs more is reported
as out of memory with how long it ran; one still going after `--timeout-s` is reported with its first step's figures
if it finished one (an upper bound: one-time allocations included).

Caveats: CPU RSS, 2 cores shared with other work (times are noisy; memory is what this measures). The results ran
with `--threads 1` for both systems: another job held one of the 2 cores at nice 0, and 2 threads beside it made a
step ~14× slower (the thread on the busy core held every op back). TRL generates each
turn by re-reading the whole context (prompt + earlier turns + tool replies) as its tool loop does, longstraw from
each trajectory's own branch of the captured prompt; both train on the same token sequences. TRL with
per_device_train_batch_size = 1 and gradient_accumulation_steps = G would hold one trajectory's graph at a time
(not measured here). The reward and the fixed tool replies make the trajectories meaningless as a task: this measures
cost, not learning.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, memory_time_figure, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "trl_agent_memory"
HERE = Path(__file__).resolve()


class FixedReplies:
    """One trajectory's environment (TRL's `environment_factory` convention): its only tool replies the row's fixed
    `reply` column, whatever the turn wrote."""

    def reset(self, reply: str = "", **columns):
        self.reply = reply

    def read(self) -> str:
        """Read the next page of the document."""
        return self.reply


def every_turn_reads(text: str) -> list:
    """longstraw's `tool_parser`: every policy turn is one call of `read`."""
    from longstraw.agent.environment import ToolCall

    return [ToolCall("read", {})]


#: transformers' response parsing (`tokenizer.response_template`, read by TRL's `parse_response`): every assistant turn
#: after the generation prompt is one call of `read`, its text dropped
EVERY_TURN_READS = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "content": "text",
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "read", "arguments": {}}},
        }
    },
}

#: SmolLM2's message body, and the same body with an assistant's `tool_calls` written before `<|im_end|>`
_BODY = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
_BODY_WITH_CALLS = (
    "{{'<|im_start|>' + message['role'] + '\n' + message['content']}}"
    "{% for call in message.get('tool_calls', []) %}{{ '<tool_call>' + (call.function | tojson) + '</tool_call>' }}"
    "{% endfor %}{{'<|im_end|>' + '\n'}}"
)


def varied_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """Distinct token ids / token ids of each trajectory (TRL's convention; both systems pass `completion_ids`):
    differs between trajectories, so that the advantages, hence the loss, are not 0."""
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


def _data(tok, args, d: str) -> list[dict]:
    """The archive row (document in the prompt) twice, with a `reply` column of `tool_tokens` tokens of English."""
    from longstraw.tasks.archive_tools import write_archive_task
    from longstraw.tasks.documents import paragraphs

    path = write_archive_task(tok, Path(d) / "data", 1, 1, num_sections=args.sections,
                              section_tokens=args.section_tokens, document_in_prompt=True)["train"]
    row = json.loads(path.read_text().splitlines()[0])
    ids = tok("\n\n".join(paragraphs()[:40]), add_special_tokens=False)["input_ids"]
    row["reply"] = tok.decode(ids[: args.tool_tokens])
    return [row, row]


def _budget(args, turns: int) -> int:
    """max_completion_length: the trajectory after the prompt, tool tokens included, with room to spare."""
    return turns * args.turn_tokens + (turns - 1) * (args.tool_tokens + 64)


def _counts(prompt: list[int], masks: list[list[int]]) -> dict:
    """Per-trajectory token counts (all G equal here: printed as the first's, checked equal)."""
    policy = [int(sum(m)) for m in masks]
    tool = [len(m) - p for m, p in zip(masks, policy)]
    turns = [sum(1 for i, x in enumerate(m) if x and (i == 0 or not m[i - 1])) for m in masks]  # runs of policy tokens
    return dict(prompt_tokens=prompt[0], policy_tokens=policy[0], tool_tokens=tool[0], policy_turns=turns[0],
                trajectories_equal=all(len(set(v)) == 1 for v in (prompt, policy, tool, turns)))


def run_longstraw(args, turns: int) -> dict:
    from transformers import AutoTokenizer

    from longstraw.tools.real_models import model_path
    from longstraw.train.config import TrainConfig
    from longstraw.train.trainer import Trainer

    class Counting(Trainer):
        """The trainer, keeping the token counts of its last rollout."""

        def rollout(self, step):
            r = super().rollout(step)
            self.counts = _counts([r.groups[g].prompt_ids.numel() for g in r.group_ids],
                                  [x.mask.tolist() for x in r.responses])
            return r

    path = model_path("smollm2")
    with tempfile.TemporaryDirectory() as d:
        rows = _data(AutoTokenizer.from_pretrained(path), args, d)
        data = Path(d) / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = TrainConfig(model=str(path), dataset=str(data), eval_fraction=0.0, eval_at_start=False,
                          environment=f"{HERE}:FixedReplies", tool_parser=f"{HERE}:every_turn_reads",
                          reward_funcs=[f"{HERE}:varied_reward"], max_turns=turns, max_turn_tokens=args.turn_tokens,
                          max_tool_tokens=args.tool_tokens + 64, ignore_eos=True,
                          max_completion_length=_budget(args, turns), lora=True, lora_r=16, lora_alpha=32,
                          lora_target_modules="all-linear", num_generations=args.G, prompts_per_step=1, num_steps=2,
                          loss_type="dapo", beta=0.0, learning_rate=1e-4, dtype="fp32", threads=args.threads,
                          output_dir=str(Path(d) / "run"), progress=False, eval_examples=1, save_every=100,
                          log_completions=False, num_completions_to_print=0)
        trainer = Counting(cfg)
        metrics = trainer.train()
    m = metrics[-1]
    out = dict(step_mem_mb=m["step_mem_mb"], wall_s=round(m["time_step"], 2), **trainer.counts,
               segment_replay=cfg.replays_segments)
    out.update({k: round(m[k], 2) for k in m if k.startswith(("mem_", "time_"))})
    return out


def run_trl(args, turns: int) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from real_trl_compare import _measure
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import supports_tool_calling

    from longstraw.agent.environment import tool_message_ids
    from longstraw.tools.real_models import model_path
    from longstraw.train.memory import peak_rss_mb, trim_heap

    path = model_path("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    plain = AutoTokenizer.from_pretrained(path)  # SmolLM2's own template: what longstraw renders with
    if _BODY not in tok.chat_template:
        raise RuntimeError("SmolLM2's chat template changed: its message body is not where this script expects it")
    tok.chat_template = tok.chat_template.replace(_BODY, _BODY_WITH_CALLS)
    tok.response_template = EVERY_TURN_READS
    assert supports_tool_calling(tok) and not supports_tool_calling(plain)
    marks: dict = {}
    with tempfile.TemporaryDirectory() as d:
        rows = _data(tok, args, d)
        kw = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
        same_prompt = tok.apply_chat_template(rows[0]["messages"], **kw) == plain.apply_chat_template(
            rows[0]["messages"], **kw)
        data = Dataset.from_list([{"prompt": r["messages"], "reply": r["reply"]} for r in rows])

        class Counting(GRPOTrainer):
            """TRL's trainer, keeping the token counts of its last rollout and the memory peak up to its end."""

            def _generate(self, prompts):
                out = super()._generate(prompts)
                prompt_ids, completion_ids, tool_mask = out[:3]
                self.counts = _counts([len(p) for p in prompt_ids], tool_mask)
                self.generate_peak = peak_rss_mb()
                suffix = self._get_tool_suffix_ids([{"role": "tool", "name": "read", "content": rows[0]["reply"]}])
                self.counts["same_tokens_as_longstraw"] = same_prompt and suffix == tool_message_ids(
                    plain, "read", rows[0]["reply"])
                return out

        class Measure(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                trim_heap()
                _measure(marks, True)

            def on_step_end(self, args, state, control, **kw):
                _measure(marks, False)
                if state.global_step == 1:  # printed at once: a run cut off in its second step keeps its first
                    first = dict(step_mem_mb=round(marks["peak"] - marks["before"], 1), wall_s=round(marks["wall"], 2))
                    print("FIRST " + json.dumps(first), flush=True)

        cfg = GRPOConfig(output_dir=d, max_steps=2, per_device_train_batch_size=args.G, num_generations=args.G,
                         max_completion_length=_budget(args, turns), max_tool_calling_iterations=turns - 1,
                         generation_kwargs={"min_new_tokens": args.turn_tokens, "max_new_tokens": args.turn_tokens},
                         learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                         bf16=False, loss_type="dapo", beta=0.0, temperature=1.0, disable_tqdm=True, seed=0)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        trainer = Counting(model=model, reward_funcs=varied_reward, args=cfg, train_dataset=data, processing_class=tok,
                           peft_config=lora, environment_factory=FixedReplies, callbacks=[Measure()])
        trainer.train()
    counts = trainer.counts
    return dict(step_mem_mb=round(marks["peak"] - marks["before"], 1), wall_s=round(marks["wall"], 2),
                trl_generate_mem_mb=round(trainer.generate_peak - marks["before"], 1),
                gradient_checkpointing=cfg.gradient_checkpointing, **counts)


def _settings(args) -> dict:
    return dict(G=args.G, turn_tokens=args.turn_tokens, reply_text_tokens=args.tool_tokens, sections=args.sections,
                section_tokens=args.section_tokens, threads=args.threads)


def _oom(res: subprocess.CompletedProcess) -> bool:
    text = res.stderr or ""
    return res.returncode < 0 or any(s in text for s in ("out of memory", "Cannot allocate", "can't allocate",
                                                          "MemoryError", "std::bad_alloc"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "TURNS"), help=argparse.SUPPRESS)
    ap.add_argument("--turns", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=16, help="tokens of every policy turn")
    ap.add_argument("--tool-tokens", type=int, default=256, help="tokens of the text of every tool reply")
    ap.add_argument("--sections", type=int, default=4, help="the archive document's sections (in the prompt)")
    ap.add_argument("--section-tokens", type=int, default=400)
    ap.add_argument("--quick", action="store_true", help="small sizes: G 2, turns of 8 tokens, replies of 64, "
                    "a ~500-token prompt (to check that it runs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-gb", type=float, default=20.0)
    ap.add_argument("--timeout-s", type=float, default=7200.0, help="a run still going after this is reported so")
    ap.add_argument("--methods", nargs="+", default=["longstraw", "trl"], choices=["longstraw", "trl"])
    ap.add_argument("--out", default=str(RESULTS), help="results path without suffix")
    ap.add_argument("--keep", action="store_true", help="keep OUT.json's rows of other (method, turns) and add these")
    args = ap.parse_args(argv)
    if args.quick:
        args.G, args.turn_tokens, args.tool_tokens, args.sections, args.section_tokens = 2, 8, 64, 2, 150
    if args.worker:
        method, turns = args.worker[0], int(args.worker[1])
        import torch

        torch.set_num_threads(args.threads)
        row = dict(method=method, turns=turns, **_settings(args))
        row.update((run_trl if method == "trl" else run_longstraw)(args, turns))
        print(json.dumps(row))
        return
    out = Path(args.out)
    rows: list[dict] = []
    if args.keep and out.with_suffix(".json").exists():
        ran = {(m, n) for m in args.methods for n in args.turns}
        rows = [r for r in json.loads(out.with_suffix(".json").read_text()) if (r["method"], r["turns"]) not in ran]
    limit = int(args.limit_gb * 2**30)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    passed = ["--G", str(args.G), "--turn-tokens", str(args.turn_tokens), "--tool-tokens", str(args.tool_tokens),
              "--sections", str(args.sections), "--section-tokens", str(args.section_tokens), "--threads",
              str(args.threads)]
    for turns in args.turns:
        for method in args.methods:
            cmd = [sys.executable, str(HERE), *passed, "--worker", method, str(turns)]
            base = dict(method=method, turns=turns, **_settings(args))
            t0 = time.perf_counter()
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, preexec_fn=cap,
                                     timeout=args.timeout_s)
            except subprocess.TimeoutExpired as cut:
                row = dict(base, error=f"two steps not done in {args.timeout_s:.0f} s", ran_s=args.timeout_s)
                text = cut.stdout.decode() if isinstance(cut.stdout, bytes) else cut.stdout or ""
                first = [line[6:] for line in text.splitlines() if line.startswith("FIRST ")]
                if first:  # the first step's figures (one-time allocations included: an upper bound)
                    row["first_step"] = json.loads(first[0])
                record(rows, row, out)
                continue
            if res.returncode == 0:
                row = json.loads(res.stdout.strip().splitlines()[-1])
            else:
                error = f"out of memory (> {args.limit_gb:.0f} GB address space)" if _oom(res) else res.stderr[-800:]
                row = dict(base, error=error, ran_s=round(time.perf_counter() - t0, 1))
                first = [line[6:] for line in res.stdout.splitlines() if line.startswith("FIRST ")]
                if first:
                    row["first_step"] = json.loads(first[0])
            record(rows, row, out)
    finish(rows, out, _plot, _table)


def _table(rows: list[dict]) -> str:
    """One line per (turns, method); token counts are per trajectory (all G equal). The rollout's peak: longstraw's
    capture and sample stages, TRL's `_generate` (each from the step's start)."""
    lines = ["| turns | method | prompt tokens | policy tokens | tool tokens | trajectory tokens (after the prompt) "
             "| step memory (MiB) | of which rollout (MiB) | step time (s) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["turns"], r["method"])):
        head = f"| {r['turns']} | {r['method']} |"
        if "prompt_tokens" in r:
            toks = (f" {r['prompt_tokens']:,} | {r['policy_tokens']:,} | {r['tool_tokens']:,} | "
                    f"{r['policy_tokens'] + r['tool_tokens']:,} |")
        else:
            toks = " | | | |"
        rollout = r.get("trl_generate_mem_mb", max(r.get("mem_capture_mb", 0), r.get("mem_sample_mb", 0)))
        if "error" in r and "first_step" in r:
            f = r["first_step"]
            lines.append(f"{head}{toks} {f['step_mem_mb']:,.0f} (first step; {r['error']}) | | {f['wall_s']:,.1f} "
                         "(first step) |")
        elif "error" in r:
            lines.append(f"{head}{toks} {r['error']} (after {r['ran_s']:,.0f} s) | | |")
        else:
            lines.append(f"{head}{toks} {r['step_mem_mb']:,.0f} | {rollout:,.0f} | {r['wall_s']:,.1f} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    series = [(method, style, [(r["turns"], r["step_mem_mb"], r["wall_s"]) for r in rows
                               if r["method"] == method and "error" not in r])
              for method, style in (("trl", "s-"), ("longstraw", "o--"))]
    G = rows[0]["G"] if rows else 8
    memory_time_figure(series, "turns per trajectory", ("step memory (MiB)", "step time (s)"),
                       f"one GRPO step, G={G} agent trajectories, SmolLM2-135M-Instruct, LoRA r16 (fp32)", path)


if __name__ == "__main__":
    main()
