"""`speclane bench agent`: multi-turn agent sessions through the chat tools API
against a running server (`speclane serve`, or any OpenAI-compatible endpoint),
several at once: tool calls, tool results, files re-emitted with edits, a history
that grows with every request (see agent_sessions.py), or a user's own session
log with --replay. For each concurrency and method it reports output tokens/s,
tokens per verify step, and the time to first token of a session's first request
against its later ones, whose prompts extend a prefix the server has cached.

Methods go in speclane's `speculation` request field; one the server refuses
(hybrid without a draft head) is reported absent with the server's reason.
Greedy by default, so a run is deterministic up to the server's batching.
"""

import asyncio
import dataclasses
import json
import pathlib
import shlex
import statistics
import sys
import uuid
from typing import Any

import httpx
from tqdm import tqdm

from speclane_cli.bench.report import markdown_table, terminal_table
from speclane_cli.bench.serve import alternated, csv_list, request_fields
from speclane_cli.bench.stats import RequestResult, RunStats, summarize

DEFAULT_METHODS = "none,suffix,hybrid"


def add_arguments(parser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    parser.add_argument("--model", default="", help="model name to request; default: the first the server lists")
    parser.add_argument("--sessions", type=int, default=16, help="scripted sessions per run")
    parser.add_argument("--requests-per-session", type=int, default=4,
                        help="requests in each scripted session (each a model reply: a tool call or text)")
    parser.add_argument("--replay", default=None, metavar="FILE",
                        help="replay a session log instead: JSONL, one chat-completions request a line "
                             "(messages, tools, tool_choice...); --sessions and --requests-per-session do not apply")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated: sessions running at once")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma-separated speculation methods; 'none' is the baseline")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="k for the speculative methods; default: each method's own on the server")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens of every request")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scripted sessions")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every method this many times, in reverse order every other round, each round with "
                             "fresh tenants; a row sums its rounds (as bench serve's --rounds)")
    parser.add_argument("--output-dir", default="bench-results/agent", help="where results.json/.md go")


def _settings(args) -> dict:
    settings = {
        "url": args.url, "model": args.model, "sessions": args.sessions,
        "requests_per_session": args.requests_per_session, "replay": args.replay,
        "concurrency": csv_list(int)(args.concurrency), "methods": csv_list(str)(args.methods),
        "num_speculative_tokens": args.num_speculative_tokens, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "seed": args.seed, "rounds": args.rounds, "output_dir": args.output_dir,
    }
    if min(settings["concurrency"]) < 1:
        raise ValueError("concurrency levels must be >= 1")
    counts = (args.sessions, args.requests_per_session, args.max_tokens, args.rounds, args.num_speculative_tokens or 1)
    if min(counts) < 1:
        raise ValueError("--sessions, --requests-per-session, --max-tokens, --rounds and --num-speculative-tokens "
                         "must be >= 1")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    return settings


def command_line(settings: dict) -> str:
    """The command that reproduces this run, every setting explicit."""
    flags = {"--url": settings["url"], "--model": settings["model"], "--sessions": settings["sessions"],
             "--requests-per-session": settings["requests_per_session"], "--replay": settings["replay"],
             "--concurrency": ",".join(map(str, settings["concurrency"])), "--methods": ",".join(settings["methods"]),
             "--num-speculative-tokens": settings["num_speculative_tokens"], "--max-tokens": settings["max_tokens"],
             "--temperature": settings["temperature"], "--seed": settings["seed"], "--rounds": settings["rounds"],
             "--output-dir": settings["output_dir"]}
    if settings["rounds"] == 1:
        del flags["--rounds"]
    if settings["replay"] is None:
        del flags["--replay"]
    else:
        del flags["--sessions"], flags["--requests-per-session"], flags["--seed"]
    if settings["num_speculative_tokens"] is None:
        del flags["--num-speculative-tokens"]
    return "speclane bench agent " + " ".join(f"{flag} {shlex.quote(str(value))}" for flag, value in flags.items())


