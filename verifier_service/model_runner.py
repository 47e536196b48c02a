"""The target model: Hugging Face weights and layers, run over ragged batches
with our attention (attention/) over a paged KV cache (kv_cache.py). Under
tensor parallelism every rank holds one; rank 0 broadcasts each message
(a cache to allocate, a plan to run) first."""

import os
import pathlib
import time
from dataclasses import dataclass

import structlog
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from verifier_service.attention import ATTENTION_NAME, PassContext, chosen_backend, cpu_invariant, select_backend
from verifier_service.attention import register as register_attention
from verifier_service.attention.ascend import unsupported as ascend_unsupported
from verifier_service.attention.mla import is_mla, latent_geometry, serve_latent
from verifier_service.batch import StepPlan, pass_inputs
from verifier_service.batch_invariant import make_invariant
from verifier_service.cpu_linear import add_measured_linears, layout_bytes, measures_linear_ways
from verifier_service.device import release_freed_memory
from verifier_service.distributed import TensorParallel
from verifier_service.fused_layer import fuse_decoder_layers, fuses_layers
from verifier_service.graphs import PassGraphs
from verifier_service.kv_cache import KVGeometry, PagedKVCache
from verifier_service.layer_kernels import device_kernels
from verifier_service.linear_attention import LinearStates, is_linear_attention
from verifier_service.quantization import quantizer_missing, unsupported_checkpoint
from verifier_service.rms_norm import fuse_rms_norms

log = structlog.get_logger()


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def kv_geometry(text_config, tp_size: int = 1) -> KVGeometry:
    """One token's KV on one rank, from a decoder config. MLA (DeepSeek-V3,
    Kimi-K2) keeps its latent (attention/mla.py)."""
    heads = text_config.num_attention_heads
    layers = text_config.num_hidden_layers
    if getattr(text_config, "kv_lora_rank", None):
        return latent_geometry(text_config)
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    kinds = getattr(text_config, "layer_types", None) or ()
    return KVGeometry(layers, kv_heads // tp_size, head_dim, head_dim,
                      frozenset(i for i, kind in enumerate(kinds[:layers]) if kind == LINEAR_ATTENTION))


# Layer kinds other than attention keep a state: the engine keeps and rolls back the gated delta rule's
# (linear_attention.py) for the models whose linear layers are gated DeltaNets; the rest are refused by name.
_STATEFUL_LAYERS = ("linear_attention", "mamba", "conv", "recurrent")
LINEAR_ATTENTION = "linear_attention"
_GATED_DELTANET_MODELS = ("qwen3_next", "qwen3_5_text")


def unsupported(text_config, tp_size: int = 1, device_type: str = "cpu") -> str | None:
    """Why the engine cannot serve this decoder correctly (on this kind of device), in one line, or None."""
    name = getattr(text_config, "model_type", "this model")
    problem = ascend_unsupported(text_config) if device_type == "npu" else None
    if problem:
        return problem
    kinds = set(getattr(text_config, "layer_types", None) or ())
    if name in _GATED_DELTANET_MODELS:
        if tp_size > 1 and LINEAR_ATTENTION in kinds:
            return f"{name}: linear-attention layers are not split across tensor-parallel ranks yet; serve it at TP 1"
        kinds.discard(LINEAR_ATTENTION)
    stateful = sorted(kind for kind in kinds if any(word in kind for word in _STATEFUL_LAYERS))
    if stateful:
        return (f"{name}: layers of type {', '.join(stateful)} keep a recurrent state that the engine does not "
                "keep or roll back yet; only attention and gated-DeltaNet layers are served")
    if getattr(text_config, "attention_chunk_size", None):
        return f"{name}: chunked local attention (attention_chunk_size) is not supported"
    if not getattr(text_config, "is_decoder", True) or getattr(text_config, "is_encoder_decoder", False):
        return f"{name}: only decoder-only causal language models are served"
    return None


@dataclass(frozen=True)
class AllocateCache:
    """Every rank allocates its KV cache: the message rank 0 sends before the first plan."""

    num_blocks: int
    block_size: int
    num_state_slots: int = 0  # sequences whose linear-attention state is kept (models with linear attention)


