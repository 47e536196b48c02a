"""Weight-only int8 for a head's linear layers on a CPU. A head's draft steps
are one row each, so each step is bound by reading the head's weights, and
after a target pass has swept the caches those reads come from memory: int8
weights (one scale per output row) halve bf16's bytes. Activations stay bf16.
The head only proposes and the target verifies in its own dtype, so this
never changes the output; it can only change which tokens are drafted."""

import torch
from torch import nn

# torch's CPU kernel reads the input dimension in blocks of 16; other widths give wrong results or crash.
_BLOCK = 16


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight", torch.round(weight / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        out = torch._weight_int8pack_mm(rows, self.weight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def quantize_linears(module: nn.Module) -> int:
    """Replaces, in place, every nn.Linear whose input width the kernel takes
    with an Int8Linear; returns how many were replaced."""
    replaced = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.in_features % _BLOCK == 0:
            setattr(module, name, Int8Linear(child))
            replaced += 1
        else:
            replaced += quantize_linears(child)
    return replaced
