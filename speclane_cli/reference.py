"""docs/reference/flags.md, rendered from the services' config dataclasses so that the
reference cannot drift from the code: `python -m speclane_cli.reference > docs/reference/flags.md`
(`make docs`); tests/cli/test_reference.py fails when the committed file differs."""

import argparse
import dataclasses

from drafter_service.config import ENV_PREFIX as DRAFTER_ENV
from drafter_service.config import DrafterConfig
from gateway.config import ENV_PREFIX as GATEWAY_ENV
from gateway.config import GatewayConfig
from speclane.config import settable_fields
from speclane_cli import serve
from speclane_cli.serve import SET_BY_SERVE
from verifier_service.config import ENV_PREFIX as VERIFIER_ENV
from verifier_service.config import VerifierConfig

SERVICES = (
    ("gateway", "speclane gateway", "python -m gateway", GatewayConfig, GATEWAY_ENV),
    ("verifier", "speclane verifier", "python -m verifier_service", VerifierConfig, VERIFIER_ENV),
    ("drafter", "speclane drafter", "python -m drafter_service", DrafterConfig, DRAFTER_ENV),
)

HEADER = """# Flags

Generated from the config dataclasses (`gateway/config.py`, `verifier_service/config.py`,
`drafter_service/config.py`) by `make docs`; a test fails when this file and the code disagree.

Every flag can also be set by the environment variable in its row; a flag on the command line wins.
Boolean flags take a `--no-` form. `--speculative-config`'s keys are in
[speculative-config.md](speculative-config.md).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(field: dataclasses.Field) -> str:
    if field.metadata.get("secret"):
        return "none"
    value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    if isinstance(value, tuple):
        value = ",".join(value)
    return f"`{value}`" if value != "" else "empty"


def _flags(field: dataclasses.Field) -> str:
    names = ["--" + field.name.replace("_", "-"), *field.metadata.get("aliases", ())]
    return ", ".join(f"`{name}`" for name in names)


def service_table(config_cls: type, env_prefix: str) -> list[str]:
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for field in settable_fields(config_cls):
        rows.append(f"| {_flags(field)} | `{env_prefix}{field.name.upper()}` | {_default(field)} | "
                    f"{_cell(field.metadata.get('help', ''))} |")
    return rows


def _serve_section() -> list[str]:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    service_flags = {field.name for _, _, _, config_cls, _ in SERVICES for field in settable_fields(config_cls)}
    # argparse has no public list of a parser's arguments; its actions are what it documents in --help.
    # --model is the gateway's and the verifier's, but serve documents its own (it also takes it positionally).
    own = [action for action in parser._actions if action.option_strings and action.dest != "help"
           and action.dest not in service_flags - {"model"}]
    lines = ["## speclane serve", "",
             "Starts the three services as child processes on free localhost ports, restarts any that dies, and "
             "stops them together. It takes every flag of the three services below but those it sets itself:", ""]
    for name, *_ in SERVICES:
        lines.append(f"- {name}: " + ", ".join(f"`--{flag.replace('_', '-')}`" for flag in sorted(SET_BY_SERVE[name])))
    lines += ["", "A flag two services share (`--model`, `--log-level`, the TLS files) sets both; the verifier "
              "takes the gateway's `--speculative-config` and the drafter its drafter-wide keys. Its own flags:", "",
              "| flag | meaning |", "|---|---|"]
    lines += [f"| {', '.join(f'`{flag}`' for flag in action.option_strings)} | {_cell(action.help or '')} |"
              for action in own]
    lines += ["", "`speclane serve` keeps the drafter's global suffix trees in "
              "`$SPECLANE_HOME/drafter/<served model name>.snapshot` (`--snapshot-path ''` keeps none), so a "
              "drafter restarted by the supervisor, or the next `speclane serve`, starts warm. A packaged model brings "
              "its own `--tool-call-parser` default where hermes does not read its calls (Qwen2.5-Coder-0.5B: json).",
              ""]
    return lines


def render() -> str:
    lines = [HEADER, *_serve_section()]
    for name, command, module, config_cls, env_prefix in SERVICES:
        lines += [f"## {command}", "", f"The {name} alone (also `{module}`).", "",
                  *service_table(config_cls, env_prefix), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
