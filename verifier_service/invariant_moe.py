"""Batch-invariant mixture-of-experts layers: a token's expert outputs do not depend on which other tokens its
pass routes to the same experts.

An expert multiplies the rows routed to it, and how many those are depends on the pass (one in a plain decode
step, several in a verify pass or a prompt chunk); a router multiplies all of the pass's rows. On x86 CPUs a bf16
product of fewer than a few rows can give a row other bits than one of more (row_padding.py), so a verify pass
could compute a token otherwise than the plain decode step it stands for, and bf16 speculation would not be
lossless.

transformers dispatches an experts module's forward through its experts interface
(`config._experts_implementation`), as it does attention. We register INVARIANT there: the eager loop over the
experts a pass hits, each expert's rows padded to the rows its weights need, each token's weighted expert outputs
summed in fp32 in the router's order. A router's rows are padded likewise. `make_moe_invariant` applies both and
checks each kind of MoE block at load: a row alone gets the bits it gets among others."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from verifier_service.row_padding import at_least_rows, fewest_rows, spread_values

INVARIANT = "speclane_invariant"
_CHECKED_ROWS = 33  # the load-time check's rows: alone, and in passes of 2, 5, 17 and all of them


def own_products(module: nn.Module) -> bool:
    """Whether `module` multiplies by weights of its own other than as nn.Linear or nn.Embedding do."""
    return (not isinstance(module, (nn.Linear, nn.Embedding))
            and any(param.dim() >= 2 for param in module.parameters(recurse=False)))


def is_experts(module: nn.Module) -> bool:
    """An experts module whose forward transformers dispatches (its weights stacked [experts, ...])."""
    down = getattr(module, "down_proj", None)
    return isinstance(down, nn.Parameter) and down.dim() == 3 and hasattr(module, "is_transposed")


def moe_blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module, list[nn.Module]]]:
    """(block, experts, routers) for each module holding an experts module; routers: its other children that
    multiply by weights of their own."""
    blocks = []
    for block in model.modules():
        children = list(block.children())
        experts = [child for child in children if is_experts(child)]
        if len(experts) == 1:
            blocks.append((block, experts[0], [child for child in children
                                               if child is not experts[0] and own_products(child)]))
    return blocks


def _product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
             min_rows: int) -> torch.Tensor:
    # Transposed layouts (GPT-OSS) store an expert's weight [in, out].
    return F.linear(at_least_rows(rows, min_rows), weight.t() if transposed else weight, bias)[:rows.shape[0]]


def invariant_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (hidden [tokens, hidden], the router's top-k experts and weights [tokens, k])
    with each expert's rows padded to `self.invariant_rows`."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    outputs = hidden_states.new_zeros(*top_k_index.shape, hidden_states.shape[-1], dtype=torch.float32)
    for expert in top_k_index.unique().tolist():
        if expert >= up.shape[0]:  # expert parallelism's placeholder for another rank's expert
            continue
        token, slot = torch.where(top_k_index == expert)
        h = _product(hidden_states[token], up[expert], None if up_bias is None else up_bias[expert],
                     self.is_transposed, self.invariant_rows)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _product(h, self.down_proj[expert], self.down_proj_bias[expert] if self.has_bias else None,
                     self.is_transposed, self.invariant_rows)
        if self.has_post_expert_norm:
            h = self.post_expert_norm(h)
        outputs[token, slot] = (h * top_k_weights[token, slot, None]).float()
    total = outputs[:, 0]
    for slot in range(1, outputs.shape[1]):  # in the router's order, whatever else the pass holds
        total = total + outputs[:, slot]
    return total.to(hidden_states.dtype)


def _experts_rows(experts: nn.Module) -> int | None:
    """The rows an expert's products need: the most fewest_rows finds for the first and last expert's weights."""
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    needed = []
    for weights in (up, experts.down_proj):
        for expert in {0, weights.shape[0] - 1}:
            weight = weights[expert].detach()
            needed.append(fewest_rows(weight.t() if experts.is_transposed else weight))
    return None if None in needed else max(needed)


def _pad_router(router: nn.Module, min_rows: int) -> None:
    """The router's rows padded to min_rows, its outputs cut back. The module itself stays (its weights' names,
    the attributes its block reads)."""
    forward = router.forward

    def padded(hidden_states: torch.Tensor, *args, **kwargs):
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = forward(at_least_rows(rows, min_rows), *args, **kwargs)
        count = rows.shape[0]
        return tuple(t[:count] for t in out) if isinstance(out, tuple) else out[:count]

    router.forward = padded


def _differs_by_pass(block: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether some row gets other bits from `block` alone than in a pass of more rows."""
    x = spread_values(torch.Generator().manual_seed(3), device, dtype, 1, _CHECKED_ROWS, hidden_size)

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = block(rows)
        return out[0] if isinstance(out, tuple) else out  # GPT-OSS's MLP returns its router's scores too

    with torch.inference_mode():
        alone = torch.cat([run(x[:, i:i + 1]) for i in range(_CHECKED_ROWS)], dim=1)
        return any(not torch.equal(run(x[:, :rows]), alone[:, :rows]) for rows in (2, 5, 17, _CHECKED_ROWS))


def make_moe_invariant(model: nn.Module) -> list[str]:
    """Makes the model's MoE blocks batch-invariant (their experts through INVARIANT, their routers' rows padded);
    returns the kinds of block it could not (a weight no padding makes invariant, or a row that still differs by
    pass at load), which then compute as before."""
    blocks = moe_blocks(model)
    if not blocks:
        return []
    ALL_EXPERTS_FUNCTIONS.register(INVARIANT, invariant_experts_forward)
    before = [experts.config._experts_implementation for _, experts, _ in blocks]
    failed, checked = set(), set()
    for block, experts, routers in blocks:
        experts_rows = _experts_rows(experts)
        weights = [[param for param in router.parameters(recurse=False) if param.dim() >= 2] for router in routers]
        routers_rows = [fewest_rows(found[0].detach()) if len(found) == 1 else None for found in weights]
        if experts_rows is None or None in routers_rows:
            failed.add(type(block).__name__)
            continue
        experts.invariant_rows = experts_rows
        for router, rows in zip(routers, routers_rows, strict=True):
            _pad_router(router, rows)
        experts.config._experts_implementation = INVARIANT
        if type(block) not in checked:
            checked.add(type(block))
            hidden_size = (experts.down_proj.shape[1] if not experts.is_transposed else experts.down_proj.shape[2])
            if _differs_by_pass(block, hidden_size, experts.down_proj.dtype, experts.down_proj.device):
                failed.add(type(block).__name__)
    if failed:
        for (_, experts, routers), implementation in zip(blocks, before, strict=True):
            experts.config._experts_implementation = implementation
            for router in routers:
                router.__dict__.pop("forward", None)
    return sorted(failed)
