"""Test doubles for the gateway's text/HTTP layer: a small real tokenizer built
offline, a scripted stand-in for the propose/verify loop, and an ASGI driver
whose client disconnects."""

import asyncio
import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.metrics import GatewayMetrics
from gateway.serving import ServingContext
from gateway.types import SpeculationUsage, TokenDelta, TokenLogprob
from speclane.speculation import SpeculationSettings

SMOLLM2_DIR = pathlib.Path.home() / ".cache/speclane/models/smollm2-135m-instruct"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld, naïve café, smörgåsbord",
    "你好世界，今天天气很好。",
    "🚀 launch 🎉 party 👍🏽 thumbs",
    "def add(a, b):\n    return a + b\n",
]
# What the scripted engine generates unless told otherwise: multi-byte
# characters split across byte-level tokens, and a stop-string candidate.
COMPLETION = "Hello world! héllo 🚀 你好, done."
MODEL_NAME = "tiny-chatml"


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with a ChatML template: small vocabulary, so most
    non-ASCII characters span several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE)


class ScriptedEngine:
    """Stands in for the orchestrator's `generate`: commits `completion`
    (then EOS) in steps of `step_size` tokens; records requests and whether
    each generator was closed before it finished (a downstream abort)."""

    def __init__(self, tokenizer, completion: str = COMPLETION, step_size: int = 3,
                 finish_reason: str = "stop", error: Exception | None = None, usage_every_step: bool = True):
        self.tokenizer = tokenizer
        self.token_ids = tokenizer.encode(completion, add_special_tokens=False)
        if finish_reason == "stop":
            self.token_ids.append(tokenizer.eos_token_id)
        self.step_size = step_size
        self.finish_reason = finish_reason
        self.error = error
        self.usage_every_step = usage_every_step
        self.requests = []
        self.aborted = []
        self.started = asyncio.Event()
        self.hold = None  # an asyncio.Event to wait for after the first step, if given

    def usage(self, steps: int) -> SpeculationUsage:
        return SpeculationUsage(draft_tokens=4 * steps, accepted_tokens=2 * steps, verify_steps=steps)

    async def generate(self, request):
        self.requests.append(request)
        self.started.set()
        if self.error is not None:
            raise self.error
        token_ids = self.token_ids[:request.max_tokens]
        finish_reason = "length" if len(self.token_ids) > request.max_tokens else self.finish_reason
        steps = [token_ids[i:i + self.step_size] for i in range(0, len(token_ids), self.step_size)]
        finished = False
        try:
            for number, step in enumerate(steps, start=1):
                await asyncio.sleep(0)
                if number == 2 and self.hold is not None:
                    await self.hold.wait()
                finished = number == len(steps)
                usage = self.usage(number) if finished or self.usage_every_step else None
                yield TokenDelta(step, finish_reason if finished else None, usage,
                                 logprobs=() if request.logprobs is None else fake_logprobs(step, request.logprobs),
                                 cached_tokens=FAKE_CACHED_TOKENS if usage is not None else 0)
        finally:
            if not finished:
                self.aborted.append(request.request_id)


FAKE_CACHED_TOKENS = 2  # the prompt tokens every fake generation reports found in the prefix cache


def fake_logprobs(token_ids, top: int) -> tuple[TokenLogprob, ...]:
    """Each token as the most likely, at -token_id / 1000, then made-up runners-up."""
    return tuple(TokenLogprob(-token_id / 1000, tuple((token_id + rank, -(token_id + rank) / 1000 - rank)
                                                      for rank in range(top)))
                 for token_id in token_ids)


def make_context(tokenizer, engine: ScriptedEngine, *, max_context_len: int = 256,
                 max_concurrent_requests: int = 8, ready: bool = True) -> ServingContext:
    async def is_ready():
        return ready

    return ServingContext(
        model_name=MODEL_NAME, tokenizer=tokenizer, generate=engine.generate,
        default_speculation=SpeculationSettings(), max_context_len=max_context_len,
        max_concurrent_requests=max_concurrent_requests, metrics=GatewayMetrics(MODEL_NAME), ready=is_ready)


async def call_asgi(app, path: str, body: dict, *, disconnect_after_first_chunk: bool) -> list[dict]:
    """Drives the ASGI app like a server whose client goes away: either right
    after the request (while the response is computed) or after the first
    streamed chunk. Returns the messages the app sent."""
    disconnected = asyncio.Event()
    if not disconnect_after_first_chunk:
        disconnected.set()
    request_sent = False
    sent = []

    async def receive():
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            disconnected.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234), "server": ("test", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent
