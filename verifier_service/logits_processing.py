"""The request's logit controls applied to the target's raw logits rows of one
step, with vLLM's semantics and order: logit_bias, min_tokens, then the
repetition, frequency and presence penalties. Temperature, min_p, top-k and
top-p follow in sampling.target_probs; greedy decoding takes the argmax of
what this returns, as vLLM's does.

Every row of a step judges a different position (verify.py): row 0 follows
the committed tokens, row i + 1 follows draft node i. Each row is processed
with the output as it would be at its position, the committed output plus
the draft tokens on the path from the root to that node, so a draft token is
judged against exactly the distribution plain decoding would sample it from.
"""

import torch

from verifier_service.sampling import SamplingParams
from verifier_service.tree import ancestor_mask, depths


class LogitsProcessor:
    """One sequence's controls and what they need on the logits' device: the
    prompt's tokens, once, and the output's token counts, brought up to date
    with each step's committed tokens rather than recounted."""

    def __init__(self, params: SamplingParams, prompt: list[int], stop_token_ids: frozenset[int],
                 vocab_size: int, device: torch.device):
        self.params = params
        self.prompt_len = len(prompt)
        self._bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        self._bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        self._stop_ids = torch.tensor(sorted(stop_token_ids), dtype=torch.long, device=device)
        self._penalised = bool(params.repetition_penalty != 1 or params.frequency_penalty or params.presence_penalty)
        self._in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self._in_prompt[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self._output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self._num_counted = len(prompt)  # tokens before this index are counted; the prompt is not output

    def __call__(self, rows: torch.Tensor, tokens: list[int], draft_tokens: list[int], parents) -> torch.Tensor:
        """New logits for `rows` [k + 1, vocab]: a step over the committed `tokens`
        (prompt and output) and a draft tree of k nodes (`parents`, see tree.py)."""
        logits = rows.clone()
        if self._bias_ids.numel():
            logits[:, self._bias_ids] += self._bias_values
        num_generated = len(tokens) - self.prompt_len
        if num_generated < self.params.min_tokens and self._stop_ids.numel():
            # A row's position is its depth below the last committed token.
            short = [row for row, depth in enumerate([0, *depths(parents)])
                     if num_generated + depth < self.params.min_tokens]
            logits[torch.tensor(short, device=logits.device)[:, None], self._stop_ids] = float("-inf")
        if self._penalised:
            logits = self._penalise(logits, row_counts(self._committed_counts(tokens), draft_tokens, parents))
        return logits

    def _committed_counts(self, tokens: list[int]) -> torch.Tensor:
        """[vocab] occurrences in the output; committed tokens only ever grow, so
        only those since the last call are added."""
        if len(tokens) > self._num_counted:
            new = torch.tensor(tokens[self._num_counted:], dtype=torch.long, device=self._output_counts.device)
            self._output_counts.index_add_(0, new, torch.ones(len(new), device=new.device))
            self._num_counted = len(tokens)
        return self._output_counts

    def _penalise(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        params = self.params
        in_output = counts > 0
        if params.repetition_penalty != 1:
            penalty = params.repetition_penalty
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(in_output | self._in_prompt, scaled, logits)
        if params.frequency_penalty:
            logits = logits - params.frequency_penalty * counts
        if params.presence_penalty:
            logits = logits - params.presence_penalty * in_output
        return logits


def row_counts(committed: torch.Tensor, draft_tokens: list[int], parents) -> torch.Tensor:
    """[k + 1, vocab] output token counts as each row sees them: the `committed`
    counts [vocab], plus for row i + 1 the draft tokens of node i and its ancestors."""
    counts = committed.repeat(len(draft_tokens) + 1, 1)
    if draft_tokens:
        node, ancestor = ancestor_mask(parents).nonzero(as_tuple=True)
        token = torch.tensor(draft_tokens, dtype=torch.long)[ancestor]
        device = counts.device
        counts.index_put_((node.to(device) + 1, token.to(device)), torch.ones(len(node), device=device),
                          accumulate=True)
    return counts


def make_logits_processor(params: SamplingParams, prompt: list[int], stop_token_ids: frozenset[int],
                          vocab_size: int, device: torch.device) -> LogitsProcessor | None:
    """None when the request sets none of these controls: its steps then do no per-row work."""
    if not (params.logit_bias or params.min_tokens or params.repetition_penalty != 1
            or params.frequency_penalty or params.presence_penalty):
        return None
    return LogitsProcessor(params, prompt, stop_token_ids, vocab_size, device)
