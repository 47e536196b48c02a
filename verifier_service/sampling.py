"""The request's target distribution p over the vocabulary, and draws from it."""

from collections.abc import Mapping
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
    """A per-sequence generator, so a seeded request is reproducible whatever
    else runs on the server. An unseeded one draws its seed from torch's global
    generator, which the verifier's --seed seeds, as vLLM's does."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(torch.randint(2**63 - 1, ())) if seed is None else seed)
    return generator


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p for each row of `logits` [n, vocab] under temperature, then min_p,
    top-k and top-p (vLLM's order)."""
    logits = logits / params.temperature
    if params.min_p:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
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
