"""transformers `TrainerCallback`s on `GRPOTrainer` (`callbacks=[...]`, `add_callback`), as TRL's trainer calls them.

    class Printer(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            print(state.global_step, logs["reward"])

    GRPOTrainer(..., callbacks=[Printer])

Events, in transformers' order: `on_init_end` (built), `on_train_begin`; each step `on_step_begin`, `on_step_end`,
`on_log` (`logs`: the step's metrics, with TRL's names, `trl_logs`), `on_save` after a checkpoint; `on_train_end`.
Each is called with transformers' `(args, state, control, **kwargs)`: `args` the config as given, `state` the
trainer's `TrainerState`
(`global_step` the steps done, `log_history` the logs so far), kwargs `model`, `processing_class`, `optimizer`,
`lr_scheduler`. `control.should_training_stop` set by a callback ends the run after that step (its checkpoint
written), as in transformers; the other `control` flags are moot (every step is logged, checkpoints follow
`save_steps`).
"""

from __future__ import annotations

from transformers.trainer_callback import CallbackHandler

#: longstraw's metric name -> TRL 1.16's (`GRPOTrainer._metrics`), where TRL logs the same quantity
TRL_NAMES = {
    "completion_length": "completions/mean_length",
    "truncated_frac": "completions/clipped_ratio",
    "clip_ratio": "clip_ratio/region_mean",
    "lr": "learning_rate",
}


def trl_logs(metrics: dict) -> dict:
    """A step's metrics (a metrics.jsonl row) with TRL's names as well: each of `TRL_NAMES` also under TRL's name;
    `reward`, `reward_std`, `frac_reward_zero_std`, `kl`, `entropy`, `loss`, `grad_norm` and
    `rewards/<name>/mean|std` are TRL's names already; longstraw's own (`time_*`, `durable_bytes`, ...) as they are."""
    return {**metrics, **{TRL_NAMES[k]: v for k, v in metrics.items() if k in TRL_NAMES}}


class Callbacks(CallbackHandler):
    """transformers' `CallbackHandler` (its `call_event`, `add_callback`, `pop_callback`, `remove_callback`) without
    its warning about a missing `DefaultFlowCallback`: the run's loop decides logging and saving itself."""

    def __init__(self, callbacks, model, processing_class, optimizer, lr_scheduler):
        self.callbacks = []
        for cb in callbacks:
            self.add_callback(cb)
        self.model = model
        self.processing_class = processing_class
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_dataloader = None
        self.eval_dataloader = None
