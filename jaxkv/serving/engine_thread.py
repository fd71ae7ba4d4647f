"""An engine stepping in its own thread while other threads (an HTTP server's handlers) add
requests, abort them and receive their outputs.

    thread = EngineThread(engine, max_waiting=64).start()
    request_id = thread.submit(prompt_ids, sink, RequestOptions(max_tokens=32))  # sink(output) per step, on its thread
    thread.abort(request_id)
    thread.stop()                                                 # finishes what is in flight, then returns

One lock guards the engine: ``submit`` waits at most one step (call it off an event loop);
``abort`` and ``stats`` never wait (an abort is applied before the next step, stats are the
last step's). Outputs go to each request's sink outside the lock; a request is forgotten
(``Engine.pop``) once all its samples have finished.

Failures: a request that fails in a step fails alone (``Engine.step`` reports it with finish
reason 'error'); a sink that raises has its request aborted. Anything else that escapes the
engine ends the thread: every request in flight gets an 'error' output, ``alive`` turns False,
``failure`` says why, and ``submit`` refuses new requests.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence

from jaxkv.serving.engine import Engine
from jaxkv.serving.requests import RequestOptions, RequestOutput
from jaxkv.serving.stats import EngineStats

Sink = Callable[[RequestOutput], None]


class EngineUnavailable(RuntimeError):
    """``submit`` refused: too many requests waiting, shutting down, or the thread has failed."""


class EngineThread:
    """``max_waiting``: ``submit`` refuses a request while this many sequences wait for a row
    (checked under the engine's lock, so concurrent submissions never exceed it; None: no limit)."""

    def __init__(self, engine: Engine, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.failure: str | None = None  # why the thread ended, if the engine raised
        self._engine_lock = threading.Lock()  # held for a step, or to add a request
        self._wakeup = threading.Event()  # set when there may be work
        self._sinks: dict[int, Sink] = {}
        self._aborts: list[int] = []  # appended by any thread, applied by the engine thread
        self._stats = engine.stats()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    @property
    def accepting(self) -> bool:
        return not self._closing

    @property
    def alive(self) -> bool:
        """Is the thread stepping the engine (started, not stopped, not failed)?"""
        return self._thread.is_alive()

    def submit(self, prompt_ids: Sequence[int], sink: Sink, options: RequestOptions = RequestOptions()) -> int:
        """Queue a request (``Engine.add_request``; its errors are raised here); ``sink``
        receives each of its outputs. Raises ``EngineUnavailable`` past ``max_waiting``, while
        shutting down, or after a failure."""
        with self._engine_lock:
            self._check_available()
            request_id = self.engine.add_request(prompt_ids, options=options)
            self._sinks[request_id] = sink
            self._stats = self.engine.stats()
        self._wakeup.set()
        return request_id

    def _check_available(self) -> None:
        if self.failure is not None:
            raise EngineUnavailable(f"the engine stopped after an error ({self.failure}); restart the server")
        if self._closing:
            raise EngineUnavailable("the engine is shutting down and takes no new requests")
        waiting = self.engine.stats().num_waiting
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise EngineUnavailable(f"{waiting} requests are waiting (the limit is {self.max_waiting}); retry later")

    def abort(self, request_id: int) -> None:
        """Stop a request; its pages are free before the next step, its sink gets 'abort' outputs."""
        self._aborts.append(request_id)  # list.append is atomic: no lock, no wait for a step
        self._wakeup.set()

    def stats(self) -> EngineStats:
        """``Engine.stats`` as of the last step (or the last submission)."""
        return self._stats

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, let the ones in flight finish, then end the thread."""
        self._closing = True
        self._wakeup.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as error:
            self._fail_all(f"{type(error).__name__}: {error}")
            raise  # the thread ends; threading's excepthook prints the traceback

    def _loop(self) -> None:
        while True:
            with self._engine_lock:
                self._apply_aborts()
                busy = self.engine.has_unfinished()
                if busy:
                    outputs = self.engine.step()
                    deliveries = [(self._sinks[output.request_id], output) for output in outputs]
                    self._forget_finished(outputs)
                    self._stats = self.engine.stats()
                elif self._closing:
                    return
            if busy:
                for sink, output in deliveries:
                    self._deliver(sink, output)
                continue
            self._wakeup.wait()  # state is read again under the lock: a wakeup between the two is not lost
            self._wakeup.clear()

    def _deliver(self, sink: Sink, output: RequestOutput) -> None:
        try:
            sink(output)
        except Exception as error:  # noqa: BLE001 - the receiver is gone: only its request ends
            warnings.warn(f"request {output.request_id}: its sink raised {error!r}; aborting it", stacklevel=2)
            self.abort(output.request_id)

    def _fail_all(self, failure: str) -> None:
        """Every request in flight gets one 'error' output (ending it whole); no request is taken after."""
        with self._engine_lock:
            self.failure = failure
            sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            output = RequestOutput(request_id, 0, [], finished=True, finish_reason="error", error=failure)
            self._deliver(sink, output)

    def _apply_aborts(self) -> None:
        while self._aborts:
            request_id = self._aborts.pop()
            if request_id in self._sinks:
                self.engine.abort(request_id)

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        for request_id in {output.request_id for output in outputs if output.finished}:
            if self.engine.request_finished(request_id):
                del self._sinks[request_id]
                self.engine.pop(request_id)
