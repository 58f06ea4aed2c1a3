"""A pool of warm sessions, so an episode's first tool call does not pay interpreter start-up.

Contract: ``acquire()`` hands out a started :class:`~agentenv.sandboxes.base.Session` (blocking up to ``timeout``
seconds when all are out; ``TimeoutError`` then). ``release(s)`` kills its interpreter at once, so no state from
one episode can reach the next, and a background thread starts a fresh one and returns it to the pool.
``close()`` (also at context exit) kills every session, handed out or not.
"""

from __future__ import annotations

import contextlib
import queue
import threading

from agentenv.sandboxes.base import Session
from agentenv.sandboxes.factory import make_sandbox
from agentenv.sandboxes.limits import Limits


class SandboxPool:
    def __init__(self, backend: str = "bubblewrap", size: int = 4, limits: Limits | None = None, **backend_kwargs):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"pool size must be a positive int, got {size!r}")
        self.sandbox = make_sandbox(backend, limits=limits, **backend_kwargs)
        self.size = size
        self._free: queue.Queue[Session] = queue.Queue()
        self._dirty: queue.Queue[Session | None] = queue.Queue()
        self._all = [self.sandbox.session() for _ in range(size)]
        self._out: set[int] = set()
        self._lock = threading.Lock()
        for s in self._all:
            self._free.put(s)
        self._refresher = threading.Thread(target=self._refresh, name="agentenv-sandbox-pool", daemon=True)
        self._refresher.start()

    def _refresh(self):
        while (s := self._dirty.get()) is not None:
            try:
                s.reset()
            finally:
                self._free.put(s)

    def acquire(self, timeout: float | None = None) -> Session:
        if self.sandbox.closed:
            raise RuntimeError("pool is closed")
        try:
            s = self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no free sandbox session within {timeout}s (pool size {self.size})") from None
        with self._lock:
            self._out.add(id(s))
        return s

    def release(self, s: Session) -> None:
        with self._lock:
            if id(s) not in self._out:
                raise ValueError("release() got a session that this pool did not hand out (or it was released twice)")
            self._out.discard(id(s))
        with s._lock:
            s._stop()  # the episode's state dies now; the fresh interpreter starts in the background
        self._dirty.put(s)

    @contextlib.contextmanager
    def session(self, timeout: float | None = None):
        s = self.acquire(timeout)
        try:
            yield s
        finally:
            self.release(s)

    def close(self) -> None:
        self._dirty.put(None)
        self.sandbox.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
