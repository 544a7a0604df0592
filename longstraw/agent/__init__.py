"""Agents: multi-turn rollouts through an environment whose tool output grows each trajectory's own state.

`environment.py` holds the environment convention (TRL 1.16's `environment_factory`: `reset`, public methods as
tools, an optional `get_reward`), tool-call parsing and the tokens of a tool message; `rollout.py` the rollout hook
that runs G trajectories from one captured prompt, each on its own `longstraw.branch.Branch`.

The convention sits below the trainer (a task's tools follow it: `longstraw.tasks.archive_tools`), the rollout beside
it (it runs the trainer's rollout stage): `AgentSettings` and `EnvironmentRollout` are imported on first use, so that
importing the convention does not import the trainer (`tests/test_layout.py`, `TIERS`).
"""

from typing import TYPE_CHECKING

from .environment import ToolCall, parse_tool_calls, tool_message_ids

if TYPE_CHECKING:
    from .rollout import AgentSettings, EnvironmentRollout

__all__ = ["AgentSettings", "EnvironmentRollout", "ToolCall", "parse_tool_calls", "tool_message_ids"]


def __getattr__(name: str):
    if name in ("AgentSettings", "EnvironmentRollout"):
        from . import rollout

        return getattr(rollout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
