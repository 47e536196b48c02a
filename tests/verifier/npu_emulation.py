"""EMULATION, not the NPU: torch_npu's `npu_fused_infer_attention_score` (and
the layer operators `npu_rms_norm`, `npu_add_rms_norm`, `npu_swiglu`,
`npu_rotary_mul`; at the end, ACL graphs' task groups) in plain torch, as its documentation describes the
arguments speclane passes (the
paged, TND-layout form vllm-ascend calls). It checks those arguments as the
operator states it requires them (dtypes, shapes, the compressed causal mask
of sparse modes 3 and 4), so a test of verifier_service/attention/ascend.py on
a CPU tests the argument building; what the real kernel computes it cannot
vouch for.

Semantics emulated (one batch entry b at a time):
- query [T, heads, dim] packed; entry b's queries are rows
  actual_seq_lengths[b - 1] .. actual_seq_lengths[b] (cumulative ends);
- key/value [blocks, block_size, kv_heads x dim]; entry b's first
  actual_seq_lengths_kv[b] keys are the rows of its blocks block_table[b] in order;
- query heads h = j * (heads / kv_heads) + g attend kv head j;
- sparse_mode 3: causal, aligned to the bottom right (query i of n sees keys
  up to kv_len - n + i); 4: the same band cut to `pre_tokens` keys before the
  query and `next_tokens` after; 0: atten_mask [B or 1, 1, n, kv_len], True/1
  hides a key;
- returns (attention_out [T, heads, dim], softmax_lse).
"""

import contextlib

import torch

CAUSAL_MASK_SIZE = 2048
INT_MAX = 2147483647


