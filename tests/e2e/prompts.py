"""Real prompts for end-to-end tests: HumanEval problems and ShareGPT turns."""

import itertools

from speclane_cli.datasets import humaneval_problems, sharegpt_conversations

_MAX_PROMPT_CHARS = 800


def humaneval_messages(count: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Complete this Python function.\n```python\n{p['prompt']}```"}]
        for p in humaneval_problems()[:count]
    ]


def sharegpt_messages(count: int) -> list[list[dict]]:
    first_turns = (c[0]["content"][:_MAX_PROMPT_CHARS] for c in sharegpt_conversations())
    return [[{"role": "user", "content": text}] for text in itertools.islice(first_turns, count)]


def code_edit_messages() -> list[dict]:
    """An agent-style request to re-emit code with one small change: what suffix decoding is for."""
    problem = humaneval_problems()[0]
    code = problem["prompt"] + problem["canonical_solution"]
    return [{"role": "user", "content": (
        "Repeat the following Python code exactly, but rename the function to `close_pairs`. "
        f"Output only the code.\n```python\n{code}```"
    )}]
