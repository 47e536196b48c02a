"""Domain types of the gateway: what the HTTP and gRPC front ends hand to the
propose/verify loop, and what comes back. No protobuf or HTTP in here."""

from dataclasses import dataclass, field

from speclane.speculation import SpeculationSettings


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    speculation: SpeculationSettings
    temperature: float | None = None  # None or 0: greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    tenant: str = ""


@dataclass(frozen=True)
class SpeculationUsage:
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0

    def __add__(self, other: "SpeculationUsage") -> "SpeculationUsage":
        return SpeculationUsage(self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens,
                                self.verify_steps + other.verify_steps)


@dataclass(frozen=True)
class TokenDelta:
    """Tokens committed by one verify step; finish_reason set on the last one."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # Cumulative for the request up to this delta; set on the final delta, may be
    # set on any (then a generation cut short by a stop string still reports its usage).
    speculation: SpeculationUsage | None = None
