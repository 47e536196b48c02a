"""The target model: Hugging Face weights and layers, run over ragged batches
with our attention (attention.py) and KV store (kv_store.py). Under tensor
parallelism every rank holds one; rank 0's broadcasts each plan first."""

import os

import structlog
import torch
from transformers import AutoModelForCausalLM

from verifier_service.attention import register as register_attention
from verifier_service.batch import StepPlan, prepare
from verifier_service.batch_invariant import make_invariant
from verifier_service.cpu_linear import add_measured_linears, measures_linear_ways
from verifier_service.distributed import TensorParallel
from verifier_service.kv_store import KVStore

log = structlog.get_logger()


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def kv_geometry(text_config, tp_size: int = 1) -> tuple[int, int, int]:
    """(layers, kv heads on one rank, head dim) of a decoder config."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return text_config.num_hidden_layers, kv_heads // tp_size, head_dim


class ModelRunner:
    """Loads the model once and runs StepPlans."""

    def __init__(self, model_dir: str, device: str, dtype: torch.dtype, *, block_size: int = 64,
                 tp: TensorParallel | None = None, max_model_len: int = 0, trust_remote_code: bool = False,
                 batch_invariant: str = "auto"):
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = tp
        kwargs = {"dtype": dtype, "attn_implementation": register_attention(), "trust_remote_code": trust_remote_code}
        if tp is not None:
            kwargs["tp_plan"] = "auto"
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        self.model = (model if tp is not None else model.to(self.device)).eval()
        # A pass's rows multiply up to 4x faster in the way timed fastest for their count on a CPU (cpu_linear.py).
        layout_bytes = (add_measured_linears(self.model)
                        if measures_linear_ways(self.device, dtype, tp is not None) else 0)
        text_config = self.model.config.get_text_config()
        self.tp_size = tp.world_size if tp is not None else 1
        layers, kv_heads, head_dim = kv_geometry(text_config, self.tp_size)
        self.batch_invariant = make_invariant(batch_invariant, self.model, self.device, dtype, tp is not None,
                                              (text_config.num_attention_heads, kv_heads, head_dim))
        self.kv_bytes_per_token = 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        self.store = KVStore(layers, block_size)
        # Hidden states a draft head reads (indices into transformers' hidden_states); () when no head.
        self.feature_layers: tuple[int, ...] = ()
        # The output layer's width (it may pad the tokenizer's vocabulary); sharded under TP, gathered in logits.
        self.vocab_size: int = (text_config.vocab_size if tp is not None
                                else self.model.get_output_embeddings().weight.shape[0])
        self.max_context_len: int = min(text_config.max_position_embeddings, max_model_len or float("inf"))
        eos = _as_ids(self.model.generation_config.eos_token_id) + _as_ids(text_config.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        log.info("model_loaded", model=os.path.basename(os.path.normpath(model_dir)), device=str(self.device),
                 dtype=str(dtype).removeprefix("torch."), vocab_size=self.vocab_size,
                 max_context_len=self.max_context_len, eos_token_ids=list(self.eos_token_ids),
                 tensor_parallel_size=self.tp_size, rank=tp.rank if tp else 0, weight_layout_bytes=layout_bytes,
                 batch_invariant=self.batch_invariant)

    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs a plan (on every rank); returns fp32 logits [rows, vocab] in
        segment order (Segment.num_logit_rows each), and with a head the fp32
        features [tokens, F] of every token fed (its layers concatenated)."""
        if self.tp is not None:
            self.tp.broadcast(plan)
        return self.run(plan)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        for op in plan.ops:
            self.store.apply(op)
        if not plan.segments:
            return torch.empty(0, self.vocab_size), None
        ids, positions, rows, batch = prepare(plan, self.store, self.device, self.batch_invariant)
        out = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=rows,
                         speclane_batch=batch, output_hidden_states=bool(self.feature_layers))
        features = None
        if self.feature_layers:
            features = torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1).float()
        return out.logits[0].float(), features
