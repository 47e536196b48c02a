"""The sessions `speclane bench agent` drives through the chat tools API: scripted
agent sessions, seeded, or a user's own session log replayed.

A scripted session is a coding agent editing one file (a HumanEval solution or a
service's JSON configuration). The script hands the model the file (a `read_file`
call and its result), asks for one change at a time, and answers every call the
model makes: `write_file` (the file re-emitted with the edit) is saved, with test
feedback, `run_tests` returns the feedback, anything else an error. `read_file` of a
file the agent has already read or written answers as Claude Code's Read does (only
the agent edits the file, so it is unchanged since): a short note to use the earlier
result, not the file again; a path never seen is an error. After a reply without
calls, the script asks for the next change. A call whose arguments are not a JSON
object (cut short by max_tokens) could not be run by any agent: it is left out of
the history, as is the whole reply's call list where none is.
Everything the script says comes from the seed alone, so a session is the same
whatever the model answers; the model's replies, tool calls included, go into a
history that grows with every request.

A session log is JSONL, one chat-completions request body a line, as a client sent
them. A request whose messages extend an earlier request's belongs to that one's
session; sessions replay their recorded requests in order (the recorded history,
not the model's new replies).
"""

import dataclasses
import json
import pathlib
import random

from speclane_cli.bench.agentic import FEEDBACK, code_file, config_file
from speclane_cli.datasets import humaneval_problems


def _function(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties)}}}


PATH_PROPERTY = {"path": {"type": "string", "description": "file path in the repository"}}
TOOLS = (
    _function("read_file", "Read a file of the repository.", PATH_PROPERTY),
    _function("write_file", "Write a file of the repository, replacing all of its content.",
              {**PATH_PROPERTY, "content": {"type": "string", "description": "the complete new content"}}),
    _function("run_tests", "Run the repository's tests.", {}),
)
SYSTEM = ("You are a coding agent working in a repository through tools. To change a file, call write_file "
          "with the complete file, unchanged apart from the requested edit. When a change is done, say so briefly.")
# Fields of a logged request that are replayed; the bench sets model, sampling, max_tokens and streaming.
REPLAYED_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "stop")


@dataclasses.dataclass(frozen=True)
class AgentSession:
    path: str
    content: str
    changes: tuple[str, ...]  # asked for one after the other
    feedback: tuple[str, ...]  # the tests' verdict after each write_file, in turn
    num_requests: int

    @property
    def turns(self) -> range:
        return range(self.num_requests)

    def request(self, replies: list[dict]) -> dict:
        """The chat request after `replies` (the model's assistant messages so far)."""
        messages = [{"role": "system", "content": SYSTEM}, self._ask(0),
                    {"role": "assistant", "content": None, "tool_calls": [_call("call_0", "read_file",
                                                                                {"path": self.path})]},
                    {"role": "tool", "tool_call_id": "call_0", "content": self.content}]
        asked, writes, seen = 1, 0, {self.path}
        for reply in replies:
            calls = [call for call in reply.get("tool_calls") or () if _readable(call["function"]["arguments"])]
            messages.append({**reply, "tool_calls": calls} if calls
                            else {"role": "assistant", "content": reply.get("content") or ""})
            for call in calls:
                result, wrote = self._tool_result(call["function"], writes, seen)
                writes += wrote
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            if not calls:  # the model says it is done: the next change
                messages.append(self._ask(asked))
                asked += 1
        return {"messages": messages, "tools": list(TOOLS), "tool_choice": "auto"}

    def _ask(self, number: int) -> dict:
        change = self.changes[number % len(self.changes)]
        return {"role": "user", "content": f"In `{self.path}`, {change}. Then write the file back."}

    def _tool_result(self, function: dict, writes: int, seen: set[str]) -> tuple[str, int]:
        """The script's answer to a call, and whether it was a write; `seen` gathers the paths read or written."""
        name, path = function["name"], json.loads(function["arguments"]).get("path")
        path = path if isinstance(path, str) else None
        feedback = self.feedback[writes % len(self.feedback)]
        if name == "write_file":
            seen.add(path or self.path)
            return f"Wrote `{path or self.path}`. {feedback}", 1
        if name == "read_file":
            if path in seen:
                return f"`{path}` is unchanged since you last read or wrote it; use that earlier tool result.", 0
            return f"error: there is no file {path!r}", 0
        if name == "run_tests":
            return feedback, 0
        return f"error: there is no tool {name!r}; use read_file, write_file or run_tests", 0


def _readable(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def agent_sessions(num_sessions: int, num_requests: int, seed: int) -> list[AgentSession]:
    """Sessions alternating between a Python file and a JSON configuration, each
    `num_requests` requests long; the same for the same seed."""
    if num_sessions < 1 or num_requests < 1:
        raise ValueError("sessions and requests per session must be >= 1")
    rng = random.Random(seed)
    problems = rng.sample(humaneval_problems(), k=min(num_sessions, 164))
    sessions = []
    for index in range(num_sessions):
        if index % 2 == 0:
            path, content, changes = code_file(problems[index % len(problems)], rng)
        else:
            path = f"config/{rng.choice(('service', 'deploy', 'settings'))}.json"
            content, changes = config_file(rng)
        feedback = tuple(rng.choice(FEEDBACK) for _ in range(num_requests))
        sessions.append(AgentSession(path, content, tuple(changes), feedback, num_requests))
    return sessions


@dataclasses.dataclass(frozen=True)
class LoggedSession:
    requests: tuple[dict, ...]  # the replayed fields of each logged request, in order

    @property
    def turns(self) -> range:
        return range(len(self.requests))

    def request(self, replies: list[dict]) -> dict:
        return self.requests[len(replies)]


def logged_sessions(path: pathlib.Path) -> list[LoggedSession]:
    """A session log's requests grouped into sessions (see the module's docstring)."""
    sessions: list[list[dict]] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            request = _logged_request(line, f"{path}:{number}")
            messages = request["messages"]
            # The latest session whose last request this one extends; else a new session.
            owner = next((session for session in reversed(sessions)
                          if messages[:len(session[-1]["messages"])] == session[-1]["messages"]), None)
            if owner is None:
                sessions.append([request])
            else:
                owner.append(request)
    if not sessions:
        raise ValueError(f"{path} holds no requests")
    return [LoggedSession(tuple(session)) for session in sessions]


def _logged_request(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ValueError(f"{where}: not JSON ({error})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise ValueError(f"{where}: expected a chat-completions request with \"messages\": [{{\"role\", ...}}, ...]")
    return {key: record[key] for key in REPLAYED_FIELDS if key in record}


def sessions_for(replay: str | None, num_sessions: int, num_requests: int, seed: int) -> list:
    """The replayed log's sessions, all of them and each once (a session run twice would find its
    prefix cached the second time), or `num_sessions` scripted ones."""
    return agent_sessions(num_sessions, num_requests, seed) if replay is None else logged_sessions(pathlib.Path(replay))
