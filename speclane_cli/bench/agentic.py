"""Generated workloads of the kind suffix decoding exists for: outputs that
repeat text the model has already seen or written.

- code-edit: "rewrite this code with one change", over real code (HumanEval
  canonical solutions).
- agent-loop: an agent session that re-emits a whole file, as a code block or
  as a JSON `write_file` tool call, with one small change per turn; each turn
  carries the model's previous output in its history.
"""

import ast
import json
import random

from speclane_cli.bench.conversation import Conversation
from speclane_cli.datasets import humaneval_problems

NEW_FUNCTION_NAMES = ("solve", "compute", "run_task", "process", "evaluate", "transform")
NEW_PARAMETER_NAMES = ("data", "items", "value_in", "source", "arg", "payload")
SERVICES = ("billing", "search", "gateway", "ingest", "reports", "auth")
FEATURES = ("caching", "metrics", "tracing", "rate_limits", "audit_log", "compression", "retries")
FEEDBACK = ("Saved. The tests pass.", "Saved. The linter reports no issues.",
            "Saved. One test still fails; keep going.", "Saved.")
AGENT_SYSTEM = ("You are a coding agent. You change files exactly as asked and always output the complete "
                "file, unchanged apart from the requested edit.")
TOOL_SYSTEM = ("You are a coding agent that acts only through tool calls. Reply with exactly one JSON object "
               '{"tool": "write_file", "arguments": {"path": ..., "content": ...}} holding the complete file, '
               "and nothing else.")


def problem_code(problem: dict) -> str:
    return problem["prompt"] + problem["canonical_solution"]


def code_changes(problem: dict, rng: random.Random) -> list[str]:
    """Small edits to a HumanEval solution, as instructions, in a seeded order."""
    name = problem["entry_point"]
    function = next(node for node in ast.walk(ast.parse(problem_code(problem)))
                    if isinstance(node, ast.FunctionDef) and node.name == name)
    changes = [f"rename the function `{name}` to `{rng.choice(NEW_FUNCTION_NAMES)}`",
               "add the comment `# Reviewed by the agent.` as the first line of the file",
               "remove the docstring of the function"]
    if function.args.args:
        parameter = rng.choice(function.args.args).arg
        changes.append(f"rename the parameter `{parameter}` to `{rng.choice(NEW_PARAMETER_NAMES)}` everywhere")
    rng.shuffle(changes)
    return changes


def code_file(problem: dict, rng: random.Random) -> tuple[str, str, list[str]]:
    """A HumanEval solution as a file an agent edits: (path, content, changes)."""
    return f"src/{problem['entry_point']}.py", problem_code(problem), code_changes(problem, rng)


def config_file(rng: random.Random) -> tuple[str, list[str]]:
    """A service's JSON configuration and small edits to it."""
    config = {
        "service": rng.choice(SERVICES),
        "port": rng.randrange(8000, 9000),
        "replicas": rng.randint(1, 4),
        "log_level": "info",
        "features": sorted(rng.sample(FEATURES, 3)),
        "database": {"host": "db.internal", "port": 5432, "pool_size": rng.choice((5, 10, 20))},
    }
    missing = [f for f in FEATURES if f not in config["features"]]
    changes = [f"set `port` to {config['port'] + 1}",
               f"set `replicas` to {config['replicas'] + 2}",
               'set `log_level` to "debug"',
               f'add "{rng.choice(missing)}" to the end of `features`',
               f"set `database.pool_size` to {config['database']['pool_size'] * 2}"]
    rng.shuffle(changes)
    return json.dumps(config, indent=2), changes


def code_edit(num_prompts: int, seed: int, max_turns: int) -> list[Conversation]:
    rng = random.Random(seed)
    conversations = []
    for problem in rng.sample(humaneval_problems(), k=min(num_prompts, 164)):
        change = code_changes(problem, rng)[0]
        conversations.append(Conversation((
            f"Rewrite this code with one change: {change}. Output only the complete code.\n"
            f"```python\n{problem_code(problem)}```",)))
    return conversations


def agent_loop(num_prompts: int, seed: int, max_turns: int) -> list[Conversation]:
    """Sessions alternate over (Python file, JSON config) x (code block, JSON tool call)."""
    rng = random.Random(seed)
    problems = rng.sample(humaneval_problems(), k=min(num_prompts, 164))
    conversations = []
    for index in range(num_prompts):
        if index % 2 == 0:
            path, content, changes = code_file(problems[index % len(problems)], rng)
        else:
            path = "config/service.json"
            content, changes = config_file(rng)
        as_tool_call = index % 4 >= 2
        conversations.append(_session(path, content, changes[:max_turns], as_tool_call, rng))
    return conversations


def _session(path: str, content: str, changes: list[str], as_tool_call: bool, rng: random.Random) -> Conversation:
    reply_format = ("Reply with the write_file tool call." if as_tool_call
                    else "Reply with the complete updated file in one code block, nothing else.")
    first = f"The file `{path}` currently contains:\n```\n{content}\n```\nChange: {changes[0]}. {reply_format}"
    later = [f"{rng.choice(FEEDBACK)} Next change to `{path}`: {change}. {reply_format}" for change in changes[1:]]
    system = TOOL_SYSTEM if as_tool_call else AGENT_SYSTEM
    return Conversation((first, *later), ({"role": "system", "content": system},))
