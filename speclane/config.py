"""One config dataclass per service, filled from CLI flags and environment.

Each field becomes a flag (`max_tokens` -> `--max-tokens`) whose default can be
overridden by an environment variable (`<PREFIX>MAX_TOKENS`). Validation lives
in the dataclass's `__post_init__`, so a config object is valid once built.
"""

import argparse
import dataclasses
import os
import typing


def _parse_value(kind: type, text: str):
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    if typing.get_origin(kind) is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return kind(text)


def _field_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def settable_fields(config_cls: type) -> list[dataclasses.Field]:
    """Fields a user sets; derived fields (init=False) are computed in __post_init__."""
    return [f for f in dataclasses.fields(config_cls) if f.init]


def add_arguments(parser, config_cls: type, env_prefix: str, exclude: frozenset[str] = frozenset()) -> None:
    """Adds one flag per field of `config_cls` (but `exclude`); env vars override the field defaults."""
    hints = typing.get_type_hints(config_cls)
    for field in settable_fields(config_cls):
        if field.name in exclude:
            continue
        kind = hints[field.name]
        env_name = env_prefix + field.name.upper()
        default = _field_default(field)
        if env_name in os.environ:
            try:
                default = _parse_value(kind, os.environ[env_name])
            except ValueError as exc:
                parser.error(f"{env_name}: {exc}")
        help_text = field.metadata.get("help", "")
        shown = "<set>" if field.metadata.get("secret") and default else repr(default)
        help_text = f"{help_text} (env {env_name}; default {shown})"
        flags = ["--" + field.name.replace("_", "-"), *field.metadata.get("aliases", ())]
        if kind is bool:
            parser.add_argument(*flags, dest=field.name, default=default,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(*flags, dest=field.name, default=default,
                                type=lambda text, kind=kind: _parse_value(kind, text),
                                help=help_text)


def from_namespace(config_cls: type, namespace: argparse.Namespace, exclude: frozenset[str] = frozenset(), **fixed):
    """Builds the config from parsed flags (and `fixed` values; fields whose flags `exclude` left out
    take their defaults); the dataclass validates itself."""
    values = {f.name: getattr(namespace, f.name) for f in settable_fields(config_cls)
              if f.name not in fixed and f.name not in exclude}
    return config_cls(**values, **fixed)


def parse_config(config_cls: type, env_prefix: str, argv, prog: str, description: str = ""):
    """A service's config from its command line (and environment); exits with a usage error on bad input."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, config_cls, env_prefix)
    args = parser.parse_args(argv)
    try:
        return from_namespace(config_cls, args)
    except ValueError as exc:  # the dataclass's own validation: the user's input
        parser.error(str(exc))


def option(default, help: str, aliases: tuple[str, ...] = (), secret: bool = False, **kwargs):
    """A dataclass field carrying its flag's help text, and other names of the flag
    (vLLM's, where ours differs: `--max-num-seqs` for `--max-batch-sequences`). A
    secret never travels on a command line (where `ps` shows it) nor in the repr."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for sequence defaults")
    metadata = {"help": help, "aliases": aliases, "secret": secret}
    return dataclasses.field(default=default, metadata=metadata, repr=not secret, **kwargs)


def _text(value) -> str:
    return ",".join(value) if isinstance(value, tuple) else str(value)


def to_argv(config) -> list[str]:
    """The flags that rebuild `config` in another process (inverse of add_arguments),
    but its secrets: `to_env` carries those."""
    argv = []
    for field in settable_fields(type(config)):
        if field.metadata.get("secret"):
            continue
        flag = "--" + field.name.replace("_", "-")
        value = getattr(config, field.name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, _text(value)]
    return argv


def to_env(config, env_prefix: str) -> dict[str, str]:
    """The environment that carries `config`'s secrets to another process."""
    return {env_prefix + field.name.upper(): _text(getattr(config, field.name))
            for field in settable_fields(type(config)) if field.metadata.get("secret")}
