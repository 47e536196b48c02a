from protos.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens", "logprobs", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: int
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[str] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("sequence_id", "prompt_token_ids", "sampling", "num_head_draft_tokens", "head_draft_on_demand", "cache_salt")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_HEAD_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DRAFT_ON_DEMAND_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    num_head_draft_tokens: int
    head_draft_on_demand: bool
    cache_salt: str
    def __init__(self, sequence_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_head_draft_tokens: _Optional[int] = ..., head_draft_on_demand: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("draft", "use_head_draft", "next_round")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    USE_HEAD_DRAFT_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    draft: _common_pb2.Draft
    use_head_draft: bool
    next_round: NextRound
    def __init__(self, draft: _Optional[_Union[_common_pb2.Draft, _Mapping]] = ..., use_head_draft: _Optional[bool] = ..., next_round: _Optional[_Union[NextRound, _Mapping]] = ...) -> None: ...

class NextRound(_message.Message):
    __slots__ = ("step_committed_len", "continuations", "lookup_tokens", "run_ahead")
    STEP_COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUN_AHEAD_FIELD_NUMBER: _ClassVar[int]
    step_committed_len: int
    continuations: _containers.RepeatedCompositeFieldContainer[Continuation]
    lookup_tokens: int
    run_ahead: bool
    def __init__(self, step_committed_len: _Optional[int] = ..., continuations: _Optional[_Iterable[_Union[Continuation, _Mapping]]] = ..., lookup_tokens: _Optional[int] = ..., run_ahead: _Optional[bool] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("bonus_token_id", "draft")
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    bonus_token_id: int
    draft: _common_pb2.Draft
    def __init__(self, bonus_token_id: _Optional[int] = ..., draft: _Optional[_Union[_common_pb2.Draft, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("prefill", "verify", "next_round")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    prefill: Prefill
    verify: Verify
    next_round: NextRound
    def __init__(self, prefill: _Optional[_Union[Prefill, _Mapping]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ..., next_round: _Optional[_Union[NextRound, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("token_ids", "num_accepted_draft_tokens", "committed_len", "finish_reason", "num_draft_tokens", "logprobs", "queue_seconds", "prefill_seconds", "head_draft", "forward_seconds", "step_seconds", "next_round_hit", "head_draft_seconds", "lookup_draft", "num_running", "num_cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DRAFT_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_HIT_FIELD_NUMBER: _ClassVar[int]
    HEAD_DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted_draft_tokens: int
    committed_len: int
    finish_reason: _common_pb2.FinishReason
    num_draft_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    queue_seconds: float
    prefill_seconds: float
    head_draft: _common_pb2.Draft
    forward_seconds: float
    step_seconds: float
    next_round_hit: bool
    head_draft_seconds: float
    lookup_draft: _common_pb2.Draft
    num_running: int
    num_cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_accepted_draft_tokens: _Optional[int] = ..., committed_len: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_draft_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., head_draft: _Optional[_Union[_common_pb2.Draft, _Mapping]] = ..., forward_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., next_round_hit: _Optional[bool] = ..., head_draft_seconds: _Optional[float] = ..., lookup_draft: _Optional[_Union[_common_pb2.Draft, _Mapping]] = ..., num_running: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_context_len", "eos_token_ids", "device", "dtype", "tensor_parallel_size", "draft_head", "draft_token_cost", "draft_token_cost_by_batch_size")
    class DraftTokenCostByBatchSizeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HEAD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_COST_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_COST_BY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_context_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    tensor_parallel_size: int
    draft_head: str
    draft_token_cost: float
    draft_token_cost_by_batch_size: _containers.ScalarMap[int, float]
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., draft_head: _Optional[str] = ..., draft_token_cost: _Optional[float] = ..., draft_token_cost_by_batch_size: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files",)
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_used_tokens", "kv_cached_tokens", "kv_max_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_cached_tokens: int
    kv_max_tokens: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_cached_tokens: _Optional[int] = ..., kv_max_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...
