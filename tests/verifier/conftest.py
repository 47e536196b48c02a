"""Tiny random Llama models saved as Hugging Face directories: every forward
takes about a millisecond, enough to test cache handling and acceptance."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from verifier_service.batch_invariant import spread_values
from verifier_service.block_manager import BlockManager
from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner
from verifier_service.scheduler import BatchLimits

torch.set_num_threads(1)

VOCAB = 64
MAX_CONTEXT = 128
CONFIG_EOS = 2
GENERATION_EOS = (2, 3)
BLOCK = 16


def save_tiny_llama(path, max_context: int = MAX_CONTEXT) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
        # Wider weights than the default 0.02 make next-token distributions peaked,
        # like a trained model's, so drafts are sometimes accepted when sampling.
        initializer_range=0.5, bos_token_id=1, eos_token_id=CONFIG_EOS,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = list(GENERATION_EOS)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(tiny_model_dir, "cpu", torch.float32)


def make_engine(runner, max_kv_tokens: int = 4096, limits: BatchLimits = BatchLimits(),
                prefix_caching: bool = False, on_step=None) -> Engine:
    """An engine with fresh KV blocks (the runner, its weights and cache memory are shared)."""
    return Engine(runner, BlockManager(max_kv_tokens // BLOCK, BLOCK, prefix_caching), limits, on_step=on_step)


@pytest.fixture
def engine(runner) -> Engine:
    return make_engine(runner)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    """An independent copy of the model, for transformers' own generate()."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def sequence_kv(runner, seq, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values [kv_heads, num_cached, dim] the cache holds for a sequence, through its block table."""
    slots = torch.tensor([seq.blocks.slot(i, runner.cache.block_size) for i in range(seq.num_cached)])
    return tuple(t[slots].transpose(0, 1) for t in (runner.cache.keys[layer], runner.cache.values[layer]))


def spread_bf16_layer(out: int, inputs: int, seed: int, bias: bool = False) -> nn.Linear:
    """A bf16 nn.Linear of values whose sums round differently in every order: a kernel that sums in another order
    than its reference shows in the rounded output."""
    linear = nn.Linear(inputs, out, bias=bias).bfloat16()
    generator = torch.Generator().manual_seed(seed)
    linear.weight.data = spread_values(generator, torch.device("cpu"), torch.bfloat16, out, inputs)
    if bias:
        linear.bias.data = spread_values(generator, torch.device("cpu"), torch.bfloat16, out)
    return linear
