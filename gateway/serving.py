"""What both front ends (OpenAI HTTP, gRPC Generate) share: turning a request
into a validated GenerationRequest, a concurrency limit, and running the
propose/verify loop with detokenization and stop strings on top."""

import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from gateway.auth import Keyring
from gateway.chat_template import ChatPrompt, render_chat
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, ConcurrencyLimiter
from gateway.metrics import GatewayMetrics
from gateway.reasoning import ReasoningParser
from gateway.response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from gateway.sampling_defaults import MAX_REPETITION_PENALTY, SamplingDefaults
from gateway.stop_strings import StopStringMatcher
from gateway.tool_calls import TOOL_CALL_PARSERS, ToolCallParser
from gateway.types import (
    CACHE_SALT_PATTERN,
    GenerationRequest,
    LogitControls,
    SpeculationUsage,
    TokenDelta,
    TokenLogprob,
)
from speclane.speculation import HEAD_METHODS, DrafterLimits, SpeculationSettings

MAX_STOP_STRINGS = 4  # OpenAI's limit
CACHE_SALT = re.compile(CACHE_SALT_PATTERN)
MAX_SEED = 2**64  # seeds travel as uint64
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_TOP_K = 2**31 - 1  # larger top_k are sent as this (the same: no cut)

GenerateFn = Callable[[GenerationRequest], AsyncIterator[TokenDelta]]


@dataclass
class ServingContext:
    model_name: str
    tokenizer: object  # any Hugging Face tokenizer
    generate: GenerateFn
    default_speculation: SpeculationSettings
    max_context_len: int
    max_concurrent_requests: int
    metrics: GatewayMetrics
    ready: Callable[[], Awaitable[bool]]
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    keyring: Keyring = field(default_factory=Keyring)  # empty: no authentication
    protect_metrics: bool = False  # /metrics needs a key too
    max_tokens_limit: int = 0  # 0: only the context length limits max_tokens
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # HTTP only
    chat_template: str | None = None  # None: the tokenizer's
    tool_call_parser: ToolCallParser | None = TOOL_CALL_PARSERS["hermes"]  # None: tools are refused
    auto_tool_choice: bool = True  # tool_choice auto reads calls from the output
    reasoning_parser: ReasoningParser | None = None  # None: reasoning stays in the content
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(DEFAULT_MAX_STORED_RESPONSES))
    # What the drafter reported of itself (None until reached): requests are checked against it.
    drafter_limits: Callable[[], DrafterLimits | None] = lambda: None
    draft_head: str = ""  # the verifiers' head method (eagle, eagle3, mtp); "" without one
    limiter: ConcurrencyLimiter = field(init=False)

    def __post_init__(self):
        self.limiter = ConcurrencyLimiter(self.max_concurrent_requests)


def _check_head(ctx: ServingContext, method: str) -> None:
    """A head method must be the verifiers' own head; hybrid needs one of any kind."""
    wanted = method if method in HEAD_METHODS else ("a draft head" if method == "hybrid" else None)
    if wanted is None or (ctx.draft_head and method in (ctx.draft_head, "hybrid")):
        return
    have = f"a {ctx.draft_head} head" if ctx.draft_head else "no draft head"
    raise InvalidRequest(f"speculation method {method!r} needs {wanted}; the verifier has {have} "
                         "(start it with --speculative-config method eagle, eagle3 or mtp)", "speculation")


@dataclass(frozen=True)
class GenerationParams:
    """A request's generation settings, as either front end parsed them."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    speculation: dict | None = None  # overrides of ctx.default_speculation
    tenant: str = ""
    cache_salt: str | None = None  # vLLM's per-request prefix-cache salt
    logit_controls: LogitControls = LogitControls()
    logit_bias: dict = field(default_factory=dict)  # token id (int or its string) -> bias
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    prediction: str | None = None  # OpenAI's predicted output
    grammar: str | None = None  # structured output (llguidance Lark), from response_format or tool_choice


def prompt_tail(ctx: ServingContext, request: GenerationRequest) -> str:
    """The prompt's last few tokens as text: enough to see whether it opened a reasoning block."""
    return ctx.tokenizer.decode(request.prompt_token_ids[-8:]) if ctx.reasoning_parser is not None else ""


def text_prompt_ids(ctx: ServingContext, text: str) -> list[int]:
    return ctx.tokenizer.encode(text)


def _check_token_ids(ctx: ServingContext, token_ids: Sequence[int], param: str) -> list[int]:
    vocab_size = len(ctx.tokenizer)
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"{param} contains token id {token_id}, outside the vocabulary [0, {vocab_size})",
                                 param)
    return list(token_ids)


