"""`speclane bench <name>`: benchmarks. Each is a module in this package with
`add_arguments(parser)` and `run(args) -> int` (the exit code), imported only
when it runs."""

from speclane_cli.main import dispatch

# name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": ("speclane_cli.bench.serve", "seeds-style benchmark table against an OpenAI-compatible endpoint"),
    "agent": ("speclane_cli.bench.agent", "multi-turn agent sessions through the tools API: tok/s, TTFT reuse"),
    "drafter": ("speclane_cli.bench.drafter", "suffix/n-gram drafter microbenchmark vs Arctic Inference"),
    "verifier": ("speclane_cli.bench.verifier", "verifier engine: batching throughput, verify overhead, KV budget"),
    "device": ("speclane_cli.bench.device", "the engine on a GPU or NPU: decode rates, weight-read limit, draft cost"),
    "head": ("speclane_cli.bench.head", "a draft head's cost next to a verify step, and its acceptance per k"),
    "soak": ("speclane_cli.bench.soak", "hours of mixed traffic in minutes: 0 errors, flat RSS, nothing left held"),
    "link": ("speclane_cli.bench.link", "a TCP link with a fixed delay each way, between two services"),
    "policy": ("speclane_cli.bench.policy", "draft policies replayed on recorded target replies, without noise"),
}


def main(argv: list[str], prog: str) -> int:
    return dispatch(prog, "benchmarks", BENCHMARKS, argv)
