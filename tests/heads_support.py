"""Heads with random weights written in each checkpoint layout, for tests that
need a head's plumbing, not its accuracy (a random head still drafts, mostly
wrongly: lossless checks hold, acceptance does not)."""

import json
import pathlib

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from verifier_service.heads.checkpoint import save_head
from verifier_service.heads.eagle import EagleHead
from verifier_service.heads.eagle3 import Eagle3Head, default_aux_layers
from verifier_service.heads.mtp import MtpHead
from verifier_service.heads.train import layer_shape


def random_head(kind: str, target_dir: pathlib.Path, seed: int = 0, draft_vocab: int = 1024):
    config = json.loads((pathlib.Path(target_dir) / "config.json").read_text())
    torch.manual_seed(seed)
    shape, vocab = layer_shape(AutoConfig.from_pretrained(target_dir), {}), config["vocab_size"]
    draft_vocab = min(draft_vocab, vocab // 2)
    embed = torch.randn(vocab, shape.hidden_size)
    if kind == "eagle":
        head = EagleHead(shape, embed, embed)
    elif kind == "eagle3":
        head = Eagle3Head(shape, embed, default_aux_layers(config["num_hidden_layers"]), draft_vocab, vocab)
        head.d2t.copy_(torch.arange(draft_vocab) % 3)  # draft id i -> target id i + i % 3
        head.t2d[head.draft_token_ids] = True
    else:
        head = MtpHead(shape, embed, embed, vocab)
    return head, config


def write_random_head(kind: str, target_dir: pathlib.Path, out_dir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    head, config = random_head(kind, target_dir, seed)
    save_head(head, out_dir, config, dtype=torch.float32)
    return out_dir


def add_mtp_layer(target_dir: pathlib.Path, seed: int = 0) -> None:
    """Appends a random DeepSeek-layout MTP layer (model.layers.N.*) to a target's safetensors."""
    head, config = random_head("mtp", target_dir, seed)
    path = pathlib.Path(target_dir) / "model.safetensors"
    tensors = load_file(path)
    prefix = f"model.layers.{config['num_hidden_layers']}."
    names = {"final_norm.": "shared_head.norm.", "layer.": ""}
    for key, value in head.state_dict().items():
        own = next((to + key[len(frm):] for frm, to in names.items() if key.startswith(frm)), key)
        tensors[prefix + own] = value.contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def count_tensor_reads(monkeypatch) -> list[str]:
    """The names of the tensors the head checkpoint reader reads from here on (the list fills as it reads)."""
    import safetensors

    from verifier_service.heads import checkpoint as checkpoint_module

    read: list[str] = []
    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self._file = real_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self._inner.get_tensor(name)

    monkeypatch.setattr(checkpoint_module, "safe_open", Counting)
    return read
