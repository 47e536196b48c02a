"""Configuration of the verifier service (flags, or SPECLANE_VERIFIER_* env vars).

No torch here: a launcher builds and checks this config without the model's libraries."""

import dataclasses
import os
import re
from dataclasses import dataclass

from speclane.config import option
from speclane.log import check_log_level
from speclane.models import PACKAGED_MODELS, hub_model, is_model_dir, served_name
from speclane.speculation import (
    CAPTURE_METHOD,
    DEFAULT_SPECULATIVE_TOKENS,
    HEAD_METHODS,
    MAX_SPECULATIVE_TOKENS,
    parse_speculation_debug,
    parse_speculative_config,
)
from speclane.tls import TlsFiles, server_tls
from verifier_service.heads.shipped import shipped_head, shipped_heads

ENV_PREFIX = "SPECLANE_VERIFIER_"
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?|npu(:\d+)?)$")
DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names
BATCH_INVARIANT_MODES = ("auto", "on", "off")
FLEX_ATTENTION, TORCH_SDPA = "FLEX_ATTENTION", "TORCH_SDPA"
ATTENTION_BACKENDS = ("auto", FLEX_ATTENTION, TORCH_SDPA)  # vLLM's names
HEAD_INT8 = "int8"  # a head's linear weights in int8 over bf16 activations (heads/int8.py)
MAX_SEED = 2**64  # torch seeds are uint64
DEFAULT_MAX_DRAFT_TOKENS = 256
DEFAULT_CPU_KV_CACHE_GIB = 4  # vLLM's CPU default; pages are committed only as blocks fill
REFERENCE_CHECK_MODES = ("refuse", "warn")


