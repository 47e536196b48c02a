"""The peer users would otherwise reach for: Hugging Face transformers'
`generate`, plain and with prompt lookup (`prompt_lookup_num_tokens=k`), run
in-process on the same model and conversations, one request at a time."""

import asyncio
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as transformers_logging

from speclane_cli.bench.conversation import Conversation, replay
from speclane_cli.bench.stats import RequestResult

PEER_METHODS = ("hf-generate", "hf-prompt-lookup")


class _TokenClock(BaseStreamer):
    """Times the first generated token: generate() puts the prompt first, then each step's tokens."""

    def __init__(self):
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class HfPeer:
    def __init__(self, model_dir, num_speculative_tokens: int | None, request_fields: dict):
        # One thread, as the verifier decodes (speclane serve --threads 0 means 1).
        torch.set_num_threads(1)
        transformers_logging.disable_progress_bar()  # its bar would tear the benchmark's own
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # None: transformers' own default prompt_lookup_num_tokens
        self.num_speculative_tokens = num_speculative_tokens or 10
        self.max_new_tokens = request_fields["max_tokens"]
        temperature = request_fields.get("temperature") or 0.0
        self.sampling = {"do_sample": temperature > 0}
        if temperature > 0:
            self.sampling.update(temperature=temperature, top_p=request_fields.get("top_p") or 1.0, top_k=0)
        # Each forward after the prefill is one verify step over 1 + (drafted tokens) inputs.
        self._forward_lengths: list[int] = []
        self.model.register_forward_pre_hook(self._record_forward, with_kwargs=True)

    def _record_forward(self, module, args, kwargs) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None:
            self._forward_lengths.append(input_ids.shape[-1])

    @torch.inference_mode()
    def generate(self, messages: list[dict], prompt_lookup: bool) -> tuple[RequestResult, str]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)
        clock = _TokenClock()
        lookup = {"prompt_lookup_num_tokens": self.num_speculative_tokens} if prompt_lookup else {}
        self._forward_lengths.clear()
        start = time.perf_counter()
        output = self.model.generate(**prompt, max_new_tokens=self.max_new_tokens, streamer=clock,
                                     pad_token_id=self.tokenizer.eos_token_id, **self.sampling, **lookup)
        end = time.perf_counter()
        prompt_length = prompt["input_ids"].shape[-1]
        new_tokens = output[0, prompt_length:]
        steps = self._forward_lengths[1:]
        result = RequestResult(
            ok=True, input_tokens=prompt_length, output_tokens=len(new_tokens),
            ttft=(clock.first_token_at or end) - start, e2e=end - start,
            draft_tokens=sum(length - 1 for length in steps),
            accepted_tokens=max(0, len(new_tokens) - 1 - len(steps)), verify_steps=len(steps),
        )
        return result, self.tokenizer.decode(new_tokens, skip_special_tokens=True)

    def run(self, conversations: list[Conversation], method: str,
            on_request: Callable[[int], None]) -> tuple[list[RequestResult], float]:
        """Replays the conversations one request at a time, as the closed loop does at concurrency 1."""
        async def ask(conversation: Conversation, replies: list[str]) -> tuple[RequestResult, str]:
            try:
                return self.generate(conversation.messages(replies), method == "hf-prompt-lookup")
            except (RuntimeError, ValueError) as error:
                return RequestResult(ok=False, error=f"{type(error).__name__}: {error}"), ""

        return asyncio.run(replay(conversations, 1, ask, on_request))
