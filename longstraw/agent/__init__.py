"""Agents: multi-turn rollouts through an environment whose tool output grows each trajectory's own state.

`environment.py` holds the environment convention (TRL 1.16's `environment_factory`: `reset`, public methods as
tools, an optional `get_reward`), tool-call parsing and the tokens of a tool message; `rollout.py` the rollout hook
that runs G trajectories from one captured prompt, each on its own `longstraw.branch.Branch`.
"""

from .environment import ToolCall, parse_tool_calls, tool_message_ids
from .rollout import AgentSettings, EnvironmentRollout

__all__ = ["AgentSettings", "EnvironmentRollout", "ToolCall", "parse_tool_calls", "tool_message_ids"]
