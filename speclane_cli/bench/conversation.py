"""A conversation replayed against a server: a fixed message prefix plus user
turns sent one after the other. Each request carries the history with the
model's own earlier replies, so multi-turn workloads exercise what the server
generated itself (what suffix decoding learns from).

`replay` drives anything with `turns` (one per request) and `request(replies)`
(the turn's request fields, from the replies so far): these conversations, and
the agent sessions of `speclane bench agent`."""

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from speclane_cli.bench.stats import RequestResult

# (conversation, its replies so far) -> (the next request's result, its reply)
Ask = Callable[[Any, list], Awaitable[tuple[RequestResult, Any]]]


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

    def request(self, replies: list[dict]) -> dict:
        """The chat request fields for the next turn; `replies` are the assistant messages so far."""
        return {"messages": self.messages([reply.get("content") or "" for reply in replies])}


async def replay(conversations: list, concurrency: int, ask: Ask,
                 on_request: Callable[[int], None]) -> tuple[list[RequestResult], float]:
    """Replays the conversations with `concurrency` workers, each taking the next
    conversation as soon as its previous one ends; returns the results and the wall time.

    A failed turn ends its conversation: the later turns would replay a history
    the server never produced. `on_request(n)` reports n requests done or skipped.
    Each result carries its turn's index in the conversation (0: the first request).
    """
    queue = list(reversed(conversations))
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            conversation = queue.pop()
            replies: list = []
            for _ in conversation.turns:
                result, reply = await ask(conversation, replies)
                results.append(dataclasses.replace(result, turn=len(replies)))
                on_request(1)
                if not result.ok:
                    on_request(len(conversation.turns) - len(replies) - 1)
                    break
                replies.append(reply)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start
