"""The load of `speclane bench soak`: `concurrency` workers, each sending its next
chat request as soon as the previous one ends, until the duration is over. Every
request draws its shape from a seeded generator: a HumanEval or ShareGPT prompt,
streamed or whole, greedy or sampled, with or without stop strings, the server's
speculation or another method, and a share of streams the client leaves early."""

import asyncio
import dataclasses
import json
import random
import time

import httpx

from speclane_cli.bench.client import api_base

STREAM_SHARE = 0.6  # of the requests that are not deliberate disconnects, the rest are whole replies
STOP_STRINGS = (["\n\n"], ["```"], ["def "], [". ", "!"])
# None: the server's own speculation settings.
SPECULATION = (None, None, {"method": "ngram"}, {"method": "none"}, {"method": "suffix"})
REQUEST_TIMEOUT_SECONDS = 600.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: str  # "stream", "whole" or "disconnect" (a stream the client leaves after a few chunks)
    ok: bool
    ended: float  # seconds since the load started
    e2e: float = 0.0
    ttft: float | None = None  # streams: seconds to the first content
    output_tokens: int = 0
    error: str = ""
    disconnected: bool = False  # left early on purpose (not an error)


@dataclasses.dataclass(frozen=True)
class Plan:
    body: dict
    kind: str
    leave_after_chunks: int = 0


def plan(rng: random.Random, model: str, prompts: list[str], max_tokens: int, disconnect_fraction: float) -> Plan:
    """One request's shape."""
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(prompts)}],
            "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens)}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
    if rng.random() < 0.25:
        body["stop"] = rng.choice(STOP_STRINGS)
    if (speculation := rng.choice(SPECULATION)) is not None:
        body["speculation"] = speculation
    draw = rng.random()
    if draw < disconnect_fraction:
        return Plan(body, "disconnect", rng.randint(1, 4))
    return Plan(body, "stream" if draw < disconnect_fraction + (1 - disconnect_fraction) * STREAM_SHARE else "whole")


async def _whole(client: httpx.AsyncClient, url: str, plan: Plan) -> tuple[str, int, float | None, bool]:
    """(error or "", output tokens, ttft, disconnected)"""
    reply = await client.post(f"{api_base(url)}/chat/completions", json=plan.body)
    if reply.status_code != 200:
        return f"HTTP {reply.status_code}: {reply.text[:200]}", 0, None, False
    body = reply.json()
    choice = (body.get("choices") or [{}])[0]
    if choice.get("finish_reason") not in ("stop", "length") or "message" not in choice or "usage" not in body:
        return f"malformed reply: {json.dumps(body)[:200]}", 0, None, False
    return "", body["usage"]["completion_tokens"], None, False


async def _stream(client: httpx.AsyncClient, url: str, plan: Plan) -> tuple[str, int, float | None, bool]:
    body = {**plan.body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, chunks, usage, finish_reason, done = None, 0, None, None, False
    async with client.stream("POST", f"{api_base(url)}/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return f"HTTP {reply.status_code}: {reply.text[:200]}", 0, None, False
        async for line in reply.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:  # the server failed after the headers were sent
                return f"error event: {json.dumps(chunk['error'])[:200]}", 0, ttft, False
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    chunks += 1
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = chunk.get("usage") or usage
            if plan.leave_after_chunks and chunks >= plan.leave_after_chunks and finish_reason is None:
                return "", 0, ttft, True  # leaving the block closes the connection mid-stream
    if not done or finish_reason not in ("stop", "length") or usage is None:
        return f"incomplete stream: [DONE] {done}, finish_reason {finish_reason}, usage {usage}", 0, ttft, False
    return "", usage["completion_tokens"], ttft, False


async def one_request(client: httpx.AsyncClient, url: str, plan: Plan, load_start: float) -> Outcome:
    start = time.perf_counter()
    try:
        send = _whole if plan.kind == "whole" else _stream
        error, tokens, ttft, disconnected = await send(client, url, plan)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        error, tokens, ttft, disconnected = f"{type(exc).__name__}: {exc}", 0, None, False
    end = time.perf_counter()
    return Outcome(plan.kind, not error, end - load_start, end - start, ttft, tokens, error, disconnected)


async def run_load(url: str, model: str, prompts: list[str], concurrency: int, duration: float, max_tokens: int,
                   disconnect_fraction: float, seed: int, load_start: float, outcomes: list[Outcome]) -> None:
    """Closed loop until `duration` seconds after `load_start` (a time.perf_counter()
    value); requests in flight then run to their end. Appends to `outcomes` as they end."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # trust_env=False: a proxy in the environment must never carry loopback traffic.
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_SECONDS, limits=limits, trust_env=False) as client:

        async def worker(index: int) -> None:
            rng = random.Random(f"{seed}-{index}")
            while time.perf_counter() - load_start < duration:
                request = plan(rng, model, prompts, max_tokens, disconnect_fraction)
                outcomes.append(await one_request(client, url, request, load_start))

        await asyncio.gather(*(worker(index) for index in range(concurrency)))
