"""`speclane bench drafter`: a tiny run of the whole command, and the replay and
batch measurements it is built from."""

import json

import pytest

from drafter_service import SuffixDecodingCache
from speclane_cli.bench import drafter
from speclane_cli.main import main

FILE = list(range(2000, 2060))
REQUESTS = [([1, 2, 3], FILE), ([1, 2, 3], FILE), ([4, 5], FILE[:30] + [7, 8, 9] + FILE[30:])]


def test_replay_measures_each_cache_alike_and_learns_across_requests():
    first, second = drafter.replay([SuffixDecodingCache(24, 100), SuffixDecodingCache(24, 100)], REQUESTS, k=16,
                                   block=1)
    for result in (first, second):
        assert result["hits"] and result["misses"] and result["append"] > 0
    # The caches take turns but see the same stream: the same drafts, so the same acceptance.
    assert first["tokens_per_step"] == second["tokens_per_step"]
    assert first["acceptance"] == second["acceptance"]
    # The second and third responses repeat the first: far fewer steps than tokens.
    assert first["tokens_per_step"] > 2.0
    (alone,) = drafter.replay([SuffixDecodingCache(24, 0)], REQUESTS[1:2], k=16)  # no global tree: nothing learnt
    assert alone["tokens_per_step"] < first["tokens_per_step"]


def test_batch_cpu_reports_a_time_per_step_for_each_implementation():
    times = drafter.batch_cpu([None, SuffixDecodingCache], REQUESTS, batch=4, k=8, depth=16, steps=4, block=2)
    assert len(times) == 2 and all(time >= 0 for time in times)


@pytest.mark.e2e
def test_the_command_prints_every_table(capsys):
    assert main(["bench", "drafter", "--sharegpt", "3", "--max-response", "48", "--agent-files", "2",
                 "--agent-rounds", "2"]) == 0
    out = capsys.readouterr().out
    for heading in ("us/append", "CPU per decode step", "bytes per cached response token",
                    "tokens per step / acceptance", "n-gram at a 32k context"):
        assert heading in out
    assert "speclane d24" in out and "speclane d64" in out


@pytest.mark.e2e
def test_the_service_run_drives_a_drafter_process_and_reports_each_level(tmp_path):
    """--service: a real drafter process, two levels of simulated verifiers, their steps answered and timed."""
    assert main(["bench", "drafter", "--service", "--sharegpt", "3", "--max-response", "48", "--agent-files", "2",
                 "--agent-rounds", "2", "--verifiers", "1,2", "--sequences", "4", "--verifier-step-rate", "200",
                 "--seconds", "1.5", "--warmup-seconds", "0.5", "--output-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [row["sequences"] for row in rows] == [4, 8]
    for row in rows:
        # Each sequence steps every 4 / 200 s: about 200 steps a second per verifier, less the draft's wait.
        assert 0.5 * row["offered_steps_per_second"] < row["steps_per_second"] <= 1.1 * row["offered_steps_per_second"]
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["drafter_cpu_ms_per_step"] > 0
        assert row["drafted_per_step"] > 0  # the replayed responses teach the trees what the next ones repeat
    assert "| 2 | 8 |" in (tmp_path / "results.md").read_text()