@dataclass(frozen=True)
class VerifierConfig:
    model: str = option("", "Hugging Face causal-LM directory (safetensors), a packaged model name (pulled into "
                            "$SPECLANE_HOME at start if missing), or a model id org/name from the Hugging Face Hub "
                            "(modelscope:org/name, or VLLM_USE_MODELSCOPE=true: ModelScope), cached or downloaded at "
                            "start; required")
    model_name: str = option("", "model name reported to clients; empty means the model id, or the directory name")
    address: str = option("127.0.0.1:50062", "gRPC listen address host:port")
    device: str = option("auto", "auto, cpu, cuda[:N] or npu[:N] (npu needs torch_npu)")
    dtype: str = option("auto", "auto (on a CPU bf16 where it multiplies bf16 natively, AVX512-BF16 or AMX, and "
                                "the passes are batch-invariant: one rank, --batch-invariant not off, the start-up "
                                "check passed; else fp32. bf16 on NPU, bf16/fp16 on CUDA), float32, bfloat16 or "
                                "float16")
    head_dtype: str = option("auto", "the draft head's dtype: auto (int8 on a CPU that multiplies bf16 natively, "
                                     "AVX512-BF16 or AMX; else --dtype's), float32, bfloat16, float16 or int8 (int8 "
                                     "linear weights over bf16, CPU only). The head only proposes, so its dtype never "
                                     "changes the output")
    batch_invariant: str = option("auto", "compute every token as a plain decode step would, whatever else its "
                                          "pass holds, so that speculation never changes a greedy output: auto (on "
                                          "for bfloat16/float16 where the start-up check finds this platform's "
                                          "kernels allow it, except on CUDA, whose FlexAttention passes are "
                                          "captured as graphs), on (refuse to start where they do not) or off")
    attention_backend: str = option("auto", "auto (a CPU: our paged kernel in fp32, else TORCH_SDPA; an NPU: "
                                            "torch_npu's fused attention; CUDA: FLEX_ATTENTION, TORCH_SDPA for "
                                            "MLA), FLEX_ATTENTION (compiled on CUDA; elsewhere eager, scoring every "
                                            "cache slot: for tests with a small cache) or TORCH_SDPA (vLLM's flag "
                                            "and names). FLEX_ATTENTION, named or chosen, turns --batch-invariant "
                                            "auto off (docs/design/verifier-engine.md)")
    enforce_eager: bool = option(False, "on CUDA and Ascend NPUs, run every pass eagerly instead of replaying "
                                        "CUDA or ACL graphs of it (vLLM's flag)")
    cuda_graph_sizes: str = option("", "comma-separated token counts of the passes captured as CUDA or ACL graphs "
                                       "(a pass pads to the next; on an NPU each as segments of 1, 2, 4, 8 or 16 "
                                       "tokens); empty: 1,2,4,8,16,24,32,48,64,96,128,192,256,384,512 up to "
                                       "--max-batch-tokens")
    threads: int = option(0, "torch intra-op CPU threads per rank; 0: the cores this process may run on, shared "
                             "among the ranks (as vLLM's CPU build takes every core)")
    tensor_parallel_size: int = option(1, "ranks the model is split over (gloo on CPU, nccl on CUDA, hccl on "
                                          "Ascend); rank 0 serves gRPC")
    gpu_memory_utilization: float = option(0.9, "on an accelerator, the share of its total memory for the weights, "
                                                "the activations at their profiled peak and the KV cache, which "
                                                "gets the rest (vLLM's flag and default)")
    kv_cache_space: float = option(0.0, "on a CPU, the KV cache's size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE, "
                                        f"also read); 0: {DEFAULT_CPU_KV_CACHE_GIB} GiB")
    num_gpu_blocks_override: int = option(0, "vLLM's override: exactly this many KV blocks, whatever the memory "
                                             "(tests, experiments); 0: sized from the two flags above")
    seed: int = option(0, "vLLM's global seed: Python's and torch's random generators are seeded with it at start, "
                          "and so the generator the unseeded requests share; a request's own seed makes its "
                          "sampling reproducible")
    kv_block_size: int = option(16, "tokens per KV block: the unit of allocation and of prefix caching (vLLM's "
                                    "default)", aliases=("--block-size",))
    enable_prefix_caching: bool = option(True, "keep finished sequences' KV so a prompt extending them "
                                               "(multi-turn) skips their prefill")
    max_batch_tokens: int = option(512, "tokens in one forward pass (long prompts are prefilled in chunks)",
                                   aliases=("--max-num-batched-tokens",))
    max_batch_sequences: int = option(64, "sequences in one forward pass", aliases=("--max-num-seqs",))
    max_model_len: int = option(0, "longest sequence (prompt + output) served; 0: the model's "
                                   "max_position_embeddings")
    trust_remote_code: bool = option(False, "let transformers run the model repository's own code")
    reference_check: str = option("refuse", "at start-up the engine's passes are compared with transformers' "
                                            "reference forward: refuse (to serve a model they differ on) or warn")
    tuning_cache: bool = option(True, "keep start-up measurements (on a CPU, the fastest way to multiply each "
                                      "weight shape; what a draft token costs a verify pass) in "
                                      "$SPECLANE_HOME/tuning, keyed by the host, libraries, threads, model and "
                                      "code, so a restart skips them; they decide how fast, never what is "
                                      "computed")
    batch_wait_ms: float = option(10.0, "how long a pass waits for running sequences whose next step is on its "
                                        "way, to batch them together (a tenth of the last pass where that is "
                                        "longer); 0 starts each pass at once")
    max_queue_wait: float = option(30.0, "seconds a new sequence may wait for KV space before "
                                         "RESOURCE_EXHAUSTED; 0 refuses at once")
    metrics_port: int = option(0, "port of the Prometheus /metrics endpoint (per-pass metrics); 0 disables it")
    max_concurrent_rpcs: int = option(256, "concurrent RPCs before RESOURCE_EXHAUSTED")
    max_draft_tokens: int = option(DEFAULT_MAX_DRAFT_TOKENS, "nodes one draft may have (INVALID_ARGUMENT beyond): "
                                                             "a huge draft would hold every sequence's pass up")
    speculative_config: str = option("", "vLLM's --speculative-config JSON. With method eagle, eagle3, mtp or "
                                         "deepseek_mtp the verifier loads that draft head from `model` (mtp: the "
                                         "target's own MTP layers when omitted; eagle/eagle3: the head shipped for "
                                         "a packaged model). With extract_hidden_states it writes each request's "
                                         "hidden states to `shared_storage_path` and generates 1 token. Other "
                                         "methods and keys are the gateway's (docs/reference/speculative-config.md)")
    speculation_debug: str = option("", "experiments only: the gateway's --speculation-debug JSON object; the "
                                        "verifier reads its draft_token_cost (a draft token's verify cost relative "
                                        "to a plain step, instead of the one measured at start-up)")
    log_level: str = option("info", "debug, info, warning or error (debug logs every forward pass)")
    tls_cert: str = option("", "PEM certificate of the gRPC server: it then serves TLS (mTLS with --tls-ca)")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_ca: str = option("", "PEM certificate of the CA that signs the clients' certificates: every client must then "
                             "show one (mTLS); needs --tls-cert")
    tls: TlsFiles = dataclasses.field(init=False, repr=False)
    draft: "DraftSettings" = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        if not self.model:
            raise ValueError(f"model is required (--model or {ENV_PREFIX}MODEL)")
        if self.model not in PACKAGED_MODELS and not is_model_dir(self.model) and hub_model(self.model) is None:
            raise ValueError(f"model {self.model!r} is neither a packaged model ({', '.join(PACKAGED_MODELS)}), "
                             "a Hugging Face model directory (no config.json) nor a model id (org/name)")
        if not self.model_name:
            # Frozen dataclass: fill the derived default once, at construction.
            object.__setattr__(self, "model_name", served_name(self.model))
        if not DEVICE_PATTERN.match(self.device):
            raise ValueError(f"device must be auto, cpu, cuda[:N] or npu[:N], got {self.device!r}")
        for name, allowed in (("dtype", ("auto", *DTYPES)), ("head_dtype", ("auto", *DTYPES, HEAD_INT8)),
                              ("batch_invariant", BATCH_INVARIANT_MODES),
                              ("attention_backend", ATTENTION_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.attention_backend != "auto" and self.batch_invariant == "on":
            raise ValueError("--batch-invariant on attends through its own backend; leave --attention-backend auto")
        if not re.fullmatch(r"(\s*[1-9]\d*\s*(,|$))*", self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be comma-separated positive integers, got "
                             f"{self.cuda_graph_sizes!r}")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not self.kv_cache_space:
            object.__setattr__(self, "kv_cache_space", float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or
                                                             DEFAULT_CPU_KV_CACHE_GIB))
        if self.kv_cache_space <= 0:
            raise ValueError("kv_cache_space must be > 0 GiB")
        if self.num_gpu_blocks_override < 0:
            raise ValueError("num_gpu_blocks_override must be >= 0")
        if self.reference_check not in REFERENCE_CHECK_MODES:
            raise ValueError(f"reference_check must be one of {', '.join(REFERENCE_CHECK_MODES)}")
        if not 0 <= self.seed < MAX_SEED:
            raise ValueError("seed must be between 0 and 2**64 - 1")
        if self.kv_block_size < 1:
            raise ValueError("kv_block_size must be >= 1")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be >= 0")
        if self.max_batch_tokens < 1 or self.max_batch_sequences < 1:
            raise ValueError("max_batch_tokens and max_batch_sequences must be >= 1")
        if self.batch_wait_ms < 0:
            raise ValueError("batch_wait_ms must be >= 0")
        if self.max_queue_wait < 0:
            raise ValueError("max_queue_wait must be >= 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be a port number (0 disables metrics)")
        if self.max_concurrent_rpcs < 1:
            raise ValueError("max_concurrent_rpcs must be >= 1")
        if self.max_draft_tokens < MAX_SPECULATIVE_TOKENS:
            # Below it, a request's own num_speculative_tokens could fail it.
            raise ValueError(f"max_draft_tokens must be at least {MAX_SPECULATIVE_TOKENS}, the most "
                             "num_speculative_tokens a request may ask for")
        check_log_level(self.log_level)
        debug = parse_speculation_debug(self.speculation_debug)
        object.__setattr__(self, "draft", draft_settings(self.speculative_config, debug.draft_token_cost))
        method = self.draft.head_method
        if method in ("eagle", "eagle3") and not self.draft.head_model and shipped_head(self.model, method) is None:
            raise ValueError(f"no {method} head ships for {self.model} (shipped: {', '.join(shipped_heads())}); "
                             "give one with the speculative config's \"model\" key")
        object.__setattr__(self, "tls", server_tls(self.tls_cert, self.tls_key, self.tls_ca))


MAX_TREE_TOPK = 16  # children per node of a head's draft tree (EAGLE-2 used 10)


@dataclass(frozen=True)
class TreeShape:
    topk: int  # children expanded per node, and nodes expanded per depth
    max_nodes: int  # draft tokens a step verifies at most

    def __post_init__(self):
        if self.topk < 2:
            raise ValueError(f"a draft tree needs topk >= 2 (1 is a chain), got {self.topk}")
        if self.max_nodes < 1:
            raise ValueError(f"a draft tree needs max_nodes >= 1, got {self.max_nodes}")


@dataclass(frozen=True)
class DraftSettings:
    """What a --speculative-config asks of the verifier itself."""

    head_method: str = ""  # a head to load ("" for none)
    head_model: str = ""  # its directory; "": the default place (see heads/loading.py)
    # A verify step's extra cost per draft token, relative to a plain step (see draft_cost.py): set by
    # --speculation-debug for experiments; None: measured at start-up. 0 makes every head draft k long.
    draft_token_cost: float | None = None
    tree: TreeShape | None = None  # the head drafts EAGLE-2 dynamic trees of this shape; None: chains
    # extract_hidden_states: hidden_states indices written per request into capture_dir
    capture_layers: tuple[int, ...] = ()
    capture_dir: str = ""


def draft_settings(speculative_config: str, draft_token_cost: float | None = None) -> DraftSettings:
    """The verifier's part of a --speculative-config (other methods are the gateway's)."""
    config = parse_speculative_config(speculative_config)
    values, method = config.verifier, config.method
    if method == CAPTURE_METHOD:
        # vLLM's keys: the layer ids under draft_model_config.hf_config; where to write ours.
        hf_config = (values.get("draft_model_config") or {}).get("hf_config") or {}
        layers = hf_config.get("eagle_aux_hidden_state_layer_ids") or ()
        directory = values.get("shared_storage_path") or ""
        if not directory or not isinstance(directory, str):
            raise ValueError("extract_hidden_states needs \"shared_storage_path\": the directory for the files")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
            raise ValueError("eagle_aux_hidden_state_layer_ids must be non-negative layer indices")
        return DraftSettings(capture_layers=tuple(layers), capture_dir=directory)
    if method not in HEAD_METHODS:
        if values.get("eagle_topk", 1) != 1:
            raise ValueError("eagle_topk needs a head method (eagle, eagle3 or mtp): it shapes the head's drafts")
        return DraftSettings(draft_token_cost=draft_token_cost)
    if values.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError("draft_tensor_parallel_size must be 1: the head runs on rank 0")
    model = values.get("model") or ""
    if not isinstance(model, str):
        raise ValueError("speculative_config.model must be a head directory")
    tree = tree_shape({**values, "num_speculative_tokens": config.settings.num_speculative_tokens})
    return DraftSettings(head_method=method, head_model=model, draft_token_cost=draft_token_cost, tree=tree)


def tree_shape(values: dict) -> TreeShape | None:
    """SGLang's EAGLE tree knobs under vLLM's config: `eagle_topk` (children per
    node; 1, the default, drafts chains) and `num_draft_tokens` (tree nodes a
    step verifies at most; default topk x num_speculative_tokens)."""
    topk = values.get("eagle_topk", 1)
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TREE_TOPK:
        raise ValueError(f"eagle_topk must be an integer in [1, {MAX_TREE_TOPK}], got {topk!r}")
    depth = values.get("num_speculative_tokens") or DEFAULT_SPECULATIVE_TOKENS
    nodes = values.get("num_draft_tokens", min(topk * depth, MAX_SPECULATIVE_TOKENS))
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_draft_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {nodes!r}")
    return TreeShape(topk, nodes) if topk > 1 else None
