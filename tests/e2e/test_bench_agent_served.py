"""`speclane bench agent` end to end, tiny: scripted sessions through the real
stack's tools API (Qwen2.5's template on SmolLM2, tools_gateway), where hybrid is
reported absent since this verifier has no draft head; and a replayed session log."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def bench_agent(stack, out_dir, *args: str) -> dict:
    command = [sys.executable, "-m", "speclane_cli", "bench", "agent", "--url", stack.base_url, "--max-tokens", "8",
               "--output-dir", str(out_dir), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out_dir / "results.json").read_text())


def test_bench_agent_runs_sessions_and_reports_each_method(tools_gateway, tmp_path):
    results = bench_agent(tools_gateway, tmp_path, "--sessions", "2", "--requests-per-session", "2",
                          "--concurrency", "2", "--methods", "none,suffix,hybrid", "--rounds", "2")
    assert results["command"].startswith("speclane bench agent ")
    assert "draft head" in results["absent_methods"]["hybrid"]
    runs = {run["method"]: run for run in results["runs"]}
    assert set(runs) == {"none", "suffix"}
    for run in runs.values():
        assert (run["requests"], run["failed"], run["concurrency"]) == (8, 0, 2)  # two rounds of 2 x 2
        assert run["ttft_first_ms"] > 0 and run["ttft_later_ms"] > 0 and run["throughput_tps"] > 0
        assert 0.5 < run["later_cached_share"] < 1  # a later prompt extends the session's earlier one
    assert runs["suffix"]["verify_steps"] > 0 and runs["suffix"]["speedup_vs_none"] is not None
    assert "| Conc. | Method |" in (tmp_path / "results.md").read_text()


def test_bench_agent_replays_a_session_log(tools_gateway, tmp_path):
    first = [{"role": "user", "content": "Write hello.py printing hello."}]
    log = [{"model": "any", "messages": first, "tools": [], "max_tokens": 9999},
           {"messages": [*first, {"role": "assistant", "content": "print('hello')"},
                         {"role": "user", "content": "Now make it print goodbye."}]}]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(request) + "\n" for request in log))
    results = bench_agent(tools_gateway, tmp_path / "out", "--replay", str(path), "--concurrency", "1",
                          "--methods", "none")
    [run] = results["runs"]
    assert (run["requests"], run["failed"]) == (2, 0) and "--replay" in results["command"]
    assert run["mean_output_tokens"] <= 8  # the bench's max_tokens, not the log's
