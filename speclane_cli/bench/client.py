"""A closed-loop load generator over the OpenAI streaming chat API: each of
`concurrency` workers replays its next conversation as soon as the previous one
ends, and every request's timings and `usage.speculation` are recorded."""

import json
import time
from collections.abc import Callable

import httpx

from protos.conventions import TENANT_METADATA_KEY
from speclane_cli.bench.conversation import replay
from speclane_cli.bench.stats import RequestResult

REQUEST_TIMEOUT_SECONDS = 600.0


class ServerUnreachable(RuntimeError):
    pass


def api_base(url: str) -> str:
    """http://host:port or http://host:port/v1 -> http://host:port/v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def served_models(url: str) -> list[str]:
    """The models the server lists; ServerUnreachable with the reason if it does not answer."""
    try:
        reply = httpx.get(f"{api_base(url)}/models", timeout=10)
        reply.raise_for_status()
        return [model["id"] for model in reply.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        raise ServerUnreachable(f"no OpenAI-compatible server answers at {api_base(url)}/models ({error})") from None


def _assistant_message(content: list[str], calls: dict[int, dict]) -> dict:
    """The streamed reply as the assistant message a client puts in its history."""
    message = {"role": "assistant", "content": "".join(content) or (None if calls else "")}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return message


def _add_call_deltas(calls: dict[int, dict], deltas: list[dict]) -> None:
    """Streamed tool calls come as an id and name, then pieces of the arguments' JSON text."""
    for delta in deltas:
        call = calls.setdefault(delta.get("index", 0),
                                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> tuple[RequestResult, dict]:
    """Sends one streaming chat request; returns its result and the reply as an assistant message
    (content, and tool_calls when it called tools); on failure the message is empty."""
    start = time.perf_counter()
    first_token_at = None
    pieces, calls, usage, error = [], {}, None, ""
    try:
        async with client.stream("POST", f"{api_base(url)}/chat/completions", json=body, headers=headers) as reply:
            if reply.status_code != 200:
                await reply.aread()
                return RequestResult(ok=False, error=f"HTTP {reply.status_code}: {reply.text[:200]}"), {}
            async for line in reply.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                if "error" in chunk:  # the server failed after the headers were sent
                    error = str(chunk["error"].get("message", chunk["error"]))
                    break
                deltas = [choice.get("delta", {}) for choice in chunk.get("choices", ())]
                text = "".join(delta.get("content") or "" for delta in deltas)
                call_deltas = [call for delta in deltas for call in delta.get("tool_calls") or ()]
                # As vLLM's benchmark counts it: the first chunk with choices, which servers send
                # once the first token exists (the role), even when the first visible text is a tool
                # call's name some tokens later.
                if deltas:
                    first_token_at = first_token_at or time.perf_counter()
                pieces.append(text)
                _add_call_deltas(calls, call_deltas)
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    if not error and usage is None:
        error = "the stream ended without a usage chunk"
    if error:
        return RequestResult(ok=False, error=error), {}
    speculation = usage.get("speculation") or {}
    return RequestResult(
        ok=True, input_tokens=usage.get("prompt_tokens", 0), output_tokens=usage.get("completion_tokens", 0),
        ttft=(first_token_at or end) - start, e2e=end - start,
        draft_tokens=speculation.get("draft_tokens"), accepted_tokens=speculation.get("accepted_tokens"),
        verify_steps=speculation.get("verify_steps"), next_round_steps=speculation.get("next_round_steps"),
        tool_calls=len(calls), cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    ), _assistant_message(pieces, calls)


async def closed_loop(url: str, conversations: list, concurrency: int, request_fields: dict,
                      tenant: str, on_request: Callable[[int], None]) -> tuple[list[RequestResult], float]:
    """Replays the conversations (`Conversation`s, agent sessions) with `concurrency` workers (see
    `conversation.replay`); `request_fields` go into every request body (model, sampling, speculation)."""
    # The tenant keeps this run's responses in a suffix tree of their own, so a
    # run never drafts from another method's answers to the same prompts.
    headers = {TENANT_METADATA_KEY: tenant}
    body = {**request_fields, "stream": True, "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_SECONDS, limits=limits) as client:
        return await replay(conversations, concurrency,
                            lambda conversation, replies: stream_chat(
                                client, url, {**conversation.request(replies), **body}, headers),
                            on_request)
