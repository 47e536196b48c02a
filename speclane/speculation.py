"""Speculation settings: vLLM's --speculative-config keys, their defaults and
bounds, and the one validation that both the gateway (its flags, each request)
and the drafter (each session) run, so a setting one accepts the other never
refuses. Server-wide values belong to the drafter, which reports them (its
GetInfo RPC) as DrafterLimits; requests are checked against those. The
mapping to and from the drafter's messages is here too, for both ends."""

import dataclasses
import json
import math
import typing
from dataclasses import dataclass

from protos.drafter.v1 import drafter_pb2

HEAD_METHODS = ("eagle", "eagle3", "mtp")  # drafted by a head inside the verifier
METHODS = ("suffix", "ngram", "none", *HEAD_METHODS, "hybrid")  # hybrid: suffix or the head, per step
DRAFTER_METHODS = ("suffix", "ngram")  # what the drafter service proposes with
METHOD_ALIASES = {"deepseek_mtp": "mtp"}  # vLLM's name for DeepSeek's MTP layers
# vLLM's method that only captures hidden states in the verifier: the sequences themselves are not speculated.
CAPTURE_METHOD = "extract_hidden_states"
MAX_SPECULATIVE_TOKENS = 64
# k where a configuration names none: suffix decoding drafts up to the tree depth (vLLM's default for it; its
# budget rule keeps drafts short where matches are short), every other method this many.
DEFAULT_SPECULATIVE_TOKENS = 8
# Appending costs O(depth) per token and tree, so a drafter's depth is bounded.
MAX_TREE_DEPTH = 256
# The longest n-gram prompt lookup matches (the drafter core's bound).
MAX_PROMPT_LOOKUP = 1024
# The public --speculative-config keys, each as vLLM, SGLang or Arctic names it
# (docs/reference/speculative-config.md). Per sequence (a request may set them too):
# SpeculationSettings' fields. The rest:
# vLLM keys that shape the drafter's shared trees: configured on the drafter, for
# all sequences (key -> DrafterLimits field). A request may only repeat the value.
DRAFTER_WIDE_KEYS = {
    "suffix_decoding_max_tree_depth": "max_tree_depth",
    "suffix_decoding_max_cached_requests": "max_cached_requests",
}
# vLLM's load cut-offs, applied by the gateway at every step.
LOAD_KEYS = ("disable_by_batch_size", "num_speculative_tokens_per_batch_size")
# The verifier's head (vLLM's, and SGLang's EAGLE tree knobs) and vLLM's hidden-state capture.
VERIFIER_KEYS = ("model", "draft_tensor_parallel_size", "eagle_topk", "num_draft_tokens", "draft_model_config",
                 "shared_storage_path")
# A batch size no verifier reaches: the open end of a load range.
MAX_BATCH_SIZE = 2**31 - 1


