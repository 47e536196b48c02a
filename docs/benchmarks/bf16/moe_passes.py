"""An MoE target on a CPU three ways: fp32 (what `--dtype auto` served MoE models before their blocks were made
batch-invariant), bf16 with invariant passes (auto now: invariant_moe.py) and bf16 without (`--batch-invariant off`,
transformers' own experts forward). A random Qwen3-MoE of Qwen3-30B-A3B's widths (hidden 2048, 128 experts of
768, 8 a token, its vocabulary) and `--layers` layers, all three loaded at once; the verifier's passes of 1-16
sequences with k draft tokens each, the ways alternating round by round, each pass the fastest of 3 steps (ms);
then, per bf16 way, whether greedy speculation (chains of the plain output's next tokens beside another
sequence's step) gives plain decoding's tokens and log-probabilities bit for bit. Both cores.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/bf16/moe_passes.py
"""

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from verifier_service.block_manager import BlockManager
from verifier_service.device import set_threads
from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, GenerationParams

WAYS = {"fp32": (torch.float32, "auto"), "bf16, invariant": (torch.bfloat16, "on"),
        "bf16, not invariant": (torch.bfloat16, "off")}


def save_model(path: str, layers: int) -> None:
    config = Qwen3MoeConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                            num_hidden_layers=layers, vocab_size=151936, max_position_embeddings=4096,
                            tie_word_embeddings=False, initializer_range=0.02)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)


def decode(engine: Engine, prompt: list[int], steps: int, plain: list[int] | None, k: int):
    """Greedy tokens and top-5 log-probabilities; with `plain`, each step verifies a chain of its next k tokens
    beside a companion sequence's plain step."""
    seq = engine.open("s", prompt, GenerationParams(max_new_tokens=steps, ignore_eos=True, logprobs=5))
    other = engine.open("o", prompt[::-1], GenerationParams(max_new_tokens=10_000, ignore_eos=True))
    tokens, logprobs = [], []
    while len(tokens) < steps:
        draft = Draft(token_ids=tuple(plain[len(tokens):len(tokens) + k])) if plain else Draft()
        result = engine.run_together([(seq, draft), (other, Draft())])[0]
        tokens += result.token_ids
        logprobs += result.logprobs
    engine.close(seq)
    engine.close(other)
    return tokens[:steps], logprobs[:steps]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sequences", default="1,4,16")
    parser.add_argument("--k", default="0,4")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="greedy tokens compared")
    args = parser.parse_args()
    set_threads(0)
    with tempfile.TemporaryDirectory() as path:
        save_model(path, args.layers)
        engines = {}
        for name, (dtype, mode) in WAYS.items():
            started = time.perf_counter()
            runner = ModelRunner(path, "cpu", dtype, batch_invariant=mode)
            engines[name] = Engine(runner, BlockManager(20_000 // 16, 16, False))
            print(f"{name}: loaded in {time.perf_counter() - started:.1f} s, batch-invariant "
                  f"{runner.batch_invariant}, {runner.model.config._experts_implementation} experts")
    print(f"\n| sequences | k | {' | '.join(WAYS)} | invariant / fp32 | invariant / not invariant |\n"
          f"|---|---|{'---|' * (len(WAYS) + 2)}")
    params = GenerationParams(max_new_tokens=100_000, ignore_eos=True)
    for count in map(int, args.sequences.split(",")):
        prompts = [[(j * 7919 + i * 31) % 150_000 for j in range(args.context)] for i in range(count)]
        opened = {name: [engine.open(f"{count}-{i}", prompt, params) for i, prompt in enumerate(prompts)]
                  for name, engine in engines.items()}
        for name, engine in engines.items():
            engine.run_together([(seq, Draft()) for seq in opened[name]])
        for k in map(int, args.k.split(",")):
            draft = Draft(token_ids=(5,) * k)
            best = dict.fromkeys(engines, float("inf"))
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    for _ in range(3):
                        started = time.perf_counter()
                        engine.run_together([(seq, draft) for seq in opened[name]])
                        best[name] = min(best[name], time.perf_counter() - started)
            fp32, invariant, other = (best[name] * 1e3 for name in WAYS)
            print(f"| {count} | {k} | {fp32:.1f} | {invariant:.1f} | {other:.1f} | {invariant / fp32:.2f}x | "
                  f"{invariant / other:.2f}x |")
        for name, engine in engines.items():
            for seq in opened[name]:
                engine.close(seq)
    prompt = [(j * 104729) % 150_000 for j in range(64)]
    print()
    for name in list(WAYS)[1:]:
        plain = decode(engines[name], prompt, args.steps, None, 0)
        for k in (3, 7):
            tokens, logprobs = decode(engines[name], prompt, args.steps, plain[0], k)
            print(f"{name}, chains of {k}: {sum(a != b for a, b in zip(tokens, plain[0], strict=True))} of "
                  f"{args.steps} greedy tokens differ from plain decoding's, log-probabilities "
                  f"{'equal bit for bit' if logprobs == plain[1] else 'differ'}")


if __name__ == "__main__":
    main()
