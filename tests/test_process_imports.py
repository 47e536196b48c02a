"""Each service process imports only its own world.

The drafter and the gateway's public client run on machines with no torch, and
the `speclane` CLI must start without paying for it. These tests run real
Python processes in which `import torch` and `import transformers` raise
ImportError (sys.modules[name] = None), so any import of either fails them.
"""

import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from speclane.net import free_port

pytestmark = pytest.mark.e2e  # starts processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = "import sys; sys.modules.update(torch=None, transformers=None); "
# Printed by the child: the loaded modules named torch*/transformers* that are real (not the None blockers).
REPORT = "; print('REAL:', sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in "\
         "('torch', 'transformers')))"
REPEATED = [11, 12, 13, 14, 15]


def blocked_python(code: str) -> list[str]:
    """argv running `code` in a fresh interpreter where torch and transformers cannot be imported."""
    return [sys.executable, "-c", BLOCK + code]


def wait_serving(address: str, process: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            try:
                if health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    process.kill()
    pytest.fail(f"drafter not SERVING (exit code {process.wait()}):\n{process.stderr.read().decode()}")


@pytest.fixture(scope="module")
def drafter_address():
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        blocked_python("from drafter_service.server import main; main(sys.argv[1:])") + ["--address", address],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_serving(address, process)
        yield address
    finally:
        process.send_signal(signal.SIGTERM)  # a no-op if it has already exited
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    assert code == 0, process.stderr.read().decode()  # a clean drain on SIGTERM


@pytest.mark.parametrize("method", [drafter_pb2.METHOD_SUFFIX, drafter_pb2.METHOD_NGRAM], ids=["suffix", "ngram"])
def test_drafter_without_torch_serves_drafts(drafter_address, method):
    prompt = REPEATED * 3
    params = drafter_pb2.ProposerParams(method=method, num_speculative_tokens=4)
    requests = [
        drafter_pb2.SessionRequest(start=drafter_pb2.Start(sequence_id="s", prompt_token_ids=prompt, params=params)),
        drafter_pb2.SessionRequest(step=drafter_pb2.Step(committed_len=len(prompt))),
        drafter_pb2.SessionRequest(step=drafter_pb2.Step(committed_token_ids=[11, 12], committed_len=len(prompt) + 2)),
    ]
    with grpc.insecure_channel(drafter_address) as channel:
        responses = list(drafter_pb2_grpc.DrafterStub(channel).Session(iter(requests), timeout=10))
    assert [list(r.draft.token_ids) for r in responses] == [[11, 12, 13, 14], [13, 14, 15, 11]]
    assert [r.draft.committed_len for r in responses] == [15, 17]


def test_the_client_needs_only_grpcio_and_protobuf():
    """What a light install of the client would lack: everything but grpcio and protobuf."""
    absent = ("torch", "transformers", "structlog", "fastapi", "uvicorn", "prometheus_client", "jinja2",
              "grpc_health", "grpc_reflection", "speclane")
    code = (f"import sys; sys.modules.update(dict.fromkeys({absent!r})); import gateway.client as c; "
            "c.GenerationClient('127.0.0.1:1').close(); c.AsyncGenerationClient('127.0.0.1:1')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("code", [
    "import speclane_cli.main; assert 'gateway' in speclane_cli.main.COMMANDS",
    "from verifier_service.config import VerifierConfig",
])
def test_module_imports_without_torch(code):
    result = subprocess.run(blocked_python(code + REPORT), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "REAL: []" in result.stdout.splitlines(), result.stdout
