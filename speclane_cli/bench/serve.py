"""`speclane bench serve`: the seeds' benchmark table against an OpenAI-compatible
endpoint. For each data set, concurrency and method it runs a closed loop of
streaming chat requests, then prints baseline versus speculation (TPOT, TPS,
acceptance and the improvements) and writes JSON, Markdown and PNG plots.

Each speculative method is chosen per request through speclane's `speculation`
extension field; method `default` sends no such field, for any other server.
"""

import asyncio
import pathlib
import shlex
import sys
import uuid

from tqdm import tqdm

from speclane_cli.bench.conversation import Conversation
from speclane_cli.bench.stats import RunStats, comparisons, summarize

DEFAULT_METHODS = "none,ngram,suffix"
PEERS = ("hf-prompt-lookup",)


def csv_list(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            values = []
        if not values:
            raise ValueError(f"expected a comma-separated list, got {text!r}")
        return values

    return parse


def add_arguments(parser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    parser.add_argument("--model", default="", help="model name to request; default: the first the server lists")
    parser.add_argument("--dataset", default="humaneval",
                        help="comma-separated: humaneval, sharegpt, agent-loop, code-edit, or a .jsonl file "
                             'with one {"prompt": ...}, {"turns": [...]} or {"messages": [...]} a line')
    parser.add_argument("--concurrency", default="1,4", help="comma-separated concurrency levels (closed loop)")
    parser.add_argument("--num-prompts", type=int, default=20,
                        help="conversations per data set (a single-turn conversation is one request)")
    parser.add_argument("--max-turns", type=int, default=3, help="turns replayed per multi-turn conversation")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma-separated speculation methods; 'none' is the baseline; 'default' sends "
                             "no speculation field (the server's own configuration)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="k, the draft length, for speculative methods and the peer; default: each "
                             "method's own on the server (suffix: the drafter's tree depth, others 8), "
                             "transformers' for the peer")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times every method runs each data set and concurrency, in reversed order every other "
                             "round, each round with fresh tenants; a row sums its rounds (drift on a noisy machine "
                             "then weighs on all methods alike)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data set sampling and generators")
    parser.add_argument("--peer", choices=PEERS, default=None,
                        help="also run a peer in-process at concurrency 1: hf-prompt-lookup runs transformers "
                             "generate() plain and with prompt_lookup_num_tokens=k")
    parser.add_argument("--peer-model", default="smollm2-135m-instruct",
                        help="packaged model name or Hugging Face directory the peer loads (the served model)")
    parser.add_argument("--output-dir", default="bench-results", help="where results.json/.md and plots go")


def _settings(args) -> dict:
    """The arguments that define a run, parsed and checked; ValueError on bad input."""
    settings = {
        "url": args.url, "model": args.model, "datasets": csv_list(str)(args.dataset),
        "concurrency": csv_list(int)(args.concurrency), "num_prompts": args.num_prompts, "max_turns": args.max_turns,
        "methods": csv_list(str)(args.methods), "num_speculative_tokens": args.num_speculative_tokens,
        "max_tokens": args.max_tokens, "rounds": args.rounds, "temperature": args.temperature, "seed": args.seed,
        "peer": args.peer, "peer_model": args.peer_model, "output_dir": args.output_dir,
    }
    if min(settings["concurrency"]) < 1:
        raise ValueError("concurrency levels must be >= 1")
    if min(args.num_prompts, args.max_turns, args.max_tokens, args.rounds, args.num_speculative_tokens or 1) < 1:
        raise ValueError("--num-prompts, --max-turns, --max-tokens, --rounds and --num-speculative-tokens must be >= 1")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    if any(method.startswith("hf-") for method in settings["methods"]):
        raise ValueError("hf-* methods come from --peer hf-prompt-lookup, not --methods")
    return settings


def command_line(settings: dict) -> str:
    """The command that reproduces this benchmark, every setting explicit."""
    flags = {"--url": settings["url"], "--model": settings["model"], "--dataset": ",".join(settings["datasets"]),
             "--concurrency": ",".join(map(str, settings["concurrency"])), "--num-prompts": settings["num_prompts"],
             "--max-turns": settings["max_turns"], "--methods": ",".join(settings["methods"]),
             "--num-speculative-tokens": settings["num_speculative_tokens"], "--max-tokens": settings["max_tokens"],
             "--rounds": settings["rounds"],
             "--temperature": settings["temperature"], "--seed": settings["seed"], "--peer": settings["peer"],
             "--peer-model": settings["peer_model"], "--output-dir": settings["output_dir"]}
    if settings["peer"] is None:
        del flags["--peer"], flags["--peer-model"]
    if settings["num_speculative_tokens"] is None:
        del flags["--num-speculative-tokens"]
    if settings["rounds"] == 1:
        del flags["--rounds"]
    return "speclane bench serve " + " ".join(f"{flag} {shlex.quote(str(value))}" for flag, value in flags.items())


