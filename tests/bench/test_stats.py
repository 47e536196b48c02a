import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from speclane_cli.bench.stats import Comparison, RequestResult, comparisons, summarize
from tests.bench.factories import ok, run


def test_tpot_spreads_the_time_after_the_first_token_over_the_remaining_tokens():
    # A speculative step delivers several tokens in one chunk; TPOT still counts tokens, not chunks.
    assert ok(output_tokens=10, ttft=0.5, e2e=1.4).tpot == pytest.approx(0.1)


def test_tpot_is_undefined_for_one_token_or_a_failure():
    assert ok(output_tokens=1).tpot is None
    assert RequestResult(ok=False, error="boom").tpot is None


def test_summarize_means_throughput_and_speculation_counters():
    stats = summarize("humaneval", 4, "suffix",
                      [ok(output_tokens=11, ttft=0.1, e2e=1.1, draft=20, accepted=10, steps=5),
                       ok(output_tokens=21, ttft=0.3, e2e=2.3, input_tokens=300, draft=20, accepted=5, steps=15)],
                      duration_s=4.0)
    assert (stats.requests, stats.failed) == (2, 0)
    assert stats.mean_input_tokens == 200
    assert stats.mean_output_tokens == 16
    assert stats.mean_tpot_ms == pytest.approx(100.0)
    assert stats.mean_ttft_ms == pytest.approx(200.0)
    assert stats.throughput_tps == pytest.approx(32 / 4.0)
    assert stats.acceptance_rate == pytest.approx(15 / 40)
    assert stats.acceptance_length == pytest.approx(15 / 20)
    assert stats.tokens_per_step == pytest.approx(1.75)


def test_the_next_round_hit_rate_counts_the_steps_a_request_could_have_run_ahead():
    results = [ok(draft=20, accepted=10, steps=5), ok(draft=20, accepted=5, steps=15)]
    results = [dataclasses.replace(r, next_round_steps=n) for r, n in zip(results, (2, 3))]
    stats = summarize("code-edit", 1, "suffix", results, duration_s=1.0)
    # A request's first verify step follows the prefill: no offer came before it.
    assert stats.next_round_steps == 5 and stats.next_round_hit_rate == pytest.approx(5 / (20 - 2))
    assert stats.as_dict()["next_round_hit_rate"] == stats.next_round_hit_rate
    assert summarize("humaneval", 1, "none", [ok(output_tokens=1, steps=0)], 1.0).next_round_hit_rate is None


def test_a_baseline_run_has_no_acceptance_rate_but_one_token_per_step():
    stats = summarize("humaneval", 1, "none", [ok(output_tokens=9)], duration_s=1.0)
    assert stats.acceptance_rate is None
    assert stats.tokens_per_step == 1.0


def test_failed_requests_are_counted_and_reported():
    stats = summarize("x", 1, "suffix", [ok(), RequestResult(ok=False, error="HTTP 500: boom")], duration_s=1.0)
    assert (stats.requests, stats.failed) == (1, 1)
    assert stats.errors == ("HTTP 500: boom",)


finished = st.builds(ok, output_tokens=st.integers(2, 500), ttft=st.floats(0.001, 5), e2e=st.floats(5, 60),
                     input_tokens=st.integers(1, 4000), draft=st.integers(0, 100), accepted=st.integers(0, 100),
                     steps=st.integers(1, 500))
failed = st.builds(RequestResult, ok=st.just(False), error=st.text(min_size=1), input_tokens=st.integers(0, 9999),
                   output_tokens=st.integers(0, 9999), ttft=st.floats(0, 100), e2e=st.floats(0, 100),
                   draft_tokens=st.integers(0, 999), accepted_tokens=st.integers(0, 999),
                   verify_steps=st.integers(0, 999))


@given(st.lists(finished, min_size=1, max_size=8), st.lists(failed, max_size=8))
def test_failed_requests_never_move_the_averages(good, bad):
    clean = summarize("d", 1, "suffix", good, duration_s=10.0)
    mixed = summarize("d", 1, "suffix", [*good, *bad], duration_s=10.0)
    assert mixed.failed == len(bad)
    keep = ("requests", "failed", "errors")
    assert {k: v for k, v in vars(mixed).items() if k not in keep} == \
           {k: v for k, v in vars(clean).items() if k not in keep}


def test_improvements_follow_the_seeds_definitions():
    row = Comparison(run("none", tpot_ms=50.0, tps=10.0), run("suffix", tpot_ms=25.0, tps=18.0))
    assert row.tpot_improvement == pytest.approx(0.5)
    assert row.tps_improvement == pytest.approx(0.8)
    slower = Comparison(run("none", tpot_ms=50.0, tps=10.0), run("ngram", tpot_ms=60.0, tps=8.0))
    assert slower.tpot_improvement < 0 and slower.tps_improvement < 0
    assert Comparison(None, run("suffix")).tps_improvement is None


def test_comparisons_pair_each_method_with_the_baseline_of_its_system_dataset_and_concurrency():
    runs = [run("none", concurrency=1, tps=10), run("ngram", concurrency=1), run("suffix", concurrency=1),
            run("none", concurrency=4, tps=30), run("suffix", concurrency=4),
            run("hf-generate", tps=5), run("hf-prompt-lookup"),
            run("none", dataset="sharegpt")]
    rows = comparisons(runs)
    pairs = [(r.run.dataset, r.run.concurrency, r.baseline and r.baseline.method,
              r.speculative and r.speculative.method, r.baseline and r.baseline.throughput_tps) for r in rows]
    assert pairs == [
        ("humaneval", 1, "none", "ngram", 10), ("humaneval", 1, "none", "suffix", 10),
        ("humaneval", 1, "hf-generate", "hf-prompt-lookup", 5),
        ("humaneval", 4, "none", "suffix", 30),
        ("sharegpt", 1, "none", None, 10.0),  # a baseline alone still gets its row
    ]
