"""The request's target distribution p over the vocabulary, and draws from it."""

from dataclasses import dataclass

import torch

from verifier_service.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float | None = None  # None or 0: greedy
    top_p: float | None = None  # None: no nucleus cut
    top_k: int | None = None  # None or 0: no top-k cut
    seed: int | None = None  # None: nondeterministic

    def __post_init__(self):
        if self.temperature is not None and not self.temperature >= 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return not self.temperature


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A per-sequence generator, so a seeded request is reproducible whatever
    else runs on the server."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p for each row of `logits` [n, vocab] under temperature, top-k, top-p."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when
        # the mass before it already does.
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id drawn from a 1-D distribution (need not be normalised)."""
    return int(torch.multinomial(probs, 1, generator=generator))
