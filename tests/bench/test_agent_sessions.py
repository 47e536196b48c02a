"""The sessions of `speclane bench agent`: scripted ones (the same for a seed,
whatever the model answers; a history that grows with its replies and tool
calls) and a user's session log, grouped into sessions by shared prefixes."""

import json

import pytest

from speclane_cli.bench.agent_sessions import TOOLS, agent_sessions, logged_sessions, sessions_for

WRITE = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_w", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "x"}'}}]}
DONE = {"role": "assistant", "content": "Done."}


def test_scripted_sessions_are_the_same_for_a_seed_and_differ_across_seeds():
    first = agent_sessions(6, 4, seed=3)
    assert first == agent_sessions(6, 4, seed=3) and first != agent_sessions(6, 4, seed=4)
    assert len(first) == 6 and all(len(session.turns) == 4 for session in first)
    assert {session.path.split("/")[0] for session in first} == {"src", "config"}  # code and configuration
    replies = [WRITE, DONE, WRITE]
    assert [s.request(replies[:n]) for s in first for n in range(4)] == \
        [s.request(replies[:n]) for s in agent_sessions(6, 4, seed=3) for n in range(4)]


def test_the_first_request_hands_over_the_file_and_asks_for_a_change():
    session = agent_sessions(1, 3, seed=0)[0]
    request = session.request([])
    assert request["tools"] == list(TOOLS) and request["tool_choice"] == "auto"
    system, ask, read, result = request["messages"]
    assert system["role"] == "system" and ask["role"] == "user" and session.path in ask["content"]
    assert read["tool_calls"][0]["function"]["name"] == "read_file"
    assert result == {"role": "tool", "tool_call_id": "call_0", "content": session.content}


def test_the_history_grows_with_replies_tool_results_and_the_next_change():
    session = agent_sessions(1, 3, seed=0)[0]
    after_call = session.request([WRITE])["messages"]
    assert after_call[4] == WRITE
    assert after_call[5]["role"] == "tool" and after_call[5]["tool_call_id"] == "call_w"
    assert after_call[5]["content"].startswith("Wrote `x`.")
    assert len(after_call) == 6  # a tool result is answered by the model, not by a new change
    after_text = session.request([WRITE, DONE])["messages"]
    assert after_text[:6] == after_call and after_text[6] == DONE
    assert after_text[7]["role"] == "user" and after_text[7]["content"] != after_call[1]["content"]


def test_unknown_tools_and_files_get_an_error_and_a_file_read_again_is_not_sent_again():
    session = agent_sessions(1, 2, seed=0)[0]
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
             for i, (name, arguments) in enumerate((("read_file", {"path": session.path}), ("rm_rf", {}),
                                                   ("read_file", {"path": "other.py"}),
                                                   ("write_file", {"path": "other.py", "content": "x"}),
                                                   ("read_file", {"path": "other.py"})))]
    results = [m["content"] for m in
               session.request([{"role": "assistant", "content": None, "tool_calls": calls}])["messages"][5:]]
    # The file is already in the history (the first read) and only the agent edits it, as Claude Code's Read
    # answers then: a note pointing at the earlier result, not the file again.
    assert "unchanged" in results[0] and session.content not in results[0]
    assert results[1].startswith("error:") and results[2].startswith("error:")  # no such tool, no such file
    assert "unchanged" in results[4]  # the agent's own write is what it last saw


def test_a_call_cut_short_is_left_out_of_the_history():
    session = agent_sessions(1, 2, seed=0)[0]
    cut = {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a.py", "con'}}
    whole = {"id": "c0", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
    messages = session.request([{"role": "assistant", "content": None, "tool_calls": [whole, cut]}])["messages"]
    assert messages[4]["tool_calls"] == [whole] and [m["tool_call_id"] for m in messages[5:]] == ["c0"]
    # A reply whose every call is cut short reads as the model being done: the next change is asked.
    messages = session.request([{"role": "assistant", "content": None, "tool_calls": [cut]}])["messages"]
    assert messages[4] == {"role": "assistant", "content": ""} and messages[5]["role"] == "user"


def test_a_session_log_is_grouped_into_sessions_by_prefix(tmp_path):
    def ask(*texts):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]

    log = [
        {"model": "m", "messages": ask("fix a.py"), "tools": [TOOLS[0]], "stream": False, "max_tokens": 9999},
        {"messages": ask("other task")},
        {"messages": ask("fix a.py", "done", "now b.py"), "tool_choice": "auto"},
        {"messages": ask("other task", "ok", "more")},
    ]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in log) + "\n\n")
    sessions = logged_sessions(path)
    assert [len(session.turns) for session in sessions] == [2, 2]
    first = sessions[0]
    # Only the conversation's own fields are replayed; the bench sets model, streaming and limits.
    assert first.request([]) == {"messages": ask("fix a.py"), "tools": [TOOLS[0]]}
    assert first.request([{"ignored": "the log's own history is replayed"}]) == log[2]
    assert sessions_for(str(path), 99, 99, 0) == sessions  # each logged session once


@pytest.mark.parametrize("line", ["not json", '{"prompt": "x"}', '{"messages": []}', '{"messages": [{"x": 1}]}'])
def test_a_bad_log_line_is_named(tmp_path, line):
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match="log.jsonl:2"):
        logged_sessions(path)
