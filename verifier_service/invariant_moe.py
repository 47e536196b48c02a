"""Batch-invariant mixture-of-experts layers: a token's expert outputs do not depend on which other tokens its
pass routes to the same experts.

An expert multiplies the rows routed to it, and how many those are depends on the pass (one in a plain decode
step, several in a verify pass or a prompt chunk); a router multiplies all of the pass's rows. On x86 CPUs a bf16
product of fewer than a few rows can give a row other bits than one of more (row_padding.py), so a verify pass
could compute a token otherwise than the plain decode step it stands for, and bf16 speculation would not be
lossless.

transformers dispatches an experts module's forward through its experts interface
(`config._experts_implementation`), as it does attention. We register INVARIANT there: the eager loop over the
experts a pass hits, each expert's products through the bf16 kernel of AVX512-BF16 hosts (one order of sums for any
rows, the weights kept only packed: PackedExperts) or else through oneDNN with its rows padded to the rows its
weights need (PaddedExperts), each token's weighted expert outputs summed in fp32 in the router's order. A router's
rows are padded likewise. `make_moe_invariant` applies both and checks each kind of MoE block at load: a row alone
gets the bits it gets among others."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from verifier_service.bf16_linear import LANES, bf16_linear_ready, fits_weight, pack, product, unpack
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


class PaddedExperts:
    """Each expert's products through oneDNN, its rows padded to `rows` (the most any of its weights needs)."""

    def __init__(self, rows: int):
        self.rows = rows

    def __call__(self, experts: nn.Module, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(experts, f"{name}_bias")[expert] if experts.has_bias else None
        return F.linear(at_least_rows(x, self.rows), _stacked(experts, name)[expert], bias)[:x.shape[0]]


class PackedExperts:
    """Each expert's products through the bf16 kernel of AVX512-BF16 hosts (bf16_linear.py), whose sums have one
    order for any rows: no padding, the weights read at the memory's speed. The experts' stacked weights live
    only packed, here."""

    def __init__(self, experts: nn.Module, names: tuple[str, ...]):
        self.packed = {}
        for name in names:
            self.packed[name] = pack(_stacked(experts, name))
            setattr(experts, name, None)

    @staticmethod
    def fit(experts: nn.Module, names: tuple[str, ...]) -> bool:
        """Whether this host runs the kernel and takes every expert weight."""
        return bf16_linear_ready() and all(fits_weight(_stacked(experts, name)) for name in names)

    def restore(self, experts: nn.Module) -> None:
        """The stacked weights back as they were (a block that failed its check computes as before)."""
        for name, packed in self.packed.items():
            stacked = unpack(packed)
            setattr(experts, name, nn.Parameter(stacked.transpose(1, 2).contiguous() if experts.is_transposed
                                                else stacked, requires_grad=False))

    def __call__(self, experts: nn.Module, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed[name][expert]
        bias = getattr(experts, f"{name}_bias")[expert] if experts.has_bias else None
        return product(x.contiguous(), packed, None if bias is None else bias.contiguous(), packed.shape[0] * LANES)


def _names(experts: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")


def _stacked(experts: nn.Module, name: str) -> torch.Tensor:
    """The experts' weights `name` as [experts, out, in] (transposed layouts, GPT-OSS's, store [in, out])."""
    weight = getattr(experts, name).detach()
    return weight.transpose(1, 2) if experts.is_transposed else weight


def invariant_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (hidden [tokens, hidden], the router's top-k experts and weights [tokens, k])
    with each expert's products in `self.invariant_products` (PaddedExperts or PackedExperts)."""
    up, down = _names(self)
    products = self.invariant_products
    outputs = hidden_states.new_zeros(*top_k_index.shape, hidden_states.shape[-1], dtype=torch.float32)
    for expert in top_k_index.unique().tolist():
        if expert >= self.num_experts:  # expert parallelism's placeholder for another rank's expert
            continue
        token, slot = torch.where(top_k_index == expert)
        h = products(self, up, expert, hidden_states[token])
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = products(self, down, expert, h)
        if self.has_post_expert_norm:
            h = self.post_expert_norm(h)
        outputs[token, slot] = (h * top_k_weights[token, slot, None]).float()
    total = outputs[:, 0]
    for slot in range(1, outputs.shape[1]):  # in the router's order, whatever else the pass holds
        total = total + outputs[:, slot]
    return total.to(hidden_states.dtype)


def _experts_products(experts: nn.Module) -> PaddedExperts | PackedExperts | None:
    """The bf16 kernel's products where the experts' weights fit it; else oneDNN's, padded to the most rows
    fewest_rows finds for the first and last expert's weights; None where no padding does."""
    names = _names(experts)
    if PackedExperts.fit(experts, names):
        return PackedExperts(experts, names)
    needed = [fewest_rows(weights[expert]) for weights in (_stacked(experts, name) for name in names)
              for expert in {0, weights.shape[0] - 1}]
    return None if None in needed else PaddedExperts(max(needed))


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
        down = _stacked(experts, "down_proj")  # [experts, hidden, intermediate]
        hidden_size, dtype, device = down.shape[1], down.dtype, down.device
        weights = [[param for param in router.parameters(recurse=False) if param.dim() >= 2] for router in routers]
        routers_rows = [fewest_rows(found[0].detach()) if len(found) == 1 else None for found in weights]
        products = None if None in routers_rows else _experts_products(experts)
        if products is None:
            failed.add(type(block).__name__)
            continue
        experts.invariant_products = products
        for router, rows in zip(routers, routers_rows, strict=True):
            _pad_router(router, rows)
        experts.config._experts_implementation = INVARIANT
        if type(block) not in checked:
            checked.add(type(block))
            if _differs_by_pass(block, hidden_size, dtype, device):
                failed.add(type(block).__name__)
    if failed:
        for (_, experts, routers), implementation in zip(blocks, before, strict=True):
            experts.config._experts_implementation = implementation
            products = experts.__dict__.pop("invariant_products", None)
            if isinstance(products, PackedExperts):
                products.restore(experts)
            for router in routers:
                router.__dict__.pop("forward", None)
    return sorted(failed)
