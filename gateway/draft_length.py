"""A request's draft length limit, adapted to how its drafts fare: a draft
rejected at its first token halves the next one's limit, a draft accepted in
full doubles it, up to the request's k. On a CPU verifier every draft token
costs compute, so a request whose drafts keep failing (chat, where the drafter
finds little to copy) stops paying for long ones, and one whose drafts keep
landing (code edits) keeps k."""


class AdaptiveDraftLength:
    def __init__(self, k: int):
        self._k = k
        self.limit = k

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verify step's outcome (a step without a draft changes nothing)."""
        if num_draft_tokens == 0:
            return
        if num_accepted == num_draft_tokens:
            self.limit = min(self._k, 2 * self.limit)
        elif num_accepted == 0:
            self.limit = max(1, self.limit // 2)
