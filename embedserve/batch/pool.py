"""Callables run by a fixed number of threads, their results handed back in submission order.

At most `window` callables are taken from the iterator ahead of the oldest unfinished one, so
memory stays bounded while a slow request (one being retried) holds the line; meanwhile the
threads keep working through the window. The threads are daemons: on Ctrl-C the command writes
what is complete and exits without waiting for requests still on the wire."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator


class OrderedPool:
    def __init__(self, threads: int, window: int, stop: threading.Event):
        self.threads, self.window, self.stop = threads, max(window, threads), stop
        self._todo: queue.Queue = queue.Queue()
        self._done: dict[int, tuple[bool, Any]] = {}
        self._ready = threading.Condition()
        self.failure: BaseException | None = None  # the first call that raised: why the job stops

    def _work(self) -> None:
        while True:
            seq, call = self._todo.get()
            try:
                outcome = (True, call())
            except BaseException as err:  # handed to the caller in order
                outcome = (False, err)
                with self._ready:
                    self.failure = self.failure or err
                self.stop.set()  # the others stop retrying: the job ends at this request
            with self._ready:
                self._done[seq] = outcome
                self._ready.notify_all()

    def map(self, calls: Iterator[Callable[[], Any]]) -> Iterator[Any]:
        for _ in range(self.threads):
            threading.Thread(target=self._work, daemon=True).start()
        submitted = yielded = 0
        exhausted = False
        while True:
            while not exhausted and submitted - yielded < self.window and not self.stop.is_set():
                call = next(calls, None)
                if call is None:
                    exhausted = True
                    break
                self._todo.put((submitted, call))
                submitted += 1
            if yielded == submitted:
                return
            with self._ready:
                while yielded not in self._done:
                    self._ready.wait(0.5)  # a timeout, so that Ctrl-C reaches this thread
                ok, value = self._done.pop(yielded)
            yielded += 1
            if not ok:
                raise self.failure or value
            yield value
