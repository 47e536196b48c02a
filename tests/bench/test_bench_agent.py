"""`speclane bench agent`'s report, offline: each run's row (TTFT of first and later
requests, speedup over none), the table and the results files."""

import json

from speclane_cli.bench.agent import command_line, row, write_results
from speclane_cli.bench.stats import RequestResult, summarize


def results(ttfts: list[float], tokens: int) -> list[RequestResult]:
    return [RequestResult(ok=True, input_tokens=100, output_tokens=tokens, ttft=ttft, e2e=ttft + 1.0,
                          draft_tokens=8, accepted_tokens=4, verify_steps=2, turn=turn, tool_calls=turn % 2,
                          cached_tokens=[0, 64, 96][turn])
            for turn, ttft in enumerate(ttfts)]


def test_rows_compare_first_and_later_requests_and_methods(tmp_path):
    plain, speculated = results([0.8, 0.2, 0.2], 10), results([0.6, 0.1, 0.2], 10)
    none = summarize("agent", 1, "none", plain, 3.0)
    rows = [row(none, plain, none), row(summarize("agent", 1, "suffix", speculated, 1.0), speculated, none)]
    assert rows[0]["ttft_first_ms"] == 800 and rows[0]["ttft_later_ms"] == 200
    assert rows[0]["ttft_later_over_first"] == 0.25 and rows[0]["tool_calls"] == 1
    assert rows[0]["later_cached_share"] == 0.8  # (64 + 96) of 200 later prompt tokens
    assert rows[1]["speedup_vs_none"] == 3.0 and rows[1]["tokens_per_step"] == 3.0
    settings = {"url": "http://h:1", "model": "m", "sessions": 2, "requests_per_session": 3, "replay": None,
                "concurrency": [1], "methods": ["none", "suffix", "hybrid"], "num_speculative_tokens": None,
                "max_tokens": 8, "temperature": 0.0, "seed": 0, "rounds": 2, "output_dir": str(tmp_path)}
    written = write_results(settings, rows, {"hybrid": "needs a draft head"})
    saved = json.loads(written[0].read_text())
    assert saved["command"] == command_line(settings) and saved["absent_methods"] == {"hybrid": "needs a draft head"}
    markdown = written[1].read_text()
    assert "| 1 | suffix |" in markdown and "3.00" in markdown and "| 80% |" in markdown
    assert "`hybrid` absent: needs a draft head" in markdown


def test_a_replayed_run_names_its_log_not_the_script():
    command = command_line({"url": "u", "model": "m", "sessions": 16, "requests_per_session": 4,
                            "replay": "log.jsonl", "concurrency": [1, 16], "methods": ["none"],
                            "num_speculative_tokens": None, "max_tokens": 8, "temperature": 0.0, "seed": 0,
                            "rounds": 1, "output_dir": "out"})
    assert "--replay log.jsonl" in command and "--sessions" not in command and "--seed" not in command
    assert "--rounds" not in command  # one round, the default


def test_each_session_salts_the_prefix_cache_with_its_own_name(monkeypatch):
    import speclane_cli.bench.client as client
    from speclane_cli.bench.agent import _run_all
    from speclane_cli.bench.agent_sessions import agent_sessions

    sent = []

    async def closed_loop(url, sessions, concurrency, fields, tenant, on_request):
        sent.extend(session.request([]) for session in sessions)
        return results([0.5, 0.1], 4), 1.0

    monkeypatch.setattr(client, "closed_loop", closed_loop)
    sessions = agent_sessions(3, 2, seed=0)
    _run_all({"url": "u", "concurrency": [1], "model": "m", "max_tokens": 8, "temperature": 0.0,
              "num_speculative_tokens": None, "rounds": 1}, sessions, ["none"])
    assert [request["cache_salt"] for request in sent] == ["session-0", "session-1", "session-2"]
    assert [request["messages"] for request in sent] == [session.request([])["messages"] for session in sessions]


def test_rounds_alternate_the_methods_under_fresh_tenants_and_rows_sum_them(monkeypatch):
    import speclane_cli.bench.client as client
    from speclane_cli.bench.agent import _run_all
    from speclane_cli.bench.agent_sessions import agent_sessions

    tenants = []

    async def closed_loop(url, sessions, concurrency, fields, tenant, on_request):
        tenants.append(tenant)
        return results([0.5, 0.1], 4), 1.0

    monkeypatch.setattr(client, "closed_loop", closed_loop)
    rows = _run_all({"url": "u", "concurrency": [1], "model": "m", "max_tokens": 8, "temperature": 0.0,
                     "num_speculative_tokens": None, "rounds": 3}, agent_sessions(1, 2, seed=0), ["none", "suffix"])
    assert [tenant.split("-", 3)[3] for tenant in tenants] == [
        "r0-c1-none", "r0-c1-suffix", "r1-c1-suffix", "r1-c1-none", "r2-c1-none", "r2-c1-suffix"]
    assert [(row["method"], row["requests"]) for row in rows] == [("none", 6), ("suffix", 6)]