@dataclass(frozen=True)
class ReferenceForward:
    """Every rank runs transformers' own forward over these token sequences (the start-up check's reference)."""

    sequences: tuple[tuple[int, ...], ...]


class UnsupportedModel(ValueError):
    """The engine cannot serve this architecture correctly (refused at start)."""


class ModelRunner:
    """Loads the model once and runs StepPlans."""

    def __init__(self, model_dir: str, device: str, dtype: torch.dtype, *, tp: TensorParallel | None = None,
                 max_model_len: int = 0, trust_remote_code: bool = False, batch_invariant: str = "auto",
                 tuning_dir: pathlib.Path | None = None, attention_backend: str = "auto",
                 cuda_graph_sizes: tuple[int, ...] = (), fuse: bool = True):
        """fuse: the layers' operators fused where the device has them (layer_kernels.py); False keeps
        transformers' layers and norms, for benchmarks to compare."""
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = tp
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        problem = (unsupported_checkpoint(model_dir, self.device.type)
                   or unsupported(config.get_text_config(), tp.world_size if tp is not None else 1, self.device.type))
        if problem:
            raise UnsupportedModel(problem)
        kwargs = {"dtype": dtype, "attn_implementation": register_attention(), "trust_remote_code": trust_remote_code}
        if tp is not None:
            kwargs["distributed_config"] = DistributedConfig(tp_size=tp.world_size)  # the model's own TP plan
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        except ImportError as missing:  # a quantizer's package (GPTQ, AWQ, bitsandbytes)
            if not getattr(config, "quantization_config", None):
                raise
            raise UnsupportedModel(quantizer_missing(config, missing)) from missing
        self.model = (model if tp is not None else model.to(self.device)).eval()
        kernels = device_kernels(self.device, dtype) if fuse else None
        if kernels is not None:
            fuse_rms_norms(self.model, kernels.rms_norm)
        # Before the products are measured: the fused ones are what passes multiply by.
        self.fused_layers = (fuse_decoder_layers(self.model, kernels)
                             if kernels is not None and fuses_layers(self.device, dtype) else 0)
        # A pass's rows multiply up to 4x faster in the way timed fastest for their count on a CPU (cpu_linear.py).
        self.linear_ways = (add_measured_linears(self.model, tuning_dir)
                            if measures_linear_ways(self.device, dtype, tp is not None) else None)
        text_config = self.model.config.get_text_config()
        self.tp_size = tp.world_size if tp is not None else 1
        self.geometry = kv_geometry(text_config, self.tp_size)
        g = self.geometry
        heads = text_config.num_attention_heads // self.tp_size
        attention_backend = chosen_backend(attention_backend, self.device.type, g.value_dim == 0, batch_invariant,
                                           g.key_dim)
        if attention_backend != "auto" and batch_invariant == "auto":
            batch_invariant = "off"  # a named backend attends as it does, not as invariant passes would
        kernel = cpu_invariant.attends(self.device, dtype, g.key_dim, latent=g.value_dim == 0)
        self.batch_invariant = make_invariant(batch_invariant, self.model, self.device, dtype, tp is not None,
                                              (heads, g.kv_heads, g.key_dim), kernel=kernel)
        if self.device.type == "cpu":
            release_freed_memory()
        try:
            self.backend = select_backend(self.device, dtype, self.batch_invariant, heads, g.kv_heads, g.key_dim,
                                          latent=g.value_dim == 0, choice=attention_backend)
        except ValueError as error:
            raise UnsupportedModel(str(error)) from error
        self.kv_bytes_per_token = g.bytes_per_token(dtype)
        self.cache: PagedKVCache | None = None  # allocated once the KV budget is known (allocate_cache)
        for module in self.model.modules():
            if is_mla(module):
                serve_latent(module, ATTENTION_NAME)
        self.linear_layers = {m.layer_idx: m for m in self.model.modules() if is_linear_attention(m)}
        for layer in self.linear_layers.values():
            _serve_linear_layer(layer)
        self.state_bytes_per_slot = LinearStates.bytes_per_slot(self.linear_layers, dtype)
        self.states: LinearStates | None = None  # allocated with the cache where the model has linear layers
        # Hidden states a draft head reads (indices into transformers' hidden_states); () when no head.
        self._feature_layers: tuple[int, ...] = ()
        # The output layer's width (it may pad the tokenizer's vocabulary); sharded under TP, gathered in logits.
        self.vocab_size: int = (text_config.vocab_size if tp is not None
                                else self.model.get_output_embeddings().weight.shape[0])
        self.max_context_len: int = min(text_config.max_position_embeddings, max_model_len or float("inf"))
        # Graphs on accelerators, for the backends that lay passes out for them (FlexAttention, Ascend's FIA). Under
        # tensor parallelism every rank captures and replays the same sizes in lockstep (capture_graphs), so the
        # collectives inside the graphs pair up.
        graphable = (self.device.type in ("cuda", "npu") and hasattr(self.backend, "graph_inputs")
                     and not self.linear_layers)
        self.graphs = (PassGraphs(self.padded_forward, self.backend, cuda_graph_sizes, self.max_context_len,
                                  self.device, self.vocab_size, dtype)
                       if cuda_graph_sizes and graphable else None)
        eos = _as_ids(self.model.generation_config.eos_token_id) + _as_ids(text_config.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        log.info("model_loaded", model=os.path.basename(os.path.normpath(model_dir)), device=str(self.device),
                 dtype=str(dtype).removeprefix("torch."), vocab_size=self.vocab_size,
                 max_context_len=self.max_context_len, eos_token_ids=list(self.eos_token_ids),
                 tensor_parallel_size=self.tp_size, rank=tp.rank if tp else 0,
                 weight_layout_bytes=layout_bytes(self.model), fused_layers=self.fused_layers,
                 batch_invariant=self.batch_invariant,
                 attention_backend=self.backend.name,
                 graph_sizes=[list(size) for size in self.graphs.sizes] if self.graphs else [])

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self._feature_layers

    @feature_layers.setter
    def feature_layers(self, layers: tuple[int, ...]) -> None:
        self._feature_layers = layers
        if self.graphs is not None:
            self.graphs.drop()  # their outputs were captured without these features

    def allocate_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        """(Re)allocates the KV cache (and linear-attention states) on every rank."""
        message = AllocateCache(num_blocks, block_size, num_state_slots)
        if self.tp is not None:
            self.tp.broadcast(message)
        self.handle(message)

    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs a plan (on every rank); returns logits [rows, vocab] in the
        model's dtype, in segment order (Segment.num_logit_rows each), and with
        a head the fp32 features [tokens, F] of every token fed (its layers
        concatenated). Callers widen the rows they compute with to fp32 (exact):
        a greedy step needs only each row's argmax, and a 16-sequence verify
        pass's fp32 copy of Qwen2.5's logits took 2 ms."""
        if self.tp is not None:
            self.tp.broadcast(plan)
        return self.run(plan)

    def reference(self, sequences: list[list[int]]) -> torch.Tensor:
        """fp32 logits [sequences, vocab] of each sequence's last token by transformers' own forward with eager
        attention over the whole sequence, no cache (on every rank)."""
        message = ReferenceForward(tuple(tuple(tokens) for tokens in sequences))
        if self.tp is not None:
            self.tp.broadcast(message)
        return self._reference(message)

    @torch.inference_mode()
    def _reference(self, message: ReferenceForward) -> torch.Tensor:
        served = self.model.config._attn_implementation
        self.model.set_attn_implementation("eager")
        try:
            return torch.stack([
                self.model(input_ids=torch.tensor([tokens], device=self.device), use_cache=False,
                           logits_to_keep=1).logits[0, -1].float()
                for tokens in message.sequences])
        finally:
            self.model.set_attn_implementation(served)

    def handle(self, message: StepPlan | AllocateCache | ReferenceForward) -> None:
        """A message from rank 0 (on a follower rank, every message)."""
        if isinstance(message, ReferenceForward):
            self._reference(message)
        elif isinstance(message, AllocateCache):
            self.cache = self.states = None  # the old memory goes first
            # With graphs, one block more: the scratch the padding rows of a captured pass write to. The graphs
            # over the old cache go first, with their memory.
            scratch = 0
            if self.graphs is not None:
                self.graphs.reset(message.block_size, message.num_blocks * message.block_size)
                scratch = 1
            self.cache = PagedKVCache(self.geometry, message.num_blocks + scratch, message.block_size, self.dtype,
                                      self.device, split=self.backend.split_kv)
            if self.linear_layers:
                self.states = LinearStates(self.linear_layers, max(message.num_state_slots, 1), self.dtype,
                                           self.device)
        else:
            self.run(message)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache, states = self.cache, self.states
        for move in plan.moves:
            cache.move(move)
        if states is not None:
            states.commit(plan.state_commits)
        if not plan.segments:
            return torch.empty(0, self.vocab_size, dtype=self.dtype), None
        size = self.graphs.size_for(plan) if self.graphs is not None else None
        if size is not None:
            return self.graphs.run(plan, size)
        inputs = pass_inputs(plan, self.device)
        linear = states.layout(plan.segments, inputs.offsets) if states is not None else None
        metadata = self.backend.prepare(plan.segments, inputs, cache.block_size, self.device)
        context = PassContext(cache, self.backend, metadata, states, linear)
        out = self.model(input_ids=inputs.input_ids, position_ids=inputs.positions, use_cache=False,
                         logits_to_keep=inputs.logit_rows, speclane_pass=context,
                         output_hidden_states=bool(self.feature_layers))
        return out.logits[0], self._features(out)

    def padded_forward(self, fields: dict[str, torch.Tensor], host: object,
                       tasks: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A captured pass (graphs.py): the model over padded fields on the device, logits of every row (in
        the model's dtype)."""
        context = PassContext(self.cache, self.backend,
                              self.backend.graph_metadata(fields, self.cache.block_size, host, tasks))
        out = self.model(input_ids=fields["input_ids"][None], position_ids=fields["positions"][None],
                         use_cache=False, logits_to_keep=0, speclane_pass=context,
                         output_hidden_states=bool(self.feature_layers))
        return out.logits[0], self._features(out)

    def capture_graphs(self) -> None:
        """Captures every size's graph now, largest first (the smaller ones reuse its memory in the pool), so no
        request waits for a capture or FlexAttention's compilation; without graphs, nothing."""
        if self.graphs is None:
            return
        started = time.perf_counter()
        try:
            for size in sorted(self.graphs.sizes, reverse=True):
                if -(-size.tokens // self.cache.block_size) < self.cache.num_blocks:  # else no such pass exists
                    self.execute(self.graphs.warm_up_plan(size))  # on every rank
        except RuntimeError as error:
            # A driver or runtime that cannot capture (vllm-ascend lists several CANN versions' errors) should cost
            # speed, not the service. Under tensor parallelism the ranks could not agree to go on eagerly.
            if self.tp is not None:
                raise
            log.warning("graphs_unavailable", device=self.device.type, reason=str(error).splitlines()[0][:300],
                        action="every pass runs eagerly, as with --enforce-eager")
            self.graphs = None
            return
        log.info("graphs_captured", device=self.device.type,
                 sizes=[list(size) for size in sorted(self.graphs.captured)],
                 seconds=round(time.perf_counter() - started, 1))

    def _features(self, out) -> torch.Tensor | None:
        if not self.feature_layers:
            return None
        return torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1).float()


def _serve_linear_layer(layer: torch.nn.Module) -> None:
    """Runs a linear-attention layer over the engine's states in our passes; transformers'
    own forward elsewhere (the start-up check's reference)."""
    original = layer.forward

    def forward(hidden_states, *args, **kwargs):
        context: PassContext | None = kwargs.get("speclane_pass")
        if context is None:
            return original(hidden_states, *args, **kwargs)
        return context.states.forward(layer, hidden_states, context.linear)

    layer.forward = forward
