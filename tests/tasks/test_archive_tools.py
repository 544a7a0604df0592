"""The agent task of `longstraw.tasks.archive_tools`: its rows, its tools and its reward."""

import json
import random

from longstraw.agent import ToolCall
from longstraw.agent.environment import call_tool, environment_tools
from longstraw.tasks.archive_tools import ArchiveTools, GuidedArchiveTools, make_row, parse_commands, write_archive_task
from longstraw.tasks.documents import named_paragraphs
from longstraw.tasks.tokenizer import build_tokenizer


def _row(seed=0):
    return make_row(build_tokenizer(), named_paragraphs(), 6, 120, random.Random(seed))


def test_rows_hide_the_code_in_one_section_behind_the_tools():
    row = _row()
    assert len(row["sections"]) == len(row["titles"]) == 6
    fact = f"The access code for the {row['archive']} archive is {row['answer']}."
    assert [fact in s for s in row["sections"]].count(True) == 1 and fact in row["sections"][row["section"] - 1]
    question = row["messages"][-1]["content"]
    assert row["answer"] not in question and all(t in question for t in row["titles"])
    assert row["messages"][0]["role"] == "user" and row["messages"][1]["content"].startswith("search ")


def test_tools_and_reward():
    row = _row(1)
    env = ArchiveTools()
    env.reset(**{k: v for k, v in row.items() if k != "messages"})
    tools = environment_tools(env)
    assert sorted(tools) == ["answer", "open", "search"]
    hit, failed = call_tool(tools, ToolCall("search", {"word": row["archive"].upper()}))
    assert not failed and f"[section {row['section']}]" in hit and row["answer"] in hit
    assert env.get_reward() == 0.25  # read the code, not answered yet
    assert "no section 99" in call_tool(tools, ToolCall("open", {"section": 99}))[0]
    assert "section number" in call_tool(tools, ToolCall("open", {"section": "x"}))[0]
    assert call_tool(tools, ToolCall("open", {"section": row["section"]}))[0] == row["sections"][row["section"] - 1]
    call_tool(tools, ToolCall("answer", {"code": "0000"}))
    assert env.done and env.get_reward() == 0.25
    env.reset(**{k: v for k, v in row.items() if k != "messages"})
    assert env.get_reward() == 0.0
    call_tool(tools, ToolCall("answer", {"code": row["answer"] + "."}))
    assert env.get_reward() == 1.0


def test_the_guided_reward_pays_a_tool_used_to_some_effect():
    """`GuidedArchiveTools`: 0.05 once a search hit or an open of a section happened (the plain environment: 0); a
    search without a hit, a refused open or a wrong answer alone pay nothing; reading the code (0.25) and the right
    code (1) as in the plain environment."""
    row = _row(1)
    columns = {k: v for k, v in row.items() if k != "messages"}
    other = next(i for i in range(1, len(row["sections"]) + 1) if row["answer"] not in row["sections"][i - 1])
    for env, used in ((ArchiveTools(), 0.0), (GuidedArchiveTools(), 0.05)):
        tools = environment_tools(env)
        env.reset(**columns)
        call_tool(tools, ToolCall("search", {"word": "zzzqqq"}))
        call_tool(tools, ToolCall("open", {"section": 99}))
        call_tool(tools, ToolCall("answer", {"code": "0000"}))
        assert env.get_reward() == 0.0
        env.reset(**columns)
        call_tool(tools, ToolCall("open", {"section": other}))
        assert env.get_reward() == used
        call_tool(tools, ToolCall("search", {"word": row["archive"]}))
        assert env.get_reward() == 0.25
        call_tool(tools, ToolCall("answer", {"code": row["answer"]}))
        assert env.get_reward() == 1.0


def test_commands_are_read_from_a_turn():
    assert parse_commands("search “Falcon” - find") == [ToolCall("search", {"word": "Falcon"})]
    assert parse_commands("Let me look.\nopen <3>") == [ToolCall("open", {"section": "3"})]
    assert parse_commands("Answer: 1357") == [ToolCall("answer", {"code": "1357"})]
    assert parse_commands("I researched the answer") == []
    assert parse_commands('<tool_call>{"name": "open", "arguments": {"section": 2}}</tool_call>') == [
        ToolCall("open", {"section": 2})]


def test_written_files_are_jsonl_rows(tmp_path):
    paths = write_archive_task(build_tokenizer(), tmp_path, 2, 3, num_sections=3, section_tokens=60)
    rows = [json.loads(line) for line in paths["eval"].read_text().splitlines()]
    assert len(rows) == 3 and len(paths["train"].read_text().splitlines()) == 2
    assert all(set(r) >= {"messages", "answer", "sections"} for r in rows)


def test_document_in_the_prompt_with_distractors():
    """The long-context variant: every section in a system message ahead of the worked example, the asked archive's
    code once, and k other archives' codes planted (the search for the asked archive still finds its code only)."""
    row = make_row(build_tokenizer(), named_paragraphs(), 6, 120, random.Random(3), document_in_prompt=True,
                   distractors=3)
    system = row["messages"][0]
    assert system["role"] == "system" and all(s in system["content"] for s in row["sections"])
    assert [m["role"] for m in row["messages"][1:]] == ["user", "assistant", "tool", "assistant", "user"]
    codes = [line for s in row["sections"] for line in s.split("\n\n") if line.startswith("The access code for")]
    assert len(codes) == 4 and len({c.split()[5] for c in codes}) == 4
    assert sum(f"the {row['archive']} archive is {row['answer']}." in c for c in codes) == 1
    asked_in_example = row["messages"][1]["content"].split()[-2]
    assert all(f"the {asked_in_example} archive" not in c for c in codes)
    env = ArchiveTools()
    env.reset(**{k: v for k, v in row.items() if k != "messages"})
    hits = environment_tools(env)["search"](row["archive"])
    assert hits.count("[section") == 1 and row["answer"] in hits
    plain = _row(3)  # the default row is drawn as before the options existed (the same seed, the same row)
    assert "system" not in [m["role"] for m in plain["messages"]]
    assert sum(s.count("The access code for") for s in plain["sections"]) == 1
