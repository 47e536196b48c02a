"""What one more draft token costs a verify step, measured on this verifier.
It decides how long a draft is worth verifying: on an accelerator a pass of
k+1 tokens costs about what a 1-token pass does (reading the weights
dominates), on a CPU every token adds compute, so a draft that pays on one
loses on the other. The gateway and the head both weigh drafts with it."""

import time

from verifier_service.sequence import Draft, GenerationParams


def measure_token_cost(engine, num_draft_tokens: int = 4, repeats: int = 5, context: int = 64) -> float:
    """(T(1 + n) - T(1)) / (n * T(1)): one sequence's verify steps with n draft
    tokens against plain ones, the fastest of `repeats` each (the least noisy)."""
    runner = engine.runner
    prompt = [(i * 7919) % runner.vocab_size for i in range(context)]
    steps = 2 * repeats * (num_draft_tokens + 1)
    seq = engine.open("draft-cost", prompt, GenerationParams(max_new_tokens=steps + 1, ignore_eos=True))
    try:
        engine.prefill(seq)
        plain, drafted = [], []
        for _ in range(repeats):
            for times, draft in ((plain, Draft()), (drafted, Draft(token_ids=(prompt[0],) * num_draft_tokens))):
                started = time.perf_counter()
                engine.verify(seq, draft)
                times.append(time.perf_counter() - started)
    finally:
        engine.close(seq)
        engine.step()  # hands the free to every rank
    return round(max(0.0, (min(drafted) - min(plain)) / (num_draft_tokens * min(plain))), 3)
