"""`speclane pull NAME`: fetch a packaged model (converted to safetensors) or data set.
A model directory that is already there is accepted as it is, so a deployment's
model-init step works for both."""

import sys

from speclane.models import ModelNotFound, resolve_model
from speclane_cli.datasets import PACKAGED_DATASETS, dataset_file


def add_arguments(parser) -> None:
    parser.add_argument("name", help="packaged model or data set name (e.g. smollm2-135m-instruct, humaneval, "
                                     "sharegpt), or a model directory to check")


def run(args) -> int:
    if args.name in PACKAGED_DATASETS:
        print(dataset_file(args.name))
        return 0
    try:
        print(resolve_model(args.name))
    except ModelNotFound as exc:
        print(f"speclane pull: {exc}; packaged data sets: {', '.join(PACKAGED_DATASETS)}", file=sys.stderr)
        return 2
    return 0
