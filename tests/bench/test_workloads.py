import json

import pytest

from speclane_cli.bench.agentic import code_changes
from speclane_cli.bench.conversation import Conversation
from speclane_cli.bench.workloads import BUILT_IN, SHAREGPT_MAX_TURN_CHARS, load_workload
from speclane_cli.datasets import humaneval_problems


def test_each_turn_carries_the_history_with_the_models_own_replies():
    conversation = Conversation(("first", "second", "third"), ({"role": "system", "content": "be brief"},))
    assert conversation.messages([]) == [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "first"}]
    assert conversation.messages(["reply one", "reply two"]) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "reply one"},
        {"role": "user", "content": "second"}, {"role": "assistant", "content": "reply two"},
        {"role": "user", "content": "third"},
    ]


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_built_in_workloads_are_deterministic_sized_and_bounded(name):
    first = load_workload(name, 6, seed=3, max_turns=2)
    assert first == load_workload(name, 6, seed=3, max_turns=2)
    assert first != load_workload(name, 6, seed=4, max_turns=2)
    assert len(first) == 6
    assert all(1 <= len(c.turns) <= 2 and all(turn.strip() for turn in c.turns) for c in first)


def test_sharegpt_replays_real_multi_turn_conversations_of_bounded_length():
    conversations = load_workload("sharegpt", 20, seed=0, max_turns=3)
    assert any(len(c.turns) > 1 for c in conversations)
    assert all(len(turn) <= SHAREGPT_MAX_TURN_CHARS for c in conversations for turn in c.turns)


def test_humaneval_prompts_are_the_problems():
    prompts = {p["prompt"] for p in humaneval_problems()}
    (conversation,) = load_workload("humaneval", 1, seed=0, max_turns=1)
    assert any(prompt in conversation.turns[0] for prompt in prompts)


def test_code_edit_asks_for_one_change_to_real_code():
    solutions = {p["prompt"] + p["canonical_solution"] for p in humaneval_problems()}
    for conversation in load_workload("code-edit", 5, seed=0, max_turns=1):
        (turn,) = conversation.turns
        assert turn.startswith("Rewrite this code with one change: ")
        assert any(code in turn for code in solutions)


def test_agent_loop_sessions_re_emit_a_file_with_a_new_change_each_turn():
    conversations = load_workload("agent-loop", 4, seed=0, max_turns=3)
    kinds = set()
    for conversation in conversations:
        first, *later = conversation.turns
        path = first.split("`")[1]
        assert "currently contains:\n```\n" in first
        assert later and all(f"Next change to `{path}`" in turn for turn in later)
        assert len(set(turn.split("Next change")[-1] for turn in later)) == len(later)  # a new change each turn
        kinds.add((path.endswith(".json"), "write_file tool call" in first))
    assert kinds == {(False, False), (True, False), (False, True), (True, True)}


def test_agent_loop_config_files_are_valid_json():
    conversation = load_workload("agent-loop", 2, seed=1, max_turns=1)[1]
    content = conversation.turns[0].split("```\n")[1].rsplit("\n```", 1)[0]
    assert json.loads(content)["database"]["host"] == "db.internal"


def test_code_changes_name_the_real_function():
    import random

    problem = humaneval_problems()[3]
    changes = code_changes(problem, random.Random(0))
    assert any(f"`{problem['entry_point']}`" in change for change in changes)
    assert any("parameter `operations`" in change for change in changes)


def test_jsonl_file_takes_prompts_turns_and_messages(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in [
        {"prompt": "hello"},
        {"turns": ["a", "b", "c"]},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]},
    ]) + "\n\n")
    conversations = load_workload(str(path), 4, seed=0, max_turns=2)
    assert conversations == [
        Conversation(("hello",)), Conversation(("a", "b")),
        Conversation(("q",), ({"role": "system", "content": "sys"},)),
        Conversation(("hello",)),  # cycles to reach num_prompts
    ]


@pytest.mark.parametrize("record", [{"prompt": 3}, {"messages": [{"role": "assistant", "content": "x"}]},
                                    {"turns": []}, ["list"]])
def test_jsonl_file_rejects_records_outside_the_schema(tmp_path, record):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_workload(str(path), 1, seed=0, max_turns=1)


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown data set 'gsm8k'"):
        load_workload("gsm8k", 1, seed=0, max_turns=1)
