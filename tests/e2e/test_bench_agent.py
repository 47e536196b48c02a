"""`speclane bench agent` end to end, tiny: scripted sessions through the real
stack's tools API (Qwen2.5's template on SmolLM2, tools_gateway); hybrid is
reported absent, since this verifier has no draft head."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_bench_agent_runs_sessions_and_reports_each_method(tools_gateway, tmp_path):
    command = [sys.executable, "-m", "speclane_cli", "bench", "agent", "--url", tools_gateway.base_url,
               "--sessions", "2", "--requests-per-session", "2", "--concurrency", "2", "--max-tokens", "8",
               "--methods", "none,suffix,hybrid", "--output-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["command"].startswith("speclane bench agent ")
    assert "draft head" in results["absent_methods"]["hybrid"]
    runs = {run["method"]: run for run in results["runs"]}
    assert set(runs) == {"none", "suffix"}
    for run in runs.values():
        assert (run["requests"], run["failed"], run["concurrency"]) == (4, 0, 2)
        assert run["ttft_first_ms"] > 0 and run["ttft_later_ms"] > 0 and run["throughput_tps"] > 0
    assert runs["suffix"]["verify_steps"] > 0 and runs["suffix"]["speedup_vs_none"] is not None
    assert "| Conc. | Method |" in (tmp_path / "results.md").read_text()
