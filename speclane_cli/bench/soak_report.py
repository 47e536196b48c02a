"""The verdict of `speclane bench soak`: its checks (no errors, every service alive,
resident memory flat after the warm-up, nothing held once the load stops) and
the report, as JSON and Markdown."""

import dataclasses
import json
import pathlib
import statistics
from collections.abc import Sequence

from speclane_cli.bench.soak_load import Outcome

Series = list[tuple[float, int | None]]  # (seconds since the load started, RSS bytes or None once gone)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear interpolation between the closest ranks, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def rss_trend(series: Series, duration: float) -> dict:
    """Medians of the RSS in the second and the last third of the load (the first third
    is the warm-up: caches filling, allocator pools growing) and the growth between them."""
    def third(index: int) -> list[int]:
        return [rss for t, rss in series if rss is not None and index * duration / 3 <= t <= (index + 1) * duration / 3]

    alive = [rss for _, rss in series if rss is not None]
    second, last = third(1), third(2)
    trend = {"samples": len(series), "first_mib": _mib(alive[0]) if alive else None,
             "max_mib": _mib(max(alive)) if alive else None, "last_mib": _mib(alive[-1]) if alive else None,
             "median_second_third_mib": None, "median_last_third_mib": None, "growth": None}
    if second and last:
        trend.update(median_second_third_mib=_mib(statistics.median(second)),
                     median_last_third_mib=_mib(statistics.median(last)),
                     growth=statistics.median(last) / statistics.median(second) - 1)
    return trend


def kv_fill(kv: Sequence[tuple[float, int, int]]) -> dict | None:
    """How full the verifier's KV pool (running sequences and prefix cache) got, and when
    it first held 90% of that peak: until then its RSS grows by design (the warm-up)."""
    if not kv:
        return None
    peak = max(held for _, held, _ in kv)
    return {"budget_tokens": kv[-1][2], "peak_held_tokens": peak,
            "ninety_percent_of_peak_at_s": next(t for t, held, _ in kv if held >= 0.9 * peak)}


def _mib(value: float) -> float:
    return round(value / 2**20, 1)


def summarize(outcomes: Sequence[Outcome]) -> dict:
    completed = [o for o in outcomes if o.ok and not o.disconnected]
    wall = max((o.ended for o in outcomes), default=0.0)
    tokens = sum(o.output_tokens for o in completed)

    def spread(values):
        return {f"p{p}": None if (v := percentile(values, p)) is None else round(v, 3) for p in (50, 90, 99)}

    errors = [o.error for o in outcomes if not o.ok]
    return {
        "requests": len(outcomes), "completed": len(completed), "errors": len(errors),
        "disconnected": sum(o.disconnected for o in outcomes),
        "by_kind": {kind: sum(o.kind == kind for o in outcomes) for kind in ("stream", "whole", "disconnect")},
        "wall_s": round(wall, 1),
        "requests_per_s": round(len(completed) / wall, 3) if wall else 0.0,
        "output_tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "output_tokens": tokens,
        "e2e_s": spread([o.e2e for o in completed]),
        "ttft_s": spread([o.ttft for o in completed if o.ttft is not None]),
        "first_errors": list(dict.fromkeys(errors))[:10],
    }


def checks(summary: dict, rss: dict[str, dict], alive: dict[str, bool], idle: tuple[bool, dict],
           tolerance: float) -> list[Check]:
    found = [
        Check("no errors", summary["errors"] == 0,
              f"{summary['errors']} of {summary['requests']} requests failed"
              + (f", e.g. {summary['first_errors'][0]}" if summary["first_errors"] else "")),
        Check("requests completed", summary["completed"] > 0, f"{summary['completed']} completed"),
    ]
    for name, up in alive.items():
        found.append(Check(f"{name} alive", up, "ran to the end" if up else "exited during the soak"))
    for name, trend in rss.items():
        if trend["growth"] is None:
            found.append(Check(f"{name} RSS flat", False, "too few samples in the second or last third: "
                               "lengthen --duration or shorten --sample-interval"))
        else:
            found.append(Check(f"{name} RSS flat", trend["growth"] <= tolerance,
                               f"{trend['median_second_third_mib']} -> {trend['median_last_third_mib']} MiB "
                               f"({trend['growth']:+.1%}, at most {tolerance:+.0%})"))
    idle_ok, figures = idle
    found.append(Check("nothing held after the load", idle_ok,
                       ", ".join(f"{key} {value:g}" for key, value in figures.items())))
    return found


def write_report(out_dir: pathlib.Path, command: str, settings: dict, services: dict, summary: dict,
                 rss: dict[str, dict], series: dict[str, Series], found: list[Check]) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    passed = all(check.ok for check in found)
    json_path, md_path = out_dir / "soak.json", out_dir / "soak.md"
    json_path.write_text(json.dumps({
        "command": command, "settings": settings, "services": services, "passed": passed,
        "checks": [dataclasses.asdict(check) for check in found], "summary": summary, "rss": rss,
        "rss_series": {name: [[t, rss] for t, rss in points] for name, points in series.items()},
    }, indent=2) + "\n")
    lines = ["# speclane bench soak", "", "```", command, "```", "",
             f"**{'PASSED' if passed else 'FAILED'}**: {summary['requests']} requests over "
             f"{settings['duration_s']:g} s at concurrency {settings['concurrency']}.", "",
             "| Check | Result | Detail |", "| :-- | :-- | :-- |",
             *(f"| {c.name} | {'ok' if c.ok else 'FAILED'} | {c.detail} |" for c in found), "",
             "| Requests | Completed | Left early | Errors | Streams / whole / left | Req/s | Output tok/s |",
             "| --: | --: | --: | --: | :-: | --: | --: |",
             f"| {summary['requests']} | {summary['completed']} | {summary['disconnected']} | {summary['errors']} | "
             f"{' / '.join(str(n) for n in summary['by_kind'].values())} | {summary['requests_per_s']} | "
             f"{summary['output_tokens_per_s']} |", "",
             "| Latency (s) | p50 | p90 | p99 |", "| :-- | --: | --: | --: |",
             *(f"| {label} | {' | '.join(str(summary[key][p]) for p in ('p50', 'p90', 'p99'))} |"
               for label, key in (("end to end", "e2e_s"), ("time to first token (streams)", "ttft_s"))), "",
             "| Service | pid | Samples | First MiB | Max MiB | Last MiB | Median 2nd third | Median last third "
             "| Growth |", "| :-- | --: | --: | --: | --: | --: | --: | --: | --: |",
             *(f"| {name} | {services.get(name, '-')} | {t['samples']} | {t['first_mib']} | {t['max_mib']} | "
               f"{t['last_mib']} | {t['median_second_third_mib']} | {t['median_last_third_mib']} | "
               f"{'-' if t['growth'] is None else format(t['growth'], '+.1%')} |" for name, t in rss.items()), ""]
    if (kv := summary.get("verifier_kv")) is not None:
        lines += [f"Verifier KV pool (running sequences and prefix cache): at most {kv['peak_held_tokens']} of "
                  f"{kv['budget_tokens']} tokens held, 90% of that {kv['ninety_percent_of_peak_at_s']:g} s into "
                  "the load (its RSS grows with it until then).", ""]
    if summary["first_errors"]:
        lines += ["Errors (first distinct):", "", *(f"- `{error}`" for error in summary["first_errors"]), ""]
    md_path.write_text("\n".join(lines) + "\n")
    return [json_path, md_path]
