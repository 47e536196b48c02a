"""Head checkpoints: every supported layout read into one normalized
description (kind, layer shape, options, tensors named as our modules name
them), and written back in the layout vLLM reads for that kind.

Layouts: EAGLE (`fc`, `layers.0.*` without input_layernorm), EAGLE-3 (`fc`,
`midlayer.*` or `layers.0.*` with the layer's `input_layernorm` and
`hidden_norm` in it, `norm`, `lm_head`, `d2t`, `t2d`; the config flat, or nested
in speculators' `transformer_layer_config`), and MTP as
DeepSeek-V3/GLM (`model.layers.N.{enorm,hnorm,eh_proj,shared_head.*}` + block),
Qwen3-Next (`mtp.*`) and MiMo (`model.mtp_layers.0.*`). A checkpoint with
missing or unexpected tensors is refused with their names."""

import json
import pathlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verifier_service.heads.eagle import EagleHead
from verifier_service.heads.eagle3 import Eagle3Head, default_aux_layers
from verifier_service.heads.head import Head
from verifier_service.heads.layer import LayerShape
from verifier_service.heads.mtp import MtpHead
from verifier_service.heads.native_layer import fused_experts
from verifier_service.heads.shipped import METHOD_KINDS

# Tensors a checkpoint may carry that a head takes from the target instead.
_SHARED_WITH_TARGET = ("embed_tokens.weight",)
_MTP_PREFIXES = {  # layout -> (prefix pattern, renames to our names, cat [hidden, embedding])
    "deepseek_mtp": (r"model\.layers\.(\d+)\.", {"shared_head.norm.": "final_norm.", "shared_head.head.": "head."},
                     False),
    "qwen3_next_mtp": (r"mtp\.", {"pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
                                  "fc.": "eh_proj.", "layers.0.": "layer.", "norm.": "final_norm."}, False),
    "mimo_mtp": (r"model\.mtp_layers\.0\.", {"token_layernorm.": "enorm.", "hidden_layernorm.": "hnorm.",
                                             "input_proj.": "eh_proj.", "final_layernorm.": "final_norm."}, True),
}
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "final_norm.", "head.", "layer.")


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class HeadCheckpoint:
    kind: str  # eagle | eagle3 | mtp
    layout: str
    shape: LayerShape
    tensors: dict[str, torch.Tensor] = field(repr=False)  # our modules' state_dict names
    aux_layers: tuple[int, ...] = ()  # eagle3
    norm_before_residual: bool = False  # eagle3
    hidden_first: bool = False  # mtp, MiMo
    native_config: dict | None = field(default=None, repr=False)  # mtp: the target's config, run as its own layer


