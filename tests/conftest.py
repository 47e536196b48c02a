"""The `e2e` marker is what `make test-fast` leaves out, so it must be on every test that starts
a process. This holds it there: outside `e2e` tests, starting a process fails the test (subprocess,
asyncio's subprocesses and multiprocessing's spawn all start one through these functions). Not on an
accelerator (SPECLANE_TEST_DEVICE, docs/benchmarks/device): there inductor compiles Triton kernels in worker
processes and Triton runs ptxas, and the marker's split matters only to the CPU suite."""

import _posixsubprocess
import os
import subprocess

import pytest


def _refuse(*args, **kwargs):
    raise AssertionError("this test starts a process: mark it @pytest.mark.e2e (tests/README.md)")


@pytest.fixture(autouse=True)
def _processes_only_in_e2e_tests(request, monkeypatch):
    if request.node.get_closest_marker("e2e") is None and os.environ.get("SPECLANE_TEST_DEVICE", "cpu") == "cpu":
        monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse)
        monkeypatch.setattr(subprocess, "_fork_exec", _refuse)
        monkeypatch.setattr(os, "posix_spawn", _refuse)
