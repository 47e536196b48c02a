"""Canned requests and runs for the statistics and report tests."""

from speclane_cli.bench.stats import RequestResult, RunStats


def ok(output_tokens=10, ttft=0.5, e2e=1.4, input_tokens=100, draft=0, accepted=0, steps=None):
    return RequestResult(ok=True, input_tokens=input_tokens, output_tokens=output_tokens, ttft=ttft, e2e=e2e,
                         draft_tokens=draft, accepted_tokens=accepted,
                         verify_steps=output_tokens - 1 if steps is None else steps)


def run(method, dataset="humaneval", concurrency=1, tpot_ms=50.0, tps=10.0, draft=0, accepted=0, steps=10):
    return RunStats(dataset=dataset, concurrency=concurrency, method=method, requests=2, failed=0, duration_s=1.0,
                    mean_input_tokens=100.0, mean_output_tokens=20.0, mean_ttft_ms=10.0, mean_tpot_ms=tpot_ms,
                    median_tpot_ms=tpot_ms, mean_e2e_s=1.0, throughput_tps=tps, draft_tokens=draft,
                    accepted_tokens=accepted, verify_steps=steps)
