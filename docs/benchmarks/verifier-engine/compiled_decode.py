"""Would inductor make a CPU decode pass cheaper? SmolLM2-135M's one-sequence decode written out in plain torch
(its weights, 300 cached tokens a layer, SDPA), timed four ways in one process, alternated in rounds: eager;
each layer as two compiled graphs (before and after attention, matrix products left to MKL either way); the whole
30-layer step as one compiled graph; and the 211 matrix products alone (the weight-read floor).

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/compiled_decode.py
"""

import os
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

MODEL = os.path.expanduser("~/.cache/speclane/models/smollm2-135m-instruct")
CONTEXT, STEPS, ROUNDS = 300, 60, 3


def main() -> None:
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim, eps = config.hidden_size // heads, config.rms_norm_eps
    layers = [{name: getattr(part, name).weight.t().contiguous()
               for part in (layer.self_attn, layer.mlp) for name in part._modules if name.endswith("_proj")}
              | {"norm_in": layer.input_layernorm.weight, "norm_post": layer.post_attention_layernorm.weight}
              for layer in model.model.layers]
    final_norm, vocab = model.model.norm.weight, model.lm_head.weight
    keys = torch.randn(len(layers), CONTEXT + 1, kv_heads, dim)
    values = torch.randn(len(layers), CONTEXT + 1, kv_heads, dim)
    cos, sin = torch.randn(1, 1, dim), torch.randn(1, 1, dim)
    x0 = model.model.embed_tokens.weight[:1].clone()

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rotate(x):
        return x * cos + torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), -1) * sin

    def before_attention(x, w):
        h = rms(x, w["norm_in"])
        return (rotate((h @ w["q_proj"]).view(-1, heads, dim)), rotate((h @ w["k_proj"]).view(-1, kv_heads, dim)),
                (h @ w["v_proj"]).view(-1, kv_heads, dim))

    def attend(q, k, v, layer):
        keys[layer, CONTEXT], values[layer, CONTEXT] = k[0], v[0]
        kk, vv = (c[layer].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[:, None] for c in (keys, values))
        return F.scaled_dot_product_attention(q.transpose(0, 1)[:, None], kk, vv)[:, 0].transpose(0, 1)

    def after_attention(x, attended, w):
        x = x + attended.reshape(-1, heads * dim) @ w["o_proj"]
        h = rms(x, w["norm_post"])
        return x + (F.silu(h @ w["gate_proj"]) * (h @ w["up_proj"])) @ w["down_proj"]

    def step(pre, post):
        def run(x):
            for layer, w in enumerate(layers):
                x = post(x, attend(*pre(x, w), layer), w)
            return rms(x, final_norm) @ vocab.t()
        return run

    def products(x):
        for w in layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"):
                x @ w[name]
            torch.empty(1, w["down_proj"].shape[0]) @ w["down_proj"]
        return x @ vocab.t()

    ways = {"eager": step(before_attention, after_attention),
            "two compiled graphs a layer": step(torch.compile(before_attention, dynamic=False),
                                                torch.compile(after_attention, dynamic=False)),
            "the whole step compiled": torch.compile(step(before_attention, after_attention), dynamic=False),
            "matrix products alone": products}
    times = {name: [] for name in ways}
    with torch.inference_mode():
        for name, way in ways.items():
            started = time.perf_counter()
            way(x0)
            print(f"{name}: first call {time.perf_counter() - started:.1f} s", flush=True)
        for _ in range(ROUNDS):
            for name, way in ways.items():
                for _ in range(3):
                    way(x0)
                started = time.perf_counter()
                for _ in range(STEPS):
                    way(x0)
                times[name].append((time.perf_counter() - started) / STEPS * 1e3)
    print("| way | step ms, each round | median |\n|---|---|--:|")
    for name, values in times.items():
        print(f"| {name} | {' / '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
