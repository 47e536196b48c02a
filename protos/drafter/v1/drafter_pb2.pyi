from protos.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Method(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    METHOD_UNSPECIFIED: _ClassVar[Method]
    METHOD_SUFFIX: _ClassVar[Method]
    METHOD_NGRAM: _ClassVar[Method]
METHOD_UNSPECIFIED: Method
METHOD_SUFFIX: Method
METHOD_NGRAM: Method

class ProposerParams(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_spec_factor", "min_token_prob", "max_tree_depth")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEC_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKEN_PROB_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    method: Method
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    max_spec_factor: float
    min_token_prob: float
    max_tree_depth: int
    def __init__(self, method: _Optional[_Union[Method, str]] = ..., num_speculative_tokens: _Optional[int] = ..., prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ..., max_spec_factor: _Optional[float] = ..., min_token_prob: _Optional[float] = ..., max_tree_depth: _Optional[int] = ...) -> None: ...

class Start(_message.Message):
    __slots__ = ("sequence_id", "prompt_token_ids", "params", "tenant", "num_lookahead_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: ProposerParams
    tenant: str
    num_lookahead_tokens: int
    def __init__(self, sequence_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[ProposerParams, _Mapping]] = ..., tenant: _Optional[str] = ..., num_lookahead_tokens: _Optional[int] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("committed_token_ids", "committed_len", "max_spec_factor", "min_token_prob")
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEC_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKEN_PROB_FIELD_NUMBER: _ClassVar[int]
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_len: int
    max_spec_factor: float
    min_token_prob: float
    def __init__(self, committed_token_ids: _Optional[_Iterable[int]] = ..., committed_len: _Optional[int] = ..., max_spec_factor: _Optional[float] = ..., min_token_prob: _Optional[float] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("start", "step")
    START_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    start: Start
    step: Step
    def __init__(self, start: _Optional[_Union[Start, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("draft",)
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    draft: _common_pb2.Draft
    def __init__(self, draft: _Optional[_Union[_common_pb2.Draft, _Mapping]] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionsRequest(_message.Message):
    __slots__ = ("entries",)
    class Entry(_message.Message):
        __slots__ = ("session", "start", "step", "end")
        SESSION_FIELD_NUMBER: _ClassVar[int]
        START_FIELD_NUMBER: _ClassVar[int]
        STEP_FIELD_NUMBER: _ClassVar[int]
        END_FIELD_NUMBER: _ClassVar[int]
        session: int
        start: Start
        step: Step
        end: End
        def __init__(self, session: _Optional[int] = ..., start: _Optional[_Union[Start, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SessionsRequest.Entry]
    def __init__(self, entries: _Optional[_Iterable[_Union[SessionsRequest.Entry, _Mapping]]] = ...) -> None: ...

class SessionsResponse(_message.Message):
    __slots__ = ("entries",)
    class Entry(_message.Message):
        __slots__ = ("session", "draft", "code", "detail")
        SESSION_FIELD_NUMBER: _ClassVar[int]
        DRAFT_FIELD_NUMBER: _ClassVar[int]
        CODE_FIELD_NUMBER: _ClassVar[int]
        DETAIL_FIELD_NUMBER: _ClassVar[int]
        session: int
        draft: _common_pb2.Draft
        code: int
        detail: str
        def __init__(self, session: _Optional[int] = ..., draft: _Optional[_Union[_common_pb2.Draft, _Mapping]] = ..., code: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SessionsResponse.Entry]
    def __init__(self, entries: _Optional[_Iterable[_Union[SessionsResponse.Entry, _Mapping]]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("methods", "max_speculative_tokens", "max_tree_depth", "max_cached_requests", "max_cached_tokens", "share_tenants")
    METHODS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARE_TENANTS_FIELD_NUMBER: _ClassVar[int]
    methods: _containers.RepeatedScalarFieldContainer[Method]
    max_speculative_tokens: int
    max_tree_depth: int
    max_cached_requests: int
    max_cached_tokens: int
    share_tenants: bool
    def __init__(self, methods: _Optional[_Iterable[_Union[Method, str]]] = ..., max_speculative_tokens: _Optional[int] = ..., max_tree_depth: _Optional[int] = ..., max_cached_requests: _Optional[int] = ..., max_cached_tokens: _Optional[int] = ..., share_tenants: _Optional[bool] = ...) -> None: ...
