"""`speclane bench serve` end to end: a tiny benchmark against the real stack
(SmolLM2, a few tokens per request), and its refusals."""

import json

import pytest

from speclane.models import DEFAULT_MODEL, resolve_model
from speclane_cli.main import main
from tests.e2e.stack import free_port, start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(resolve_model(DEFAULT_MODEL), tmp_path_factory.mktemp("stack-logs"))
    yield running
    running.stop()


def bench(*flags) -> int:
    """The exit code of `speclane bench serve FLAGS` (argparse exits on its own errors)."""
    try:
        return main(["bench", "serve", *flags])
    except SystemExit as exited:
        return exited.code


@pytest.mark.e2e
def test_a_tiny_benchmark_runs_end_to_end(stack, tmp_path, capsys):
    # Short prompts keep CPU prefill quick; the built-in data sets have tests of their own.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Repeat exactly: the quick brown fox jumps over the lazy dog.",
                                             "Repeat your answer once more."]}) + "\n"
                       + json.dumps({"prompt": "Repeat exactly: one two three four five six seven."}) + "\n")
    code = bench("--url", f"http://{stack.gateway.host}:{stack.gateway.port}", "--dataset", str(prompts),
                 "--concurrency", "2", "--num-prompts", "2", "--max-tokens", "12",
                 "--methods", "none,suffix", "--peer", "hf-prompt-lookup", "--output-dir", str(tmp_path))
    out = capsys.readouterr().out
    assert code == 0, out
    saved = json.loads((tmp_path / "results.json").read_text())
    runs = {(r["concurrency"], r["method"]): r for r in saved["runs"]}
    # The peer runs one request at a time, beside the closed loop's concurrency.
    assert set(runs) == {(2, "none"), (2, "suffix"), (1, "hf-generate"), (1, "hf-prompt-lookup")}
    for run in runs.values():
        assert (run["requests"], run["failed"]) == (3, 0)  # 2 turns + 1
        assert 0 < run["mean_output_tokens"] <= 12 and run["throughput_tps"] > 0 and run["mean_tpot_ms"] > 0
        assert run["verify_steps"] > 0
    # Drafting under a loaded CPU is timing-dependent for the server (a slow draft is skipped),
    # so only the baseline's and the in-process peer's counters are certain.
    assert runs[(2, "none")]["draft_tokens"] == 0 and runs[(1, "hf-generate")]["draft_tokens"] == 0
    assert runs[(1, "hf-prompt-lookup")]["draft_tokens"] > 0
    # Same prompts through the same chat template on both sides.
    assert runs[(1, "hf-generate")]["mean_input_tokens"] == runs[(2, "none")]["mean_input_tokens"]
    table = out.splitlines()
    assert any(line.split()[:3] == [str(prompts), "2", "suffix"] for line in table)
    assert any(line.split()[:3] == [str(prompts), "1", "hf-prompt-lookup"] for line in table)
    assert "speclane bench serve --url" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "throughput_tpot.png").stat().st_size > 0 and (tmp_path / "acceptance.png").is_file()


@pytest.mark.e2e
def test_failed_requests_are_counted_and_reported_not_averaged(stack, tmp_path, capsys):
    # Two rounds: each row sums both.
    code = bench("--url", stack.base_url, "--dataset", "humaneval", "--concurrency", "1", "--num-prompts", "1",
                 "--max-tokens", "4", "--methods", "none,eagle9", "--rounds", "2", "--output-dir", str(tmp_path))
    captured = capsys.readouterr()
    assert code == 1
    assert "FAILED: humaneval c=1 eagle9: 2 failed, e.g. HTTP 400" in captured.err
    runs = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert (runs["eagle9"]["requests"], runs["eagle9"]["failed"]) == (0, 2)
    assert runs["eagle9"]["mean_tpot_ms"] is None and runs["eagle9"]["throughput_tps"] == 0
    assert (runs["none"]["requests"], runs["none"]["failed"]) == (2, 0)


def test_an_unreachable_server_is_refused_with_a_clear_message(tmp_path, capsys):
    code = bench("--url", f"http://127.0.0.1:{free_port()}", "--output-dir", str(tmp_path))
    err = capsys.readouterr().err
    assert code == 2
    assert "no OpenAI-compatible server answers at" in err and "Traceback" not in err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "0"], "concurrency levels must be >= 1"),
    (["--concurrency", "one"], "expected a comma-separated list"),
    (["--max-tokens", "0"], "must be >= 1"),
    (["--rounds", "0"], "must be >= 1"),
    (["--methods", "hf-generate"], "come from --peer"),
])
def test_bad_flags_are_refused_before_any_request(flags, message, capsys):
    assert bench("--url", f"http://127.0.0.1:{free_port()}", *flags) == 2
    assert message in capsys.readouterr().err
