"""The verifiers as the propose/verify loop sees them: one bidirectional
stream per sequence (prefill once, then one verify per step), and the pool
that picks a verifier for each new sequence, watches their health and polls
their load for the gateway's metrics."""

import asyncio

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import Unavailable
from gateway.metrics import GatewayMetrics, SequenceTimer
from gateway.routing import PrefixAffinity, block_prefixes
from gateway.types import SCALAR_LOGIT_CONTROLS, GenerationRequest, LogitControls
from protos.common.v1 import common_pb2
from protos.conventions import CHANNEL_OPTIONS, request_metadata
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.tls import TlsFiles, aio_channel

log = structlog.get_logger()
# A prompt's cached prefix is worth queueing behind this many more sequences than the
# least busy verifier has; beyond that, prefilling it again elsewhere balances the load.
AFFINITY_SLACK = 2

NEUTRAL_LOGIT_CONTROLS = {name: getattr(LogitControls(), name) for name in SCALAR_LOGIT_CONTROLS}


class VerifierSession:
    """A sequence on a verifier: prefill once, then one verify per step."""

    def __init__(self, call, timer: SequenceTimer | None = None, step_timeout_seconds: float | None = None):
        self._call = call
        self._timer = timer
        self._step_timeout = step_timeout_seconds

    async def _deadline(self, awaitable):
        # A link that stops carrying bytes without closing (a frozen peer, a dropped
        # route) never fails the stream by itself: without this deadline the request
        # would wait forever. The caller's close() then cancels the call.
        try:
            return await asyncio.wait_for(awaitable, self._step_timeout)
        except TimeoutError:
            raise Unavailable(f"the verifier did not answer within {self._step_timeout:g} s") from None

    async def _send(self, *messages: verifier_pb2.SessionRequest) -> None:
        async def write_all():
            for message in messages:
                await self._call.write(message)

        if messages:
            await self._deadline(write_all())

    async def _read(self) -> verifier_pb2.SessionResponse:
        response = await self._deadline(self._call.read())
        if response is grpc.aio.EOF:  # an error status would have raised in read()
            raise RuntimeError("the verifier ended the session without answering")
        return response

    async def prefill(self, request: GenerationRequest) -> verifier_pb2.SessionResponse:
        sampling = verifier_pb2.SamplingParams(
            max_new_tokens=request.max_tokens,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
        )
        for name in ("temperature", "top_p", "top_k", "seed", "logprobs", "grammar"):
            value = getattr(request, name)
            if value is not None:
                setattr(sampling, name, value)
        controls = request.logit_controls
        for name, neutral in NEUTRAL_LOGIT_CONTROLS.items():
            if getattr(controls, name) != neutral:
                setattr(sampling, name, getattr(controls, name))
        sampling.logit_bias.update(controls.logit_bias)
        speculation = request.speculation
        prefill = verifier_pb2.Prefill(
            sequence_id=request.request_id, prompt_token_ids=request.prompt_token_ids, sampling=sampling,
            num_head_draft_tokens=speculation.num_speculative_tokens if speculation.uses_head else 0,
            # Hybrid picks its source before the head would have drafted (gateway/planner.py).
            head_draft_on_demand=speculation.method == "hybrid",
            # NUL never occurs in a request's salt, so no tenant and salt pair reads as another.
            cache_salt=f"{request.tenant}\x00{request.cache_salt}" if request.cache_salt else request.tenant,
        )
        await self._send(verifier_pb2.SessionRequest(prefill=prefill))
        response = await self._read()
        if self._timer is not None:
            self._timer.prefilled(len(response.token_ids), _optional(response, "queue_seconds"),
                                  _optional(response, "prefill_seconds"))
        return response

    async def send_verify(self, draft: common_pb2.Draft | None, use_head_draft: bool = False,
                          next_round: verifier_pb2.NextRound | None = None) -> None:
        """Sends a step: `draft`, or with `use_head_draft` the verifier head's own;
        offers `next_round` for the step after it. answer() reads its answer."""
        verify = verifier_pb2.Verify(draft=draft, use_head_draft=use_head_draft)
        await self._send(verifier_pb2.SessionRequest(verify=verify), *_offer(next_round))

    async def send_offer(self, next_round: verifier_pb2.NextRound | None) -> None:
        """Offers `next_round` while the verifier runs a step it started on its own
        (the last answer's next_round_hit); answer() reads that step's answer."""
        await self._send(*_offer(next_round))

    async def answer(self) -> verifier_pb2.SessionResponse:
        """The answer to the step in flight."""
        response = await self._read()
        if self._timer is not None:
            self._timer.stepped(len(response.token_ids))
        return response

    def close(self) -> None:
        # Cancelling (rather than half-closing) frees the KV cache at once, also mid-generation.
        self._call.cancel()
        if self._timer is not None:
            self._timer.close()


def _offer(next_round: verifier_pb2.NextRound | None) -> tuple[verifier_pb2.SessionRequest, ...]:
    return () if next_round is None else (verifier_pb2.SessionRequest(next_round=next_round),)


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


