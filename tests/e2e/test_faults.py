"""Faults, one test each, on one stack of real processes whose verifier sits behind
a TCP proxy the tests can freeze and cut: a client leaving mid-stream, the drafter
killed and restarted, the gateway-verifier link frozen then cut, the verifier
killed and restarted. Each test ends with nothing left behind: no generation in
flight on the gateway, no sequence or KV on the verifier, no drafter session.

What test_resilience.py (drafter killed, not restarted) and test_supervisor.py
(`speclane serve` restarting a killed verifier) already show is not repeated."""

import concurrent.futures
import dataclasses
import threading
import time
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from drafter_service.config import DrafterConfig
from gateway.client import GenerationClient
from gateway.config import GatewayConfig
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.net import free_port
from tests.e2e.link_proxy import LinkProxy
from tests.e2e.prompts import code_edit_messages
from tests.e2e.stack import TEST_THREADS, Stack, grpc_health
from verifier_service.config import VerifierConfig

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
STEP_DEADLINE_S = 3.0  # the gateway's --verifier-timeout-s here
SNAPSHOT_INTERVAL_S = 1.0
LONG = 2000  # tokens: far more than any test waits for, so only a fault ends these generations
COUNTING = [{"role": "user", "content": "Count from one to one hundred in words, separated by commas."}]
PRIME = [{"role": "user", "content": "Write a Python function that checks whether a number is prime, "
                                     "with a docstring and three examples."}]
FAST_FAILURE_S = STEP_DEADLINE_S + 4  # a request hit by a fault ends within this, never at a client timeout


def metric_samples(url: str) -> dict[str, float]:
    """Prometheus samples by name, labels dropped (each process serves one model)."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name if "source" not in sample.labels else f"{sample.name}:{sample.labels['source']}"
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f} s")
        time.sleep(0.2)


@dataclasses.dataclass
class FaultyStack:
    stack: Stack
    link: LinkProxy

    def openai(self, timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.stack.base_url, api_key="unused", max_retries=0, timeout=timeout)

    def grpc_client(self) -> GenerationClient:
        return GenerationClient(self.stack.gateway.grpc_address, retries=0)

    def gateway_metrics(self) -> dict[str, float]:
        return metric_samples(f"http://{self.stack.gateway.host}:{self.stack.gateway.port}/metrics")

    def drafter_metrics(self) -> dict[str, float]:
        return metric_samples(f"http://127.0.0.1:{self.stack.drafter.metrics_port}/metrics")

    def verifier_load(self) -> verifier_pb2.EngineLoad:
        """Asked of the verifier itself, never through the link."""
        with grpc.insecure_channel(self.stack.verifier.address) as channel:
            return verifier_pb2_grpc.VerifierStub(channel).GetLoad(verifier_pb2.GetLoadRequest(), timeout=10)

    def figures(self) -> dict[str, float]:
        """What a request holds anywhere: generations in flight on the gateway, sequences
        and KV in use on the verifier, open drafter sessions."""
        load = self.verifier_load()
        return {"gateway_running": self.gateway_metrics()["vllm:num_requests_running"],
                "verifier_running": load.num_running, "verifier_waiting": load.num_waiting,
                "verifier_kv_used_tokens": load.kv_used_tokens,
                "drafter_sessions": self.drafter_metrics()["speclane:drafter_sessions"]}

    def wait_idle(self, timeout: float = 15) -> None:
        last = {}

        def idle():
            last.update(self.figures())
            return not any(last.values())

        deadline = time.monotonic() + timeout
        while not idle():
            assert time.monotonic() < deadline, f"still held {timeout:.0f} s later: {last}"
            time.sleep(0.2)

    def wait_serving(self, timeout: float = 240) -> None:
        client = self.openai(timeout=30)

        def answers():
            try:
                return client.chat.completions.create(model=MODEL, messages=COUNTING, max_tokens=2, temperature=0)
            except openai.APIStatusError as error:
                assert error.status_code == 503, error.body
                return None

        wait_for(answers, timeout, "the stack did not serve again")


@pytest.fixture(scope="module")
def faulty(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("faults")
    verifier = VerifierConfig(model=str(model_dir), model_name=MODEL, address=f"127.0.0.1:{free_port()}",
                              threads=TEST_THREADS)
    link = LinkProxy(verifier.address)
    drafter = DrafterConfig(address=f"127.0.0.1:{free_port()}", metrics_port=free_port(),
                            snapshot_path=str(log_dir / "drafter.snapshot"),
                            snapshot_interval_seconds=SNAPSHOT_INTERVAL_S)
    gateway = GatewayConfig(
        model=str(model_dir), served_model_name=MODEL, port=free_port(), grpc_address=f"127.0.0.1:{free_port()}",
        drafter_address=drafter.address, verifier_addresses=(link.address,),
        # No verifier lookups: with the drafter down they still draft, and a probe below asks if the drafter does.
        speculative_config='{"method": "suffix", "num_speculative_tokens": 8}', speculation_debug='{"lookup": "off"}',
        verifier_timeout_s=STEP_DEADLINE_S,
        # A busy 2-core host may delay a draft past the 200 ms default, which would end a drafter
        # session early and upset the session counts; a killed drafter fails at once anyway.
        draft_timeout_ms=2000,
    )
    stack = Stack(drafter, verifier, gateway, log_dir)
    try:
        for name in ("drafter", "verifier", "gateway"):
            stack.start_service(name)
        stack.wait_ready()
        yield FaultyStack(stack, link)
    finally:
        stack.stop()
        link.close()


def in_background(function, *args, **kwargs):
    """Runs `function(*args, **kwargs)` on a thread; the future's result is (outcome, when it ended)."""
    def timed():
        try:
            outcome = function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            outcome = error
        return outcome, time.monotonic()

    return concurrent.futures.ThreadPoolExecutor(1).submit(timed)


