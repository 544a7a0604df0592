"""transformers `TrainerCallback`s on `GRPOTrainer`: the events transformers' `Trainer` calls, in its order, with its
`(args, state, control, **kwargs)`; the logged values held to the run's metrics.jsonl (written by the metrics writer,
not by the callbacks' code) under TRL 1.16's names (from TRL's `GRPOTrainer._metrics` keys)."""

import json

from transformers import TrainerCallback

from longstraw import GRPOTrainer

from .test_trl_shape import ROWS, _args, reward_len


class Recorder(TrainerCallback):
    """Each event as (name, state.global_step), the logs, and what the kwargs held."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict] = []
        self.seen: list[tuple] = []

    def _record(self, name, args, state, control, **kw):
        self.events.append((name, state.global_step))
        self.seen.append((args, state, kw.get("model"), kw.get("optimizer")))

    def on_init_end(self, args, state, control, **kw):
        self._record("init_end", args, state, control, **kw)

    def on_train_begin(self, args, state, control, **kw):
        self._record("train_begin", args, state, control, **kw)

    def on_step_begin(self, args, state, control, **kw):
        self._record("step_begin", args, state, control, **kw)

    def on_step_end(self, args, state, control, **kw):
        self._record("step_end", args, state, control, **kw)

    def on_log(self, args, state, control, logs=None, **kw):
        self._record("log", args, state, control, **kw)
        self.logs.append(dict(logs))

    def on_save(self, args, state, control, **kw):
        self._record("save", args, state, control, **kw)

    def on_train_end(self, args, state, control, **kw):
        self._record("train_end", args, state, control, **kw)


class Added(Recorder):
    pass


class StopAt2(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 2:
            control.should_training_stop = True
        return control


def test_callbacks_are_called_in_transformers_order_with_the_steps_metrics_under_trls_names(tmp_path):
    """4 steps of a LoRA adapter, a checkpoint every 2 (beta > 0: a KL term). Given in `callbacks=[...]` (an
    instance) and by `add_callback` (a class): both see the same events; `on_log`'s logs equal metrics.jsonl's rows
    value for value, with TRL's names for what TRL logs alike."""
    from peft import LoraConfig

    rec = Recorder()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = GRPOTrainer(model="llama", reward_funcs=reward_len, args=_args(tmp_path, "run", beta=0.04),
                          train_dataset=ROWS, callbacks=[rec], peft_config=lora)
    trainer.add_callback(Added)
    added = trainer.callback_handler.callbacks[-1]
    trainer.train()
    want = [("init_end", 0), ("train_begin", 0)]
    for s in range(4):
        want += [("step_begin", s), ("step_end", s + 1), ("log", s + 1)] + ([("save", s + 1)] if s % 2 else [])
    want.append(("train_end", 4))
    assert rec.events == want
    assert added.events == want[1:]  # added after the trainer was built: no on_init_end
    assert all(a is trainer.args and st is trainer.state and m is trainer.model and o is trainer.opt
               for a, st, m, o in rec.seen)

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rec.logs) == len(rows) == 4
    trl = {"completions/mean_length": "completion_length", "completions/clipped_ratio": "truncated_frac",
           "clip_ratio/region_mean": "clip_ratio", "learning_rate": "lr", "reward": "reward",
           "reward_std": "reward_std", "frac_reward_zero_std": "frac_reward_zero_std", "kl": "kl",
           "entropy": "entropy", "loss": "loss", "grad_norm": "grad_norm", "rewards/reward_len/mean":
           "rewards/reward_len/mean", "clip_ratio/low_mean": "clip_ratio/low_mean",
           "clip_ratio/high_mean": "clip_ratio/high_mean"}
    for logs, row in zip(rec.logs, rows):
        assert logs["step"] == row["step"]
        for name, ours in trl.items():
            assert logs[name] == row[ours], (name, logs[name], row[ours])
    assert [m["step"] for m in trainer.state.log_history[:-1]] == [1, 2, 3, 4]
    assert trainer.state.log_history[0]["learning_rate"] == rows[0]["lr"]


def test_should_training_stop_ends_the_run_after_that_step(tmp_path):
    """A callback that sets `control.should_training_stop` at step 2 of 4: the run ends there (as in transformers),
    2 rows in metrics.jsonl, and `on_train_end` still called."""
    rec = Recorder()
    trainer = GRPOTrainer(model="llama", reward_funcs=reward_len, args=_args(tmp_path, "run"), train_dataset=ROWS,
                          callbacks=[StopAt2(), rec])
    assert trainer.train().global_step == 2
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    assert rec.events[-1] == ("train_end", 2)
