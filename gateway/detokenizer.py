"""Incremental detokenization: token ids in, text deltas out.

Decoding token by token is wrong for most tokenizers: a character can span
several byte-level tokens, and SentencePiece-style decoders drop or add a
leading space depending on what precedes a token. So, as TGI and vLLM do, we
decode a short window twice -- the tokens already emitted from `prefix_offset`
up to `read_offset`, and the same window plus the new tokens -- and emit only
the difference. Text ending in U+FFFD is an unfinished UTF-8 sequence and is
held back until the following tokens complete it.
"""

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first generated tokens.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.token_ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the text they complete (possibly empty)."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held back at the end of the generation.

        Only non-empty when the output ends inside a UTF-8 sequence that will
        never be completed: we then return it as the full decode would show it
        (with U+FFFD), so the streamed text always equals the full decode.
        """
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]
