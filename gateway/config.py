"""The gateway's configuration, from flags and SPECLANE_GATEWAY_* variables."""

import dataclasses
from dataclasses import dataclass

from gateway.auth import Keyring
from gateway.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from gateway.reasoning import REASONING_PARSERS
from gateway.response_store import DEFAULT_MAX_STORED_RESPONSES
from gateway.sampling_defaults import GENERATION_CONFIG_MODES
from gateway.tool_calls import TOOL_CALL_PARSERS
from speclane.config import option
from speclane.log import check_log_level
from speclane.speculation import (
    SpeculationDebug,
    SpeculationSettings,
    parse_speculation_debug,
    parse_speculative_config,
)
from speclane.tls import TlsFiles, check_pair

ENV_PREFIX = "SPECLANE_GATEWAY_"

DNS_SCHEME = "dns:///"  # a verifier address standing for every address its name resolves to

@dataclass(frozen=True)
class GatewayConfig:
    model: str = option("", "packaged model name, Hugging Face directory or cached hub id org/name to read the "
                            "tokenizer and chat template from; empty: fetch them from the verifier")
    served_model_name: str = option("", "model name clients use; defaults to the model's name")
    host: str = option("127.0.0.1", "HTTP listen address")
    port: int = option(8000, "HTTP port (OpenAI-compatible API)")
    grpc_address: str = option("127.0.0.1:50060", "listen address of the gRPC Generate API")
    drafter_address: str = option("127.0.0.1:50061", "drafter service address; empty disables speculation")
    verifier_addresses: tuple[str, ...] = option(
        ("127.0.0.1:50062",), "comma-separated verifier addresses host:port; dns:///name:port stands for every "
                              "address the name resolves to (a headless Kubernetes Service), resolved again every "
                              "10 s, so verifiers scaled up join and those scaled down leave")
    speculative_config: str = option(
        "", "vLLM-style JSON, e.g. '{\"method\": \"suffix\", \"num_speculative_tokens\": 8}' (keys: "
            "docs/reference/speculative-config.md)")
    speculation_debug: str = option("", "experiments only: a JSON object switching step-planner policies off, "
                                        "e.g. '{\"next_round\": false, \"lookup\": \"off\", \"break_even\": false}' "
                                        "(docs/reference/speculative-config.md); empty: as shipped")
    generation_config: str = option("auto", "auto: a request's missing temperature, top_p, top_k, "
                                            "repetition_penalty, min_p and max_tokens (max_new_tokens) come "
                                            "from the model's generation_config.json (else temperature 1.0), as "
                                            "vLLM's; vllm: ignore the file, as vLLM's flag")
    chat_template: str = option("", "Jinja chat template (a file, or the template itself) used instead of the "
                                    "model's")
    tool_call_parser: str = option("hermes", "how tool calls are read from the output: hermes (<tool_call> "
                                             "blocks: Qwen2.5, Qwen3, Hermes) or json; empty: tools are refused")
    reasoning_parser: str = option("", "how reasoning is split off the output: qwen3 or deepseek_r1 (<think> "
                                       "blocks, as vLLM's flag); empty: reasoning stays in the content")
    enable_auto_tool_choice: bool = option(True, "read tool calls from the output when tool_choice is auto "
                                                 "(vLLM needs the flag; here it is on by default)")
    max_stored_responses: int = option(DEFAULT_MAX_STORED_RESPONSES, "Responses API responses kept in memory for "
                                       "previous_response_id and GET /v1/responses/{id}, the oldest dropped "
                                       "first (lost on restart); 0: store nothing")
    draft_timeout_ms: int = option(200, "a draft slower than this is skipped and the drafter given a rest")
    # Above the verifier's default --max-queue-wait (30 s), which a prefill may legitimately spend waiting for KV.
    verifier_timeout_s: float = option(60.0, "seconds a prefill or verify step waits for the verifier's answer "
                                             "before the request fails with 503 / UNAVAILABLE (a frozen link "
                                             "would otherwise hang it); 0: no deadline")
    max_concurrent_requests: int = option(64, "requests in flight before new ones get HTTP 429 / RESOURCE_EXHAUSTED")
    api_key: tuple[str, ...] = option((), "comma-separated keys a client must send (Authorization: Bearer KEY, "
                                          "or gRPC metadata authorization); empty: no authentication",
                                      secret=True)
    api_keys_file: str = option("", "JSON or YAML file mapping each API key to its tenant and concurrency limit, "
                                    "{\"KEY\": {\"tenant\": \"team-a\", \"max_concurrent_requests\": 4}}; with "
                                    "keys, a request's tenant is its key's, never the x-tenant-id header")
    protect_metrics: bool = option(False, "/metrics needs an API key too (/health stays open for probes)")
    max_tokens_limit: int = option(0, "largest max_tokens a request may ask for (400 beyond), and the default of "
                                      "requests that ask for none; 0: the context length is the only limit")
    max_request_body_bytes: int = option(DEFAULT_MAX_REQUEST_BODY_BYTES, "largest HTTP request body; a larger "
                                                                         "one gets 413")
    log_level: str = option("info", "debug, info, warning or error")
    tls_cert: str = option("", "PEM certificate of the gateway: the gRPC Generate API serves TLS with it (client "
                               "certificates not required: clients show API keys), and it is the gateway's client "
                               "certificate towards the drafter and verifiers")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_ca: str = option("", "PEM certificate of the CA that signs the drafter's and verifiers' certificates: the "
                             "gateway then dials them over TLS (mTLS with --tls-cert); empty: plaintext")
    tls_server_name: str = option("", "name the drafter's and verifiers' certificates must carry, instead of the host "
                                      "dialled (grpc.ssl_target_name_override); needs --tls-ca")
    ssl_certfile: str = option("", "PEM certificate of the HTTP API: it then serves HTTPS (vLLM's flag)")
    ssl_keyfile: str = option("", "PEM private key of --ssl-certfile (vLLM's flag)")
    speculation: SpeculationSettings = dataclasses.field(init=False, repr=False)
    # Drafter-wide keys of --speculative-config (tree depth, cached requests): the
    # drafter's own flags set them; `speclane serve` passes these on to it.
    drafter_wide_speculation: dict = dataclasses.field(init=False, repr=False)
    unused_speculation_keys: tuple[str, ...] = dataclasses.field(init=False, repr=False)  # warned about
    # (fewest, most running sequences, at most this many draft tokens): vLLM's disable_by_batch_size and
    # num_speculative_tokens_per_batch_size.
    speculation_draft_tokens_by_load: tuple[tuple[int, int, int], ...] = dataclasses.field(init=False, repr=False)
    debug: SpeculationDebug = dataclasses.field(init=False, repr=False)  # --speculation-debug
    tls: TlsFiles = dataclasses.field(init=False, repr=False)  # the drafter and verifier links
    keyring: Keyring = dataclasses.field(init=False, repr=False, compare=False)  # --api-key and --api-keys-file

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        if not self.verifier_addresses:
            raise ValueError("at least one verifier address is needed")
        for target in self.verifier_addresses:
            host, _, port = target.removeprefix(DNS_SCHEME).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"verifier address {target!r} must be host:port or {DNS_SCHEME}name:port")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}")
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.max_stored_responses < 0:
            raise ValueError("max_stored_responses must be >= 0")
        if self.draft_timeout_ms <= 0:
            raise ValueError("draft_timeout_ms must be positive")
        if self.verifier_timeout_s < 0:
            raise ValueError("verifier_timeout_s must be >= 0 (0: no deadline)")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
        if self.max_tokens_limit < 0:
            raise ValueError("max_tokens_limit must be >= 0 (0: no limit but the context length)")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1")
        # Read once, here: a bad keys file stops the start with a usage error.
        object.__setattr__(self, "keyring", Keyring.load(self.api_key, self.api_keys_file))
        if self.protect_metrics and not self.keyring:
            raise ValueError("protect_metrics needs API keys (--api-key or --api-keys-file) to check")
        check_log_level(self.log_level)
        check_pair("--ssl-certfile", self.ssl_certfile, "--ssl-keyfile", self.ssl_keyfile)
        object.__setattr__(self, "tls", TlsFiles(self.tls_cert, self.tls_key, self.tls_ca, self.tls_server_name))
        speculative = parse_speculative_config(self.speculative_config)
        object.__setattr__(self, "speculation", speculative.settings)
        object.__setattr__(self, "drafter_wide_speculation", speculative.drafter_wide)
        object.__setattr__(self, "unused_speculation_keys", speculative.unused)
        object.__setattr__(self, "speculation_draft_tokens_by_load", speculative.draft_tokens_by_load)
        object.__setattr__(self, "debug", parse_speculation_debug(self.speculation_debug))
