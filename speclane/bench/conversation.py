"""A conversation replayed against a server: a fixed message prefix plus user
turns sent one after the other. Each request carries the history with the
model's own earlier replies, so multi-turn workloads exercise what the server
generated itself (what suffix decoding learns from)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Conversation:
    turns: tuple[str, ...]  # user messages, sent one per request
    prefix: tuple[dict, ...] = ()  # fixed messages before the first turn (system prompt, given history)

    def messages(self, replies: list[str]) -> list[dict]:
        """The request for turn len(replies): history with the model's replies, then the next user turn."""
        turn = len(replies)
        history = [message for user, reply in zip(self.turns, replies)
                   for message in ({"role": "user", "content": user}, {"role": "assistant", "content": reply})]
        return [*self.prefix, *history, {"role": "user", "content": self.turns[turn]}]
