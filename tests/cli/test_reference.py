"""docs/reference/flags.md is what the config dataclasses say: a flag added, renamed or
re-documented in code without `make docs` fails here."""

import pathlib

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
