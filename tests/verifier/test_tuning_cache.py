import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from verifier_service import tuning_cache

ON_CPU = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cpu")))  # an engine, as draft_cost reads it
KEY = {"host": {"model name": "a CPU"}, "threads": 2, "shapes": [[64, 32], [32, 64]]}


def test_a_stored_value_is_read_back_under_its_key_only(tmp_path):
    assert tuning_cache.load(tmp_path, "ways", KEY) is None
    tuning_cache.store(tmp_path, "ways", KEY, [[1, 2], [3]])
    assert tuning_cache.load(tmp_path, "ways", KEY) == [[1, 2], [3]]
    assert tuning_cache.load(tmp_path, "ways", {**KEY, "threads": 1}) is None
    assert tuning_cache.load(tmp_path, "other", KEY) is None
    assert tuning_cache.load(None, "ways", KEY) is None


def test_a_file_holding_another_key_or_garbage_is_not_read(tmp_path):
    tuning_cache.store(tmp_path, "ways", KEY, 1)
    (path,) = tmp_path.glob("ways-*.json")
    path.write_text(json.dumps({"key": {**KEY, "threads": 9}, "value": 2}))  # as a hash collision would
    assert tuning_cache.load(tmp_path, "ways", KEY) is None
    path.write_text("{not json")
    assert tuning_cache.load(tmp_path, "ways", KEY) is None


def test_a_directory_that_cannot_be_written_costs_only_the_next_measurement(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    tuning_cache.store(blocker / "tuning", "ways", KEY, 1)  # no exception
    assert tuning_cache.load(blocker / "tuning", "ways", KEY) is None


needs_proc_stat = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")


@pytest.mark.e2e  # starts busy processes
@needs_proc_stat
def test_the_core_watch_sees_other_processes_on_its_cores_and_not_its_own_threads():
    cpus = os.sched_getaffinity(0)
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    with tuning_cache.CoreWatch() as busy:
        spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in cpus]
        for spinner in spinners:
            spinner.wait()
    assert busy.others_share >= 0.5 and not busy.quiet
    with tuning_cache.CoreWatch() as own:
        end = time.monotonic() + 1.0
        a = torch.randn(256, 256)
        while time.monotonic() < end:
            a @ a  # every torch thread busy: all of the cores, but this process's own time
    assert own.others_share < 0.5


@needs_proc_stat
def test_draft_token_costs_measured_beside_another_process_on_a_cpu_serve_but_are_not_stored(tmp_path, monkeypatch):
    from verifier_service import draft_cost

    monkeypatch.setattr(draft_cost, "measure_token_costs", lambda engine: time.sleep(0.05) or {1: 0.05, 8: 0.2})
    monkeypatch.setattr(tuning_cache, "QUIET_SHARE", -1.0)  # any use of the cores counts as disturbed
    monkeypatch.setattr(tuning_cache, "QUIET_SLACK_S", 0.0)
    key = {"host": tuning_cache.host_fingerprint(), "model": "abc", "threads": 2}
    assert draft_cost.stored_or_measured_token_costs(ON_CPU, key, tmp_path) == ({1: 0.05, 8: 0.2}, True)
    assert not list(tmp_path.iterdir())
    # An accelerator's passes do not run on the host's cores: its costs are stored whatever else runs there.
    on_gpu = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cuda", 0)))
    assert draft_cost.stored_or_measured_token_costs(on_gpu, key, tmp_path) == ({1: 0.05, 8: 0.2}, True)
    assert draft_cost.stored_or_measured_token_costs(on_gpu, key, tmp_path) == ({1: 0.05, 8: 0.2}, False)


def test_the_host_fingerprint_names_the_cpu():
    fingerprint = tuning_cache.host_fingerprint()
    assert fingerprint["cpus"] >= 1
    assert fingerprint.get("model name") or fingerprint.get("processor") is not None


def test_draft_token_costs_are_measured_once_per_key_and_read_back_by_batch_size(tmp_path, monkeypatch):
    from verifier_service import draft_cost

    measured = []
    monkeypatch.setattr(draft_cost, "measure_token_costs", lambda engine: measured.append(engine) or {1: 0.06, 32: 0.5})
    key = {"host": tuning_cache.host_fingerprint(), "model": "abc", "threads": 2}
    assert draft_cost.stored_or_measured_token_costs(ON_CPU, key, tmp_path) == ({1: 0.06, 32: 0.5}, True)
    assert draft_cost.stored_or_measured_token_costs(ON_CPU, key, tmp_path) == ({1: 0.06, 32: 0.5}, False)
    assert len(measured) == 2  # measured twice, agreeing: stored
    assert draft_cost.stored_or_measured_token_costs(ON_CPU, {**key, "threads": 1}, tmp_path)[1]
    assert draft_cost.stored_or_measured_token_costs(ON_CPU, key, None)[1]  # no cache: measured every time
    assert len(measured) == 6


def test_draft_token_costs_that_two_measurements_disagree_on_are_not_stored(tmp_path, monkeypatch):
    """A start measured while another process held the cores (here the first measurement, 4x at one sequence):
    the median of three serves it, and the next start measures again rather than keeping it."""
    from verifier_service import draft_cost

    readings = iter([{1: 0.16, 8: 0.18}, {1: 0.04, 8: 0.22}, {1: 0.045, 8: 0.25},
                     {1: 0.044, 8: 0.23}, {1: 0.046, 8: 0.24}])
    monkeypatch.setattr(draft_cost, "measure_token_costs", lambda engine: next(readings))
    key = {"host": tuning_cache.host_fingerprint(), "model": "abc", "threads": 2}
    assert draft_cost.stored_or_measured_token_costs(ON_CPU, key, tmp_path) == ({1: 0.045, 8: 0.22}, True)
    assert draft_cost.stored_or_measured_token_costs(ON_CPU, key, tmp_path) == ({1: 0.045, 8: 0.235}, True)
    assert draft_cost.stored_or_measured_token_costs(ON_CPU, key, tmp_path) == ({1: 0.045, 8: 0.235}, False)


def test_the_code_fingerprint_changes_with_any_source_file(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    before = tuning_cache.code_fingerprint(tmp_path)
    (tmp_path / "notes.txt").write_text("not code")
    assert tuning_cache.code_fingerprint(tmp_path) == before
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert tuning_cache.code_fingerprint(tmp_path) != before
