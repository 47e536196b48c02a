"""The seeds-style table (terminal and Markdown) and the JSON results file."""

import json
import pathlib
from collections.abc import Callable, Sequence

from speclane_cli.bench.stats import Comparison, RunStats

Cell = Callable[[Comparison], str]


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _percent(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{value * 100:{'+' if signed else ''}.1f}%"


def _field(run: RunStats | None, name: str, digits: int = 1) -> str:
    return "-" if run is None else _number(getattr(run, name), digits)


COLUMNS: tuple[tuple[str, Cell], ...] = (
    ("Data set", lambda c: c.run.dataset),
    ("Conc.", lambda c: str(c.run.concurrency)),
    ("Method", lambda c: c.run.method),
    ("Mean in", lambda c: _field(c.run, "mean_input_tokens", 0)),
    ("Mean out", lambda c: _field(c.run, "mean_output_tokens", 0)),
    ("Requests", lambda c: str(c.run.requests)),
    ("Failed", lambda c: str(sum(run.failed for run in (c.baseline, c.speculative) if run is not None))),
    ("Base TPOT ms", lambda c: _field(c.baseline, "mean_tpot_ms")),
    ("Base TPS", lambda c: _field(c.baseline, "throughput_tps")),
    ("Spec TPOT ms", lambda c: _field(c.speculative, "mean_tpot_ms")),
    ("Spec TPS", lambda c: _field(c.speculative, "throughput_tps")),
    ("Accept", lambda c: "-" if c.speculative is None else _percent(c.speculative.acceptance_rate)),
    ("Tok/step", lambda c: _field(c.speculative, "tokens_per_step", 2)),
    ("TPOT impr.", lambda c: _percent(c.tpot_improvement, signed=True)),
    ("TPS impr.", lambda c: _percent(c.tps_improvement, signed=True)),
)
_LEFT_ALIGNED = 3  # the first three columns are names


def _cells(rows: Sequence, columns: Sequence[tuple[str, Callable]]) -> list[list[str]]:
    return [[cell(row) for _, cell in columns] for row in rows]


def terminal_table(rows: Sequence, columns: Sequence[tuple[str, Callable]] = COLUMNS,
                   left_aligned: int = _LEFT_ALIGNED) -> str:
    """`columns` are (header, row -> cell text); the first `left_aligned` hold names."""
    header = [name for name, _ in columns]
    body = _cells(rows, columns)
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i < left_aligned else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(cells) for cells in body)])


def markdown_table(rows: Sequence, columns: Sequence[tuple[str, Callable]] = COLUMNS,
                   left_aligned: int = _LEFT_ALIGNED) -> str:
    header = [name for name, _ in columns]
    align = [":--" if i < left_aligned else "--:" for i in range(len(header))]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, align, *_cells(rows, columns)])


def failure_lines(runs: Sequence[RunStats]) -> list[str]:
    return [f"{run.dataset} c={run.concurrency} {run.method}: {run.failed} failed, e.g. {run.errors[0]}"
            for run in runs if run.failed]


def write_results(out_dir: pathlib.Path, command: str, settings: dict, runs: Sequence[RunStats],
                  rows: Sequence[Comparison], plots: Sequence[pathlib.Path]) -> list[pathlib.Path]:
    """Writes results.json and results.md; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    json_path.write_text(json.dumps({"command": command, "settings": settings,
                                     "runs": [run.as_dict() for run in runs]}, indent=2) + "\n")
    failures = failure_lines(runs)
    lines = ["# speclane bench serve", "", "```", command, "```", "", markdown_table(rows), "",
             "TPOT = (e2e - TTFT) / (output tokens - 1), mean over successful requests; TPS = output tokens "
             "per second of wall time; Accept = accepted / drafted tokens; Tok/step = tokens per verify step; "
             "TPOT impr. = (base - spec) / base; TPS impr. = spec / base - 1.", ""]
    one_wave = [c for c in settings["concurrency"] if settings["num_prompts"] <= c]
    if one_wave:
        lines += [f"At concurrency {', '.join(map(str, one_wave))} every conversation starts at once (num_prompts <= "
                  "concurrency): TPS measures the slowest conversation, not a steady load's throughput; TPOT and "
                  "more prompts than concurrency tell that.", ""]
    if failures:
        lines += ["Failed requests (not in the averages):", "", *(f"- {line}" for line in failures), ""]
    lines += [f"![{path.stem}]({path.name})" for path in plots]
    md_path.write_text("\n".join(lines) + "\n")
    return [json_path, md_path]
