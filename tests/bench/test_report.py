import json

from speclane_cli.bench.plots import write_plots
from speclane_cli.bench.report import markdown_table, terminal_table, write_results
from speclane_cli.bench.serve import command_line, request_fields
from speclane_cli.bench.stats import comparisons
from tests.bench.factories import run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUNS = [run("none", tpot_ms=50.0, tps=10.0), run("suffix", tpot_ms=25.0, tps=18.0, draft=40, accepted=30, steps=10),
        run("none", concurrency=4, tpot_ms=80.0, tps=20.0), run("suffix", concurrency=4, tpot_ms=40.0, tps=30.0,
                                                                 draft=40, accepted=20, steps=10),
        run("hf-generate", tpot_ms=60.0, tps=9.0), run("hf-prompt-lookup", tpot_ms=45.0, tps=11.0, draft=50,
                                                       accepted=10, steps=10)]


def test_terminal_table_shows_baseline_speculation_and_improvements():
    lines = terminal_table(comparisons(RUNS)).splitlines()
    assert lines[0].split()[:3] == ["Data", "set", "Conc."]
    assert len(lines) == 2 + 3
    suffix_c1 = lines[2].split()
    assert suffix_c1[:3] == ["humaneval", "1", "suffix"]
    # base TPOT, base TPS, spec TPOT, spec TPS, acceptance, tokens/step, TPOT and TPS improvement
    assert suffix_c1[-8:] == ["50.0", "10.0", "25.0", "18.0", "75.0%", "4.00", "+50.0%", "+80.0%"]
    assert lines[3].split()[2] == "hf-prompt-lookup" and lines[3].split()[-2:] == ["+25.0%", "+22.2%"]


def test_markdown_table_has_one_row_per_comparison():
    table = markdown_table(comparisons(RUNS)).splitlines()
    assert len(table) == 2 + 3
    assert {line.count("|") for line in table} == {16}


def test_results_files_and_plots(tmp_path):
    rows = comparisons(RUNS)
    plots = write_plots(RUNS, tmp_path)
    assert [p.name for p in plots] == ["throughput_tpot.png", "acceptance.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in plots)
    settings = {"url": "http://127.0.0.1:8000", "model": "m", "datasets": ["humaneval"], "concurrency": [1, 4],
                "num_prompts": 2, "max_turns": 3, "methods": ["none", "suffix"], "num_speculative_tokens": 8,
                "max_tokens": 16, "rounds": 1, "temperature": 0.0, "seed": 0, "peer": "hf-prompt-lookup",
                "peer_model": "smollm2-135m-instruct", "output_dir": str(tmp_path)}
    command = command_line(settings)
    json_path, md_path = write_results(tmp_path, command, settings, RUNS, rows, plots)
    saved = json.loads(json_path.read_text())
    assert saved["command"] == command and len(saved["runs"]) == len(RUNS)
    assert saved["runs"][1]["acceptance_rate"] == 0.75
    markdown = md_path.read_text()
    assert command in markdown and markdown_table(rows) in markdown
    assert "![acceptance](acceptance.png)" in markdown
    # Two prompts: at concurrency 4 all start at once, and TPS is their slowest one's; at 1 they queue.
    assert "At concurrency 4 every conversation starts at once" in markdown and "At concurrency 1" not in markdown


def test_command_line_reproduces_every_setting():
    settings = {"url": "http://h:1", "model": "m", "datasets": ["humaneval", "my prompts.jsonl"],
                "concurrency": [1, 4], "num_prompts": 5, "max_turns": 2, "methods": ["none", "suffix"],
                "num_speculative_tokens": 4, "max_tokens": 32, "rounds": 2, "temperature": 0.0, "seed": 7, "peer": None,
                "peer_model": "x", "output_dir": "out"}
    assert command_line(settings) == (
        "speclane bench serve --url http://h:1 --model m --dataset 'humaneval,my prompts.jsonl' --concurrency 1,4 "
        "--num-prompts 5 --max-turns 2 --methods none,suffix --num-speculative-tokens 4 --max-tokens 32 --rounds 2 "
        "--temperature 0.0 --seed 7 --output-dir out")


def test_without_a_k_each_method_drafts_the_servers_own_length():
    settings = {"url": "http://h:1", "model": "m", "datasets": ["humaneval"], "concurrency": [1], "num_prompts": 5,
                "max_turns": 1, "methods": ["ngram", "suffix"], "num_speculative_tokens": None, "max_tokens": 32,
                "rounds": 1, "temperature": 0.0, "seed": 7, "peer": None, "peer_model": "x", "output_dir": "out"}
    assert not {"--num-speculative-tokens", "--rounds"} & set(command_line(settings).split())
    assert request_fields(settings, "suffix")["speculation"] == {"method": "suffix"}
    assert request_fields({**settings, "num_speculative_tokens": 4}, "ngram")["speculation"] == {
        "method": "ngram", "num_speculative_tokens": 4}
