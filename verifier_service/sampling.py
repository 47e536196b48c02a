"""The request's target distribution p over the vocabulary, and draws from it."""

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from verifier_service.device import cpu_kernels
from verifier_service.errors import InvalidRequest


def greedy_choices(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of logits [rows, vocab], as torch.argmax picks it (the
    first maximum; a NaN counts as the maximum), in the logits' own dtype
    (widening bf16 to fp32 keeps the order). On a CPU, fp32 or bf16, our
    kernel (csrc/greedy.cc): torch's reduction took 4.8 ms of a 16-sequence
    verify pass of Qwen2.5 (80 rows of 151,936), and its fp32 copy 2 more;
    elsewhere torch.max's indices (reduced vectorized, argmax's not)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() == 2:
        rows = logits if logits.stride(-1) == 1 else logits.contiguous()
        out = torch.empty(rows.shape[0], dtype=torch.int64)
        cpu_kernels().row_argmax(rows.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0),
                                 rows.dtype == torch.bfloat16, torch.get_num_threads())
        return out
    return logits.max(dim=-1).indices


@dataclass(frozen=True)
class SamplingParams:
    temperature: float | None = None  # None or 0: greedy
    top_p: float | None = None  # None: no nucleus cut
    top_k: int | None = None  # None or 0: no top-k cut
    seed: int | None = None  # None: nondeterministic
    # Logit controls with vLLM's meanings and ranges; the defaults are off
    # (logits_processing.py applies all but min_p, which target_probs does).
    presence_penalty: float = 0.0  # subtracted from output tokens' logits once
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive, multiplies negative logits of prompt and output tokens
    min_p: float = 0.0  # drops tokens less likely than min_p times the most likely one
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)  # token id -> added to its logit
    min_tokens: int = 0  # stop tokens are masked until this many tokens are generated

    def __post_init__(self):
        if self.temperature is not None and not 0 <= self.temperature < float("inf"):
            raise InvalidRequest(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise InvalidRequest(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        for token, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                raise InvalidRequest(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
        if self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return not self.temperature


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded with `seed`, or where None with a seed drawn from torch's global generator (which the
    verifier's --seed seeds, as vLLM's does). A seeded request gets its own, so it is reproducible whatever else
    runs on the server; the unseeded ones share their engine's, so a pass draws all their uniforms at once."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(torch.randint(2**63 - 1, ())) if seed is None else seed)
    return generator


def draw_uniforms(counts: Sequence[int], generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """counts[i] uniforms in [0, 1) for each i, in order, those of every i with the same generator drawn in one
    operation (a launch on an accelerator): a pass draws once for its unseeded sequences (vLLM draws them from one
    generator too) and once for each seeded sequence, whose own draws so depend on nothing else in the pass."""
    totals: dict[int, int] = {}
    for generator, count in zip(generators, counts):
        totals[id(generator)] = totals.get(id(generator), 0) + count
    distinct = {id(generator): generator for generator in generators}  # in order of first appearance
    draws = [torch.rand(totals[key], generator=generator, device=device) for key, generator in distinct.items()]
    if len(draws) == 1:
        return draws[0]
    # Each generator's next uniform in the concatenation of the draws.
    firsts = dict(zip(distinct, itertools.accumulate((totals[key] for key in distinct), initial=0)))
    order = []
    for generator, count in zip(generators, counts):
        first = firsts[id(generator)]
        order += range(first, first + count)
        firsts[id(generator)] = first + count
    return torch.cat(draws)[torch.tensor(order, device=device)]


# A CPU computes target probabilities in groups of rows this large, well under glibc's largest mmap threshold
# (32 MB), above which every temporary is mapped and faulted in afresh: the temperature and softmax over 256 rows
# of 49,152 took 54 ms at once and 10.6 in groups of 16 (docs/benchmarks/verifier-engine/softmax_groups.py).
# An accelerator takes every row at once.
CPU_GROUP_BYTES = 4 << 20
NUCLEUS_WIDTH = 1024  # tokens top-p looks among on an accelerator before it sorts a whole row (_nucleus)


def step_groups(counts: Sequence[int], vocab_size: int, device: torch.device) -> list[range]:
    """Consecutive steps (counts[i] rows each) grouped for batch_target_probs: on a CPU up to CPU_GROUP_BYTES of
    fp32 rows a group (at least one step), elsewhere all of them."""
    if device.type != "cpu":
        return [range(len(counts))]
    groups, first, rows = [], 0, 0
    for i, count in enumerate(counts):
        if rows and (rows + count) * vocab_size * 4 > CPU_GROUP_BYTES:
            groups.append(range(first, i))
            first, rows = i, 0
        rows += count
    return [*groups, range(first, len(counts))] if counts else []


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p for each row of `logits` [n, vocab] under temperature, then min_p,
    top-k and top-p (vLLM's order)."""
    return batch_target_probs(logits, [params], [logits.shape[0]])


def batch_target_probs(logits: torch.Tensor, params: Sequence[SamplingParams], counts: Sequence[int]) -> torch.Tensor:
    """target_probs for the rows of several steps at once: `logits` [rows, vocab] holds counts[i] rows under
    params[i], in order. Each control is one operation over every row with the rows' own values (one copy of
    them to the device), and is skipped where no step sets it."""
    vocab = logits.shape[-1]
    top_ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]
    top_ps = [p.top_p if p.top_p is not None and p.top_p < 1 else 2.0 for p in params]  # 2: keeps every token
    settings = torch.tensor([[p.temperature, p.min_p, top_k, top_p]
                             for p, top_k, top_p, n in zip(params, top_ks, top_ps, counts) for _ in range(n)],
                            dtype=torch.float32, device=logits.device)
    temperature, min_p, top_k, top_p = settings.T[:, :, None]
    logits = logits / temperature
    if any(p.min_p for p in params):
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    likeliest = None  # each row's most likely tokens, most likely first, where top-k found them
    if any(top_ks):
        largest, likeliest = torch.topk(logits, max(top_ks), dim=-1)
        kth = largest.gather(1, (top_k.long() - 1).clamp(min=0))
        logits = logits.masked_fill((logits < kth) & (top_k > 0), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(top_p < 1 for top_p in top_ps):
        probs = _nucleus(probs, top_p, likeliest)
    return probs


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor, likeliest: torch.Tensor | None = None) -> torch.Tensor:
    """Each row where top_p < 1 keeps the smallest prefix of its tokens by probability whose mass reaches top_p (a
    token is dropped when the mass before it already does), renormalised. Under top-k the prefix is looked for
    among top-k's tokens; on a CPU otherwise, and where those hold less than top_p, by our kernel
    (csrc/nucleus.cc), which reads a row three times and sorts only the few tokens around the cut. Elsewhere among
    the row's NUCLEUS_WIDTH most likely tokens (a partial sort), and the whole rows are sorted only where those
    hold less than top_p: the usual nucleus of a trained model is far narrower than a vocabulary."""
    cut = top_p < 1
    cpu = _kernel_takes(probs)
    if likeliest is None and cpu:
        return _cpu_nucleus(probs, top_p)
    if likeliest is None:
        values, order = torch.topk(probs, min(probs.shape[-1], NUCLEUS_WIDTH), dim=-1)
    else:
        values, order = probs.gather(-1, likeliest), likeliest
    if order.shape[-1] < probs.shape[-1] and bool(((values.sum(-1, keepdim=True) < top_p) & cut).any()):
        if cpu:
            return _cpu_nucleus(probs, top_p)
        values, order = torch.sort(probs, dim=-1, descending=True)
    kept = values.masked_fill((values.cumsum(dim=-1) - values) >= top_p, 0.0)
    nucleus = torch.zeros_like(probs).scatter(-1, order, kept)
    return torch.where(cut, nucleus / nucleus.sum(dim=-1, keepdim=True), probs)


def _kernel_takes(probs: torch.Tensor) -> bool:
    return probs.device.type == "cpu" and probs.dtype == torch.float32


def _cpu_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """_nucleus by csrc/nucleus.cc: the nucleus of each fp32 row [rows, vocab] where top_p [rows, 1] < 1, found
    without sorting the row (a sort of SmolLM2's 49,152 took 3.5 ms on this repository's CPU host)."""
    rows = probs.contiguous()
    cut = top_p.reshape(-1).contiguous()
    out = torch.empty_like(rows)
    cpu_kernels().nucleus(rows.data_ptr(), cut.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1],
                          torch.get_num_threads())
    return out


def draw(probs: torch.Tensor, uniforms: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A token from each row of `probs` [m, vocab] (non-negative, not necessarily normalised), by inverting its
    cumulative sum at the row's uniform in [0, 1): torch.multinomial's distribution, but from a uniform drawn
    with the sequence's generator, so rows of many sequences are drawn in one operation. A token of probability
    0 is never drawn. The sum in float64 where the device computes it natively, so its rounding skews no
    token's chance; elsewhere (an Ascend NPU leaves float64 to its AI CPU) in float32, off by at most half an
    ulp of the running sum (3e-8) per token; `dtype` chooses. On a CPU, fp32 rows without a `dtype` go through
    our kernel (csrc/draw.cc), which sums in double without writing the cumulative sum out."""
    if dtype is None and _kernel_takes(probs) and probs.dim() == 2 and probs.stride(-1) == 1:
        at = uniforms.to(torch.float32).contiguous()
        tokens = torch.empty(probs.shape[0], dtype=torch.int64)
        cpu_kernels().draw(probs.data_ptr(), probs.stride(0), at.data_ptr(), tokens.data_ptr(), probs.shape[0],
                           probs.shape[1], torch.get_num_threads())
        return tokens
    exact = dtype or (torch.float64 if probs.device.type in ("cpu", "cuda") else torch.float32)
    cumulative = probs.to(exact).cumsum(-1)
    # A uniform below 1 times the total stays below it (in float32 too), so a token with mass is found; the clamp
    # keeps a row without finite mass (_usable) in the vocabulary.
    tokens = torch.searchsorted(cumulative, uniforms.to(exact)[:, None] * cumulative[:, -1:], right=True)[:, 0]
    return tokens.clamp(max=probs.shape[-1] - 1)
