"""A vLLM user's command line runs as it is: the model as a positional argument,
vLLM's names for the batch and KV flags, and a --speculative-config copied from
the seeds with keys speclane does not use (named in a warning, not an exit),
--api-key, the memory, seed and tool-calling flags."""

import json
import pathlib

import openai
import pytest

from tests.e2e.stack import speclane_serve

pytestmark = pytest.mark.e2e
VLLM_ARGS = ["smollm2-135m-instruct", "--served-model-name", "smol", "--max-model-len", "1024",
             "--max-num-seqs", "16", "--max-num-batched-tokens", "1024", "--block-size", "32",
             "--generation-config", "vllm", "--api-key", "sk-test-key", "--gpu-memory-utilization", "0.1",
             "--seed", "1234", "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--speculative-config",
             '{"method": "suffix", "num_speculative_tokens": 3, "enforce_eager": true, "quantization": null}']


def test_a_vllm_command_line_serves(tmp_path):
    log_path = tmp_path / "serve.log"
    with speclane_serve(VLLM_ARGS, log_path) as (_, port):
        base_url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base_url, api_key="sk-test-key", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        # The key reaches the gateway through its environment: `ps` shows it on no service's command line.
        services = [line for line in (path.read_bytes() for path in pathlib.Path("/proc").glob("[0-9]*/cmdline"))
                    if b"-m\x00gateway\x00" in line]
        assert services and not [line for line in services if b"sk-test-key" in line]
        (model,) = client.models.list().data
        reply = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, temperature=0)
        with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
            client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2000, temperature=0)
    assert model.id == "smol" and model.model_extra["max_model_len"] == 1024
    assert reply.choices[0].message.content
    warnings = [json.loads(line) for line in log_path.read_text().splitlines()
                if "speculative_config_keys_unused" in line]
    assert warnings and warnings[0]["keys"] == ["enforce_eager", "quantization"]
