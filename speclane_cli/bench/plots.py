"""PNG plots of a benchmark: throughput and TPOT versus concurrency for each
method (one column per data set), and acceptance rate per data set."""

import pathlib
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from speclane_cli.bench.stats import BASELINE_METHODS, RunStats  # noqa: E402


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def _colors(runs: Sequence[RunStats]) -> dict[str, str]:
    """One color per method, the same in every plot."""
    return {method: f"C{index % 10}" for index, method in enumerate(_ordered(r.method for r in runs))}


def plot_throughput_and_tpot(runs: Sequence[RunStats], path: pathlib.Path) -> pathlib.Path:
    datasets, methods = _ordered(r.dataset for r in runs), _ordered(r.method for r in runs)
    colors = _colors(runs)
    figure, axes = plt.subplots(2, len(datasets), figsize=(4.2 * len(datasets), 7), squeeze=False)
    for column, dataset in enumerate(datasets):
        for method in methods:
            points = sorted((r.concurrency, r.throughput_tps, r.mean_tpot_ms) for r in runs
                            if r.dataset == dataset and r.method == method)
            if not points:
                continue
            style = {"marker": "o", "linestyle": "--" if method.startswith("hf-") else "-", "label": method,
                     "color": colors[method]}
            axes[0][column].plot([p[0] for p in points], [p[1] for p in points], **style)
            tpot = [(p[0], p[2]) for p in points if p[2] is not None]
            axes[1][column].plot([p[0] for p in tpot], [p[1] for p in tpot], **style)
        axes[0][column].set_title(dataset)
        axes[1][column].set_xlabel("concurrency")
        for row in axes[:, column]:
            row.set_xticks(sorted({r.concurrency for r in runs}))
            row.set_ylim(bottom=0)
            row.grid(alpha=0.3)
    axes[0][0].set_ylabel("throughput (output tokens/s)")
    axes[1][0].set_ylabel("TPOT (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(methods), frameon=False)
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_acceptance(runs: Sequence[RunStats], path: pathlib.Path) -> pathlib.Path | None:
    """Accepted / drafted tokens per data set and method, summed over concurrency levels."""
    speculative = [r for r in runs if r.method not in BASELINE_METHODS and r.draft_tokens]
    if not speculative:
        return None
    datasets, methods = _ordered(r.dataset for r in speculative), _ordered(r.method for r in speculative)
    colors, width = _colors(runs), 0.8 / len(methods)
    figure, axis = plt.subplots(figsize=(max(6, 1.8 * len(datasets)), 4.5))
    for index, method in enumerate(methods):
        rates = []
        for dataset in datasets:
            mine = [r for r in speculative if r.dataset == dataset and r.method == method]
            drafted = sum(r.draft_tokens for r in mine)
            rates.append(100 * sum(r.accepted_tokens for r in mine) / drafted if drafted else 0)
        positions = [d + (index - (len(methods) - 1) / 2) * width for d in range(len(datasets))]
        bars = axis.bar(positions, rates, width, label=method, color=colors[method])
        axis.bar_label(bars, fmt="%.0f", fontsize=8)
    axis.set_xticks(range(len(datasets)), datasets)
    axis.set_ylabel("acceptance rate (% of drafted tokens)")
    axis.set_ylim(0, 115)  # room for the legend above 100%
    axis.legend(frameon=False, loc="upper center", ncol=len(methods))
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_plots(runs: Sequence[RunStats], out_dir: pathlib.Path) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_throughput_and_tpot(runs, out_dir / "throughput_tpot.png"),
             plot_acceptance(runs, out_dir / "acceptance.png")]
    return [p for p in paths if p is not None]
