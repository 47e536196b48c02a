"""The supervisor behind `speclane serve`: children that die come back after a
growing back-off, a crash loop stops everything, and stopping goes in reverse
order. Real processes (tiny Python one-liners), short back-offs."""

import subprocess
import sys
import time

import pytest

from speclane_cli import supervisor
from speclane_cli.supervisor import Child, CrashLoop, supervise

pytestmark = pytest.mark.e2e  # starts processes


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(supervisor, "BACKOFF_SECONDS", 0.05)
    monkeypatch.setattr(supervisor, "QUICK_EXIT_SECONDS", 5.0)
    monkeypatch.setattr(supervisor, "MAX_QUICK_EXITS", 3)


def python(code: str):
    return lambda: subprocess.Popen([sys.executable, "-c", code])


def test_a_child_that_dies_is_started_again_after_a_back_off():
    child = Child("sleeper", python("import time; time.sleep(60)"))
    child.poll(now=0.0)
    first = child.process
    first.kill()
    first.wait()
    child.poll(now=100.0)  # notices the exit (not quick: it ran 100 s)
    assert child.process is None and child.restart_at == pytest.approx(100.05)
    child.poll(now=100.01)
    assert child.process is None  # still backing off
    child.poll(now=100.1)
    assert child.process is not None and child.process.pid != first.pid
    child.stop()
    assert child.process.returncode is not None


def test_quick_exits_double_the_back_off_and_end_in_a_crash_loop():
    child = Child("crasher", python("raise SystemExit(3)"))
    now, delays = 0.0, []
    with pytest.raises(CrashLoop, match="crasher exited 3 times"):
        for _ in range(10):
            child.poll(now)  # start
            child.process.wait()
            child.poll(now + 0.1)  # notice the exit
            delays.append(child.restart_at - (now + 0.1))
            now = child.restart_at
    assert delays == pytest.approx([0.1, 0.2])


def test_supervise_stops_children_in_reverse_order_and_reports_a_crash_loop():
    stopped = []

    class Recording(Child):
        def stop(self):
            stopped.append(self.name)
            super().stop()

    children = [Recording("first", python("import time; time.sleep(60)")),
                Recording("second", python("raise SystemExit(1)"))]
    started = time.monotonic()
    assert supervise(children, stopping=lambda: time.monotonic() - started > 20, poll_seconds=0.01) == 1
    assert stopped == ["second", "first"]
    assert children[0].process.poll() is not None  # the healthy child was stopped too


def test_a_child_does_not_outlive_a_killed_supervisor():
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; from speclane_cli.supervisor import die_with_parent; "
         "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
         "preexec_fn=die_with_parent); print(child.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    for _ in range(100):
        try:
            with open(f"/proc/{child_pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # exited, waiting to be reaped by init
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the child outlived its killed parent")
