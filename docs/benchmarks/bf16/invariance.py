"""Does a verify pass compute a token as a plain decode step does? Greedy
decoding of 30 bench prompts (all in one batch), then the same prompts again
with each step verifying the next 7 tokens of that plain output as its draft.
In exact arithmetic every draft is accepted and the outputs are equal; any
sequence that differs is one where the multi-token pass rounded differently.

    python docs/benchmarks/bf16/invariance.py --dtype bfloat16
"""

import argparse

import torch
from transformers import AutoTokenizer

from speclane.models import DEFAULT_MODEL, resolve_model
from speclane_cli.bench.workloads import code_edit, humaneval, sharegpt
from verifier_service.block_manager import BlockManager
from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, FinishReason, GenerationParams

MAX_TOKENS, DRAFT = 48, 7


def generate(engine, prompts, drafts_from=None) -> list[list[int]]:
    """Greedy outputs of all prompts stepped together; with `drafts_from`, each
    step verifies the next DRAFT tokens of those outputs."""
    params = GenerationParams(max_new_tokens=MAX_TOKENS, ignore_eos=True)
    seqs = [engine.open(f"s{i}", prompt, params) for i, prompt in enumerate(prompts)]
    outputs = [list(r.token_ids) for r in engine.run_together([(seq, Draft()) for seq in seqs])]
    live = list(range(len(seqs)))
    while live:
        steps = [(seqs[i], Draft(token_ids=tuple(drafts_from[i][len(outputs[i]):len(outputs[i]) + DRAFT]))
                  if drafts_from else Draft()) for i in live]
        for i, result in zip(list(live), engine.run_together(steps)):
            outputs[i] += result.token_ids
            if result.finish_reason is not FinishReason.NONE:
                live.remove(i)
    for seq in seqs:
        engine.close(seq)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-invariant", default="auto", choices=("auto", "on", "off"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = str(resolve_model(DEFAULT_MODEL))
    engine = Engine(ModelRunner(model_dir, "cpu", getattr(torch, args.dtype),
                         batch_invariant=args.batch_invariant), BlockManager(200_000 // 16, 16, False))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = humaneval(12, 0, 1) + sharegpt(12, 0, 1) + code_edit(6, 0, 1)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c.turns[0]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for c in conversations]
    plain = generate(engine, prompts)
    verified = generate(engine, prompts, drafts_from=plain)
    first_difference = [next((j for j, (a, b) in enumerate(zip(v, p)) if a != b), None)
                        for v, p in zip(verified, plain)]
    differing = [j for j in first_difference if j is not None]
    print(f"{args.dtype}: {len(differing)} of {len(prompts)} sequences differ (at output tokens {differing})")


if __name__ == "__main__":
    main()
