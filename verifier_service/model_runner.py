"""The target model: a Hugging Face causal LM run one sequence at a time over
its own DynamicCache."""

import os
from collections.abc import Sequence

import structlog
import torch
from transformers import AutoModelForCausalLM, DynamicCache

log = structlog.get_logger()


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def crop_cache(cache: DynamicCache, keep: int) -> None:
    """Drops the cached positions from `keep` on (rejected draft tokens).

    transformers 5 `crop` takes a negative count of tokens to remove and
    raises on a positive one.
    """
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


class ModelRunner:
    """Loads the model once and runs single-sequence forward passes."""

    def __init__(self, model_dir: str, device: str, dtype: torch.dtype):
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        text_config = self.model.config.get_text_config()
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.max_context_len: int = text_config.max_position_embeddings
        eos = _as_ids(self.model.generation_config.eos_token_id) + _as_ids(text_config.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        log.info("model_loaded", model=os.path.basename(os.path.normpath(model_dir)), device=str(self.device),
                 dtype=str(dtype).removeprefix("torch."), vocab_size=self.vocab_size,
                 max_context_len=self.max_context_len, eos_token_ids=list(self.eos_token_ids))

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: Sequence[int], cache: DynamicCache, *, last_only: bool = False) -> torch.Tensor:
        """Appends `input_ids` to the sequence in `cache`; returns fp32 logits,
        one row per input token ([1, vocab] with `last_only`)."""
        ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        return out.logits[0].float()

    def warm_up(self) -> None:
        """One throwaway forward so the first request pays no lazy-init cost."""
        self.forward([0], self.new_cache())