def http_stream(client: openai.OpenAI, messages, max_tokens: int, started: threading.Event | None = None,
                **fields) -> str:
    """A streamed chat completion's text; sets `started` after its third chunk."""
    pieces = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, **fields):
        pieces.append((chunk.choices[0].delta.content or "") if chunk.choices else "")
        if started is not None and len(pieces) == 3:
            started.set()
    return "".join(pieces)


def grpc_stream(faulty: FaultyStack, messages, max_tokens: int, started: threading.Event | None = None,
                **fields) -> str:
    pieces = []
    with faulty.grpc_client() as client:
        for chunk in client.stream(messages=messages, max_tokens=max_tokens, temperature=0, **fields):
            pieces.append(chunk.text)
            if started is not None and len(pieces) == 3:
                started.set()
    return "".join(pieces)


def test_a_client_leaving_mid_stream_frees_its_sequence_and_its_drafter_session(faulty):
    client = faulty.openai()
    http = client.chat.completions.create(model=MODEL, messages=COUNTING, max_tokens=LONG, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
    http_chunks = iter(http)
    for _ in range(3):
        next(http_chunks)
    with faulty.grpc_client() as grpc_client:
        grpc_chunks = grpc_client.stream(messages=COUNTING, max_tokens=LONG, temperature=0, ignore_eos=True)
        for _ in range(3):
            next(grpc_chunks)
        # Both hold a generation, a sequence with its KV and a drafter session: the figures see them.
        held = faulty.figures()
        assert (held["gateway_running"], held["verifier_running"], held["drafter_sessions"]) == (2, 2, 2), held
        assert held["verifier_kv_used_tokens"] > 0
        http.close()
        grpc_chunks.close()
        left = time.monotonic()
        faulty.wait_idle(timeout=10)
    # Long before the generations could have ended by themselves.
    assert time.monotonic() - left < 10


def test_a_drafter_killed_mid_stream_and_restarted_keeps_the_output_and_comes_back_warm(faulty):
    client = faulty.openai()
    remembered = [{"role": "user", "content": "List the first twenty prime numbers, separated by commas."}]
    # A response for the drafter's global tree, then a snapshot that holds it.
    client.chat.completions.create(model=MODEL, messages=remembered, max_tokens=64, temperature=0)
    answered = time.time()
    snapshot = faulty.stack.log_dir / "drafter.snapshot"
    wait_for(lambda: snapshot.is_file() and snapshot.stat().st_mtime > answered + 1.5 * SNAPSHOT_INTERVAL_S,
             30, "the drafter saved no snapshot")
    cached_before = faulty.drafter_metrics()["speclane:drafter_cached_requests"]
    assert cached_before >= 1

    requests = [("http", PRIME), ("http", code_edit_messages()), ("grpc", PRIME)]
    plain = [in_background(http_stream, client, messages, 80, extra_body={"speculation": {"method": "none"}})
             for _, messages in requests]
    plain = [future.result(timeout=120)[0] for future in plain]
    started = [threading.Event() for _ in requests]
    running = [in_background(http_stream, client, messages, 80, started[index]) if kind == "http"
               else in_background(grpc_stream, faulty, messages, 80, started[index])
               for index, (kind, messages) in enumerate(requests)]
    for event in started:
        assert event.wait(60), "a request never streamed"
    faulty.stack.kill("drafter")
    for index, future in enumerate(running):
        output, _ = future.result(timeout=120)
        assert output == plain[index], f"request {index} changed when the drafter died"

    faulty.stack.start_service("drafter")
    wait_for(lambda: _serving(faulty.stack.drafter.address), 60, "the drafter did not come back")
    # Warm: its global tree is the snapshot's, not empty (it serves only once the snapshot is loaded).
    assert faulty.drafter_metrics()["speclane:drafter_cached_requests"] >= cached_before
    # The gateway rests a failed drafter for a few seconds, then drafts again.
    probe = [{"role": "user", "content": "Repeat: alpha beta gamma alpha beta gamma alpha beta gamma"}]

    def drafting():
        reply = client.chat.completions.create(model=MODEL, messages=probe, max_tokens=8, temperature=0,
                                               extra_body={"speculation": {"method": "ngram"}},
                                               extra_headers={"x-tenant-id": "probe"})
        return reply.usage.model_extra["speculation"]["draft_tokens"] > 0

    wait_for(drafting, 60, "the gateway never drafted again")
    again = client.chat.completions.create(model=MODEL, messages=remembered, max_tokens=64, temperature=0)
    assert again.usage.model_extra["speculation"]["accepted_tokens"] > 0
    # Drafted from the restored global tree: the restarted drafter never saw this answer itself.
    assert faulty.drafter_metrics().get("speclane:drafter_drafts_total:suffix-global", 0) > 0
    faulty.wait_idle()


def _serving(address: str) -> bool:
    try:
        return grpc_health(address) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def test_a_frozen_then_cut_link_to_the_verifier_fails_requests_fast_and_heals(faulty):
    client = faulty.openai()
    started = [threading.Event(), threading.Event()]
    running = [in_background(http_stream, client, COUNTING, LONG, started[0], extra_body={"ignore_eos": True}),
               in_background(grpc_stream, faulty, COUNTING, LONG, started[1], ignore_eos=True)]
    for event in started:
        assert event.wait(60), "a request never streamed"
    faulty.link.freeze()
    frozen_at = time.monotonic()
    (http_error, http_ended), (grpc_error, grpc_ended) = (future.result(timeout=60) for future in running)
    # The stream reports an error event (its headers are long gone), the gRPC call UNAVAILABLE.
    assert isinstance(http_error, openai.APIError) and not isinstance(http_error, openai.APITimeoutError), http_error
    assert isinstance(grpc_error, grpc.RpcError) and grpc_error.code() == grpc.StatusCode.UNAVAILABLE, grpc_error
    assert max(http_ended, grpc_ended) - frozen_at < FAST_FAILURE_S

    # New requests while the link is frozen, then cut: 503 within the deadline, no hang.
    for fault in ("frozen", "cut"):
        if fault == "cut":
            faulty.link.cut()
        asked_at = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model=MODEL, messages=COUNTING, max_tokens=8, temperature=0)
        assert refused.value.status_code == 503, (fault, refused.value.body)
        assert time.monotonic() - asked_at < FAST_FAILURE_S, fault
    # The cut reached the verifier: the sequences of the failed requests are freed there too.
    wait_for(lambda: faulty.verifier_load().num_running == 0, 10, "the verifier kept the cut sequences")

    faulty.link.restore()
    faulty.wait_serving(timeout=60)
    assert http_stream(client, PRIME, 16)
    faulty.wait_idle()


