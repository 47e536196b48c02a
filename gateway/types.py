"""Domain types of the gateway: what the HTTP and gRPC front ends hand to the
propose/verify loop, and what comes back. No protobuf or HTTP in here."""

from dataclasses import astuple, dataclass, field

from speclane.speculation import SpeculationSettings

# vLLM's rule for a request's cache_salt: 1 to 128 characters, none of them @ / \ or NUL.
CACHE_SALT_PATTERN = r"[^@/\\\x00]{1,128}"


@dataclass(frozen=True)
class LogitControls:
    """vLLM's logit controls; the verifier applies them at every verified position. A request leaving
    repetition_penalty or min_p out (None) gets the model's default (gateway/sampling_defaults.py)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0


# The controls that are one number each (logit_bias is a map).
SCALAR_LOGIT_CONTROLS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens")


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
    cache_salt: str = ""  # vLLM's: prefix-cache blocks are shared only within a tenant and a salt
    logit_controls: LogitControls = LogitControls()
    logprobs: int | None = None  # None: none; N: each token's logprob and its N most likely alternatives
    prediction_token_ids: tuple[int, ...] = ()  # OpenAI's predicted output, drafted from
    grammar: str | None = None  # the output must match it (llguidance Lark syntax)


@dataclass(frozen=True)
class SpeculationUsage:
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    # Of the above, the draft tokens that came from the request's predicted output.
    prediction_draft_tokens: int = 0
    prediction_accepted_tokens: int = 0
    # Steps whose draft came from the drafter service, and from the verifier's head (hybrid picks per step).
    drafter_steps: int = 0
    head_steps: int = 0
    # Steps the verifier started on its own, with the next-round draft the gateway had offered.
    next_round_steps: int = 0

    def __add__(self, other: "SpeculationUsage") -> "SpeculationUsage":
        return SpeculationUsage(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class TokenDelta:
    """Tokens committed by one verify step; finish_reason set on the last one."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # Cumulative for the request up to this delta; set on the final delta, may be
    # set on any (then a generation cut short by a stop string still reports its usage).
    speculation: SpeculationUsage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked for them
    cached_tokens: int = 0  # prompt tokens the verifier's prefix cache held; set with speculation
