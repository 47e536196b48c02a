"""docs/reference/flags.md is what the config dataclasses say: a flag added, renamed or
re-documented in code without `make docs` fails here."""

import dataclasses
import pathlib
import re

from speclane_cli import reference

FLAGS_MD = pathlib.Path(__file__).parents[2] / "docs" / "reference" / "flags.md"


def test_the_committed_flag_reference_matches_the_code():
    assert FLAGS_MD.read_text() == reference.render(), "docs/reference/flags.md is stale: run `make docs`"


def test_every_service_flag_and_its_environment_variable_is_listed():
    text = reference.render()
    for _, _, _, config_cls, env_prefix in reference.SERVICES:
        for field in reference.settable_fields(config_cls):
            assert f"`--{field.name.replace('_', '-')}`" in text
            assert f"`{env_prefix}{field.name.upper()}`" in text
    assert "`--tls-dir`" in text and "`--grpc-port`" in text  # speclane serve's own


def test_the_speculative_config_reference_lists_exactly_the_keys_the_parser_reads():
    """docs/reference/speculative-config.md is written by hand: a key added to or dropped from the parser
    (or the debug setting) without the page fails here. At most 16 public keys, as the ecosystem names them."""
    from speclane import speculation

    public = ({field.name for field in dataclasses.fields(speculation.SpeculationSettings)}
              | set(speculation.DRAFTER_WIDE_KEYS) | set(speculation.LOAD_KEYS) | set(speculation.VERIFIER_KEYS))
    debug = {field.name for field in dataclasses.fields(speculation.SpeculationDebug)}
    page = (FLAGS_MD.parent / "speculative-config.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", page, flags=re.MULTILINE))
    assert documented == public | debug
    assert len(public) <= 16
