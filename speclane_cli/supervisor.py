"""Keeps child processes running: a child that exits is started again after a
back-off that doubles with each quick exit in a row (1 s, 2 s, 4 s ... 30 s).
A child that keeps dying right after its start is a crash loop: the supervisor
gives up instead of restarting it forever. Stops children in a given order."""

import ctypes
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger()

BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
QUICK_EXIT_SECONDS = 10.0  # an exit sooner than this after the start counts towards a crash loop
MAX_QUICK_EXITS = 5
STOP_TIMEOUT_SECONDS = 20.0


def die_with_parent() -> None:
    """For Popen's preexec_fn: the child gets SIGTERM when its parent dies, even by SIGKILL,
    so no service outlives its supervisor (Linux's PR_SET_PDEATHSIG; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class CrashLoop(RuntimeError):
    """A child exited right after its start too many times in a row."""


@dataclass
class Child:
    name: str
    start: Callable[[], subprocess.Popen]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    quick_exits: int = 0  # in a row
    restart_at: float = 0.0

    def poll(self, now: float) -> None:
        """Starts the child when it is due; notices its exit and schedules the restart."""
        if self.process is None:
            if now >= self.restart_at:
                self.process, self.started_at = self.start(), now
            return
        if self.process.poll() is None:
            return
        quick = now - self.started_at < QUICK_EXIT_SECONDS
        self.quick_exits = self.quick_exits + 1 if quick else 0
        if self.quick_exits >= MAX_QUICK_EXITS:
            raise CrashLoop(f"{self.name} exited {self.quick_exits} times within {QUICK_EXIT_SECONDS:.0f} s "
                            f"of its start (last exit code {self.process.returncode})")
        delay = min(BACKOFF_SECONDS * 2 ** self.quick_exits, MAX_BACKOFF_SECONDS)
        log.warning("service_exited", service=self.name, returncode=self.process.returncode,
                    restart_in_seconds=delay)
        self.process, self.restart_at = None, now + delay

    def stop(self) -> None:
        if self.process is not None and not terminate(self.process, STOP_TIMEOUT_SECONDS):
            log.warning("service_killed", service=self.name)


def terminate(process: subprocess.Popen, timeout: float) -> bool:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; whether it exited on its own
    (or had already)."""
    if process.poll() is not None:
        return True
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False


def supervise(children: list[Child], stopping: Callable[[], bool], on_tick: Callable[[], None] = lambda: None,
              poll_seconds: float = 0.5) -> int:
    """Runs the children until `stopping()` (exit code 0) or a crash loop (1); stops them in reverse order."""
    exit_code = 0
    try:
        while not stopping():
            for child in children:
                child.poll(time.monotonic())
            on_tick()
            time.sleep(poll_seconds)
    except CrashLoop as exc:
        log.error("crash_loop", error=str(exc), action="stopping")
        exit_code = 1
    finally:
        for child in reversed(children):
            child.stop()
    return exit_code
