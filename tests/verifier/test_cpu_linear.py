import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from verifier_service.cpu_linear import TransposedLinear, gains_from_transposed_linears, transpose_linears


def test_a_transposed_linear_computes_what_the_linear_did():
    torch.manual_seed(0)
    linear = nn.Linear(8, 5)
    x = torch.randn(3, 4, 8)
    expected = linear(x)
    transposed = TransposedLinear(linear)
    assert transposed.weight_t.is_contiguous() and transposed.weight_t.shape == (8, 5)
    assert transposed.weight.shape == (5, 8)
    torch.testing.assert_close(transposed(x), expected)


def test_every_linear_of_a_tied_model_is_replaced_and_the_embedding_shares_the_transposed_weights():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.inference_mode():
        expected = model(ids).logits
    assert transpose_linears(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the output layer
    assert not any(type(module) is nn.Linear for module in model.modules())
    output = model.get_output_embeddings()
    assert model.get_input_embeddings().weight.data_ptr() == output.weight_t.data_ptr()  # not held twice
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected)


def test_only_fp32_on_a_cpu_without_tensor_parallelism_uses_them():
    cpu = torch.device("cpu")
    assert gains_from_transposed_linears(cpu, torch.float32, tensor_parallel=False)
    assert not gains_from_transposed_linears(cpu, torch.bfloat16, tensor_parallel=False)
    assert not gains_from_transposed_linears(cpu, torch.float32, tensor_parallel=True)
    assert not gains_from_transposed_linears(torch.device("cuda"), torch.float32, tensor_parallel=False)


def test_the_runner_serves_fp32_on_a_cpu_with_transposed_linears(runner):
    assert not any(type(module) is nn.Linear for module in runner.model.modules())
    assert any(isinstance(module, TransposedLinear) for module in runner.model.modules())
