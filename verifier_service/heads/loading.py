"""Finding and loading the verifier's draft head: a head directory, the
target's own MTP layers, or the head shipped for a packaged model."""

import pathlib

import structlog
import torch
from safetensors import safe_open

from verifier_service.config import TreeShape
from verifier_service.device import HeadPrecision
from verifier_service.heads.checkpoint import CheckpointError, build_head, read_head
from verifier_service.heads.drafting import HeadDrafter
from verifier_service.heads.int8 import quantize_linears
from verifier_service.heads.shipped import METHOD_KINDS, shipped_head, shipped_heads

log = structlog.get_logger()


def head_directory(method: str, head_model: str, target_dir: str) -> pathlib.Path:
    """Where the head for `method` is: `head_model` when given; for MTP the
    target itself; else the head shipped for the target (by directory name)."""
    if head_model:
        return pathlib.Path(head_model).expanduser()
    if METHOD_KINDS[method] == "mtp":
        return pathlib.Path(target_dir)
    shipped = shipped_head(target_dir, method)
    if shipped is None:
        raise CheckpointError(f"no {method} head ships for {pathlib.Path(target_dir).name} (shipped: "
                              f"{', '.join(shipped_heads()) or 'none'}); give one with the speculative config's "
                              "\"model\" key")
    return shipped


def _target_weights(model, model_dir: str, sharded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and output layer. Under tensor parallelism the
    model holds shards, so rank 0 reads the whole tensors from the checkpoint."""
    if not sharded:
        return model.get_input_embeddings().weight, model.get_output_embeddings().weight
    found: dict[str, torch.Tensor] = {}
    for path in sorted(pathlib.Path(model_dir).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight") or key == "lm_head.weight":
                    found.setdefault("lm_head" if key == "lm_head.weight" else "embed", f.get_tensor(key))
    embed = found["embed"]
    return embed, found.get("lm_head", embed)  # tied embeddings have no lm_head tensor


def load_head(method: str, head_model: str, runner, precision: HeadPrecision | None = None,
              tree: TreeShape | None = None) -> HeadDrafter:
    """The head on the runner's device, at `precision` (the runner's dtype when None), checked against the
    target; drafting chains, or `tree`-shaped dynamic trees."""
    directory = head_directory(method, head_model, runner.model_dir)
    target_config = runner.model.config.get_text_config().to_dict()
    embed, lm_head = _target_weights(runner.model, runner.model_dir, runner.tp is not None)
    checkpoint = read_head(directory, method, target_config)
    precision = precision or HeadPrecision(runner.dtype)
    dtype = precision.dtype
    head_embed = embed.to(runner.device, dtype)
    # Tied embeddings (SmolLM2's): one converted copy serves as both, not two.
    head_lm_head = head_embed if lm_head is embed else lm_head.to(runner.device, dtype)
    head = build_head(checkpoint, head_embed, head_lm_head)
    if checkpoint.shape.hidden_size != target_config["hidden_size"] and checkpoint.kind != "eagle3":
        raise CheckpointError(f"the head's hidden size {checkpoint.shape.hidden_size} is not the target's "
                              f"{target_config['hidden_size']}")
    parameters = sum(p.numel() for p in head.parameters())
    int8_linears = quantize_linears(head) if precision.int8_weights else 0
    log.info("draft_head_loaded", method=method, layout=checkpoint.layout, directory=str(directory),
             dtype=precision.name, int8_linears=int8_linears, parameters=parameters,
             feature_layers=list(head.feature_layers))
    return HeadDrafter(head, tree)
