"""`speclane extract-hidden-states`: dump conversations (the target's regenerated
replies, or the data set's own) and the target's hidden states over them, one
shard per conversation, for `speclane train-head`."""

import itertools
import json
import pathlib
from collections.abc import Iterator

import torch

from speclane.models import resolve_model
from speclane_cli.datasets import humaneval_problems, sharegpt_conversations
from verifier_service.heads.extract import REPLIES, extract, pick_device


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="target model: directory, packaged name or hub id")
    parser.add_argument("--dataset", required=True,
                        help="sharegpt, humaneval, or a .jsonl file with 'messages', or 'prompt' (and 'completion'), "
                             "per line")
    parser.add_argument("--output", required=True, help="directory for the shards and meta.json")
    parser.add_argument("--layers", default="",
                        help="comma-separated output_hidden_states indices (default: 2,L/2,L-3,L, which trains "
                             "both EAGLE-3 and EAGLE)")
    parser.add_argument("--max-samples", type=int, default=None, help="number of conversations (shards)")
    parser.add_argument("--skip", type=int, default=None,
                        help="conversations passed over first; default 4000 for sharegpt (the benchmarks and tests "
                             "draw their ShareGPT prompts from the first 2000: a head is never measured on its "
                             "training data), else 0")
    parser.add_argument("--replies", choices=REPLIES, default="regenerate",
                        help="regenerate: the target answers the user turns itself (slow on a CPU); dataset: "
                             "whole conversations as written, teacher-forced (labels are still the target's "
                             "distributions)")
    parser.add_argument("--turns", type=int, default=1,
                        help="--replies regenerate: user turns answered per conversation, one after another, the "
                             "target's own replies before each (as bench serve replays a chat)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="--replies dataset: length limit of a sequence")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="length limit of a regenerated reply")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts regenerated together")
    parser.add_argument("--no-hidden-states", action="store_true",
                        help="write tokens and loss masks alone; speclane train-head then runs the target as it "
                             "trains (on an accelerator, cheaper than a dump 500x the size)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda[:N] or npu[:N]")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")


SHAREGPT_HELD_OUT = 4000


def default_skip(dataset: str) -> int:
    return SHAREGPT_HELD_OUT if dataset == "sharegpt" else 0


def conversations(dataset: str, skip: int) -> Iterator[list[dict]]:
    return itertools.islice(_conversations(dataset), skip, None)


def _conversations(dataset: str) -> Iterator[list[dict]]:
    if dataset == "sharegpt":
        return sharegpt_conversations()
    if dataset == "humaneval":
        return ([{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["canonical_solution"]}]
                for p in humaneval_problems())
    return _jsonl_conversations(pathlib.Path(dataset))


def _jsonl_conversations(path: pathlib.Path) -> Iterator[list[dict]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield _messages(json.loads(line))


def _messages(record: dict) -> list[dict]:
    if "messages" in record:
        return record["messages"]
    reply = [{"role": "assistant", "content": record["completion"]}] if "completion" in record else []
    return [{"role": "user", "content": record["prompt"]}, *reply]


def run(args) -> int:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    layers = tuple(int(i) for i in args.layers.split(",")) if args.layers else ()
    skip = default_skip(args.dataset) if args.skip is None else args.skip
    # The skip is part of the source: resuming a dump with another one is refused (its shard names would clash).
    extract(resolve_model(args.model), conversations(args.dataset, skip), args.output,
            source=f"{args.dataset}[{skip}:]", layers=layers, replies=args.replies, max_samples=args.max_samples,
            max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
            batch_size=args.batch_size, device=pick_device(args.device), with_hidden_states=not args.no_hidden_states,
            turns=args.turns)
    return 0
