import pytest

from speclane.models import DEFAULT_MODEL, resolve_model
from tests.e2e.stack import start_stack


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def stack(model_dir, tmp_path_factory):
    # The verifier's own lookups ("auto") engage by measured timings, so tests that count next-round
    # steps would depend on the host's speed; test_lossless.py runs a gateway with them always on.
    running = start_stack(model_dir, tmp_path_factory.mktemp("stack-logs"),
                          speculative_config='{"method": "suffix", "num_speculative_tokens": 8, '
                                             '"next_round_lookup": false}')
    yield running
    running.stop()
