"""The start-up check's numbers in bf16, and what lies behind them: the largest difference between the engine's
logits and transformers' bf16 reference forward over the check's passes (what the check bounds), and each of the
two against the same checkpoint's fp32 forward.

    python docs/benchmarks/bf16/reference_check.py --model qwen2.5-coder-0.5b-instruct [--batch-invariant off]
"""

import argparse

import torch
from transformers import AutoModelForCausalLM

from speclane.models import DEFAULT_MODEL, resolve_model
from verifier_service import self_check
from verifier_service.model_runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-invariant", default="auto", choices=("auto", "on", "off"))
    args = parser.parse_args()
    path = str(resolve_model(args.model))
    runner = ModelRunner(path, "cpu", torch.bfloat16, batch_invariant=args.batch_invariant)
    runner.allocate_cache(64, 16)
    seen = {"ours": []}
    reference, execute = runner.reference, runner.execute

    def recorded_reference(sequences):
        seen["sequences"], seen["reference"] = sequences, reference(sequences)
        return seen["reference"]

    def recorded_execute(plan):
        logits = execute(plan)
        seen["ours"].append(logits[0])
        return logits

    runner.reference, runner.execute = recorded_reference, recorded_execute
    difference, scale = self_check.largest_difference(runner)
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        exact = torch.stack([fp32(torch.tensor([tokens])).logits[0, -1].float() for tokens in seen["sequences"]])
    ours = torch.cat(seen["ours"])
    print(f"| {args.model} | {runner.backend.name} | {difference:.3f} | {(ours - exact).abs().max().item():.3f} | "
          f"{(seen['reference'] - exact).abs().max().item():.3f} | {scale:.2f} |")


if __name__ == "__main__":
    main()