class VerifierPool:
    """Verifiers serving the same model; each new sequence goes to a serving one
    (see open). A verifier counts as serving until a health check or a broken
    session says otherwise, and again once a health check says SERVING."""

    def __init__(self, addresses: tuple[str, ...], step_timeout_seconds: float | None = None,
                 tls: TlsFiles = TlsFiles()):
        self._step_timeout = step_timeout_seconds  # per prefill or verify answer; None: no deadline
        self._channels = [aio_channel(a, tls, CHANNEL_OPTIONS) for a in addresses]
        self._stubs = [verifier_pb2_grpc.VerifierStub(c) for c in self._channels]
        self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self._in_flight = [0] * len(addresses)  # this gateway's sequences on each verifier
        # Each verifier's sequences as its last GetLoad counted them, and how many of them were ours then:
        # other gateways' sequences are the difference.
        self._counted = [(0, 0)] * len(addresses)
        self._affinity = PrefixAffinity()
        self._serving = [True] * len(addresses)
        self.addresses = addresses
        self._metrics: GatewayMetrics | None = None
        # Each verifier's last GetLoad answer, and whether the last poll was answered (None: not polled yet).
        self._loads: list[verifier_pb2.EngineLoad | None] = [None] * len(addresses)
        self._load_answered: list[bool | None] = [None] * len(addresses)

    def attach_metrics(self, metrics: GatewayMetrics) -> None:
        """Sequences report their timings, and /metrics the verifiers' load, to `metrics`."""
        self._metrics = metrics
        metrics.add_verifiers_serving(lambda: sum(self._serving))
        metrics.add_verifier_loads(self.loads)

    def busy(self, index: int) -> int:
        """Sequences on a verifier: ours now, and every other gateway's as its last GetLoad counted them."""
        counted, ours_then = self._counted[index]
        return self._in_flight[index] + max(0, counted - ours_then)

    def open(self, request_id: str, prompt_token_ids: list[int]) -> tuple[int, VerifierSession]:
        """A session on the least busy serving verifier, or on the one that took
        the longest prefix of this prompt (its KV is likely still cached there)
        unless it is busier by more than AFFINITY_SLACK sequences. Busy counts
        every gateway's sequences (busy). Raises Unavailable when no verifier is serving."""
        serving = self._serving_indices()
        index = min(serving, key=self.busy)
        prefixes = block_prefixes(prompt_token_ids)
        owner, _ = self._affinity.lookup(prefixes)
        if owner in serving and self.busy(owner) <= self.busy(index) + AFFINITY_SLACK:
            index = owner
        self._affinity.remember(prefixes, index)
        self._in_flight[index] += 1
        timer = SequenceTimer(self._metrics) if self._metrics is not None else None
        call = self._stubs[index].Session(metadata=request_metadata(request_id))
        return index, VerifierSession(call, timer, self._step_timeout)

    def release(self, index: int) -> None:
        self._in_flight[index] -= 1

    def mark_down(self, index: int) -> None:
        """A session found the verifier gone: no new sequences until its health says SERVING."""
        if self._serving[index]:
            log.warning("verifier_unavailable", address=self.addresses[index])
            self._affinity.forget(index)  # a restarted verifier has an empty cache
        self._serving[index] = False

    def _serving_indices(self) -> list[int]:
        serving = [index for index, up in enumerate(self._serving) if up]
        if not serving:
            raise Unavailable("no verifier is serving right now; retry shortly")
        return serving

    async def model_info(self) -> verifier_pb2.ModelInfo:
        stub = self._stubs[self._serving_indices()[0]]
        return await stub.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=10)

    async def tokenizer_files(self) -> dict[str, bytes]:
        stub = self._stubs[self._serving_indices()[0]]
        reply = await stub.GetTokenizer(verifier_pb2.GetTokenizerRequest(), timeout=30)
        return dict(reply.files)

    async def check(self) -> None:
        """Asks every verifier's health service; updates which ones are serving."""
        replies = await asyncio.gather(*(stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                                         for stub in self._health), return_exceptions=True)
        for index, reply in enumerate(replies):
            up = not isinstance(reply, BaseException) and reply.status == health_pb2.HealthCheckResponse.SERVING
            if up and not self._serving[index]:
                log.info("verifier_serving", address=self.addresses[index])
            self._serving[index] = up

    async def num_serving(self) -> int:
        """How many verifiers answer their health check with SERVING right now."""
        await self.check()
        return sum(self._serving)

    async def refresh_loads(self, timeout_seconds: float = 5.0) -> None:
        """Asks every verifier for its load; one that does not answer is left out (and logged once)."""
        async def get_load(index: int):
            reply = await self._stubs[index].GetLoad(verifier_pb2.GetLoadRequest(), timeout=timeout_seconds)
            # Ours as the answer arrives: a sequence opened while it was on its way may be missing from both.
            self._counted[index] = (reply.num_running + reply.num_waiting, self._in_flight[index])
            return reply

        replies = await asyncio.gather(*(get_load(index) for index in range(len(self._stubs))),
                                       return_exceptions=True)
        for index, reply in enumerate(replies):
            answered = not isinstance(reply, BaseException)
            if answered:
                self._loads[index] = reply
            elif self._load_answered[index] is not False:
                log.warning("verifier_load_unavailable", address=self.addresses[index], error=_describe(reply),
                            action="left out of the load metrics until it answers")
            self._load_answered[index] = answered

    def loads(self) -> list[tuple[verifier_pb2.EngineLoad, bool]]:
        """Each verifier's last known load, and whether it answered the last poll."""
        return [(load, bool(answered)) for load, answered in zip(self._loads, self._load_answered)
                if load is not None]

    async def ready(self) -> bool:
        """True when at least one verifier reports SERVING."""
        await self.check()
        return any(self._serving)

    async def wait_ready(self, poll_seconds: float = 0.5) -> None:
        while not await self.ready():
            await asyncio.sleep(poll_seconds)

    async def watch(self, poll_seconds: float = 1.0) -> None:
        """Keeps the serving flags and the loads fresh (until cancelled). Two loops:
        a slow load answer (it waits for a forward pass) never delays a health check."""

        async def every_poll(refresh):
            while True:
                await asyncio.sleep(poll_seconds)
                await refresh()

        await asyncio.gather(every_poll(self.check), every_poll(self.refresh_loads))

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return type(error).__name__
