"""Domain types of the gateway: what the HTTP and gRPC front ends hand to the
propose/verify loop, and what comes back. No protobuf or HTTP in here."""

import dataclasses
import json
from dataclasses import dataclass, field

SPECULATION_METHODS = ("suffix", "ngram", "none")
# Keys that shape the drafter's shared global tree; fixed per drafter, so a
# request may only repeat the server's value.
SERVER_WIDE_SPECULATION_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests")


@dataclass(frozen=True)
class SpeculationSettings:
    """vLLM --speculative-config keys, validated."""

    method: str = "suffix"
    num_speculative_tokens: int = 8
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Ask the drafter for a token tree (several continuations verified in one pass).
    suffix_decoding_use_tree_spec: bool = False

    def __post_init__(self):
        if self.method not in SPECULATION_METHODS:
            raise ValueError(f"speculation method must be one of {', '.join(SPECULATION_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be between 1 and 64")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be >= 1 and <= prompt_lookup_max")
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    @classmethod
    def from_json(cls, text: str) -> "SpeculationSettings":
        """Parses a vLLM --speculative-config JSON object; empty text gives the defaults.

        As in vLLM, when only one of prompt_lookup_min/max is given the other takes its value.
        """
        if not text.strip():
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if isinstance(values, dict):
            if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
                values = {**values, "prompt_lookup_max": values["prompt_lookup_min"]}
            elif "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
                values = {**values, "prompt_lookup_min": values["prompt_lookup_max"]}
        return cls()._merge(values, allow_server_wide=True)

    def override(self, overrides: dict) -> "SpeculationSettings":
        """Applies a request's `speculation` object (same keys) on top of these settings.

        Raises ValueError for unknown keys, wrong types, or a change to a server-wide key.
        """
        return self._merge(overrides, allow_server_wide=False)

    def _merge(self, overrides: dict, allow_server_wide: bool) -> "SpeculationSettings":
        if not isinstance(overrides, dict):
            raise ValueError("speculation must be an object")
        known = {f.name: f for f in dataclasses.fields(self)}
        values = {}
        for key, value in overrides.items():
            if key not in known:
                raise ValueError(f"unknown speculation key {key!r}")
            expected = type(getattr(self, key))
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
                raise ValueError(f"speculation.{key} must be of type {expected.__name__}")
            if not allow_server_wide and key in SERVER_WIDE_SPECULATION_KEYS and value != getattr(self, key):
                raise ValueError(f"speculation.{key} is fixed by the server ({getattr(self, key)}); "
                                 "set it in --speculative-config")
            values[key] = value
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = max(values["prompt_lookup_min"], self.prompt_lookup_max)
        return dataclasses.replace(self, **values)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    speculation: SpeculationSettings
    temperature: float | None = None  # None or 0: greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    tenant: str = ""


@dataclass
class SpeculationUsage:
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0


@dataclass(frozen=True)
class TokenDelta:
    """Tokens committed by one verify step; finish_reason set on the last one."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # Cumulative for the request; set on the final delta, may be set on any
    # (then a generation cut short by a stop string still reports its usage).
    speculation: SpeculationUsage | None = None
