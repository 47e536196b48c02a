"""Per-request measurements, per-run statistics, and the seeds' comparison of a
speculative run against its baseline (same data set, concurrency and system)."""

import dataclasses
import statistics
from collections.abc import Sequence

# Methods that decode one token per step; every other method is compared against one of these.
BASELINE_METHODS = ("none", "hf-generate")


@dataclasses.dataclass(frozen=True)
class RequestResult:
    ok: bool
    error: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first chunk, which servers send once the first token exists
    e2e: float = 0.0  # seconds to the end of the response
    # usage.speculation; None when the server does not report it
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    verify_steps: int | None = None
    next_round_steps: int | None = None  # steps the verifier started on a next-round draft
    turn: int = 0  # the request's place in its conversation (0: the first, with nothing to reuse)
    tool_calls: int = 0  # calls in the reply
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first. A speculative step delivers several
        tokens in one chunk, so this is (e2e - ttft) / (output_tokens - 1), as vLLM's
        benchmark computes it, not a mean over chunk gaps."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


@dataclasses.dataclass(frozen=True)
class RunStats:
    """One run: a data set at one concurrency with one method. Failed requests are
    counted in `failed` and left out of every mean."""

    dataset: str
    concurrency: int
    method: str
    requests: int
    failed: int
    duration_s: float
    mean_input_tokens: float | None
    mean_output_tokens: float | None
    mean_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    mean_e2e_s: float | None
    throughput_tps: float  # output tokens of successful requests per second of wall time
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    errors: tuple[str, ...] = ()  # distinct failure messages, first few
    next_round_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def acceptance_length(self) -> float | None:
        """Mean accepted draft tokens per verify step."""
        return self.accepted_tokens / self.verify_steps if self.verify_steps else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens each verify step yields: the accepted drafts plus the model's own token."""
        return None if self.acceptance_length is None else 1 + self.acceptance_length

    @property
    def next_round_hit_rate(self) -> float | None:
        """Of the steps after a request's first, those the verifier started on the
        gateway's next-round draft, without waiting for a Verify."""
        later_steps = self.verify_steps - self.requests
        return self.next_round_steps / later_steps if later_steps > 0 else None

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
                "acceptance_length": self.acceptance_length, "tokens_per_step": self.tokens_per_step,
                "next_round_hit_rate": self.next_round_hit_rate}


def summarize(dataset: str, concurrency: int, method: str, results: Sequence[RequestResult],
              duration_s: float) -> RunStats:
    ok = [r for r in results if r.ok]
    tpots_ms = [r.tpot * 1000 for r in ok if r.tpot is not None]
    output_tokens = sum(r.output_tokens for r in ok)

    def total(field: str) -> int:
        return sum(getattr(r, field) or 0 for r in ok)

    return RunStats(
        dataset=dataset, concurrency=concurrency, method=method, requests=len(ok),
        failed=len(results) - len(ok), duration_s=duration_s,
        mean_input_tokens=_mean([r.input_tokens for r in ok]),
        mean_output_tokens=_mean([r.output_tokens for r in ok]),
        mean_ttft_ms=_mean([r.ttft * 1000 for r in ok]),
        mean_tpot_ms=_mean(tpots_ms),
        median_tpot_ms=statistics.median(tpots_ms) if tpots_ms else None,
        mean_e2e_s=_mean([r.e2e for r in ok]),
        throughput_tps=output_tokens / duration_s if duration_s > 0 else 0.0,
        draft_tokens=total("draft_tokens"), accepted_tokens=total("accepted_tokens"),
        verify_steps=total("verify_steps"), next_round_steps=total("next_round_steps"),
        errors=tuple(dict.fromkeys(r.error for r in results if not r.ok))[:5],
    )


def baseline_of(method: str) -> str:
    return "hf-generate" if method.startswith("hf-") else "none"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A row of the seeds' table: a speculative run beside its baseline (either may be missing)."""

    baseline: RunStats | None
    speculative: RunStats | None

    @property
    def run(self) -> RunStats:
        return self.speculative or self.baseline

    @property
    def tpot_improvement(self) -> float | None:
        """Fraction of the baseline's TPOT saved: (baseline - speculative) / baseline."""
        b, s = (None if run is None else run.mean_tpot_ms for run in (self.baseline, self.speculative))
        return (b - s) / b if b and s is not None else None

    @property
    def tps_improvement(self) -> float | None:
        """Throughput gain: speculative / baseline - 1."""
        b, s = (None if run is None else run.throughput_tps for run in (self.baseline, self.speculative))
        return s / b - 1 if b and s is not None else None


def comparisons(runs: Sequence[RunStats]) -> list[Comparison]:
    """One row per speculative run, beside the baseline of its data set, concurrency and
    system; a baseline with no speculative run beside it gets a row of its own."""
    by_key = {(r.dataset, r.concurrency, r.method): r for r in runs}
    rows, paired = [], set()
    for run in runs:
        if run.method in BASELINE_METHODS:
            continue
        baseline = by_key.get((run.dataset, run.concurrency, baseline_of(run.method)))
        paired.add(id(baseline))
        rows.append(Comparison(baseline, run))
    rows += [Comparison(run, None) for run in runs if run.method in BASELINE_METHODS and id(run) not in paired]
    order = {key: index for index, key in enumerate(dict.fromkeys((r.dataset, r.concurrency) for r in runs))}
    return sorted(rows, key=lambda row: order[(row.run.dataset, row.run.concurrency)])