@dataclass(frozen=True)
class DrafterLimits:
    """A drafter's server-wide settings, as its GetInfo RPC reports them."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_speculative_tokens: int = MAX_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class SpeculationSettings:
    """One sequence's speculation settings: vLLM's --speculative-config keys."""

    method: str = "suffix"
    num_speculative_tokens: int | None = None  # None: the method's default (see with_draft_length)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # suffix: draft budget = min(k, factor * match_len); stop below min_token_prob
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self):
        if self.method in METHOD_ALIASES:
            object.__setattr__(self, "method", METHOD_ALIASES[self.method])
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= {MAX_PROMPT_LOOKUP}, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.suffix_decoding_max_spec_factor < 0:
            raise ValueError("suffix_decoding_max_spec_factor must be >= 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    def merged(self, values: dict, limits: DrafterLimits | None = None) -> "SpeculationSettings":
        """These settings with `values` (speculative-config keys) on top, checked
        against a drafter's `limits` when known. Raises ValueError naming the key.

        As in vLLM, when only one of prompt_lookup_min/max is given the other takes its value.
        """
        if not isinstance(values, dict):
            raise ValueError("speculation must be an object")
        values = dict(values)
        for key, limit_name in DRAFTER_WIDE_KEYS.items():
            if key in values:
                value = values.pop(key)
                fixed = getattr(limits, limit_name) if limits is not None else value
                if value != fixed:
                    raise ValueError(f"{key} is fixed by the drafter ({fixed}); configure it there")
        fields = {field.name: field for field in dataclasses.fields(self)}
        for key, value in values.items():
            if key not in fields:
                raise ValueError(f"unknown speculation key {key!r}")
            values[key] = _typed(key, value, _value_type(fields[key]))
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = values["prompt_lookup_min"]
        elif "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = values["prompt_lookup_max"]
        settings = dataclasses.replace(self, **values)
        if limits is not None and (settings.num_speculative_tokens or 0) > limits.max_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be at most {limits.max_speculative_tokens} "
                             "on this drafter")
        return settings

    def with_draft_length(self, limits: DrafterLimits | None) -> "SpeculationSettings":
        """These settings with k fixed: as given, else the method's default on a drafter with `limits`
        (its defaults where unknown)."""
        if self.num_speculative_tokens is not None:
            return self
        limits = limits or DrafterLimits()
        k = (min(limits.max_tree_depth, limits.max_speculative_tokens) if self.method == "suffix"
             else DEFAULT_SPECULATIVE_TOKENS)
        return dataclasses.replace(self, num_speculative_tokens=k)

    @property
    def uses_drafter(self) -> bool:
        return self.method in DRAFTER_METHODS or self.method == "hybrid"

    @property
    def uses_head(self) -> bool:
        return self.method in HEAD_METHODS or self.method == "hybrid"

    @property
    def feeds_drafter(self) -> bool:
        """Whether the output goes to the drafter's trees: all speculation does, head
        methods too (they draft without it), so a later request learns from it."""
        return self.method != "none"

    @property
    def drafter_method(self) -> str:
        """What the drafter service is asked for: suffix decoding pairs with a head (hybrid) or is
        what a head's output feeds."""
        return "suffix" if self.method == "hybrid" or self.method in HEAD_METHODS else self.method


def draft_value(score: float, num_tokens: int, token_cost: float, overhead: float = 0.0) -> float:
    """Tokens a step commits per unit of verify time: (1 + expected accepted
    tokens) over the step's cost, where a plain step costs 1, each draft
    token `token_cost` more (the verifier measures it; see draft_cost.py),
    and making the draft `overhead` more, where it is on the step's path."""
    return (1.0 + score) / (1.0 + token_cost * num_tokens + overhead)


def token_cost_at(token_costs: tuple[tuple[int, float], ...], num_running: int) -> float:
    """What a draft token adds to a verify step with `num_running` sequences in
    the verifier's batch, as a fraction of a plain step: the verifier's measure
    (verifier_service/draft_cost.py), interpolated between the measured batch
    sizes. It is also the chance of acceptance a draft token needs to pay.
    `token_costs`: (batch size, cost), by batch size; empty: drafts are free."""
    if not token_costs:
        return 0.0
    running = max(1, num_running)
    for (low, low_cost), (high, high_cost) in zip(token_costs, token_costs[1:]):
        if low <= running <= high:
            return low_cost + (high_cost - low_cost) * (running - low) / (high - low)
    return token_costs[0][1] if running < token_costs[0][0] else token_costs[-1][1]


def _value_type(field: dataclasses.Field) -> type:
    """What a key's value must be: the field's type, int for `int | None`."""
    return next((kind for kind in typing.get_args(field.type) if kind is not type(None)), field.type)


