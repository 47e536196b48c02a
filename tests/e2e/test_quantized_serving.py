"""A quantized checkpoint through the real drafter, verifier and gateway: a
compressed-tensors W8A8 model decodes greedily with n-gram and suffix drafts
exactly what it decodes alone."""

import pytest

from gateway.client import GenerationClient
from speclane.models import copy_tokenizer
from tests.e2e.prompts import code_edit_messages, humaneval_messages
from tests.e2e.stack import start_stack
from tests.quantized_support import save_w8a8_llama

pytestmark = pytest.mark.e2e


def test_a_w8a8_checkpoint_speculates_losslessly(model_dir, tmp_path):
    target = save_w8a8_llama(tmp_path / "w8a8", vocab_size=49152)
    copy_tokenizer(model_dir, target)
    stack = start_stack(target, tmp_path)
    try:
        with GenerationClient(stack.gateway.grpc_address) as client:
            drafted = 0
            for messages in [code_edit_messages(), *humaneval_messages(2)]:
                plain = client.generate(messages=messages, max_tokens=48, temperature=0.0,
                                        speculation={"method": "none"})
                for method in ("ngram", "suffix"):
                    run = client.generate(messages=messages, max_tokens=48, temperature=0.0,
                                          speculation={"method": method})
                    assert run.token_ids == plain.token_ids, method
                    drafted += run.usage.draft_tokens
    finally:
        stack.stop()
    assert drafted > 0
