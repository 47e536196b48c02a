"""Log-probabilities in OpenAI's two shapes: chat's list of token entries and
the legacy completions' parallel lists. Tokens are shown as their own text."""

from collections.abc import Sequence

from gateway.types import TokenLogprob


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _chat_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = _token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> list[dict]:
    """The entries of `choice.logprobs.content` for these tokens."""
    return [{**_chat_entry(tokenizer, token_id, entry.logprob),
             "top_logprobs": [_chat_entry(tokenizer, top_id, top) for top_id, top in entry.top]}
            for token_id, entry in zip(token_ids, logprobs)]


class TextLogprobs:
    """`choice.logprobs` of /v1/completions, built up delta by delta (offsets run on)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.offset = 0

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> dict:
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, logprobs):
            text = _token_text(self.tokenizer, token_id)
            body["tokens"].append(text)
            body["token_logprobs"].append(entry.logprob)
            body["top_logprobs"].append({_token_text(self.tokenizer, top_id): top for top_id, top in entry.top})
            body["text_offset"].append(self.offset)
            self.offset += len(text)
        return body


def merge_text_logprobs(parts: Sequence[dict]) -> dict:
    return {key: [value for part in parts for value in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
