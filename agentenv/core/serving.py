"""How episode threads reach a token sampler: one :class:`GenerationRequest` per turn in, one :class:`Generation` out.

* :func:`request_server` picks the way for a policy: a policy that serves continuously (it has
  ``submit(request) -> concurrent.futures.Future``, e.g. :class:`agentenv.samplers.vllm_policy.VLLMPolicy`) gets a
  :class:`PerRequest`: each turn goes to the sampler the moment its episode asks and comes back the moment that one
  request finishes, so no episode waits for another episode's turn. Any other policy (``generate(batch)`` only, e.g.
  :class:`agentenv.samplers.hf_policy.HFPolicy`) gets a :class:`Batcher`, which gathers the requests waiting while the
  sampler is busy into its next ``generate`` call.
* Both are callables ``server(request) -> Generation`` (the runtime's ``generate_fn``) with ``fail_pending(reason)``
  (requests not yet being generated fail at once: the caller stopped the rollout; those being generated finish) and
  ``close()``.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import CancelledError, Future

from agentenv.core.policy import Generation, GenerationRequest


def request_server(policy) -> "PerRequest | Batcher":
    """The way episodes reach ``policy``: per request when it serves continuously, else batched."""
    return PerRequest(policy) if callable(getattr(policy, "submit", None)) else Batcher(policy)


class PerRequest:
    """Each request goes straight to ``policy.submit``; the calling thread waits for that request's future only."""

    def __init__(self, policy):
        self.policy = policy
        self._lock = threading.Lock()
        self._waiting: dict[int, Future] = {}
        self._reason = "request withdrawn"
        self.requests = 0

    def __call__(self, req: GenerationRequest) -> Generation:
        fut = self.policy.submit(req)
        with self._lock:
            self._waiting[id(fut)] = fut
            self.requests += 1
        try:
            return fut.result()
        except CancelledError:  # withdrawn by fail_pending before the engine took it
            raise RuntimeError(self._reason) from None
        finally:
            with self._lock:
                self._waiting.pop(id(fut), None)

    def fail_pending(self, reason: str) -> None:
        """Withdraw every request the sampler has not started (the ones it is generating finish)."""
        with self._lock:
            futures = list(self._waiting.values())
            self._reason = reason
        for f in futures:
            f.cancel()  # a no-op for a request already running

    def close(self) -> None:
        self.fail_pending("request server closed")


class Batcher:
    """Collects generation requests from many episode threads and serves them with batched ``policy.generate``.

    A batch is whatever is waiting when the sampler becomes free, topped up for at most ``max_wait_s`` while more
    episodes are known to be about to ask (``expected`` callers). Results are delivered per request via futures.
    """

    def __init__(self, policy, max_batch_size: int = 64, max_wait_s: float = 0.002):
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="agentenv-batcher", daemon=True)
        self._thread.start()
        self.batches = 0
        self.requests = 0

    def __call__(self, req: GenerationRequest) -> Generation:
        fut: Future = Future()
        self._q.put((req, fut))
        return fut.result()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._q.get(timeout=0.05)
            except queue.Empty:
                continue
            items = [first]
            deadline = time.perf_counter() + self.max_wait_s
            while len(items) < self.max_batch_size:
                try:
                    items.append(self._q.get(timeout=max(0.0, deadline - time.perf_counter())))
                except queue.Empty:
                    break
            try:
                gens = self.policy.generate([r for r, _ in items])
                for (_, fut), gen in zip(items, gens):
                    fut.set_result(gen)
            except BaseException as e:  # noqa: BLE001 -- every waiting episode sees the error
                for _, fut in items:
                    if not fut.done():
                        fut.set_exception(e)
            self.batches += 1
            self.requests += len(items)

    def fail_pending(self, reason: str) -> None:
        """Fail every request still waiting for a batch (the one being generated finishes)."""
        while True:
            try:
                _, fut = self._q.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                fut.set_exception(RuntimeError(reason))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.fail_pending("batcher closed")
