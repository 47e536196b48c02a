"""Structured output inside verification: a sequence's grammar (llguidance's
Lark syntax, JSON schemas included) masks the tokens it forbids at every
verified position. Each draft node is judged in the grammar state its path
reaches, so a draft token the grammar forbids is simply rejected and the
output is what constrained decoding without drafts would give."""

from collections.abc import Sequence
from functools import cached_property

import torch

from verifier_service.errors import InvalidRequest
from verifier_service.tree import children


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it, built on first use (about a second)."""

    def __init__(self, model_dir: str, vocab_size: int):
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's

    @cached_property
    def tokenizer(self):
        import llguidance.hf
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError) as exc:  # a model directory without tokenizer files
            raise InvalidRequest(f"structured output needs the model's tokenizer, which does not load here "
                                 f"({type(exc).__name__})") from None
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)

    def matcher(self, grammar: str) -> "GrammarMatcher":
        import llguidance

        if problem := llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer):
            raise InvalidRequest(f"the grammar (structured output) does not compile: {problem}")
        return GrammarMatcher(llguidance.LLMatcher(self.tokenizer, grammar), self.vocab_size)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    def _allowed(self) -> torch.Tensor:
        allowed = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8)
        return allowed[:self._vocab_size].bool()

    def row_masks(self, draft: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """[len(draft) + 1, vocab] allowed tokens: row 0 after the committed tokens, row i + 1
        after draft node i's path. A node the grammar forbids can never be accepted, so its
        subtree's rows allow everything (their values do not matter)."""
        masks = torch.ones(len(draft) + 1, self._vocab_size, dtype=torch.bool)
        kids = children(parents)

        def visit(row: int) -> None:
            allowed = masks[row] = self._allowed()
            if self._matcher.is_stopped():  # only EOS is left, which ends the sequence
                return
            for child in kids[row]:
                if allowed[draft[child]] and self._matcher.consume_token(draft[child]):
                    visit(child + 1)
                    self._matcher.rollback(1)

        visit(0)
        return masks

    def commit(self, token_ids: Sequence[int]) -> None:
        """Advances past committed tokens (each was allowed where it was chosen)."""
        for token in token_ids:
            if self._matcher.is_stopped():
                return
            self._matcher.consume_token(token)
