"""The engine behind one model thread. The event loop posts commands (submit
a step, close a sequence) to the thread's inbox; the thread runs them between
forward passes and resolves the callers' futures. Steps of all sequences that
are ready when a pass starts share it."""

import asyncio
import queue
import threading
import time
from collections.abc import Callable

import structlog

from verifier_service.device import set_threads
from verifier_service.engine import Engine
from verifier_service.sequence import Draft, GenerationParams, Sequence, StepResult

log = structlog.get_logger()

_STOP = object()
# While sequences wait for KV space, wake up this often to admit or refuse them.
_WAITING_POLL_SECONDS = 0.05
# A pass waits for running sequences' next steps up to this share of the last pass's time, when
# that is longer than the configured batch window: a step that misses a pass of T seconds loses T,
# and under load the ones left out form passes of their own, each paying the weights' read again.
_BATCH_WAIT_SHARE = 0.1


def batch_window(batch_wait_seconds: float, last_pass_seconds: float) -> float:
    """How long a pass waits for running sequences' next steps: the configured
    window, or a share of the last pass where that is longer; 0 never waits."""
    return max(batch_wait_seconds, _BATCH_WAIT_SHARE * last_pass_seconds) if batch_wait_seconds else 0.0


def _resolve(future: asyncio.Future, outcome) -> None:
    if future.done():  # the caller went away
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class AsyncEngine:
    """`load` builds the Engine on the model thread (after warm-up); `start` waits for it."""

    def __init__(self, load: Callable[[], Engine], threads: int = 0, on_stop: Callable[[], None] | None = None,
                 batch_wait_seconds: float = 0.0):
        self._load = load
        self._batch_wait = batch_wait_seconds
        self._last_pass_seconds = 0.0
        self._threads = threads
        self._on_stop = on_stop
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.engine: Engine | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        self._thread = threading.Thread(target=self._main, args=(loop, started), name="verifier-model", daemon=True)
        self._thread.start()
        self.engine = await started

    def open(self, sequence_id: str, prompt: list[int], params: GenerationParams) -> Sequence:
        return self.engine.open(sequence_id, prompt, params)

    async def prefill(self, seq: Sequence) -> StepResult:
        return await self._submit(seq, Draft())

    async def verify(self, seq: Sequence, draft: Draft) -> StepResult:
        return await self._submit(seq, draft)

    def close(self, seq: Sequence) -> None:
        """Runs on the model thread after any step of this sequence in flight."""
        self._inbox.put(lambda engine: engine.close(seq))

    async def num_live(self) -> int:
        """Live sequences, counted after every queued command has run."""
        return await self.call(lambda engine: engine.num_live)

    async def call(self, fn: Callable[[Engine], object]):
        """Runs fn(engine) on the model thread between passes."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def command(engine):
            try:
                outcome = fn(engine)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                outcome = exc
            loop.call_soon_threadsafe(_resolve, future, outcome)

        self._inbox.put(command)
        return await future

    async def stop(self, timeout_seconds: float = 30.0) -> None:
        """Stops the model thread after its current pass (and the follower ranks with it)."""
        self._inbox.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_seconds)

    async def _submit(self, seq: Sequence, draft: Draft) -> StepResult:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(outcome):
            loop.call_soon_threadsafe(_resolve, future, outcome)

        self._inbox.put(lambda engine: engine.submit(seq, draft, done))
        return await future

    def _main(self, loop: asyncio.AbstractEventLoop, started: asyncio.Future) -> None:
        set_threads(self._threads)  # before this thread's first torch op
        try:
            engine = self._load()
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            loop.call_soon_threadsafe(_resolve, started, exc)
            return
        loop.call_soon_threadsafe(_resolve, started, engine)
        progressed = False
        try:
            while True:
                timeout = 0 if progressed else (_WAITING_POLL_SECONDS if engine.has_work else None)
                if not self._drain(engine, timeout) or not self._gather(engine):
                    return
                try:
                    started = time.monotonic()
                    progressed = engine.step()
                    if progressed:
                        self._last_pass_seconds = time.monotonic() - started
                except Exception:  # noqa: BLE001 - a bug in one pass must not stop the model thread
                    log.exception("engine_step_failed")
                    progressed = False
        finally:
            if self._on_stop is not None:
                self._on_stop()

    def _gather(self, engine: Engine) -> bool:
        """Waits up to the batch window for running sequences whose next step is
        on its way (their clients answer a pass one by one), so the next pass
        takes them all instead of starting with the first; False on stop."""
        deadline = time.monotonic() + batch_window(self._batch_wait, self._last_pass_seconds)
        while engine.scheduler.ready and engine.num_between_steps:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            if not self._drain(engine, left):
                return False
        return True

    def _drain(self, engine: Engine, timeout: float | None) -> bool:
        """Runs queued commands, first waiting up to `timeout` for one; False on stop."""
        try:
            command = self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            command(engine)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
