"""Fresh sandboxes started ahead of need: a ``run`` takes one whose namespaces, cgroup and interpreter are up.

Contract:

* A :class:`ReadyQueue` keeps up to ``depth`` processes started by ``start(limits)`` in mode ``"once"`` for one set of
  limits (its sandbox's default ones), and starts a replacement in a background thread after every take. Nothing
  has run in a queued process: its runner is blocked at (or on its way to) its first read, with its own uid,
  cgroup and namespaces, so taking one is a fresh sandbox exactly as if it had been started at the call. Its
  limits clock (``timeout_s``) starts when it is taken.
* :meth:`ReadyQueue.take` returns a process only for limits that start the same process (:func:`start_key`:
  the runner's arguments and the tmp size; the wall timeout and output cap are the host's per call), and never
  one that died while it waited; else None, and the caller starts one itself.
* The queue fills lazily, from the second take on (a sandbox used only for sessions, or for one run, starts
  nothing extra), holds only a weak reference to its sandbox, and :meth:`ReadyQueue.close` (the sandbox's
  ``close``, its garbage collection) kills what it holds; the process registry (:func:`.process.kill_all`) covers interpreter exit.
  A start that fails in the background stops the filling (the caller's own start then raises the real error).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque

from agentenv.sandboxes.limits import Limits

log = logging.getLogger(__name__)


def start_key(limits: Limits) -> tuple:
    """What fixes a fresh process at its start (see :func:`.base.runner_args`), beside the backend's own options."""
    return (limits.memory_mb, limits.cpu_s, limits.max_processes, limits.max_file_mb, limits.max_open_files,
            limits.disk_mb)


class ReadyQueue:
    def __init__(self, sandbox, limits: Limits, depth: int):
        self._sandbox = weakref.ref(sandbox)
        self.limits, self.key, self.depth = limits, start_key(limits), depth
        self._ready: deque = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._takes = 0
        self.closed = False

    def take(self, limits: Limits):
        if self.depth <= 0 or self.closed or start_key(limits) != self.key:
            return None
        with self._cond:
            self._takes += 1
            if self._thread is None and self._takes >= 2:
                self._thread = threading.Thread(target=self._fill, name="agentenv-sandbox-ready", daemon=True)
                self._thread.start()
            proc = None
            while self._ready and proc is None:
                proc = self._ready.popleft()
                if proc.wait(0) is not None:  # died while it waited (killed from outside): never hand it out
                    proc.kill()
                    proc = None
            self._cond.notify()
            return proc

    def _fill(self) -> None:
        while True:
            with self._cond:
                while not self.closed and len(self._ready) >= self.depth:
                    self._cond.wait()
                if self.closed:
                    return
            sandbox = self._sandbox()
            if sandbox is None or sandbox.closed:
                return
            try:
                proc = sandbox._start("once", self.limits)
            except Exception as e:  # noqa: BLE001 - the caller's own start will raise it with its context
                log.warning("sandbox ready queue: background start failed, not filling any more: %s", e)
                return
            finally:
                del sandbox
            with self._cond:
                if self.closed:
                    proc.kill()
                    return
                self._ready.append(proc)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            procs, self._ready = list(self._ready), deque()
            self._cond.notify_all()
        for p in procs:
            p.kill()
