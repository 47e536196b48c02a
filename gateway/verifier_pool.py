"""The verifiers as the propose/verify loop sees them: one bidirectional
stream per sequence (prefill once, then one verify per step), and the pool
that picks a verifier for each new sequence, watches their health and polls
their load for the gateway's metrics."""

import asyncio
import dataclasses
import itertools
import socket

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import DNS_SCHEME
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

# What the verifier assumes of a control left unset.
NEUTRAL_LOGIT_CONTROLS = {name: getattr(LogitControls(repetition_penalty=1.0, min_p=0.0), name)
                          for name in SCALAR_LOGIT_CONTROLS}


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

    async def _send(self, message: verifier_pb2.SessionRequest) -> None:
        await self._deadline(self._call.write(message))

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
            if getattr(controls, name) not in (None, neutral):
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
        verify = verifier_pb2.Verify(draft=draft, use_head_draft=use_head_draft, next_round=next_round)
        await self._send(verifier_pb2.SessionRequest(verify=verify))

    async def send_offer(self, next_round: verifier_pb2.NextRound | None) -> None:
        """Offers `next_round` while the verifier runs a step it started on its own
        (the last answer's next_round_hit); answer() reads that step's answer."""
        if next_round is not None:
            await self._send(verifier_pb2.SessionRequest(next_round=next_round))

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


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


DISCOVERY_SECONDS = 10.0  # how often such names are resolved again


def discovered_by_dns(target: str) -> bool:
    return target.startswith(DNS_SCHEME)


async def resolve(target: str) -> set[str]:
    """The host:port addresses a dns:/// target's name resolves to now (empty if it resolves to none)."""
    host, _, port = target.removeprefix(DNS_SCHEME).rpartition(":")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # no answer, or a name DNS cannot carry: keep what is known
        return set()
    return {f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}" for info in infos}


@dataclasses.dataclass(eq=False)
class _Verifier:
    """One verifier the pool dials, and what the pool knows of it."""

    address: str
    target: str  # the address or dns:/// name it came from
    channel: grpc.aio.Channel
    stub: verifier_pb2_grpc.VerifierStub
    health: health_pb2_grpc.HealthStub
    in_flight: int = 0  # this gateway's sequences on it
    # Its sequences as its last GetLoad counted them, and how many were ours then: other gateways'
    # are the difference.
    counted: tuple[int, int] = (0, 0)
    serving: bool = True
    load: verifier_pb2.EngineLoad | None = None  # its last GetLoad answer
    load_answered: bool | None = None  # whether the last poll was answered (None: not polled yet)
    gone: bool = False  # no longer resolved: no new sequences, closed once its last one ends


