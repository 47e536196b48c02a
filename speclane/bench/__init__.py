"""`speclane bench <name>`: benchmarks. Each is a module in this package with
`add_arguments(parser)` and `run(args) -> int` (the exit code)."""

import importlib

# name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": ("speclane.bench.serve", "seeds-style benchmark table against an OpenAI-compatible endpoint"),
    "drafter": ("speclane.bench.drafter", "suffix/n-gram drafter microbenchmark vs Arctic Inference"),
    "verifier": ("speclane.bench.verifier", "verifier engine: batching throughput, verify overhead, KV budget"),
}


def add_bench_parsers(bench_parser) -> None:
    names = bench_parser.add_subparsers(dest="benchmark", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        parser = names.add_parser(name, help=help_text)
        importlib.import_module(module_name).add_arguments(parser)


def run(args) -> int:
    module_name, _ = BENCHMARKS[args.benchmark]
    return importlib.import_module(module_name).run(args)
