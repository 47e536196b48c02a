"""The OpenAI request schema and its translation into the serving layer's
terms: what is accepted, what is refused, and how the prompt is read."""

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from gateway.errors import InvalidRequest
from gateway.json_limits import json_problem
from gateway.types import CACHE_SALT_PATTERN, SCALAR_LOGIT_CONTROLS, LogitControls

LEGACY_DEFAULT_MAX_TOKENS = 16  # /v1/completions' default in OpenAI's API (and vLLM's)
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' limit in OpenAI's API
# Values of refused fields that ask for nothing, so clients sending defaults still work.
NEUTRAL_VALUES = {"best_of": (1,), "modalities": (["text"],), "service_tier": ("auto", "default")}


def documented(default: Any = None, **schema: Any) -> Any:
    """A field whose OpenAPI schema states the bounds the serving layer checks (which
    refuses with its own messages): documentation and fuzzing only, never validation."""
    return Field(default, json_schema_extra=schema)


# What a request may not carry: the schema lists every field it takes (the refused ones, taken
# only with neutral values, are left out); validation itself still lets them through to be named.
CLOSED_OBJECT = {"additionalProperties": False}


class RequestBody(BaseModel):
    """A request body of any of the HTTP APIs."""

    @model_validator(mode="before")
    @classmethod
    def _readable_json(cls, data: Any) -> Any:
        """Refuses lone surrogates and too deep nesting anywhere in the body (a 400 naming the field)."""
        if (problem := json_problem(data)) is not None:
            param, what = problem
            raise PydanticCustomError("unreadable_json", "{message}",
                                      {"message": f"{param or 'the request body'} {what}", "param": param})
        return data


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(BaseModel):
    # Not strict: image/audio parts carry other fields; chat_messages refuses them by type.
    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    role: str = documented(..., enum=["system", "developer", "user", "assistant", "tool"])
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this answers


class Prediction(StrictModel):
    type: str = "content"
    content: str | list[ContentPart]


class StreamOptions(StrictModel):
    include_usage: bool = False


class CompletionBase(RequestBody):
    # Other fields are checked by check_extra_fields: refused unless neutral, or unknown.
    model_config = ConfigDict(extra="allow", json_schema_extra=CLOSED_OBJECT)
    refused: ClassVar[tuple[str, ...]] = ()

    model: str | None = None
    max_tokens: int | None = documented(minimum=1)
    temperature: float | None = documented(minimum=0, maximum=2)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = documented(minimum=-1)  # extension (vLLM)
    seed: int | None = documented(minimum=0, maximum=2**64 - 1)
    stop: str | list[str] | None = documented(minLength=1, maxItems=4, items={"type": "string", "minLength": 1})
    stop_token_ids: list[int] | None = documented(items={"type": "integer", "minimum": 0})  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)
    n: int = documented(1, minimum=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: dict[str, Any] | None = None  # extension: vLLM --speculative-config keys
    cache_salt: str | None = documented(pattern=f"^{CACHE_SALT_PATTERN}$")  # extension (vLLM)
    user: str | None = None  # an end-user id for the provider's abuse tracking: nothing to do
    presence_penalty: float | None = documented(minimum=-2, maximum=2)
    frequency_penalty: float | None = documented(minimum=-2, maximum=2)
    repetition_penalty: float | None = documented(exclusiveMinimum=0, maximum=2)  # extension (vLLM)
    min_p: float | None = documented(minimum=0, maximum=1)  # extension (vLLM)
    min_tokens: int = documented(0, minimum=0)  # extension (vLLM)
    # Token id (as a JSON key) -> bias.
    logit_bias: dict[str, float] | None = documented(propertyNames={"pattern": "^[0-9]+$"},
                                                     additionalProperties={"type": "number", "minimum": -100,
                                                                           "maximum": 100})
    response_format: dict[str, Any] | None = None

    def logit_controls(self) -> LogitControls:
        given = {name: getattr(self, name) for name in SCALAR_LOGIT_CONTROLS}
        return LogitControls(**{name: value for name, value in given.items() if value is not None})


class ChatCompletionRequest(CompletionBase):
    refused: ClassVar[tuple[str, ...]] = (*CompletionBase.refused, "functions", "function_call", "audio",
                                          "modalities", "store", "reasoning_effort", "service_tier",
                                          "web_search_options")
    messages: list[ChatMessage] = documented(..., minItems=1)
    max_completion_tokens: int | None = None
    metadata: dict[str, str] | None = None  # only labels stored completions, which we do not store
    logprobs: bool = False
    top_logprobs: int | None = documented(minimum=0, maximum=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    prediction: Prediction | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM), e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True  # extension (vLLM)
    continue_final_message: bool = False  # extension (vLLM)

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def prediction_text(self) -> str | None:
        if self.prediction is None:
            return None
        if self.prediction.type != "content":
            raise InvalidRequest("prediction.type must be content", "prediction.type")
        content = self.prediction.content
        return content if isinstance(content, str) else "".join(part.text or "" for part in content)


class CompletionRequest(CompletionBase):
    refused: ClassVar[tuple[str, ...]] = (*CompletionBase.refused, "echo", "suffix", "best_of")
    # A text, or token ids (batched prompts are refused).
    prompt: Any = documented(..., anyOf=[{"type": "string"}, {"type": "array", "items": {"type": "integer",
                                                                                         "minimum": 0}}])
    # The legacy API's count of top alternatives (up to 5).
    logprobs: int | None = documented(minimum=0, maximum=MAX_LEGACY_LOGPROBS)

    def top_logprobs_count(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LEGACY_LOGPROBS:
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_LEGACY_LOGPROBS}", "logprobs")
        return self.logprobs


def validation_message(error: dict) -> tuple[str, str | None]:
    """A readable message and the offending parameter for one pydantic error."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if error["type"] == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}", None
    if error["type"] == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if error["type"] == "unreadable_json":
        return error["msg"], error["ctx"]["param"]
    if error["type"] == "missing":
        if param is None:  # no body at all
            return "the request body is missing: send a JSON object", None
        return f"missing required parameter: {param}", param
    return (f"{param}: {error['msg']}" if param else error["msg"]), param


def check_extra_fields(body: CompletionBase) -> None:
    for name, value in (body.model_extra or {}).items():
        if name not in body.refused:  # OpenAI's own answer to unknown fields
            raise InvalidRequest(f"Unrecognized request argument supplied: {name}", name)
        if value and value not in NEUTRAL_VALUES.get(name, ()):
            raise InvalidRequest(f"{name} is not supported by this server", name)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    rendered = []
    for index, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise InvalidRequest("only text content parts are supported", f"messages.{index}.content")
            content = "\n".join(part.text or "" for part in content)
        rendered.append({**message.model_dump(exclude_none=True), "content": content})
    return rendered


def completion_prompt(prompt: Any) -> dict:
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"token_ids": prompt}
    raise InvalidRequest("prompt must be a string or a list of token ids (batched prompts are not supported)",
                         "prompt")
