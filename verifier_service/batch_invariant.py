"""Batch-invariant attention and linear layers: a token's values do not depend
on what else its pass computes (other sequences, its own draft tree, how long
a prompt chunk is).

Speculation is lossless only if a verify pass computes each token as a plain
decode step would. In fp32 the kernels differ in the last bits, far below a
greedy choice; in bf16 by enough to flip one: a bf16 target changed 16 of 20
greedy outputs under speculation. Measured on x86 CPUs with torch 2.13
(oneDNN): a bf16 product gives each row the same bits whatever the number of
rows once there are a few (fewer take other kernel paths; on CPUs with AMX
not for every shape, so there our own kernel takes the linear layers,
amx_linear.py), and each element the same bits whatever the number of
columns; an fp32 softmax gives a row's values the same bits whatever -inf
entries follow them. SDPA does not, so attention is written here in those
operations. Whether they hold on a platform is checked when the model loads
(`holds_on`, `fewest_rows`)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verifier_service.amx_linear import AmxGatedMlp, AmxLinear, amx_ready
from verifier_service.bf16_linear import StreamedLinear, bf16_linear_ready, fits
from verifier_service.cpu_linear import replace_linears
from verifier_service.invariant_moe import make_moe_invariant, moe_blocks, own_products
from verifier_service.row_padding import at_least_rows, fewest_rows, spread_values
from verifier_service.tree import ancestors


@dataclass(frozen=True)
class KeyOrder:
    """Per query of a segment, the new keys it attends, in the order a plain
    decode holds them (the pending tokens causally, then its tree path), and
    the keys it does not attend after them: `columns` [n, n] (a permutation
    per row) and `attends` [n, n] (True for the first ones of each row)."""

    columns: torch.Tensor
    attends: torch.Tensor
    is_tree: bool


def key_order(num_pending: int, parents: tuple[int, ...], device) -> KeyOrder:
    if not parents:  # every query's keys are in sequence order already
        causal = torch.ones(num_pending, num_pending, dtype=torch.bool).tril()
        return KeyOrder(torch.arange(num_pending).expand(num_pending, -1).to(device), causal.to(device), False)
    n = num_pending + len(parents)
    rows = ([list(range(i + 1)) for i in range(num_pending)]
            + [list(range(num_pending)) + [num_pending + a for a in path] for path in ancestors(parents)])
    columns = [row + sorted(set(range(n)) - set(row)) for row in rows]
    attends = torch.arange(n)[None, :] < torch.tensor([len(row) for row in rows])[:, None]
    return KeyOrder(torch.tensor(columns, device=device), attends.to(device), True)


# A prompt chunk's queries go this many at a time, so that their fp32 scores stay in the caches (a 500-token
# prefill took 0.5 s less so here). A query's values do not depend on the others.
_QUERY_CHUNK = 64
# Values are weighted in blocks of this many sequence positions, the blocks' products summed in fp32 one after
# another: a bf16 product sums neighbouring keys in pairs, so a tree path with its siblings' zeros between its
# keys would sum otherwise than the plain decode that holds the path's keys side by side.
KEY_BLOCK = 64
_MIN_ROWS = 2  # attention's products of fewer rows are padded
# Raised by the invariant attention backends at the first pass of such a layer (the start-up check's): a ValueError,
# so the verifier refuses to start with this line rather than failing on every request.
UNSUPPORTED = ("batch-invariant attention has no sliding window, softcapping or sinks: serve this model with "
               "--batch-invariant off (speculation may then change a greedy output) or --dtype float32")
_LOOP_ROWS = 64  # query rows (heads x tokens) from which the blocks' sum is a loop rather than a cumsum


def segment_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, order: KeyOrder,
                      scaling: float) -> torch.Tensor:
    """query [heads, n, d] for a segment's new tokens; keys [kv_heads,
    capacity, d] and values [kv_heads, capacity, d_v] (MLA's d_v differs) in
    sequence order (each head's rows contiguous), the new tokens' at
    start..start+n, the positions after them weighing 0; returns
    [heads, n, d_v]. Each query's scores are laid out by sequence position
    (its tree path moved to where a plain decode has it) with -inf after them,
    softmaxed in fp32, and weight the values laid out the same way."""
    heads, n, dim = query.shape
    if n > _QUERY_CHUNK and not order.is_tree:
        # A chunk attends the keys up to its last query, as a plain step there would: the keys after it
        # would only add -inf scores and zero-weighted values, at the cost of the whole context.
        return torch.cat([segment_attention(query[:, a:a + _QUERY_CHUNK],
                                            *_first(start + a + _QUERY_CHUNK, keys, values), start + a,
                                            KeyOrder(order.columns[a:a + _QUERY_CHUNK, a:a + _QUERY_CHUNK],
                                                     order.attends[a:a + _QUERY_CHUNK, a:a + _QUERY_CHUNK], False),
                                            scaling)
                          for a in range(0, n, _QUERY_CHUNK)], dim=1)
    kv_heads, capacity, _ = keys.shape
    group = heads // kv_heads
    grouped = query.reshape(kv_heads, group * n, dim)  # heads h = j * group + g share kv head j
    scores = (at_least_rows(grouped, _MIN_ROWS) @ keys.transpose(1, 2))[:, :group * n].float().mul_(scaling)
    scores = scores.view(kv_heads, group, n, capacity)
    new = scores[..., start:start + n]
    if order.is_tree:
        new.copy_(new.gather(-1, order.columns.expand(kv_heads, group, n, n)))
    if n > 1:
        new.masked_fill_(~order.attends, float("-inf"))
    scores[..., start + n:] = float("-inf")
    out = _weighted_values(torch.softmax(scores, dim=-1).to(values.dtype), values, start, order)
    return out.to(query.dtype).reshape(heads, n, values.shape[-1])


def _first(rows: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each [kv_heads, capacity, d] tensor's first rows, contiguous (the products would copy a view)."""
    return [t if rows >= t.shape[1] else t[:, :rows].contiguous() for t in tensors]


def _weighted_values(probs: torch.Tensor, values: torch.Tensor, start: int, order: KeyOrder) -> torch.Tensor:
    """probs [kv_heads, group, n, capacity], each query's keys in sequence order;
    returns the fp32 weighted sums [kv_heads, group, n, d], summed block by block."""
    kv_heads, group, n, capacity = probs.shape
    dim = values.shape[-1]
    length = -(-capacity // KEY_BLOCK) * KEY_BLOCK
    if length != capacity:  # zero probabilities over zero values
        probs, values = F.pad(probs, (0, length - capacity)), F.pad(values, (0, 0, 0, length - capacity))
    # Blocks before the one holding the new tokens are in sequence order for every query alike.
    shared = start // KEY_BLOCK * KEY_BLOCK if order.is_tree else length
    blocks = []
    if shared:
        weights = probs[..., :shared].reshape(kv_heads, group * n, shared // KEY_BLOCK, KEY_BLOCK).transpose(1, 2)
        products = at_least_rows(weights, _MIN_ROWS) @ values[:, :shared].view(kv_heads, -1, KEY_BLOCK, dim)
        blocks.append(products[..., :group * n, :].reshape(kv_heads, -1, group, n, dim))
    if order.is_tree:  # each query's own values from there: the cached ones, its path, then the rest
        rest = torch.arange(start + n, length, device=probs.device).expand(n, -1)
        index = torch.cat([torch.arange(shared, start, device=probs.device).expand(n, -1), start + order.columns,
                           rest], dim=1)
        own = values[:, index].view(kv_heads, n, -1, KEY_BLOCK, dim)
        weights = probs[..., shared:].transpose(1, 2).reshape(kv_heads, n, group, -1, KEY_BLOCK).transpose(2, 3)
        products = (at_least_rows(weights, _MIN_ROWS) @ own)[..., :group, :]
        blocks.append(products.permute(0, 2, 3, 1, 4))
    # Summed in sequence order; a plain step's store, longer or shorter, only adds zeros.
    return in_order_sum(torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0], group * n)


def in_order_sum(products: torch.Tensor, rows: int) -> torch.Tensor:
    """products [kv_heads, blocks, ...] summed over the blocks in order, accumulated in fp64 and rounded
    once to fp32. CPU cumsum computes exactly that (and every prefix sum, which costs most of a prompt
    chunk's attention); a loop of adds gives the same bits, and is faster once a block holds `rows` of a
    few dozen queries."""
    if rows < _LOOP_ROWS:
        return products.float().cumsum(dim=1)[:, -1]
    total = products[:, 0].double()
    for block in range(1, products.shape[1]):
        total += products[:, block]
    return total.float()


class PaddedLinear(nn.Module):
    """nn.Linear's computation with inputs of fewer than `min_rows` rows padded."""

    def __init__(self, linear: nn.Linear, min_rows: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows_product(x.reshape(-1, self.in_features), self.bias).reshape(*x.shape[:-1],
                                                                                      self.out_features)

    def rows_product(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(at_least_rows(rows, self.min_rows), self.weight, bias)[:rows.shape[0]]


def make_linears_invariant(model: nn.Module) -> bool:
    """Makes each nn.Linear's rows batch-invariant: on a CPU with AMX, a bf16
    layer computes through our AMX kernel, whose sums have one order for any
    rows (amx_linear.py), a SwiGLU MLP's gate and up projections in one
    product; on a CPU with AVX512-BF16, through our kernel likewise
    (bf16_linear.py); elsewhere its inputs are padded to the rows its weight's
    shape needs (the most fewest_rows finds for any layer of that shape:
    whether a kernel path shows depends on the weights too). Our kernels keep
    only their packed copy of a weight, but the output layer's. False,
    changing nothing, where some layer has no such padding."""
    amx, streamed = amx_ready(), bf16_linear_ready()
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def by_amx(linear: nn.Linear) -> bool:
        return amx and linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu"

    def by_kernel(linear: nn.Linear) -> bool:
        return by_amx(linear) or (streamed and fits(linear))

    paddings: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if type(module) is nn.Linear and not by_kernel(module):
            shape, needed = tuple(module.weight.shape), fewest_rows(module.weight.detach())
            if needed is None:
                return False
            paddings[shape] = max(paddings.get(shape, 0), needed)
    mlps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if AmxGatedMlp.fuses(child) and by_amx(child.gate_proj)]
    for parent, name, child in mlps:
        setattr(parent, name, AmxGatedMlp(child))

    def invariant(linear: nn.Linear) -> nn.Module:
        if by_amx(linear):
            return AmxLinear(linear, keep_weight=linear is output)
        if by_kernel(linear):
            return StreamedLinear(linear, keep_weight=linear is output)
        return PaddedLinear(linear, paddings[tuple(linear.weight.shape)])

    replace_linears(model, invariant)
    return True


def make_invariant(mode: str, model: nn.Module, device: torch.device, dtype: torch.dtype, tensor_parallel: bool,
                   sizes: tuple[int, int, int], kernel: bool = False) -> bool:
    """Applies --batch-invariant's mode to a loaded model (its linear layers
    and MoE blocks made invariant where the checks pass); returns whether its
    passes are. kernel: the CPU's invariant attention kernel attends this model
    (attention/cpu_invariant.py), so only the torch operators' attention needs
    the start-up check. fp32 is left as it is under auto (its kernels'
    differences stay below a greedy choice); tensor parallelism shards
    nn.Linear by type and reduces across ranks, so it is not covered."""
    if mode == "off" or (mode == "auto" and (dtype == torch.float32 or tensor_parallel)):
        return False
    uncovered = uncovered_products(model)
    reason = (" under tensor parallelism" if tensor_parallel
              else f" in {', '.join(uncovered)}, whose products are not linear layers" if uncovered
              else " (start-up check)")
    holds = (not tensor_parallel and not uncovered and (kernel or holds_on(device, dtype, sizes))
             and make_linears_invariant(model))
    if holds and (blocks := make_moe_invariant(model)):
        holds, reason = False, f" in {', '.join(blocks)}, whose experts' or router's rows no padding makes invariant"
    if mode == "on" and not holds:
        raise ValueError(f"--batch-invariant on: this platform's {str(dtype).removeprefix('torch.')} kernels on "
                         f"{device.type} are not batch-invariant{reason}")
    return holds


def uncovered_products(model: nn.Module) -> list[str]:
    """The kinds of module that multiply by weights of their own other than through nn.Linear and outside the MoE
    blocks invariant_moe.py covers (a gated DeltaNet's convolution, experts without a block of their own): the mode
    does not make their rows batch-invariant."""
    covered = {id(module) for _, experts, routers in moe_blocks(model) for module in (experts, *routers)}
    return sorted({type(module).__name__ for module in model.modules()
                   if own_products(module) and id(module) not in covered})


def holds_on(device: torch.device, dtype: torch.dtype, sizes: tuple[int, int, int]) -> bool:
    """Whether this platform's kernels give the invariance the module relies on,
    tried on random data of the model's sizes (heads, kv heads, head dim): a
    tree's attention against each node's plain decode. (Products with the
    weights are checked per shape by fewest_rows.)"""
    heads, kv_heads, dim = sizes
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return spread_values(generator, device, dtype, *shape)

    parents = (-1, -1, -1, -1, 1, 1, 1, 1, 6, 6, 6, 6, 8, 8, 8, 8)  # each path among its siblings
    n, capacity = 1 + len(parents), 128
    query, keys, values = rand(heads, n, dim), rand(kv_heads, capacity, dim), rand(kv_heads, capacity, dim)
    return not differing_from_plain_decode(query, keys, values, 100, key_order(1, parents, device))


def differing_from_plain_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                                order: KeyOrder) -> list[int]:
    """The queries of a segment (segment_attention's arguments) whose values
    differ from a plain decode step's, each over a store of just its own keys."""
    dim = query.shape[-1]
    with torch.inference_mode():
        out = segment_attention(query, keys, values, start, order, dim ** -0.5)
        differing = []
        for i in range(query.shape[1]):
            attended = order.columns[i, :int(order.attends[i].sum())] + start
            index = torch.cat([torch.arange(start, device=keys.device), attended])
            # Another capacity too: a plain step's store is seldom as long as the verify pass's.
            plain_keys, plain_values = (torch.cat([t[:, index], torch.zeros_like(t[:, :i + 1])], dim=1)
                                        for t in (keys, values))
            plain = segment_attention(query[:, i:i + 1], plain_keys, plain_values, len(index) - 1,
                                      key_order(1, (), keys.device), dim ** -0.5)
            if not torch.equal(plain[:, 0], out[:, i]):
                differing.append(i)
    return differing