def test_a_killed_verifier_fails_requests_at_once_then_503_then_serves_with_nothing_held(faulty):
    client = faulty.openai()
    started = [threading.Event(), threading.Event()]

    def whole_reply():
        started[1].wait(60)  # sent once the streams run, so it is in flight when the verifier dies
        return client.chat.completions.create(model=MODEL, messages=COUNTING, max_tokens=LONG, temperature=0,
                                              extra_body={"ignore_eos": True})

    running = [in_background(http_stream, client, COUNTING, LONG, started[0], extra_body={"ignore_eos": True}),
               in_background(grpc_stream, faulty, PRIME, LONG, started[1], ignore_eos=True),
               in_background(whole_reply)]
    for event in started:
        assert event.wait(60), "a request never streamed"
    wait_for(lambda: faulty.gateway_metrics()["vllm:num_requests_running"] == 3, 30, "three requests never ran")
    faulty.stack.kill("verifier")
    killed_at = time.monotonic()
    (stream_error, _), (grpc_error, _), (reply_error, _) = outcomes = [f.result(timeout=60) for f in running]
    assert max(ended for _, ended in outcomes) - killed_at < FAST_FAILURE_S  # at once, not at a timeout
    assert isinstance(stream_error, openai.APIError) and not isinstance(stream_error, openai.APITimeoutError)
    assert isinstance(grpc_error, grpc.RpcError) and grpc_error.code() == grpc.StatusCode.UNAVAILABLE, grpc_error
    assert isinstance(reply_error, openai.APIStatusError) and reply_error.status_code == 503, reply_error

    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=COUNTING, max_tokens=8, temperature=0)
    assert refused.value.status_code == 503 and refused.value.body["type"] == "service_unavailable_error"

    faulty.stack.start_service("verifier")  # as a supervisor would
    faulty.wait_serving()
    assert http_stream(client, PRIME, 16)
    faulty.wait_idle()
    # The gateway's own view of the verifiers' load (GetLoad, polled each second) is back to zero too.
    wait_for(lambda: faulty.gateway_metrics().get("speclane:verifier_requests_running") == 0
             and faulty.gateway_metrics().get("vllm:kv_cache_usage_perc") == 0, 10,
             "the gateway's verifier load figures did not return to zero")