def _typed(key: str, value, expected: type):
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
        raise ValueError(f"speculation.{key} must be of type {expected.__name__}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A --speculative-config, split by who applies each part."""

    settings: SpeculationSettings = SpeculationSettings()  # each sequence's defaults
    drafter_wide: dict = dataclasses.field(default_factory=dict)  # for the drafter's own flags
    # (fewest, most running sequences, at most this many draft tokens): the gateway's per-step load limits.
    draft_tokens_by_load: tuple[tuple[int, int, int], ...] = ()
    method: str = ""  # as given (the verifier tells extract_hidden_states and the head methods apart)
    verifier: dict = dataclasses.field(default_factory=dict)  # VERIFIER_KEYS given
    unused: tuple[str, ...] = ()  # keys speclane does not use (e.g. vLLM's `enforce_eager`): warned about


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The one reading of a vLLM --speculative-config JSON object (empty: the defaults),
    for the gateway and the verifier alike. Keys speclane does not use are named, not
    refused, so a vLLM command line runs as it is. Raises ValueError naming the key."""
    values = _json_object(text)
    drafter_wide = {key: values.pop(key) for key in DRAFTER_WIDE_KEYS if key in values}
    for key, value in drafter_wide.items():
        if not _int_in(value, 0):
            raise ValueError(f"{key} must be a non-negative integer")
    by_load = draft_tokens_by_load(values.pop("disable_by_batch_size", None),
                                   values.pop("num_speculative_tokens_per_batch_size", None))
    verifier = {key: values.pop(key) for key in VERIFIER_KEYS if key in values}
    method = values.get("method", "")
    if method == CAPTURE_METHOD:
        values["method"] = "none"
    known = {field.name for field in dataclasses.fields(SpeculationSettings)}
    settings = SpeculationSettings().merged({key: value for key, value in values.items() if key in known})
    unused = tuple(sorted(key for key in values if key not in known))
    return SpeculativeConfig(settings, drafter_wide, by_load, METHOD_ALIASES.get(method, method), verifier, unused)


def draft_tokens_by_load(disable_by_batch_size, per_batch_size) -> tuple[tuple[int, int, int], ...]:
    """vLLM's load cut-offs as (fewest, most running sequences, at most this many
    draft tokens): num_speculative_tokens_per_batch_size's ranges ([[1, 8, 5], [9, 32, 2],
    [33, 256, 0]]: k 5 up to 8 sequences, 2 up to 32, none beyond) and
    disable_by_batch_size L, no drafts while more than L sequences run."""
    limits = []
    if disable_by_batch_size is not None:
        if not _int_in(disable_by_batch_size, 1):
            raise ValueError("disable_by_batch_size must be a positive integer")
        limits.append((disable_by_batch_size + 1, MAX_BATCH_SIZE, 0))
    ranges = [] if per_batch_size is None else per_batch_size
    if not isinstance(ranges, list):
        raise ValueError("num_speculative_tokens_per_batch_size must be a list of [min, max, k] batch size ranges")
    for entry in ranges:
        if not (isinstance(entry, list) and len(entry) == 3 and _int_in(entry[0], 1) and _int_in(entry[1], entry[0])
                and _int_in(entry[2], 0, MAX_SPECULATIVE_TOKENS)):
            raise ValueError("num_speculative_tokens_per_batch_size entries are [min, max, k]: batch sizes "
                             f"1 <= min <= max, k 0 to {MAX_SPECULATIVE_TOKENS}; got {entry!r}")
    ordered = sorted(tuple(entry) for entry in ranges)
    if any(low <= previous[1] for previous, (low, _, _) in zip(ordered, ordered[1:])):
        raise ValueError("num_speculative_tokens_per_batch_size ranges must not overlap")
    return tuple(sorted(limits + ordered))


def _json_object(text: str) -> dict:
    if not text.strip():
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative config is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError("speculative config must be a JSON object")
    return values


def _int_in(value, low: int, high: float = float("inf")) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True)
class SpeculationDebug:
    """--speculation-debug: switches for experiments, one JSON object read by the
    gateway and the verifier alike. What ships is the default of each."""

    next_round: bool = True  # offer the verifier the drafts after each step
    lookup: str = "auto"  # verifier lookups where no offer matches: "auto" (where they pay), "on", "off"
    break_even: bool = True  # cut drafter drafts where their tokens stop paying
    draft_token_cost: float | None = None  # the verifier's cost of a draft token; None: measured at start-up


MAX_TOKEN_COST = 10.0  # a draft token costing ten plain steps is no speculation worth doing


def parse_speculation_debug(text: str) -> SpeculationDebug:
    values = _json_object(text)
    fields = {field.name for field in dataclasses.fields(SpeculationDebug)}
    for key in values:
        if key not in fields:
            raise ValueError(f"unknown speculation debug switch {key!r} (known: {', '.join(sorted(fields))})")
    for key in ("next_round", "break_even"):
        if not isinstance(values.get(key, True), bool):
            raise ValueError(f"speculation debug {key} must be true or false")
    if values.get("lookup", "auto") not in ("auto", "on", "off"):
        raise ValueError('speculation debug lookup must be "auto", "on" or "off"')
    cost = values.get("draft_token_cost")
    if cost is not None and (isinstance(cost, bool) or not isinstance(cost, int | float)
                             or not 0 <= cost <= MAX_TOKEN_COST):
        raise ValueError(f"speculation debug draft_token_cost must be a number in [0, {MAX_TOKEN_COST}]")
    return SpeculationDebug(**{**values, **({"draft_token_cost": float(cost)} if cost is not None else {})})


_PROTO_METHODS = {"suffix": drafter_pb2.METHOD_SUFFIX, "ngram": drafter_pb2.METHOD_NGRAM}
# ProposerParams field -> speculative-config key
_PROTO_KEYS = {
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "max_spec_factor": "suffix_decoding_max_spec_factor",
    "min_token_prob": "suffix_decoding_min_token_prob",
    "max_tree_depth": "suffix_decoding_max_tree_depth",
}


def settings_to_proto(settings: SpeculationSettings) -> drafter_pb2.ProposerParams:
    """What a client sends the drafter for these settings (a method that uses_drafter)."""
    return drafter_pb2.ProposerParams(
        method=_PROTO_METHODS[settings.drafter_method], num_speculative_tokens=settings.num_speculative_tokens,
        **{field: getattr(settings, key) for field, key in _PROTO_KEYS.items() if key not in DRAFTER_WIDE_KEYS},
    )


def settings_from_proto(message: drafter_pb2.ProposerParams, limits: DrafterLimits) -> SpeculationSettings:
    """The drafter's reading of a session's params: absent optional fields take
    the defaults; raises ValueError with the checks the gateway runs."""
    methods = {value: name for name, value in _PROTO_METHODS.items()}
    if message.method not in methods:
        raise ValueError(f"params.method must be one of {', '.join(DRAFTER_METHODS)}")
    given = {_PROTO_KEYS[field.name]: value for field, value in message.ListFields() if field.name in _PROTO_KEYS}
    values = {**given, "method": methods[message.method], "num_speculative_tokens": message.num_speculative_tokens}
    return SpeculationSettings().merged(values, limits)


def info_to_proto(limits: DrafterLimits, max_cached_tokens: int, share_tenants: bool) -> drafter_pb2.DrafterInfo:
    return drafter_pb2.DrafterInfo(
        methods=list(_PROTO_METHODS.values()), max_speculative_tokens=limits.max_speculative_tokens,
        max_tree_depth=limits.max_tree_depth, max_cached_requests=limits.max_cached_requests,
        max_cached_tokens=max_cached_tokens, share_tenants=share_tenants,
    )


def limits_from_proto(info: drafter_pb2.DrafterInfo) -> DrafterLimits:
    return DrafterLimits(max_tree_depth=info.max_tree_depth, max_cached_requests=info.max_cached_requests,
                         max_speculative_tokens=info.max_speculative_tokens)
