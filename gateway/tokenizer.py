"""The gateway's tokenizer and chat template: from a local model directory, or
fetched from the verifier (its GetTokenizer RPC), so that a gateway on a CPU
host needs no copy of the model and always tokenizes as the served model does."""

import contextlib
import os
import pathlib
import sys
import tempfile

from gateway.verifier_pool import VerifierPool


def hide_torch() -> None:
    """transformers imports torch whenever it is installed, though a tokenizer and
    a chat template need none of it; in the gateway that would cost ~3 s of
    start-up and ~270 MB of memory. Call before transformers is first imported."""
    sys.modules.setdefault("torch", None)  # `import torch` now fails: transformers takes torch as absent
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" warning


def load_tokenizer(model_dir: str | os.PathLike):
    from transformers import AutoTokenizer  # late: after the gateway process hid torch

    return AutoTokenizer.from_pretrained(model_dir)


@contextlib.asynccontextmanager
async def files_from_verifier(verifiers: VerifierPool):
    """A temporary directory holding the verifier's tokenizer and generation-config
    files; what is loaded from it lives in memory, so it goes afterwards."""
    files = await verifiers.tokenizer_files()
    with tempfile.TemporaryDirectory(prefix="speclane-tokenizer-") as directory:
        for name, content in files.items():
            (pathlib.Path(directory) / pathlib.Path(name).name).write_bytes(content)
        yield directory
