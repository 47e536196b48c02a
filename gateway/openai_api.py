"""OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions (with SSE
streaming), /v1/models, /health and /metrics, over a ServingContext."""

import dataclasses
import time
import uuid

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from gateway.anthropic_api import MESSAGES_PATH, add_messages_routes, anthropic_error_body
from gateway.auth import tenant_for
from gateway.chat_template import ChatPrompt
from gateway.errors import InvalidRequest
from gateway.http_serving import bind_request, choice_events, request_caller, unless_disconnected
from gateway.metrics import CONTENT_TYPE
from gateway.openai_protocol import (
    LEGACY_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionBase,
    CompletionRequest,
    chat_messages,
    check_extra_fields,
    completion_prompt,
    validation_message,
)
from gateway.openai_responses import (
    CHAT,
    TEXT,
    ApiFlavor,
    EventStream,
    ResponseWriter,
    UsageTally,
    error_body,
    error_for,
)
from gateway.responses_api import add_responses_routes
from gateway.serving import (
    MAX_SEED,
    GenerationParams,
    ServingContext,
    build_generation_request,
    prompt_tail,
)
from gateway.structured_output import response_format_grammar, tool_choice_plan, tools_or_format_grammar
from protos.conventions import TENANT_METADATA_KEY

log = structlog.get_logger()


def _tool_plan(ctx: ServingContext, body: ChatCompletionRequest):
    return tool_choice_plan(ctx.tool_call_parser, body.tools, body.tool_choice, body.parallel_tool_calls,
                            ctx.auto_tool_choice)


def _chat_prompt(body: ChatCompletionRequest) -> ChatPrompt:
    # With tool_choice "none" the tools still reach the template, as vLLM does; no call is read back.
    return ChatPrompt(chat_messages(body.messages), tools=body.tools,
                      add_generation_prompt=body.add_generation_prompt,
                      continue_final_message=body.continue_final_message,
                      template_kwargs=body.chat_template_kwargs or {})


def error_shape(path: str):
    """The error body of the API a path belongs to: Anthropic's for /v1/messages, else OpenAI's."""
    return anthropic_error_body if path.startswith(MESSAGES_PATH) else error_body


