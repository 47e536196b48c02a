"""The gateway and the drafter of a running stack have loaded no torch.

Both only need a tokenizer (gateway) or the compiled suffix-tree core (drafter);
torch costs seconds of start-up and hundreds of MB per process. The gateway hides
torch from transformers (gateway.tokenizer.hide_torch) although torch is installed;
the shared libraries a process has mapped (/proc/<pid>/maps) show whether it
loaded torch anyway. The verifier, which runs the model, is the control.
"""

import pathlib

import pytest

pytestmark = pytest.mark.e2e


def torch_libraries(stack, name: str) -> list[str]:
    """The mapped files of service `name` whose path names libtorch."""
    process = stack.processes[name]
    assert process.poll() is None, f"{name} exited:\n{stack.logs(name)}"
    paths = {line.split(maxsplit=5)[5] for line in pathlib.Path(f"/proc/{process.pid}/maps").read_text().splitlines()
             if len(line.split(maxsplit=5)) == 6}
    return sorted(path for path in paths if "libtorch" in path)


@pytest.mark.parametrize("name", ["gateway", "drafter"])
def test_service_maps_no_torch(stack, name):
    assert torch_libraries(stack, name) == []


def test_verifier_maps_torch(stack):
    assert torch_libraries(stack, "verifier"), "the check cannot see torch where it is loaded"
