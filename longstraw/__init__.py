"""longstraw: GRPO on very long prompts by capturing the shared prompt once and replaying branches.

Public surface (docs/design.md):

    state = longstraw.capture(model, prompt_ids, chunk_size=4096, prompt_grad="detached")  # or "exact"
    samples = state.sample(num=8, max_new_tokens=256)  # G responses from the one state
    out = state.replay(response_ids)   # out.logprobs, out.entropy: [R], differentiable
    branch = state.fork()              # a trajectory's own state: branch.extend(tool_output), branch.sample(...),
    out = branch.replay(turn_ids)      # its replay (the branch's tokens constants, as the prompt); your loss, backward
    longstraw.replay_segments(state, trajectory, mask, segment_loss)  # a long trajectory, one segment's graph at a
                                       # time, the whole trajectory's gradient (each segment's loss back-propagated)
    longstraw.replay_segments(..., layer_major=longstraw.LayerMajor(2, 3))  # one decoder layer at a time instead:
                                       # one layer's own K/V held, not every layer's (docs/agents.md, "Cost")
    state.backward()                   # exact mode: the prompt's share of the gradient
    state.nbytes; state.release()      # or: with longstraw.capture(...) as state: ...
    longstraw.prepare(model)           # once per model (capture calls it); the model still works normally
    report = longstraw.check(model)    # self-check against the unmodified model: report.ok, worst errors

Around it: `longstraw.losses` (GRPO loss family), `longstraw.train.trainer.Trainer` with
`longstraw.train.config.TrainConfig`, the same trainer in TRL's shape (`longstraw.GRPOTrainer`, `longstraw.GRPOConfig`:
`longstraw.train.trl_shape`), the `longstraw` command line.
"""

from .api import capture
from .branch import Branch
from .errors import UnsupportedArchitectureError
from .model.capability import tested_families
from .model.prepare import prepare, unprepare
from .prompt_state import PromptState, Replay
from .replay.layer_major import LayerMajor
from .replay.segments import replay_segments
from .self_check import CheckReport, check

__version__ = "0.1.0"

__all__ = [
    "Branch",
    "CheckReport",
    "GRPOConfig",
    "GRPOTrainer",
    "LayerMajor",
    "PromptState",
    "Replay",
    "UnsupportedArchitectureError",
    "capture",
    "check",
    "prepare",
    "replay_segments",
    "tested_families",
    "unprepare",
]


def __getattr__(name: str):
    """`GRPOTrainer`, `GRPOConfig` on first use (the trainer tier loads transformers and PEFT: `import longstraw` does
    not)."""
    if name in ("GRPOConfig", "GRPOTrainer"):
        from .train import trl_shape

        return getattr(trl_shape, name)
    raise AttributeError(f"module 'longstraw' has no attribute {name!r}")
