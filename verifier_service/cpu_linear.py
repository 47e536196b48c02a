"""Linear layers for fp32 on a CPU, with their weights stored transposed
([in, out], contiguous).

A verify pass feeds a few to a few dozen tokens (one sequence's draft, or a
batch of decodes). For that many rows, PyTorch's CPU `F.linear(x, W)`, a GEMM
with W transposed, runs 1.5 to 2.5 times slower than `x @ W_t` with W_t laid
out [in, out] (measured on this project's x86 CPU, torch 2.13: SmolLM2's MLP
projection at 8 rows 365 against 177 µs, at 15 rows 603 against 246 µs; one
row and bf16 the same either way). The vocabulary projection of 13 rows: 29
against 17 ms. A SmolLM2 verify pass of 13 tokens at 500 tokens of context
fell from 160 to 101 ms, one of 25 tokens from 140 to 120 ms; one token's
pass stays at about 51 ms. Speculation on a CPU lives on cheap draft tokens.
"""

import torch
from torch import nn


class TransposedLinear(nn.Module):
    """nn.Linear's computation with the weight kept as weight_t = W.T (contiguous)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], as nn.Linear's (a view): for model code that reads its shape or dtype."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight_t
        return out if self.bias is None else out + self.bias


def transpose_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear in `model` with a TransposedLinear; returns how many.
    An embedding tied to one (an output layer sharing the input embedding's
    weights) is re-pointed at the transposed weights, so they are not held twice;
    its lookups then gather strided rows, about 7 µs a token at SmolLM2's prefill."""
    embeddings = {id(module.weight): module for module in model.modules() if isinstance(module, nn.Embedding)}
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        replacement = TransposedLinear(child)
        setattr(parent, name, replacement)
        tied = embeddings.get(id(child.weight))
        if tied is not None:
            tied.weight = nn.Parameter(replacement.weight, requires_grad=False)
    return len(targets)


def gains_from_transposed_linears(device: torch.device, dtype: torch.dtype, tensor_parallel: bool) -> bool:
    """Only fp32 on a CPU gains; accelerators' GEMMs handle either layout, and
    tensor parallelism shards nn.Linear modules by their type."""
    return device.type == "cpu" and dtype == torch.float32 and not tensor_parallel