def npu_fused_infer_attention_score(query, key, value, *, num_heads, num_key_value_heads, input_layout, scale,
                                    sparse_mode=0, atten_mask=None, pre_tokens=INT_MAX, next_tokens=INT_MAX,
                                    block_table=None, block_size=0, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None):
    assert input_layout == "TND" and query.dim() == 3 and query.shape[1] == num_heads
    assert block_table is not None and block_table.dtype == torch.int32 and block_table.dim() == 2
    assert key.dim() == 3 and key.shape == value.shape and key.shape[1] == block_size
    assert key.is_contiguous() and value.is_contiguous()
    batch = block_table.shape[0]
    assert len(actual_seq_lengths) == len(actual_seq_lengths_kv) == batch
    assert list(actual_seq_lengths) == sorted(actual_seq_lengths) and actual_seq_lengths[-1] == query.shape[0]
    if sparse_mode in (3, 4):
        expected = torch.triu(torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool), diagonal=1)
        assert atten_mask.shape == expected.shape and atten_mask.dtype == torch.int8
        assert torch.equal(atten_mask.bool().cpu(), expected)
    else:
        assert sparse_mode == 0 and atten_mask is not None and atten_mask.dtype == torch.bool
    dim = query.shape[2]
    group = num_heads // num_key_value_heads
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[0], num_heads, 1, dtype=torch.float32)
    first = 0
    for b in range(batch):
        end, context = actual_seq_lengths[b], actual_seq_lengths_kv[b]
        n = end - first
        blocks = block_table[b, :-(-context // block_size)].long()
        k = key[blocks].reshape(-1, num_key_value_heads, dim)[:context].repeat_interleave(group, dim=1)
        v = value[blocks].reshape(-1, num_key_value_heads, dim)[:context].repeat_interleave(group, dim=1)
        q = query[first:end]
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        query_at = torch.arange(n)[:, None] + context - n
        key_at = torch.arange(context)[None, :]
        if sparse_mode == 0:
            assert atten_mask.shape[-2:] == (n, context) and atten_mask.dim() == 4
            hidden = atten_mask[min(b, atten_mask.shape[0] - 1), 0].cpu()
        else:
            hidden = key_at > query_at
            if sparse_mode == 4:
                hidden |= (key_at < query_at - pre_tokens) | (key_at > query_at + next_tokens)
        scores = scores.masked_fill(hidden[None].to(scores.device), float("-inf"))
        lse[first:end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)[..., None]
        out[first:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v.float()).to(query.dtype)
        first = end
    return out, lse


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """x / rms(x) x gamma over the last dimension, in fp32, out in x's dtype; returns (y, rstd)."""
    assert gamma.shape == x.shape[-1:]
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """x = x1 + x2 in their dtype, then npu_rms_norm of x; returns (y, rstd, x)."""
    assert x1.shape == x2.shape and x1.dtype == x2.dtype == gamma.dtype
    x = x1 + x2
    y, rstd = npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x


def npu_swiglu(x, dim=-1):
    """silu(A) x B for the halves A, B of x along dim, in fp32, out in x's dtype; x must be contiguous."""
    assert x.is_contiguous() and x.shape[dim] % 2 == 0
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    """r1 x x + r2 x (x's halves swapped, the second negated), in fp32, out in x's dtype; x 4-D with an even last
    dimension under 896, r1 and r2 4-D and broadcast to it as the BSND layout allows (1S1D, BS1D or BSND)."""
    assert rotary_mode == "half" and x.dim() == r1.dim() == r2.dim() == 4 and r1.shape == r2.shape
    assert x.shape[-1] % 2 == 0 and x.shape[-1] < 896 and x.dtype == r1.dtype == r2.dtype
    batch, tokens, heads, dim = x.shape
    assert r1.shape in ((1, tokens, 1, dim), (batch, tokens, 1, dim), x.shape)
    x1, x2 = x.float().chunk(2, dim=-1)
    return (r1.float() * x.float() + r2.float() * torch.cat((-x2, x1), dim=-1)).to(x.dtype)


class _Handle:
    """A captured FIA task group: the lengths it was captured, or last updated, with."""

    lengths: tuple[list[int], list[int]]


class GraphOps:
    """EMULATION of what an ACL graph's attention calls (AscendAttention's graph_ops): FIA's out variant and
    workspace query, torch.npu's task groups and their updates, streams and external events. AclGraph below
    stands for torch.npu.NPUGraph: it runs the captured function again on replay, so the model's Python runs
    again; what differs from an eager pass is emulated where it matters: a captured FIA task computes with the
    sequence lengths it was captured or last updated with, whatever lengths the Python passes again, over the
    tensors as they are now (a graph holds tensors by address, host lists by value). Streams and events only
    order work on the device; here everything runs in program order."""

    class ExternalEvent:
        def wait(self, stream):
            pass

        def reset(self, stream):
            pass

        def record(self, stream):
            pass

    def __init__(self):
        self.capturing = self.replaying = None  # the AclGraph
        self.recording = self.updating = None  # the task group's handle
        self.updates = 0

    @staticmethod
    def current_stream():
        return "stream"

    @staticmethod
    def Stream():  # noqa: N802 - torch.npu's name
        return "update stream"

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def fia_workspace(**arguments):
        return torch.empty(1)

    def graph_task_group_begin(self, stream):
        if self.replaying is not None:
            self.recording = self.replaying.handles[self.replaying.cursor]
            self.replaying.cursor += 1
        else:
            assert self.capturing is not None, "a task group outside a graph's capture"
            self.recording = _Handle()

    def graph_task_group_end(self, stream):
        handle, self.recording = self.recording, None
        if self.replaying is None:
            self.capturing.handles.append(handle)
        return handle

    def graph_task_update_begin(self, stream, handle):
        self.updating = handle

    def graph_task_update_end(self, stream):
        self.updating = None
        self.updates += 1

    def fia_out(self, *, workspace, out, **arguments):
        lengths = (list(arguments["actual_seq_lengths"]), list(arguments["actual_seq_lengths_kv"]))
        if self.updating is not None:  # an update sets the task's lengths; nothing runs
            self.updating.lengths = lengths
            return
        handle = self.recording
        assert handle is not None, "FIA's out variant outside a task group"
        if self.replaying is None:
            handle.lengths = lengths
        query_ends, contexts = handle.lengths
        attended, _ = npu_fused_infer_attention_score(
            **{**arguments, "actual_seq_lengths": query_ends, "actual_seq_lengths_kv": contexts})
        out[0].copy_(attended)


class AclGraph:
    """EMULATION of torch.npu.NPUGraph as graphs.PassGraphs captures and replays it; `acl_graphs(ops)` is the
    factory PassGraphs takes."""

    def __init__(self, ops: GraphOps):
        self.ops, self.handles, self.cursor = ops, [], 0

    def capture(self, forward, warm_up):
        warm_up()  # eager: no task groups
        self.ops.capturing = self
        try:
            self.forward, self.outputs = forward, forward()
        finally:
            self.ops.capturing = None
        return self.outputs

    def replay(self):
        self.ops.replaying, self.cursor = self, 0
        try:
            outputs = self.forward()
        finally:
            self.ops.replaying = None
        assert self.cursor == len(self.handles)  # every captured task ran
        for captured, new in zip(self.outputs, outputs):
            if captured is not None:
                captured.copy_(new)


def acl_graphs(ops: GraphOps):
    def graph(pool):
        return AclGraph(ops)

    graph.new_pool = lambda: None
    return graph