class RequireApiKey:
    """ASGI middleware: with keys configured, /v1/ (and /metrics with --protect-metrics)
    answers 401 (OpenAI's body) without one, and the caller's key rides in the request's
    state. Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap our streams."""

    def __init__(self, app, ctx: ServingContext):
        self.app, self.ctx = app, ctx

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1/") or (self.ctx.protect_metrics and path == "/metrics")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.ctx.keyring and self._protected(scope["path"]):
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not authorization and b"x-api-key" in headers:  # Anthropic's clients send their key so
                authorization = "Bearer " + headers[b"x-api-key"].decode("latin-1")
            caller = self.ctx.keyring.authenticate(authorization)
            if caller is None:
                self.ctx.metrics.record_error("unauthenticated")
                body = error_shape(scope["path"])(
                    "Incorrect or missing API key: send Authorization: Bearer KEY (or x-api-key: KEY)",
                    "authentication_error", code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = caller
        await self.app(scope, receive, send)


class LimitRequestBody:
    """ASGI middleware: a request body over --max-request-body-bytes gets 413 (OpenAI's
    body) before any of it is parsed: at once when its Content-Length says so, else as
    soon as the bytes received pass the limit (a chunked upload). It reads the body
    whole, as the JSON parsing behind it would, and hands it on."""

    def __init__(self, app, ctx: ServingContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.ctx.max_request_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was in: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body_sent = False

        async def replay():
            # The body once, then the client's own messages (its disconnect, which streams watch for).
            nonlocal body_sent
            if body_sent:
                return await receive()
            body_sent = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        self.ctx.metrics.record_error("request_too_large")
        limit = self.ctx.max_request_body_bytes
        body = error_shape(scope["path"])(f"The request body is larger than this server's limit of {limit} bytes",
                                          "invalid_request_error", code="request_too_large")
        # The rest of the body is never read, so this connection cannot carry another request.
        await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)


def create_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="speclane gateway")
    # The last added runs first: a caller without a key is refused before its body is read.
    app.add_middleware(LimitRequestBody, ctx=ctx)
    app.add_middleware(RequireApiKey, ctx=ctx)
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        message, param = validation_message(error.errors()[0])
        ctx.metrics.record_error("invalid_request")
        return JSONResponse(error_shape(request.url.path)(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        body = error_shape(request.url.path)(str(error.detail), "invalid_request_error",
                                             code="not_found" if error.status_code == 404 else None)
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    async def complete(request: Request, flavor: ApiFlavor, body: CompletionBase, max_tokens: int | None):
        response_id = f"{flavor.id_prefix}-{uuid.uuid4().hex}"
        request_id = bind_request(request, response_id)
        headers = {"X-Request-Id": request_id}
        caller = request_caller(request)
        try:
            check_extra_fields(body)
            if not 1 <= body.n <= ctx.max_concurrent_requests:
                raise InvalidRequest(f"n must be between 1 and {ctx.max_concurrent_requests}", "n")
            if body.stream_options is not None and not body.stream:
                raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")
            stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
            tool_grammar, tool_parser = _tool_plan(ctx, body) if flavor.chat else (None, None)
            grammar = response_format_grammar(body.response_format)
            if flavor.chat:
                grammar = tools_or_format_grammar(grammar, tool_grammar, tool_parser, body.tools,
                                                  body.parallel_tool_calls)
            params = GenerationParams(
                model=body.model, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                top_k=body.top_k, seed=body.seed, stop=stop, stop_token_ids=body.stop_token_ids or (),
                ignore_eos=body.ignore_eos, speculation=body.speculation,
                tenant=tenant_for(caller, request.headers.get(TENANT_METADATA_KEY)), cache_salt=body.cache_salt,
                logit_controls=body.logit_controls(),
                logit_bias=body.logit_bias or {}, logprobs=body.top_logprobs_count(),
                prediction=body.prediction_text() if flavor.chat else None, grammar=grammar)
            prompt = {"chat": _chat_prompt(body)} if flavor.chat else completion_prompt(body.prompt)
            base = build_generation_request(ctx, request_id, params, **prompt)
            requests = [base] if body.n == 1 else [
                # Distinct ids downstream (one KV cache each) and distinct samples for one seed.
                dataclasses.replace(base, request_id=f"{request_id}-{index}",
                                    seed=None if base.seed is None else (base.seed + index) % MAX_SEED)
                for index in range(body.n)]
            events = choice_events(ctx, requests, stop, caller)
            writer = ResponseWriter(ctx, flavor, response_id, body.n, UsageTally(len(base.prompt_token_ids)),
                                    tool_parser=tool_parser, logprobs=base.logprobs is not None,
                                    prompt_text=prompt_tail(ctx, base))
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                # Waiting for the first tokens lets overload and bad input still get a status code.
                first = await anext(events)
                return EventStream(writer.events(first, events, include_usage),
                                   headers={**headers, "Cache-Control": "no-cache"})
            result = await unless_disconnected(request, writer.body(events))
            if result is None:
                log.info("client disconnected")
                return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
            return JSONResponse(result, headers=headers)
        except Exception as error:  # noqa: BLE001 - every failure gets an OpenAI error body (5xx if unexpected)
            status, error_json = error_for(ctx, error)
            return JSONResponse(error_json, status_code=status, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await complete(request, CHAT, body, max_tokens)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        max_tokens = body.max_tokens if body.max_tokens is not None else LEGACY_DEFAULT_MAX_TOKENS
        return await complete(request, TEXT, body, max_tokens)

    add_messages_routes(app, ctx)
    add_responses_routes(app, ctx)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": started,
                                            "owned_by": "speclane", "max_model_len": ctx.max_context_len}]}

    @app.get("/health")
    async def health():
        try:
            ready = await ctx.ready()
        except Exception as error:  # noqa: BLE001 - a failing check means not ready
            log.warning("readiness check failed", error=str(error))
            ready = False
        return Response(status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return app