class VerifierPool:
    """Verifiers serving the same model; each new sequence goes to a serving one
    (see open). A verifier counts as serving until a health check or a broken
    session says otherwise, and again once a health check says SERVING. A
    target dns:///name:port stands for every address the name resolves to,
    resolved again every DISCOVERY_SECONDS: verifiers scaled up join, those
    gone finish their sequences and leave."""

    def __init__(self, targets: tuple[str, ...], step_timeout_seconds: float | None = None,
                 tls: TlsFiles = TlsFiles(), resolver=resolve):
        self._step_timeout = step_timeout_seconds  # per prefill or verify answer; None: no deadline
        self._tls = tls
        self._resolver = resolver
        self._targets = targets
        self._ids = itertools.count()
        self._verifiers: dict[int, _Verifier] = {}  # by an id never reused
        self._affinity = PrefixAffinity()
        self._metrics: GatewayMetrics | None = None
        self._closing: set[asyncio.Task] = set()  # channels of verifiers that left, closing
        for target in targets:
            if not discovered_by_dns(target):
                self._add(target, target)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(verifier.address for verifier in self._verifiers.values() if not verifier.gone)

    def _add(self, address: str, target: str) -> None:
        tls = self._tls
        if discovered_by_dns(target) and tls.ca and not tls.server_name:
            # Dialled by its IP: its certificate names the Service.
            tls = dataclasses.replace(tls, server_name=target.removeprefix(DNS_SCHEME).rpartition(":")[0])
        channel = aio_channel(address, tls, CHANNEL_OPTIONS)
        self._verifiers[next(self._ids)] = _Verifier(address, target, channel, verifier_pb2_grpc.VerifierStub(channel),
                                                     health_pb2_grpc.HealthStub(channel))
        if discovered_by_dns(target):
            log.info("verifier_discovered", address=address, target=target)

    async def discover(self) -> None:
        """Resolves the dns:/// targets again: new addresses join; an address no longer listed
        takes no new sequences and is closed once its last one ends. A name that resolves to
        nothing for a moment (DNS trouble) keeps its verifiers."""
        for target in filter(discovered_by_dns, self._targets):
            listed = await self._resolver(target)
            if not listed:
                continue
            known = {v.address for v in self._verifiers.values() if v.target == target and not v.gone}
            for address in sorted(listed - known):
                self._add(address, target)
            for number, verifier in list(self._verifiers.items()):
                if verifier.target == target and not verifier.gone and verifier.address not in listed:
                    log.info("verifier_left", address=verifier.address, target=target, sequences=verifier.in_flight)
                    verifier.gone = True
                    self._affinity.forget(number)
                    self._drop_if_done(number)

    def _drop_if_done(self, number: int) -> None:
        """Drops a verifier that left once its last sequence ended, closing its channel."""
        verifier = self._verifiers[number]
        if verifier.gone and verifier.in_flight == 0:
            del self._verifiers[number]
            task = asyncio.ensure_future(verifier.channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def attach_metrics(self, metrics: GatewayMetrics) -> None:
        """Sequences report their timings, and /metrics the verifiers' load, to `metrics`."""
        self._metrics = metrics
        metrics.add_verifiers_serving(lambda: len(self._up()))
        metrics.add_verifier_loads(self.loads)

    def busy(self, number: int) -> int:
        """Sequences on a verifier: ours now, and every other gateway's as its last GetLoad counted them."""
        verifier = self._verifiers[number]
        counted, ours_then = verifier.counted
        return verifier.in_flight + max(0, counted - ours_then)

    def open(self, request_id: str, prompt_token_ids: list[int]) -> tuple[int, VerifierSession]:
        """A session on the least busy serving verifier, or on the one that took
        the longest prefix of this prompt (its KV is likely still cached there)
        unless it is busier by more than AFFINITY_SLACK sequences. Busy counts
        every gateway's sequences (busy). Returns the verifier's number for
        release and mark_down. Raises Unavailable when no verifier is serving."""
        serving = self._serving_numbers()
        number = min(serving, key=self.busy)
        prefixes = block_prefixes(prompt_token_ids)
        owner, _ = self._affinity.lookup(prefixes)
        if owner in serving and self.busy(owner) <= self.busy(number) + AFFINITY_SLACK:
            number = owner
        self._affinity.remember(prefixes, number)
        verifier = self._verifiers[number]
        verifier.in_flight += 1
        timer = SequenceTimer(self._metrics) if self._metrics is not None else None
        call = verifier.stub.Session(metadata=request_metadata(request_id))
        return number, VerifierSession(call, timer, self._step_timeout)

    def release(self, number: int) -> None:
        self._verifiers[number].in_flight -= 1
        self._drop_if_done(number)

    def mark_down(self, number: int) -> None:
        """A session found the verifier gone: no new sequences until its health says SERVING."""
        verifier = self._verifiers[number]
        if verifier.serving:
            log.warning("verifier_unavailable", address=verifier.address)
            self._affinity.forget(number)  # a restarted verifier has an empty cache
        verifier.serving = False

    def _up(self) -> list[int]:
        """The numbers of the verifiers that take new sequences: serving, and still resolved."""
        return [number for number, v in self._verifiers.items() if v.serving and not v.gone]

    def _serving_numbers(self) -> list[int]:
        serving = self._up()
        if not serving:
            raise Unavailable("no verifier is serving right now; retry shortly")
        return serving

    async def model_info(self) -> verifier_pb2.ModelInfo:
        stub = self._verifiers[self._serving_numbers()[0]].stub
        return await stub.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=10)

    async def tokenizer_files(self) -> dict[str, bytes]:
        stub = self._verifiers[self._serving_numbers()[0]].stub
        reply = await stub.GetTokenizer(verifier_pb2.GetTokenizerRequest(), timeout=30)
        return dict(reply.files)

    async def check(self) -> None:
        """Asks every verifier's health service; updates which ones are serving."""
        verifiers = list(self._verifiers.values())
        replies = await asyncio.gather(*(v.health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                                         for v in verifiers), return_exceptions=True)
        for verifier, reply in zip(verifiers, replies):
            up = not isinstance(reply, BaseException) and reply.status == health_pb2.HealthCheckResponse.SERVING
            if up and not verifier.serving:
                log.info("verifier_serving", address=verifier.address)
            verifier.serving = up

    async def num_serving(self) -> int:
        """How many verifiers answer their health check with SERVING right now."""
        await self.check()
        return len(self._up())

    async def refresh_loads(self, timeout_seconds: float = 5.0) -> None:
        """Asks every verifier for its load; one that does not answer is left out (and logged once)."""
        async def get_load(verifier: _Verifier):
            reply = await verifier.stub.GetLoad(verifier_pb2.GetLoadRequest(), timeout=timeout_seconds)
            # Ours as the answer arrives: a sequence opened while it was on its way may be missing from both.
            verifier.counted = (reply.num_running + reply.num_waiting, verifier.in_flight)
            return reply

        verifiers = list(self._verifiers.values())
        replies = await asyncio.gather(*(get_load(v) for v in verifiers), return_exceptions=True)
        for verifier, reply in zip(verifiers, replies):
            answered = not isinstance(reply, BaseException)
            if answered:
                verifier.load = reply
            elif verifier.load_answered is not False:
                log.warning("verifier_load_unavailable", address=verifier.address, error=_describe(reply),
                            action="left out of the load metrics until it answers")
            verifier.load_answered = answered

    def loads(self) -> list[tuple[verifier_pb2.EngineLoad, bool]]:
        """Each verifier's last known load, and whether it answered the last poll."""
        return [(v.load, bool(v.load_answered)) for v in self._verifiers.values() if v.load is not None]

    async def ready(self) -> bool:
        """True when at least one verifier reports SERVING."""
        await self.check()
        return bool(self._up())

    async def wait_ready(self, poll_seconds: float = 0.5) -> None:
        while True:
            await self.discover()
            if await self.ready():
                return
            await asyncio.sleep(poll_seconds)

    async def watch(self, poll_seconds: float = 1.0, discovery_seconds: float = DISCOVERY_SECONDS) -> None:
        """Keeps the verifiers, their serving flags and their loads fresh (until cancelled). Separate
        loops: a slow load answer (it waits for a forward pass) never delays a health check."""

        async def every(seconds, refresh):
            while True:
                await asyncio.sleep(seconds)
                await refresh()

        await asyncio.gather(every(poll_seconds, self.check), every(poll_seconds, self.refresh_loads),
                             every(discovery_seconds, self.discover))

    async def close(self) -> None:
        for verifier in self._verifiers.values():
            await verifier.channel.close()
        await asyncio.gather(*self._closing)


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return type(error).__name__
