"""The committed generated modules must be what the .proto files generate."""

import pathlib

from protos.build import PROJECT_ROOT, generate


def test_generated_code_matches_the_proto_files(tmp_path):
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc generated nothing"
    for relative in generated:
        committed = PROJECT_ROOT / relative
        assert committed.is_file(), f"{relative} is not committed; run `make protos`"
        assert committed.read_text() == (tmp_path / relative).read_text(), f"{relative} is stale; run `make protos`"


def test_every_contract_is_versioned():
    for proto in pathlib.Path(PROJECT_ROOT, "protos").glob("*/*/*.proto"):
        assert proto.parent.name == "v1"
        assert f"package speclane.{proto.parent.parent.name}.v1;" in proto.read_text()