def request_fields(settings: dict, method: str) -> dict:
    fields = {"model": settings["model"], "max_tokens": settings["max_tokens"], "temperature": settings["temperature"]}
    if method == "none":
        fields["speculation"] = {"method": "none"}
    elif method != "default":
        fields["speculation"] = {"method": method}
        if settings["num_speculative_tokens"] is not None:
            fields["speculation"]["num_speculative_tokens"] = settings["num_speculative_tokens"]
    return fields


def alternated(methods: list[str], round_number: int) -> list[str]:
    """Every other round runs the methods in reverse, so drift on a noisy machine favours none of them."""
    return methods if round_number % 2 == 0 else methods[::-1]


def _run_all(settings: dict, workloads: dict[str, list[Conversation]]) -> list[RunStats]:
    from speclane_cli.bench.client import closed_loop

    peer_methods = []
    if settings["peer"]:
        from speclane_cli.bench.hf_peer import PEER_METHODS

        peer_methods = list(PEER_METHODS)
    plan = []
    for number in range(settings["rounds"]):
        plan += [(number, dataset, concurrency, method) for dataset in workloads
                 for concurrency in settings["concurrency"] for method in alternated(settings["methods"], number)]
        plan += [(number, dataset, 1, method) for dataset in workloads for method in alternated(peer_methods, number)]
    total = sum(len(c.turns) for _, dataset, _, _ in plan for c in workloads[dataset])
    run_id = uuid.uuid4().hex[:8]
    measured: dict[tuple, tuple[list, float]] = {}  # (dataset, concurrency, method) -> results, seconds
    peer = None
    with tqdm(total=total, unit="req", desc="bench serve") as bar:
        for number, dataset, concurrency, method in plan:
            bar.set_postfix_str(f"{dataset} c={concurrency} {method}")
            if method in peer_methods:
                if peer is None:
                    peer = _load_peer(settings)
                results, duration = peer.run(workloads[dataset], method, bar.update)
            else:
                results, duration = asyncio.run(closed_loop(
                    settings["url"], workloads[dataset], concurrency, request_fields(settings, method),
                    tenant=f"bench-{run_id}-r{number}-{dataset}-c{concurrency}-{method}", on_request=bar.update))
            earlier, seconds = measured.get((dataset, concurrency, method), ([], 0.0))
            measured[(dataset, concurrency, method)] = (earlier + results, seconds + duration)
    return [summarize(*key, results, duration) for key, (results, duration) in measured.items()]


def _load_peer(settings: dict):
    from speclane.models import resolve_model
    from speclane_cli.bench.hf_peer import HfPeer

    fields = request_fields(settings, "none")
    return HfPeer(resolve_model(settings["peer_model"]), settings["num_speculative_tokens"], fields)


def run(args) -> int:
    from speclane_cli.bench.client import ServerUnreachable, served_models
    from speclane_cli.bench.plots import write_plots
    from speclane_cli.bench.report import failure_lines, terminal_table, write_results
    from speclane_cli.bench.workloads import load_workload

    try:
        settings = _settings(args)
        served = served_models(settings["url"])
        if not settings["model"]:
            settings["model"] = served[0] if served else ""
        if settings["model"] not in served:
            raise ValueError(f"the server does not serve {settings['model']!r}; it lists {served}")
        workloads = {name: load_workload(name, settings["num_prompts"], settings["seed"], settings["max_turns"])
                     for name in settings["datasets"]}
    except (ValueError, ServerUnreachable) as error:
        print(f"speclane bench serve: error: {error}", file=sys.stderr)
        return 2
    runs = _run_all(settings, workloads)
    rows = comparisons(runs)
    out_dir = pathlib.Path(settings["output_dir"])
    plots = write_plots(runs, out_dir)
    written = write_results(out_dir, command_line(settings), settings, runs, rows, plots)
    print(terminal_table(rows))
    failures = failure_lines(runs)
    for line in failures:
        print(f"FAILED: {line}", file=sys.stderr)
    print("wrote " + ", ".join(str(path) for path in [*written, *plots]))
    return 1 if failures else 0
