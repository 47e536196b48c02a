"""The verifier re-executes itself with tcmalloc preloaded (verifier_service/launch.py)."""

import sys

import pytest

from verifier_service import launch


def found(name: str) -> str | None:
    return {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}.get(name)


def test_preloads_tcmalloc_ahead_of_what_is_preloaded():
    assert launch.preload_environment({"PATH": "/bin"}, found) == {
        "PATH": "/bin", "LD_PRELOAD": "libtcmalloc_minimal.so.4"}
    assert launch.preload_environment({"LD_PRELOAD": "/opt/libiomp5.so"}, found)["LD_PRELOAD"] == (
        "libtcmalloc_minimal.so.4:/opt/libiomp5.so")


@pytest.mark.parametrize("preload", ["libtcmalloc_minimal.so.4", "/usr/lib/libjemalloc.so.2", "x.so:libmimalloc.so"])
def test_keeps_an_allocator_already_preloaded(preload):
    assert launch.preload_environment({"LD_PRELOAD": preload}, found) is None
    assert launch.allocator({"LD_PRELOAD": preload}) in preload


def test_runs_on_glibc_where_no_tcmalloc_is_installed():
    assert launch.preload_environment({}, lambda name: None) is None
    assert launch.allocator({}).startswith("glibc")


def test_main_reexecutes_the_same_command_line(monkeypatch):
    calls = []
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-m", "verifier_service", "--model", "m"])
    monkeypatch.setattr(launch, "preload_environment", lambda environ: {"LD_PRELOAD": "libtcmalloc.so"})
    monkeypatch.setattr(launch.os, "execve", lambda *args: calls.append(args) or sys.exit(0))
    with pytest.raises(SystemExit):
        launch.main()
    assert calls == [(sys.executable, [sys.executable, "-m", "verifier_service", "--model", "m"],
                      {"LD_PRELOAD": "libtcmalloc.so"})]