def _check_params(params: GenerationParams) -> None:
    if params.max_tokens is not None and params.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {params.max_tokens}", "max_tokens")
    if params.temperature is not None and not 0 <= params.temperature <= 2:
        raise InvalidRequest(f"temperature must be between 0 and 2, got {params.temperature}", "temperature")
    if params.top_p is not None and not 0 < params.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
    if params.top_k is not None and params.top_k < -1:
        raise InvalidRequest(f"top_k must be -1 or 0 (disabled) or a positive number, got {params.top_k}", "top_k")
    if params.seed is not None and not 0 <= params.seed < MAX_SEED:
        raise InvalidRequest("seed must be between 0 and 2**64 - 1", "seed")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(params.stop)}", "stop")
    if any(not isinstance(stop, str) or not stop for stop in params.stop):
        raise InvalidRequest("stop strings must be non-empty strings", "stop")
    if params.cache_salt is not None and not CACHE_SALT.fullmatch(params.cache_salt):
        raise InvalidRequest("cache_salt must be 1 to 128 characters, none of them '@', '/', '\\' or NUL",
                             "cache_salt")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {params.logprobs}",
                             "top_logprobs")
    controls = params.logit_controls
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(controls, name) <= 2:
            raise InvalidRequest(f"{name} must be between -2 and 2, got {getattr(controls, name)}", name)
    if controls.repetition_penalty is not None and not 0 < controls.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidRequest(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got "
                             f"{controls.repetition_penalty}", "repetition_penalty")
    if controls.min_p is not None and not 0 <= controls.min_p <= 1:
        raise InvalidRequest(f"min_p must be between 0 and 1, got {controls.min_p}", "min_p")
    if controls.min_tokens < 0 or (params.max_tokens is not None and controls.min_tokens > params.max_tokens):
        raise InvalidRequest(f"min_tokens must be between 0 and max_tokens, got {controls.min_tokens}", "min_tokens")


def _logit_bias(ctx: ServingContext, bias: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (JSON keys are token id strings) as checked (id, bias) pairs."""
    pairs = []
    for key, value in bias.items():
        # A string of ASCII digits (int() would also take " 5", "+5", "5_0" and other scripts' digits: "٥").
        digits = isinstance(key, str) and key.isascii() and key.isdigit()
        if not digits and (isinstance(key, bool) or not isinstance(key, int)):
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        token_id = int(key)
        if not isinstance(value, int | float) or not -100 <= value <= 100:
            raise InvalidRequest(f"logit_bias values must be numbers between -100 and 100, got {value!r}",
                                 "logit_bias")
        pairs.append((token_id, float(value)))
    _check_token_ids(ctx, [token_id for token_id, _ in pairs], "logit_bias")
    return tuple(pairs)


def _max_tokens(ctx: ServingContext, prompt_len: int, requested: int | None) -> int:
    """The request's output budget; refusals word it as vLLM does, which clients parse."""
    room = ctx.max_context_len - prompt_len
    if room < 1:
        raise InvalidRequest(f"This model's maximum context length is {ctx.max_context_len} tokens. However, your "
                             f"request has {prompt_len} input tokens. Please reduce the length of the input messages.")
    if requested is None:
        return min(limit for limit in (room, ctx.max_tokens_limit, ctx.sampling_defaults.max_tokens) if limit)
    if ctx.max_tokens_limit and requested > ctx.max_tokens_limit:
        raise InvalidRequest(f"max_tokens must be at most {ctx.max_tokens_limit} on this server, got {requested}",
                             "max_tokens")
    if requested > room:
        raise InvalidRequest(f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
                             f"maximum context length is {ctx.max_context_len} tokens and your request has "
                             f"{prompt_len} input tokens ({requested} > {ctx.max_context_len} - {prompt_len}).",
                             "max_tokens")
    return requested


def _given_or(value, default):
    return default if value is None else value


def _logit_controls(ctx: ServingContext, params: GenerationParams) -> LogitControls:
    """The request's controls, the model's defaults for those it leaves out."""
    controls, defaults = params.logit_controls, ctx.sampling_defaults
    return replace(controls, repetition_penalty=_given_or(controls.repetition_penalty, defaults.repetition_penalty),
                   min_p=_given_or(controls.min_p, defaults.min_p), logit_bias=_logit_bias(ctx, params.logit_bias))


def build_generation_request(ctx: ServingContext, request_id: str, params: GenerationParams, *,
                             chat: ChatPrompt | None = None, text: str | None = None,
                             token_ids: Sequence[int] | None = None) -> GenerationRequest:
    """Validates a request whose prompt is exactly one of a chat, text or token ids.

    Raises ModelNotFound or InvalidRequest with a message meant for the client.
    """
    if params.model and params.model != ctx.model_name:
        raise ModelNotFound(f"the model {params.model!r} does not exist; this server serves {ctx.model_name!r}",
                            "model")
    _check_params(params)
    if sum(prompt is not None for prompt in (chat, text, token_ids)) != 1:
        raise InvalidRequest("give exactly one of messages, a text prompt or a token id prompt", "prompt")
    if chat is not None:
        prompt_ids = render_chat(ctx.tokenizer, ctx.chat_template, chat)
    elif text is not None:
        prompt_ids = text_prompt_ids(ctx, text)
    else:
        prompt_ids = _check_token_ids(ctx, token_ids, "prompt")
    if not prompt_ids:
        raise InvalidRequest("the prompt must not be empty", "prompt")
    try:
        limits = ctx.drafter_limits()
        speculation = ctx.default_speculation.merged(params.speculation or {}, limits).with_draft_length(limits)
    except ValueError as error:
        raise InvalidRequest(str(error), "speculation") from error
    _check_head(ctx, speculation.method)
    stop_token_ids = _check_token_ids(ctx, params.stop_token_ids, "stop_token_ids")
    if not params.ignore_eos and ctx.tokenizer.eos_token_id is not None:
        stop_token_ids.append(ctx.tokenizer.eos_token_id)
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        max_tokens=_max_tokens(ctx, len(prompt_ids), params.max_tokens),
        speculation=speculation,
        temperature=_given_or(params.temperature, ctx.sampling_defaults.temperature),
        top_p=_given_or(params.top_p, ctx.sampling_defaults.top_p),
        # Any k beyond the vocabulary keeps every token; the verifier's field is an int32.
        top_k=min(top_k, MAX_TOP_K) if (top_k := _given_or(params.top_k, ctx.sampling_defaults.top_k)) and top_k > 0
        else None,
        seed=params.seed,
        stop_token_ids=stop_token_ids,
        ignore_eos=params.ignore_eos,
        tenant=params.tenant,
        cache_salt=params.cache_salt or "",
        logit_controls=_logit_controls(ctx, params),
        logprobs=params.logprobs,
        grammar=params.grammar,
        prediction_token_ids=tuple(ctx.tokenizer.encode(params.prediction, add_special_tokens=False))
        if params.prediction else (),
    )


