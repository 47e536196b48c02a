"""Stored responses of the Responses API (`store: true`), for `previous_response_id`
and GET/DELETE /v1/responses/{id}: in the gateway's memory, bounded by count, the
oldest dropped first. A restart loses them all, and each gateway replica has its
own (as vLLM's store): route a conversation's requests to one gateway."""

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object as it was returned
    messages: tuple[dict, ...]  # the conversation up to and including its output, as chat messages


class ResponseStore:
    def __init__(self, max_responses: int):
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_responses < 1:
            return
        self._responses[response_id] = stored
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
