"""Regenerates the Python modules from the .proto files: `python -m protos.build`.

Generated code is committed so that a fresh clone imports without a build step;
tests/test_protos.py fails when it drifts from the .proto files.
"""

import argparse
import pathlib
import sys

from grpc_tools import protoc

PROJECT_ROOT = pathlib.Path(__file__).resolve().parent.parent


def proto_files() -> list[pathlib.Path]:
    return sorted((PROJECT_ROOT / "protos").glob("*/v1/*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every contract under out_dir."""
    grpc_include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROJECT_ROOT}",
        f"-I{grpc_include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROJECT_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=PROJECT_ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
