"""`speclane serve` heals: a verifier killed mid-stream ends that stream with an
error at once, requests get 503 (never 500, never a hang) while it is away,
and succeed again once the supervisor has brought it back."""

import os
import pathlib
import signal
import time

import openai
import pytest

from tests.e2e.stack import speclane_serve

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Count from one to one hundred in words, separated by commas."}]


def children_of(pid: int) -> dict[int, str]:
    """Child processes of `pid` and their command lines."""
    found = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.fixture
def serve(tmp_path):
    with speclane_serve(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
                        tmp_path / "serve.log") as running:
        yield running


def test_a_killed_verifier_fails_its_streams_then_503_then_comes_back(serve):
    process, port = serve
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    (verifier_pid,) = [pid for pid, cmd in children_of(process.pid).items() if "verifier_service" in cmd]

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=400, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    received = 0
    with pytest.raises(openai.APIError):
        for _ in stream:
            received += 1
            if received == 3:
                os.kill(verifier_pid, signal.SIGKILL)
                killed_at = time.monotonic()
    assert time.monotonic() - killed_at < 10  # the stream ended at once, not at a timeout

    statuses = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
            break
        except openai.APIStatusError as error:
            statuses.append(error.status_code)
            assert error.body["type"] == "service_unavailable_error", error.body
            time.sleep(0.5)
    else:
        pytest.fail(f"the verifier did not come back; statuses {statuses}")
    assert statuses and set(statuses) == {503}
    assert reply.choices[0].message.content
    restarted = [pid for pid, cmd in children_of(process.pid).items() if "verifier_service" in cmd]
    assert restarted and restarted != [verifier_pid]