@dataclass(frozen=True)
class TextDelta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    speculation: SpeculationUsage | None = None  # cumulative, on the last delta
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when asked for
    stop_string: str | None = None  # on the last delta, the stop string that ended the output
    cached_tokens: int = 0  # on the last delta, prompt tokens the prefix cache held


class _TextStream:
    """Detokenizer and stop strings over one generation's tokens."""

    def __init__(self, ctx: ServingContext, request: GenerationRequest, stop_strings: Sequence[str]):
        self.detokenizer = IncrementalDetokenizer(ctx.tokenizer, request.prompt_token_ids)
        self.stops = StopStringMatcher(stop_strings)

    def advance(self, token_ids: list[int]) -> tuple[list[int], str, bool]:
        """Returns the tokens kept, their text, and whether a stop string ended the output.

        Token by token, so that a stop string cuts the token ids where it cuts the text.
        """
        pieces = []
        for count, token_id in enumerate(token_ids, start=1):
            text, stopped = self.stops.push(self.detokenizer.push([token_id]))
            pieces.append(text)
            if stopped:
                return token_ids[:count], "".join(pieces), True
        return token_ids, "".join(pieces), False

    def finish(self) -> tuple[str, bool]:
        text, stopped = self.stops.push(self.detokenizer.flush())
        return (text, True) if stopped else (text + self.stops.flush(), False)


async def generate_text(ctx: ServingContext, request: GenerationRequest,
                        stop_strings: Sequence[str] = ()) -> AsyncIterator[TextDelta]:
    """Runs one generation, yielding text as it is committed.

    The last delta has finish_reason and speculation usage. A stop string ends
    the output with "stop" and closes the token generator, which aborts the
    generation downstream; so does closing this generator early. Front ends
    hold a `ctx.limiter.acquire()` slot around it.
    """
    stream = _TextStream(ctx, request, stop_strings)
    started = time.perf_counter()
    generated = 0
    usage, cached_tokens = None, 0
    outcome = "abort"  # unless we get to the end
    with ctx.metrics.in_flight():
        try:
            async with contextlib.aclosing(ctx.generate(request)) as deltas:
                async for delta in deltas:
                    if delta.speculation is not None:
                        usage, cached_tokens = delta.speculation, delta.cached_tokens
                    if generated == 0 and delta.token_ids:
                        ctx.metrics.record_first_token(time.perf_counter() - started)
                    token_ids, text, stopped = stream.advance(delta.token_ids)
                    logprobs = delta.logprobs[:len(token_ids)]
                    generated += len(token_ids)
                    if delta.finish_reason and not stopped:
                        tail, stopped = stream.finish()
                        text += tail
                    if stopped:
                        await deltas.aclose()  # abort downstream before the client hears of it
                    finish_reason = "stop" if stopped else delta.finish_reason
                    if finish_reason:
                        outcome = finish_reason
                        yield TextDelta(token_ids, text, finish_reason, usage or SpeculationUsage(), logprobs,
                                        stream.stops.matched, cached_tokens)
                        return
                    if token_ids or text:
                        yield TextDelta(token_ids, text, logprobs=logprobs)
            raise RuntimeError("generation ended without a finish reason")
        except Exception:
            outcome = None  # the front end reports the error
            raise
        finally:
            if outcome is not None:
                ctx.metrics.record_request(outcome, len(request.prompt_token_ids), generated,
                                           time.perf_counter() - started)
