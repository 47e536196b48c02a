"""The MTP layers of DeepSeek-V3 and GLM-4.5 (`model.layers.N.*`: MoE, and
MLA in DeepSeek's) and of Qwen3-Next (`mtp.*`: gated attention and MoE), at
tiny sizes with their real tensor names (per-expert, as their checkpoints and
transformers' save write them): only the MTP tensors are read, the block runs
as transformers' own layer of the target's architecture would over the same
sequence, and greedy speculation with the head decodes what plain decoding
does."""

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.heads_support import count_tensor_reads
from tests.verifier.architectures import save_tiny
from tests.verifier.conftest import make_engine
from verifier_service.heads.checkpoint import build_head, read_head
from verifier_service.heads.layer import HeadKV
from verifier_service.heads.loading import load_head
from verifier_service.heads.native_layer import run_native_layer
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, GenerationParams

MODELS = ["deepseek_v3", "glm4_moe", "qwen3_next"]
SOURCE = "model.layers.1."  # the tiny targets' layer 1: MoE, and full attention in Qwen3-Next
PROMPT = [5, 9, 11, 20, 7, 30, 41, 12]


def add_real_mtp_layer(target: pathlib.Path, model_type: str) -> str:
    """Appends an MTP layer named as the architecture's checkpoints name it (its block a copy of layer 1's
    tensors); returns the prefix of its names."""
    path = target / "model.safetensors"
    tensors = load_file(path)
    config = json.loads((target / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(3)

    def norm() -> torch.Tensor:  # Qwen3-Next's norms scale by (1 + weight)
        return torch.randn(hidden, generator=generator) * 0.1 + (0 if model_type == "qwen3_next" else 1)

    fc = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
    block = {key[len(SOURCE):]: value.clone() for key, value in tensors.items() if key.startswith(SOURCE)}
    if model_type == "qwen3_next":
        prefix = "mtp."
        mtp = {"fc.weight": fc, "pre_fc_norm_embedding.weight": norm(), "pre_fc_norm_hidden.weight": norm(),
               "norm.weight": norm(), **{"layers.0." + key: value for key, value in block.items()}}
    else:
        prefix = f"model.layers.{config['num_hidden_layers']}."
        mtp = {"enorm.weight": norm(), "hnorm.weight": norm(), "eh_proj.weight": fc, "shared_head.norm.weight": norm(),
               "shared_head.head.weight": torch.randn(vocab, hidden, generator=generator) * 0.2,
               "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(), **block}
    tensors.update({prefix + key: value.contiguous() for key, value in mtp.items()})
    save_file(tensors, path, metadata={"format": "pt"})
    return prefix


@pytest.fixture(scope="module", params=MODELS)
def target(request, tmp_path_factory) -> tuple[pathlib.Path, str, str]:
    path = pathlib.Path(save_tiny(request.param, tmp_path_factory.mktemp(request.param)))
    return path, request.param, add_real_mtp_layer(path, request.param)


def test_only_the_mtp_layer_is_read_and_its_block_is_the_architectures_own(target, monkeypatch):
    path, model_type, prefix = target
    config = json.loads((path / "config.json").read_text())
    read = count_tensor_reads(monkeypatch)
    checkpoint = read_head(path, "mtp", config)
    assert read and all(name.startswith(prefix) for name in read)
    assert checkpoint.native_config is not None
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    embed = reference.get_input_embeddings().weight
    head = build_head(checkpoint, embed, reference.get_output_embeddings().weight)
    assert type(head.layer) is type(reference.model.layers[1])

    # Seven rows attended by transformers' layer at once (eager, causal) and by the head's layer over its
    # own KV in two steps, as drafting feeds it.
    torch.manual_seed(0)
    x, positions = torch.randn(7, config["hidden_size"]), torch.arange(7)
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = reference.model.layers[1](x[None], attention_mask=causal, position_ids=positions[None],
                                             position_embeddings=reference.model.rotary_emb(x[None],
                                                                                            positions[None]))[0]
        kv = HeadKV()
        got = torch.cat([run_native_layer(head.layer, head.rotary, x[rows], positions[rows], kv, None)
                         for rows in (slice(0, 4), slice(4, 7))])
    assert torch.allclose(got, expected, atol=1e-5)


def test_greedy_speculation_with_the_mtp_head_decodes_what_plain_decoding_does(target):
    path, _, _ = target
    runner = ModelRunner(str(path), "cpu", torch.float32)
    engine = make_engine(runner)
    engine.head = load_head("deepseek_mtp", "", runner)
    runner.feature_layers = engine.head.head.feature_layers

    def generate(k: int) -> tuple[list[int], int]:
        seq = engine.open(f"s{k}", PROMPT, GenerationParams(max_new_tokens=16, ignore_eos=True,
                                                            num_head_draft_tokens=k))
        engine.prefill(seq)
        while not seq.finished:
            engine.verify(seq, seq.own_draft() if k else Draft())
        engine.close(seq)
        return seq.tokens, seq.num_draft_tokens

    plain, _ = generate(0)
    drafted, num_drafted = generate(3)
    assert drafted == plain and num_drafted > 0
