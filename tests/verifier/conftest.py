"""Tiny random Llama models saved as Hugging Face directories: every forward
takes about a millisecond, enough to test cache handling and acceptance."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner

torch.set_num_threads(1)

VOCAB = 64
MAX_CONTEXT = 128
CONFIG_EOS = 2
GENERATION_EOS = (2, 3)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_CONTEXT,
        # Wider weights than the default 0.02 make next-token distributions peaked,
        # like a trained model's, so drafts are sometimes accepted when sampling.
        initializer_range=0.5, bos_token_id=1, eos_token_id=CONFIG_EOS,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = list(GENERATION_EOS)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(tiny_model_dir, "cpu", torch.float32)


@pytest.fixture
def engine(runner) -> Engine:
    return Engine(runner)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    """An independent copy of the model, for transformers' own generate()."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