class _Tensors:
    """A checkpoint's tensors: their names from the safetensors headers alone, and the
    tensors themselves read only where wanted (an MTP layer out of a target's hundreds
    of GB). A .bin checkpoint has no such headers: it is read whole, once."""

    def __init__(self, directory: pathlib.Path):
        self._files = sorted(directory.glob("*.safetensors"))
        self._loaded: dict[str, torch.Tensor] | None = None
        if not self._files:
            bins = sorted(directory.glob("pytorch_model*.bin"))
            if not bins:
                raise CheckpointError(f"{directory} has no *.safetensors or pytorch_model*.bin file")
            self._loaded = {}
            for path in bins:
                self._loaded.update(torch.load(path, map_location="cpu", weights_only=True))
            self.names = list(self._loaded)
            return
        self.names = []
        for path in self._files:
            with safe_open(path, "pt") as f:
                self.names += f.keys()

    def read(self, wanted: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
        """The tensors whose names are `wanted`."""
        if self._loaded is not None:
            return {key: value for key, value in self._loaded.items() if wanted(key)}
        tensors = {}
        for path in self._files:
            with safe_open(path, "pt") as f:
                tensors.update({key: f.get_tensor(key) for key in f.keys() if wanted(key)})
        return tensors


def _config(directory: pathlib.Path) -> dict:
    """config.json, with speculators' `transformer_layer_config` (the layer's settings) flattened into it."""
    path = directory / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    return {**config.pop("transformer_layer_config", {}), **config}


def _shape(config: dict, target: dict, tensors: dict[str, torch.Tensor], layer: str, plus_one: bool) -> LayerShape:
    def get(key, default=None):
        return config.get(key, target.get(key, default))

    hidden = tensors[f"{layer}self_attn.o_proj.weight"].shape[0]
    head_dim = config.get("head_dim") or (target.get("head_dim") if hidden == target.get("hidden_size") else None)
    heads = get("num_attention_heads")
    head_dim = head_dim or hidden // heads
    rope = get("rope_parameters") or {}
    return LayerShape(
        hidden_size=hidden, num_heads=tensors[f"{layer}self_attn.q_proj.weight"].shape[0] // head_dim,
        num_kv_heads=tensors[f"{layer}self_attn.k_proj.weight"].shape[0] // head_dim, head_dim=head_dim,
        intermediate_size=tensors[f"{layer}mlp.gate_proj.weight"].shape[0],
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=float(get("rope_theta") or rope.get("rope_theta")
                                                                        or 10000.0),
        attention_bias=f"{layer}self_attn.q_proj.bias" in tensors, qk_norm=f"{layer}self_attn.q_norm.weight" in tensors,
        norm_plus_one=plus_one,
    )


def _renamed(tensors: dict, renames: dict[str, str], default_prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        new = next((to + key[len(frm):] for frm, to in renames.items() if key.startswith(frm)), default_prefix + key)
        out[new] = value
    return out


def detect_layout(keys) -> str:
    keys = set(keys)
    if "d2t" in keys or any(k.startswith("midlayer.") or k.endswith("hidden_norm.weight") for k in keys):
        return "eagle3"
    if any(re.match(r"model\.layers\.\d+\.eh_proj\.weight$", k) for k in keys):
        return "deepseek_mtp"
    if "mtp.fc.weight" in keys:
        return "qwen3_next_mtp"
    if "model.mtp_layers.0.input_proj.weight" in keys:
        return "mimo_mtp"
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return "eagle"
    raise CheckpointError("no head layout recognized (EAGLE fc + layers.0, EAGLE-3 midlayer/d2t, or MTP "
                          "eh_proj / mtp.fc / mtp_layers)")


def _mtp_prefix(names, layout: str) -> str:
    """The pattern of the MTP layer's tensor names (DeepSeek's: the first layer with eh_proj; the
    target's own layers stay out)."""
    pattern = _MTP_PREFIXES[layout][0]
    if layout == "deepseek_mtp":
        index = min(int(m.group(1)) for k in names if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.", k)))
        pattern = rf"model\.layers\.{index}\."
    return pattern


# Parts of tensor names that mark an MTP layer our dense layer cannot run (MoE experts, an MoE router, MLA
# attention), which the target architecture's own layer class then runs (native_layer.py).
_NATIVE_MTP = ("mlp.experts.", "mlp.gate.weight", "self_attn.kv_a_proj_with_mqa.")


def _mtp_tensors(tensors: dict, layout: str, pattern: str) -> tuple[dict[str, torch.Tensor], bool]:
    """The MTP layer's tensors under our names, and whether its block runs as the target's own layer class."""
    own = {}
    for key, value in tensors.items():
        if m := re.match(pattern, key):
            own[key[m.end():]] = value
    if any("linear_attn." in key for key in own):
        raise CheckpointError(f"the {layout} layer has linear attention; MTP layers are served with full "
                              "attention only")
    native = any(part in key for part in _NATIVE_MTP for key in own)
    renamed = _renamed(own, _MTP_PREFIXES[layout][1])
    ours = {(k if k.startswith(_MTP_OWN) or k in _SHARED_WITH_TARGET else "layer." + k): v
            for k, v in renamed.items()}
    return (fused_experts(ours, "layer.") if native else ours), native


def _native_shape(target: dict, plus_one: bool) -> LayerShape:
    """What MtpHead reads of the shape (its norms' width and epsilon) for a block transformers' class runs."""
    heads = target["num_attention_heads"]
    return LayerShape(hidden_size=target["hidden_size"], num_heads=heads,
                      num_kv_heads=target.get("num_key_value_heads") or heads,
                      head_dim=target.get("head_dim") or target["hidden_size"] // heads,
                      intermediate_size=target.get("intermediate_size", 0),
                      rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)), norm_plus_one=plus_one)


def read_head(directory: str | pathlib.Path, method: str, target_config: dict) -> HeadCheckpoint:
    """Reads a head (or, for MTP, the target directory holding MTP layers) for
    vLLM `method`. Raises CheckpointError naming missing or unexpected tensors."""
    directory = pathlib.Path(directory)
    kind = METHOD_KINDS.get(method)
    if kind is None:
        raise CheckpointError(f"method {method!r} has no head; expected one of {', '.join(METHOD_KINDS)}")
    checkpoint = _Tensors(directory)
    layout = detect_layout(checkpoint.names)
    layout_kind = "mtp" if layout.endswith("_mtp") else layout
    if layout_kind != kind:
        raise CheckpointError(f"{directory} holds a {layout} head, not one for method {method!r}")
    if kind == "mtp":  # the target's own directory: only the MTP layer is read
        pattern = _mtp_prefix(checkpoint.names, layout)
        tensors, native = _mtp_tensors(checkpoint.read(lambda name: re.match(pattern, name) is not None), layout,
                                       pattern)
        plus_one = layout == "qwen3_next_mtp"
        shape = (_native_shape(target_config, plus_one) if native
                 else _shape({}, target_config, tensors, "layer.", plus_one))
        return HeadCheckpoint(kind, layout, shape, tensors, hidden_first=_MTP_PREFIXES[layout][2],
                              native_config=target_config if native else None)
    tensors = checkpoint.read()
    config = _config(directory)
    if kind == "eagle":
        tensors = _renamed(tensors, {"layers.0.": "layer."})
        return HeadCheckpoint(kind, layout, _shape(config, target_config, tensors, "layer.", False), tensors)
    # eagle3
    if config.get("norm_before_fc"):
        raise CheckpointError(f"{directory}: norm_before_fc (a norm over the aux hidden states before fc) is "
                              "not supported")
    tensors = _renamed(_renamed(tensors, {"layers.0.": "midlayer."}),
                       {"midlayer.input_layernorm.": "input_layernorm.", "midlayer.hidden_norm.": "hidden_norm."})
    ids = (config.get("eagle_aux_hidden_state_layer_ids")  # vLLM's and speculators' place for them
           or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    aux = tuple(ids) if ids else default_aux_layers(target_config["num_hidden_layers"])
    return HeadCheckpoint(kind, layout, _shape(config, target_config, tensors, "midlayer.", False), tensors, aux,
                          norm_before_residual=bool(config.get("norm_before_residual")))


def build_head(checkpoint: HeadCheckpoint, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> Head:
    """The head module with the checkpoint's weights (strictly: every tensor used, none missing)."""
    tensors = {k: v for k, v in checkpoint.tensors.items() if k not in _SHARED_WITH_TARGET}
    vocab = embed_weight.shape[0]
    if checkpoint.kind == "eagle":
        head = EagleHead(checkpoint.shape, embed_weight, lm_head_weight, fc_bias="fc.bias" in tensors)
    elif checkpoint.kind == "eagle3":
        draft_vocab = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else vocab
        head = Eagle3Head(checkpoint.shape, embed_weight, checkpoint.aux_layers, draft_vocab, vocab,
                          checkpoint.norm_before_residual)
    else:
        own_head = "head.weight" in tensors
        head = MtpHead(checkpoint.shape, embed_weight, None if own_head else lm_head_weight, vocab,
                       checkpoint.hidden_first, checkpoint.native_config)
    expected = head.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{checkpoint.layout} checkpoint does not match its head: "
                              f"missing {missing or 'none'}, unexpected {unexpected or 'none'}")
    if wrong := [f"{k} {list(tensors[k].shape)} (expected {list(v.shape)})" for k, v in expected.items()
                 if tensors[k].shape != v.shape]:
        raise CheckpointError(f"{checkpoint.layout} checkpoint does not fit the target: {', '.join(wrong)}")
    head.load_state_dict(tensors)  # copied into the module's fp32 parameters, then cast with them
    return head.to(embed_weight.device, embed_weight.dtype).eval()


def save_head(head: Head, directory: str | pathlib.Path, target_config: dict, dtype: torch.dtype = torch.bfloat16,
              extra_config: dict | None = None) -> None:
    """Writes model.safetensors + config.json in the layout vLLM loads for the head's kind."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    s = head.shape
    config = {
        "model_type": "llama", "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
        "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope_theta, "num_hidden_layers": 1,
        "vocab_size": target_config["vocab_size"], "torch_dtype": str(dtype).removeprefix("torch."),
        **(extra_config or {}),
    }
    if head.kind == "eagle":
        state = _renamed(state, {"layer.": "layers.0."})
        config["architectures"] = ["LlamaForCausalLMEagle"]
    elif head.kind == "eagle3":  # vLLM's names: the layer's two input norms are inside it
        state = _renamed(state, {"input_layernorm.": "midlayer.input_layernorm.",
                                 "hidden_norm.": "midlayer.hidden_norm."})
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        config["draft_vocab_size"] = len(head.d2t)
        config["eagle_aux_hidden_state_layer_ids"] = list(head.feature_layers)
        config["norm_before_residual"] = head.norm_before_residual
    else:
        index = target_config["num_hidden_layers"]
        state = {f"model.layers.{index}." + _renamed({k: None}, {"final_norm.": "shared_head.norm.",
                                                                 "head.": "shared_head.head.", "layer.": ""})
                 .popitem()[0]: v for k, v in state.items()}
        config["architectures"] = ["DeepseekV3MTP"]
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
