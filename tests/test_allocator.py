"""The verifier and the drafter re-execute themselves with tcmalloc preloaded (speclane/allocator.py)."""

import sys

import pytest

from drafter_service import server as drafter_server
from speclane import allocator
from verifier_service import launch


def found(name: str) -> str | None:
    return {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}.get(name)


def test_preloads_tcmalloc_ahead_of_what_is_preloaded():
    assert allocator.preload_environment({"PATH": "/bin"}, found) == {
        "PATH": "/bin", "LD_PRELOAD": "libtcmalloc_minimal.so.4"}
    assert allocator.preload_environment({"LD_PRELOAD": "/opt/libiomp5.so"}, found)["LD_PRELOAD"] == (
        "libtcmalloc_minimal.so.4:/opt/libiomp5.so")


@pytest.mark.parametrize("preload", ["libtcmalloc_minimal.so.4", "/usr/lib/libjemalloc.so.2", "x.so:libmimalloc.so"])
def test_keeps_an_allocator_already_preloaded(preload):
    assert allocator.preload_environment({"LD_PRELOAD": preload}, found) is None
    assert allocator.allocator({"LD_PRELOAD": preload}) in preload


def test_runs_on_glibc_where_no_tcmalloc_is_installed():
    assert allocator.preload_environment({}, lambda name: None) is None
    assert allocator.allocator({}).startswith("glibc (")


def test_the_verifier_raises_glibcs_thresholds_where_no_tcmalloc_is_installed():
    raised = allocator.preload_environment({"PATH": "/bin"}, lambda name: None, glibc_thresholds=True)
    assert raised == {"PATH": "/bin", **allocator.GLIBC_THRESHOLDS}
    assert allocator.preload_environment(raised, lambda name: None, glibc_thresholds=True) is None  # once
    assert allocator.preload_environment({"MALLOC_TOP_PAD_": "0"}, lambda name: None, glibc_thresholds=True) is None
    assert allocator.preload_environment({}, found, glibc_thresholds=True) == {"LD_PRELOAD": found("tcmalloc_minimal")}
    assert allocator.allocator(raised).startswith("glibc, its thresholds raised")


@pytest.mark.parametrize(("main", "command"), [(launch.main, ["-m", "verifier_service", "--model", "m"]),
                                               (drafter_server.main, ["-m", "drafter_service", "--address", "a"])])
def test_each_service_reexecutes_its_command_line_first(monkeypatch, main, command):
    calls = []
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(sys, "orig_argv", ["python3", *command])
    monkeypatch.setattr(allocator, "preload_environment", lambda environ, **_: {"LD_PRELOAD": "libtcmalloc.so"})
    monkeypatch.setattr(allocator.os, "execve", lambda *args: calls.append(args) or sys.exit(0))
    with pytest.raises(SystemExit):
        main()
    assert calls == [(sys.executable, [sys.executable, *command], {"LD_PRELOAD": "libtcmalloc.so"})]
