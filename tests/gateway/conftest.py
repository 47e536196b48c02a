"""Fixtures for the gateway's text/HTTP layer: real tokenizers (a small one
built offline, and SmolLM2's when it has been downloaded) and a scripted
stand-in for the propose/verify loop."""

import pytest
from transformers import AutoTokenizer

from tests.gateway.fakes import SMOLLM2_DIR, ScriptedEngine, build_tiny_tokenizer, make_context


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


TOKENIZER_NAMES = ["tiny"] + (["smollm2"] if (SMOLLM2_DIR / "tokenizer.json").exists() else [])


@pytest.fixture(scope="session", params=TOKENIZER_NAMES)
def any_tokenizer(request, tiny_tokenizer):
    """Every real tokenizer available here (SmolLM2's once downloaded)."""
    if request.param == "tiny":
        return tiny_tokenizer
    return AutoTokenizer.from_pretrained(SMOLLM2_DIR)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def engine(tiny_tokenizer):
    return ScriptedEngine(tiny_tokenizer)


@pytest.fixture
def ctx(tiny_tokenizer, engine):
    return make_context(tiny_tokenizer, engine)
