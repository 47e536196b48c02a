"""`speclane bench soak`, short: 16 clients for 20 s against a stack it starts itself
(real processes, the real model), with every check of the 10-minute soak: no failed
request, every service alive, RSS flat after the warm-up, nothing held afterwards.
And its discovery of a running stack's processes from /proc."""

import json
import subprocess
import sys

import pytest

from speclane_cli.bench.soak_watch import discover

pytestmark = pytest.mark.e2e
SERVICES = ("drafter", "verifier", "gateway")


def test_a_short_soak_passes_every_check(tmp_path):
    out = tmp_path / "soak"
    # Short requests: several waves of them in 20 s, so the caches fill within the warm-up third.
    soak = subprocess.run([sys.executable, "-m", "speclane_cli", "bench", "soak", "--concurrency", "16",
                           "--duration", "20s", "--max-tokens", "32", "--sample-interval", "1",
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=600)
    assert soak.returncode == 0, soak.stdout[-4000:] + soak.stderr[-4000:]
    report = json.loads((out / "soak.json").read_text())
    checks = {check["name"]: check["ok"] for check in report["checks"]}
    assert checks == {"no errors": True, "requests completed": True,
                      **{f"{name} alive": True for name in SERVICES},
                      **{f"{name} RSS flat": True for name in SERVICES},
                      "nothing held after the load": True}
    assert report["passed"]
    summary = report["summary"]
    assert summary["errors"] == 0 and summary["completed"] >= 20
    assert summary["disconnected"] >= 1  # clients left streams early, and that cost nothing
    assert min(summary["by_kind"].values()) >= 1 and summary["output_tokens_per_s"] > 0
    for name in SERVICES:
        trend = report["rss"][name]
        assert trend["samples"] >= 15 and trend["growth"] <= 0.10, (name, trend)
    held = next(check["detail"] for check in report["checks"] if check["name"] == "nothing held after the load")
    # Every figure was read: the gateway's, the verifier's own GetLoad, the drafter's sessions.
    for figure in ("gateway_running 0", "verifier_running 0", "verifier_kv_used_tokens 0", "drafter_sessions 0"):
        assert figure in held
    assert (out / "soak.md").read_text().startswith("# speclane bench soak")
    assert (out / "logs" / "verifier.log").stat().st_size > 0


def test_the_processes_of_a_running_stack_are_found_from_its_url(stack):
    services = discover(f"http://{stack.gateway.host}:{stack.gateway.port}", {}, "", "")
    assert services.pids == {name: stack.processes[name].pid for name in SERVICES}
    assert services.verifier_address == stack.verifier.address
    assert services.drafter_metrics_url == ""  # this drafter serves no metrics: named, not guessed