def refusal(url: str, fields: dict) -> str | None:
    """Why the server refuses requests with these fields (its error message), or None."""
    from speclane_cli.bench.client import api_base

    body = {**fields, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    reply = httpx.post(f"{api_base(url)}/chat/completions", json=body, timeout=120)
    if reply.status_code == 200:
        return None
    try:
        return reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {reply.status_code}: {reply.text[:200]}"


def _ttft_ms(results: list[RequestResult], later: bool) -> float | None:
    values = [r.ttft * 1000 for r in results if r.ok and (r.turn > 0) == later]
    return statistics.fmean(values) if values else None


def _later_cached_share(results: list[RequestResult]) -> float | None:
    """Of the later requests' prompt tokens, the share the server found in its prefix cache."""
    later = [r for r in results if r.ok and r.turn > 0 and r.cached_tokens is not None]
    prompt_tokens = sum(r.input_tokens for r in later)
    return sum(r.cached_tokens for r in later) / prompt_tokens if prompt_tokens else None


def row(run: RunStats, results: list[RequestResult], baseline: RunStats | None) -> dict:
    """A run's line of the table: RunStats plus what agent sessions add."""
    first, later = _ttft_ms(results, later=False), _ttft_ms(results, later=True)
    return {**run.as_dict(), "ttft_first_ms": first, "ttft_later_ms": later,
            "ttft_later_over_first": later / first if first and later is not None else None,
            "later_cached_share": _later_cached_share(results),
            "tool_calls": sum(r.tool_calls for r in results if r.ok),
            "speedup_vs_none": run.throughput_tps / baseline.throughput_tps
            if baseline is not None and baseline.throughput_tps else None}


def _number(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


COLUMNS = (
    ("Conc.", lambda r: str(r["concurrency"])),
    ("Method", lambda r: r["method"]),
    ("Requests", lambda r: str(r["requests"])),
    ("Failed", lambda r: str(r["failed"])),
    ("Mean in", lambda r: _number(r["mean_input_tokens"], 0)),
    ("Mean out", lambda r: _number(r["mean_output_tokens"], 0)),
    ("Tool calls", lambda r: str(r["tool_calls"])),
    ("Tok/s", lambda r: _number(r["throughput_tps"])),
    ("x none", lambda r: _number(r["speedup_vs_none"], 2)),
    ("Tok/step", lambda r: _number(r["tokens_per_step"], 2)),
    ("Accept", lambda r: "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate'] * 100:.1f}%"),
    ("TTFT first ms", lambda r: _number(r["ttft_first_ms"], 0)),
    ("TTFT later ms", lambda r: _number(r["ttft_later_ms"], 0)),
    ("Later/first", lambda r: _number(r["ttft_later_over_first"], 2)),
    ("Later cached", lambda r: "-" if r["later_cached_share"] is None else f"{r['later_cached_share'] * 100:.0f}%"),
)


@dataclasses.dataclass(frozen=True)
class Salted:
    """A session whose requests share prefix-cache blocks with each other only (vLLM's cache_salt): its first
    request starts cold, as a new conversation's does on a server that has not seen its system prompt, and
    the TTFT of its later requests shows what reusing its own prefix saves."""

    session: Any
    salt: str

    @property
    def turns(self) -> range:
        return self.session.turns

    def request(self, replies: list[dict]) -> dict:
        return {**self.session.request(replies), "cache_salt": self.salt}


def _run_all(settings: dict, sessions: list, methods: list[str]) -> list[dict]:
    from speclane_cli.bench.client import closed_loop

    run_id = uuid.uuid4().hex[:8]
    sessions = [Salted(session, f"session-{index}") for index, session in enumerate(sessions)]
    plan = [(number, concurrency, method) for number in range(settings["rounds"])
            for concurrency in settings["concurrency"] for method in alternated(methods, number)]
    measured: dict[tuple, tuple[list, float]] = {}  # (concurrency, method) -> results, seconds
    with tqdm(total=len(plan) * sum(len(s.turns) for s in sessions), unit="req", desc="bench agent") as bar:
        for number, concurrency, method in plan:
            bar.set_postfix_str(f"c={concurrency} {method}")
            # A tenant per run: its own suffix tree (learning from all its sessions) and prefix cache.
            results, seconds = asyncio.run(closed_loop(
                settings["url"], sessions, concurrency, request_fields(settings, method),
                tenant=f"bench-agent-{run_id}-r{number}-c{concurrency}-{method}", on_request=bar.update))
            earlier, before = measured.get((concurrency, method), ([], 0.0))
            measured[(concurrency, method)] = (earlier + results, before + seconds)
    rows = []
    for concurrency in settings["concurrency"]:
        runs = {method: summarize("agent", concurrency, method, *measured[(concurrency, method)])
                for method in methods}
        rows += [row(runs[method], measured[(concurrency, method)][0], runs.get("none")) for method in methods]
    return rows


def write_results(settings: dict, rows: list[dict], absent: dict[str, str]) -> list[pathlib.Path]:
    out_dir = pathlib.Path(settings["output_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    command = command_line(settings)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    json_path.write_text(json.dumps({"command": command, "settings": settings, "absent_methods": absent,
                                     "runs": rows}, indent=2) + "\n")
    lines = ["# speclane bench agent", "", "```", command, "```", "", markdown_table(rows, COLUMNS, left_aligned=2), "",
             "Tok/s = output tokens per second of wall time; x none = Tok/s over none's at the same concurrency; "
             "Tok/step = tokens per verify step; Accept = accepted / drafted tokens; TTFT first = mean time to "
             "first token (the first streamed chunk, as vLLM's benchmark times it) of the sessions' first requests, "
             "later = of the others (their prompts extend the previous request's; each session salts the prefix "
             "cache, so only its own earlier requests are reused); Later cached = the later requests' prompt tokens "
             "the server reports found in its prefix cache (usage.prompt_tokens_details.cached_tokens); "
             "Tool calls = calls in the replies.", ""]
    lines += [f"- `{method}` absent: {reason}" for method, reason in absent.items()]
    md_path.write_text("\n".join(lines) + "\n")
    return [json_path, md_path]


def run(args) -> int:
    from speclane_cli.bench.agent_sessions import sessions_for
    from speclane_cli.bench.client import ServerUnreachable, served_models

    try:
        settings = _settings(args)
        served = served_models(settings["url"])
        settings["model"] = settings["model"] or (served[0] if served else "")
        if settings["model"] not in served:
            raise ValueError(f"the server does not serve {settings['model']!r}; it lists {served}")
        sessions = sessions_for(settings["replay"], settings["sessions"], settings["requests_per_session"],
                                settings["seed"])
        absent = {method: reason for method in settings["methods"]
                  if (reason := refusal(settings["url"], request_fields(settings, method))) is not None}
    except (ValueError, OSError, httpx.HTTPError, ServerUnreachable) as error:
        print(f"speclane bench agent: error: {error}", file=sys.stderr)
        return 2
    methods = [method for method in settings["methods"] if method not in absent]
    rows = _run_all(settings, sessions, methods)
    written = write_results(settings, rows, absent)
    print(terminal_table(rows, COLUMNS, left_aligned=2))
    for method, reason in absent.items():
        print(f"{method}: absent: {reason}", file=sys.stderr)
    failed = sum(r["failed"] for r in rows)
    if failed:
        print(f"FAILED: {failed} requests failed, e.g. {next(e for r in rows for e in r['errors'])}", file=sys.stderr)
    print("wrote " + ", ".join(map(str, written)))
    return 1 if failed else 0
