"""An engine stepping in its own thread while other threads (an HTTP server's handlers) add
requests, abort them and receive their outputs.

    runner = EngineRunner(engine).start()
    request_id = runner.submit(prompt_ids, sink, max_tokens=32)   # sink(output) per step, on the runner's thread
    runner.abort(request_id)
    runner.stop()                                                 # finishes what is in flight, then returns

One lock guards the engine: ``submit`` and ``abort`` wait at most one step. Outputs go to each
request's sink outside the lock; a request is forgotten (``Engine.pop``) once all its samples
have finished.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from jaxkv.serving.engine import Engine
from jaxkv.serving.requests import RequestOutput

Sink = Callable[[RequestOutput], None]


class EngineRunner:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._condition = threading.Condition()
        self._sinks: dict[int, Sink] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="jaxkv-engine", daemon=True)

    def start(self) -> EngineRunner:
        self._thread.start()
        return self

    @property
    def accepting(self) -> bool:
        return not self._closing

    def submit(self, prompt_ids: Sequence[int], sink: Sink, **options) -> int:
        """Queue a request (``Engine.add_request``'s keywords; its errors are raised here);
        ``sink`` receives each of its outputs."""
        with self._condition:
            if self._closing:
                raise RuntimeError("the engine is shutting down and takes no new requests")
            request_id = self.engine.add_request(prompt_ids, **options)
            self._sinks[request_id] = sink
            self._condition.notify()
        return request_id

    def abort(self, request_id: int) -> None:
        """Stop a request; its pages are free before the next step, its sink gets 'abort' outputs."""
        with self._condition:
            if request_id in self._sinks:
                self.engine.abort(request_id)
                self._condition.notify()

    def stats(self) -> dict:
        with self._condition:
            return self.engine.stats()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, let the ones in flight finish, then end the thread."""
        with self._condition:
            self._closing = True
            self._condition.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not (self.engine.has_unfinished() or self.engine.aborted or self._closing):
                    self._condition.wait()
                if self._closing and not (self.engine.has_unfinished() or self.engine.aborted):
                    return
                outputs = self.engine.step()
                deliveries = [(self._sinks[output.request_id], output) for output in outputs]
                self._forget_finished(outputs)
            for sink, output in deliveries:
                sink(output)

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        for request_id in {output.request_id for output in outputs if output.finished}:
            if self.engine.request_finished(request_id):
                del self._sinks[request_id]
                self.engine.pop(request_id)
