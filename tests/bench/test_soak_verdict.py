"""The soak's verdict without processes: each check fails on what it guards
against, the request mix is seeded and mixed, and its input is checked."""

import argparse
import random

import pytest

from speclane_cli.bench import soak
from speclane_cli.bench.soak_load import Outcome, plan
from speclane_cli.bench.soak_report import checks, percentile, rss_trend, summarize

MIB = 2**20
IDLE = (True, {"gateway_running": 0.0, "drafter_sessions": 0.0})


def flat(mib: float, duration: float = 90, step: float = 3) -> list:
    return [(t * step, int(mib * MIB)) for t in range(int(duration / step) + 1)]


def verdict(outcomes=(), rss=None, alive=None, idle=IDLE) -> dict[str, bool]:
    rss = rss if rss is not None else {"gateway": rss_trend(flat(150), 90)}
    found = checks(summarize(list(outcomes) or [Outcome("stream", True, 1.0, 1.0, 0.1, 10)]), rss,
                   alive or {"gateway": True}, idle, 0.10)
    return {check.name: check.ok for check in found}


def test_a_clean_run_passes():
    assert all(verdict().values())


def test_a_failed_request_fails_but_a_deliberate_disconnect_does_not():
    left = Outcome("disconnect", True, 1.0, disconnected=True)
    done = Outcome("whole", True, 2.0, 2.0, None, 12)
    assert verdict([left, done])["no errors"]
    failed = Outcome("stream", False, 3.0, error="error event: {}")
    assert not verdict([left, done, failed])["no errors"]
    summary = summarize([left, done, failed])
    assert (summary["completed"], summary["disconnected"], summary["errors"]) == (1, 1, 1)
    assert summary["first_errors"] == ["error event: {}"]


def test_rss_growth_after_the_warm_up_fails_and_growth_during_it_does_not():
    warming = [(t, int((100 + 2 * min(t, 30)) * MIB)) for t, _ in flat(0)]  # +60 MiB in the first third, then flat
    assert verdict(rss={"verifier": rss_trend(warming, 90)})["verifier RSS flat"]
    leaking = [(t, int((100 + t) * MIB)) for t, _ in flat(0)]  # one MiB a second, all along
    trend = rss_trend(leaking, 90)
    assert trend["growth"] > 0.10
    assert not verdict(rss={"verifier": trend})["verifier RSS flat"]
    assert not verdict(rss={"verifier": rss_trend(flat(100)[:5], 90)})["verifier RSS flat"]  # too few samples


def test_a_dead_service_and_anything_still_held_fail():
    assert not verdict(alive={"drafter": False})["drafter alive"]
    assert not verdict(idle=(False, {"drafter_sessions": 2.0}))["nothing held after the load"]


def test_percentiles_interpolate():
    assert percentile([], 50) is None
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5


def test_the_request_mix_is_seeded_and_mixed():
    prompts = ["a", "b", "c"]
    draws = [plan(random.Random(7), "m", prompts, 64, 0.1) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = random.Random(0)
    plans = [plan(rng, "m", prompts, 64, 0.1) for _ in range(2000)]
    kinds = {kind: sum(p.kind == kind for p in plans) for kind in ("stream", "whole", "disconnect")}
    assert 150 < kinds["disconnect"] < 250 and kinds["stream"] > kinds["whole"] > 500
    assert all(1 <= p.leave_after_chunks <= 4 for p in plans if p.kind == "disconnect")
    assert all(16 <= p.body["max_tokens"] <= 64 for p in plans)
    assert {p.body.get("temperature") for p in plans} == {0, 0.8}
    assert any("stop" in p.body for p in plans) and any("speculation" not in p.body for p in plans)


def test_durations_and_refusals():
    assert [soak.parse_duration(text) for text in ("45s", "10m", "1h", "90", "1.5m")] == [45, 600, 3600, 90, 90]
    for bad in ("", "10x", "-5s", "0"):
        with pytest.raises(ValueError):
            soak.parse_duration(bad)
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    with pytest.raises(ValueError, match="loopback"):
        soak._settings(parser.parse_args(["--url", "http://10.0.0.5:8000"]))
    with pytest.raises(ValueError, match="--pids"):
        soak._settings(parser.parse_args(["--url", "http://127.0.0.1:8000", "--pids", "gateway=abc"]))
    settings = soak._settings(parser.parse_args(["--concurrency", "8", "--max-tokens", "32"]))
    # The stack it starts: room for twice the clients, caches sized to fill in the warm-up.
    assert settings["max_concurrent_requests"] == 16 and settings["drafter_max_cached_requests"] == 16
    assert settings["num_gpu_blocks_override"] == 8 * -(-(32 + soak.PROMPT_ALLOWANCE_TOKENS) // soak.KV_BLOCK)
    assert "--num-gpu-blocks-override" in soak.command_line(settings) and "--url" not in soak.command_line(settings)
