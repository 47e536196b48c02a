"""Benchmark workloads by name: packaged data sets, built-in generators, or a
user's .jsonl file. Every workload is deterministic for a given seed."""

import itertools
import json
import pathlib
import random

from speclane_cli.bench.agentic import agent_loop, code_edit
from speclane_cli.bench.conversation import Conversation
from speclane_cli.datasets import humaneval_problems, sharegpt_conversations

# ShareGPT turns longer than this are skipped: prefill on a CPU would dominate the run.
SHAREGPT_MAX_TURN_CHARS = 1200
# Conversations considered before sampling, so a run never decodes the whole file.
SHAREGPT_POOL = 2000


def humaneval(num_prompts: int, seed: int, max_turns: int) -> list[Conversation]:
    problems = random.Random(seed).sample(humaneval_problems(), k=min(num_prompts, 164))
    return [Conversation((f"Complete this Python function.\n```python\n{p['prompt']}```",)) for p in problems]


def sharegpt(num_prompts: int, seed: int, max_turns: int) -> list[Conversation]:
    """Real multi-turn chats: the users' turns, replayed with the model's own replies."""
    pool = []
    for turns in sharegpt_conversations():
        user_turns = tuple(t["content"] for t in turns if t["role"] == "user")[:max_turns]
        if all(len(text) <= SHAREGPT_MAX_TURN_CHARS for text in user_turns):
            pool.append(Conversation(user_turns))
        if len(pool) == SHAREGPT_POOL:
            break
    return random.Random(seed).sample(pool, k=min(num_prompts, len(pool)))


def jsonl_file(path: pathlib.Path, num_prompts: int, max_turns: int) -> list[Conversation]:
    """A user's prompts, one JSON object a line: {"prompt": "..."}, {"turns": ["...", ...]}
    (replayed as a conversation) or {"messages": [...]} (OpenAI messages ending with a user message)."""
    conversations = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                conversations.append(_conversation_from_record(json.loads(line), f"{path}:{number}", max_turns))
    if not conversations:
        raise ValueError(f"{path} holds no prompts")
    return list(itertools.islice(itertools.cycle(conversations), num_prompts))


def _conversation_from_record(record, where: str, max_turns: int) -> Conversation:
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return Conversation((record["prompt"],))
    if isinstance(record, dict) and _is_list_of(record.get("turns"), str) and record["turns"]:
        return Conversation(tuple(record["turns"][:max_turns]))
    messages = record.get("messages") if isinstance(record, dict) else None
    if (_is_list_of(messages, dict) and messages and messages[-1].get("role") == "user"
            and all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)):
        return Conversation((messages[-1]["content"],), tuple(messages[:-1]))
    raise ValueError(f"{where}: expected {{\"prompt\": str}}, {{\"turns\": [str, ...]}} or "
                     "{\"messages\": [{\"role\", \"content\"}, ...]} ending with a user message")


def _is_list_of(value, kind) -> bool:
    return isinstance(value, list) and all(isinstance(item, kind) for item in value)


BUILT_IN = {
    "humaneval": humaneval,
    "sharegpt": sharegpt,
    "agent-loop": agent_loop,
    "code-edit": code_edit,
}


def load_workload(name: str, num_prompts: int, seed: int, max_turns: int) -> list[Conversation]:
    """`num_prompts` conversations of data set `name` (built-in, or a .jsonl path), at most `max_turns` turns each."""
    if num_prompts < 1 or max_turns < 1:
        raise ValueError("num_prompts and max_turns must be >= 1")
    if name in BUILT_IN:
        return BUILT_IN[name](num_prompts, seed, max_turns)
    path = pathlib.Path(name)
    if path.suffix == ".jsonl" and path.is_file():
        return jsonl_file(path, num_prompts, max_turns)
    raise ValueError(f"unknown data set {name!r}: use one of {', '.join(BUILT_IN)} or a path to a .jsonl file")
