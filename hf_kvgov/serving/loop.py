"""`EngineLoop`: a `ServingEngine`'s steps in a background thread, with requests submitted from any thread and their
tokens streamed back as they come.

One lock orders the engine's calls: the loop holds it for a step, `submit` and `cancel` for their bookkeeping, so a
cancel takes effect between two steps (the request's blocks go back to the pool then) and a new request joins the
next step. The loop sleeps while there is no work.

    with EngineLoop(engine) as loop:
        stream = loop.submit(prompt_ids, SamplingParams(max_new_tokens=32))
        for token in stream:
            ...
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence

from hf_kvgov.serving.engine import ServingEngine
from hf_kvgov.serving.request import SamplingParams, TokenEvent


class RequestStream:
    """The tokens of one submitted request, in order; iterate it, or call `result` for all of them."""

    def __init__(self, loop: EngineLoop, request_id: int) -> None:
        self.request_id = request_id
        self.finish_reason: str | None = None
        self.tokens: list[int] = []
        self._loop = loop
        self._events: queue.Queue[TokenEvent | BaseException] = queue.Queue()

    def __iter__(self) -> Iterator[int]:
        while self.finish_reason is None:
            event = self._events.get()
            if isinstance(event, BaseException):
                raise RuntimeError(f"The serving loop failed while request {self.request_id} ran.") from event
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
            if event.token is not None:
                self.tokens.append(event.token)
                yield event.token

    def result(self) -> list[int]:
        """Every token of the request, once it ended."""
        for _ in self:
            pass
        return self.tokens

    def cancel(self) -> None:
        """Stop the request; its blocks go back to the pool before the next step."""
        self._loop.cancel(self.request_id)

    def deliver(self, event: TokenEvent | BaseException) -> None:
        self._events.put(event)


class EngineLoop:
    """Runs `engine.step()` in a daemon thread while any request is queued or running.

    `listener`, when given, is called in the loop's thread with every event of every request (after the streams
    have theirs), and with the exception that stopped the loop, if one does.
    """

    def __init__(
        self, engine: ServingEngine, listener: Callable[[TokenEvent | BaseException], None] | None = None
    ) -> None:
        self.engine = engine
        self.listener = listener
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._streams: dict[int, RequestStream] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvgov-serving-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None, namespace: str = "") -> RequestStream:
        """Queue a request (refused at once, as `ServingEngine.add_request` refuses); returns its stream."""
        with self._wake:
            if self._stopping or self.error is not None:
                raise RuntimeError("This EngineLoop is stopped; start a new one.") from self.error
            request_id = self.engine.add_request(prompt, params, namespace)
            stream = RequestStream(self, request_id)
            self._streams[request_id] = stream
            self._wake.notify()
        return stream

    def cancel(self, request_id: int) -> None:
        """Cancel a request between two steps; its stream ends with finish_reason "cancelled"."""
        with self._lock:
            event = self.engine.cancel(request_id)
            stream = self._streams.pop(request_id, None)
        if event is not None and stream is not None:
            stream.deliver(event)
        if event is not None and self.listener is not None:
            self.listener(event)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_work:
                    self._wake.wait()
                if self._stopping:
                    return
                try:
                    events = self.engine.step()
                except BaseException as error:  # every waiting stream learns of it, nothing hangs
                    self.error = error
                    for stream in self._streams.values():
                        stream.deliver(error)
                    self._streams.clear()
                    if self.listener is not None:
                        self.listener(error)
                    return
                streams = [(self._streams.get(e.request_id), e) for e in events]
                for event in events:
                    if event.finished:
                        self._streams.pop(event.request_id, None)
            for receiver, event in streams:
                if receiver is not None:
                    receiver.deliver(event)
                if self.listener is not None:
                    self.listener(event)

    def stop(self) -> None:
        """Cancel what is left and end the thread (the engine stays open)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()
        for request_id in list(self._streams):
            self.cancel(request_id)

    def __enter__(self) -> EngineLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
