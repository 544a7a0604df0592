"""The environment convention, tool calls in the policy's text, and the tokens of a tool's reply.

An environment follows TRL 1.16's `environment_factory` convention: a factory `() -> env` makes one instance per
trajectory; `env.reset(**columns)` starts it (the example's data columns, `answer` included) and may return a first
observation (text); every public method other than `reset` and `get_reward` is a tool the policy may call by name
with keyword arguments; `env.get_reward()`, if defined, scores the finished trajectory. (TRL appends `reset`'s text to
the last user message; here the prompt is shared by all G trajectories and captured once, so that text is the first
tool message of the trajectory instead.)

Tool calls are read from a policy turn's text in the Hermes / Qwen format that transformers' chat templates write:
`<tool_call>{"name": "open", "arguments": {"section": 3}}</tool_call>`; `parse_tool_calls` can be replaced by any
`text -> list[ToolCall]`. A tool's reply becomes the tokens the chat template writes for a `tool` message followed
by the generation prompt (as TRL's `_get_tool_suffix_ids`); a tokenizer without a chat template gets
`<tool_response>` … `</tool_response>` lines.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's `name` and its keyword `arguments`."""

    name: str
    arguments: dict = field(default_factory=dict)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The `<tool_call>{json}</tool_call>` blocks of `text`, in order. A block that is not a JSON object with a string
    `name` (and a mapping `arguments`, if any) is returned as a call of the tool `""` whose `arguments` hold the raw
    text under `error`, so that the policy gets an error message back rather than silence."""
    calls = []
    for raw in _CALL.findall(text):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {"error": f"the tool call is not valid JSON ({e.msg}): {raw[:200]}"}))
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            calls.append(ToolCall("", {"error": 'a tool call is {"name": str, "arguments": {...}}; got ' + raw[:200]}))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


def environment_tools(env) -> dict:
    """The tools of an environment instance: its public methods but `reset` and `get_reward` (name → bound method)."""
    if not callable(getattr(env, "reset", None)):
        raise TypeError(f"an environment needs a callable reset(**columns); {type(env).__name__} has none")
    tools = {}
    for name, fn in inspect.getmembers(type(env), predicate=inspect.isfunction):
        if not name.startswith("_") and name not in ("reset", "get_reward"):
            tools[name] = fn.__get__(env, type(env))  # the class's method, even where an attribute shadows the name
    return tools


def call_tool(tools: dict, call: ToolCall) -> tuple[str, bool]:
    """(the reply as text, whether the call failed). A failing call replies with the error, so the trajectory goes
    on: an unknown tool, bad arguments, an exception inside the tool, a reply of None or nothing."""
    if not call.name:
        return f"error: {call.arguments.get('error', 'unreadable tool call')}", True
    fn = tools.get(call.name)
    if fn is None:
        return f"error: no tool named {call.name!r}; tools: {sorted(tools)}", True
    try:
        out = fn(**call.arguments)
    except TypeError as e:
        return f"error: {call.name}: {e}", True
    except Exception as e:  # noqa: BLE001 - the tool's failure is the policy's observation
        return f"error: {call.name} raised {type(e).__name__}: {e}", True
    text = (
        ""
        if out is None
        else out
        if isinstance(out, str)
        else json.dumps(out)
        if isinstance(out, (dict, list))
        else str(out)
    )
    if not text.strip():
        return f"({call.name} returned nothing)", False
    return text, False


def tool_message_ids(tokenizer, name: str, content: str) -> list[int]:
    """Token ids of one tool message and the generation prompt after it, as the chat template writes them after an
    assistant turn that ended with the stop token (TRL's `_get_tool_suffix_ids`)."""
    if getattr(tokenizer, "chat_template", None):
        calls = [{"type": "function", "function": {"name": name or "tool", "arguments": {}}}]
        head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        prefix = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False)
        full = tokenizer.apply_chat_template(
            head + [{"role": "tool", "name": name, "content": content}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        eos = tokenizer.eos_token_id
        ends = [i for i, t in enumerate(prefix) if t == eos]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] == prefix:
            return list(full[len(prefix) :])
    return tokenizer(f"\n<tool_response>\n{content}\n</tool_response>\n", add_special_tokens=False)["input_ids"]
