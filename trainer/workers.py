"""Rollout workers: episodes on threads, each with an env from the worker's pool and the worker's sampler.

Contract of :class:`RolloutWorker`:

* ``submit(eid, task)`` starts one episode on its own thread (an env from the pool, or a new one from ``make_env``).
  Its result goes to ``sink`` as ``("done", worker_id, eid, trajectory)``.
* ``cancel(eid)`` gives up on an episode: its next ``generate`` raises :class:`EpisodeCancelled` (cancellation is
  checked before and after each generation, so a cancelled episode never starts another env step), its result is
  discarded, and its env is closed, never reused: once the episode thread has ended, or after ``cancel_grace_s``
  if it has not (a hung ``env.step`` may only return once its env is closed). Removing the episode, setting
  its cancel flag and deciding who closes the env happen under ONE lock together with the episode thread's own
  finish, so an env that ``cancel`` closes can never have been put back into the pool.
* A crash (any ``BaseException`` escaping ``run_episode``, or :meth:`kill`) marks the worker dead, cancels its
  episodes and emits ``("died", worker_id, reason)`` once. ``make_env`` failing is NOT a crash: the episode ends as
  an ``env_error`` trajectory and the worker lives on.
* ``close()`` cancels everything, closes pooled envs and joins every thread it started (returns how many are still
  alive, i.e. stuck in an env call that ignored close).

The local backend runs these in the driver process; the Ray backend runs the same class inside an actor.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentenv.core.runtime import EpisodeCancelled, EpisodeSpec, RolloutConfig, run_episode
from agentenv.core.trajectory import Trajectory

log = logging.getLogger("agentenv.trainer.workers")


def publish_to_policy(policy, state_dict: dict, version: int) -> None:
    """In-process weight sync: every sampler (HFPolicy, VLLMPolicy) takes ``load_weights(state_dict, version)``."""
    fn = getattr(policy, "load_weights", None)
    if fn is None:
        raise TypeError(f"{type(policy).__name__} has no load_weights(state_dict, version): cannot publish weights")
    fn(state_dict, version)


def sampler_kind(policy) -> str:
    """What samples: the policy's ``backend`` ("hf", "vllm"), else "hf" for a token policy, "text" for a text one."""
    return getattr(policy, "backend", None) or ("hf" if hasattr(policy, "generate") else "text")


@dataclass
class _Episode:
    eid: int
    cancel: threading.Event
    env: Any = None
    env_closed_by_cancel: bool = False
    thread: threading.Thread | None = None


class RolloutWorker:
    def __init__(self, worker_id: int, make_env: Callable, policy, rollout_cfg: RolloutConfig,
                 generate_fn: Callable | None = None, sink: queue.Queue | None = None, cancel_grace_s: float = 2.0):
        self.cancel_grace_s = cancel_grace_s
        self.worker_id, self.make_env, self.policy, self.cfg = worker_id, make_env, policy, rollout_cfg
        self.generate_fn = generate_fn or (lambda req: policy.generate([req])[0])
        self.sink = sink if sink is not None else queue.Queue()
        self.alive = True
        self._lock = threading.Lock()
        self._pool: list = []
        self._episodes: dict[int, _Episode] = {}
        self._threads: list[threading.Thread] = []

    def submit(self, eid: int, task: EpisodeSpec) -> None:
        with self._lock:
            if not self.alive:
                raise RuntimeError(f"worker {self.worker_id} is dead")
            ep = _Episode(eid, threading.Event(), env=self._pool.pop() if self._pool else None)
            self._episodes[eid] = ep
            ep.thread = threading.Thread(target=self._run, args=(ep, task), daemon=True,
                                         name=f"agentenv-w{self.worker_id}-ep{eid}")
            self._threads = [t for t in self._threads if t.is_alive()] + [ep.thread]
        ep.thread.start()

    def _run(self, ep: _Episode, task: EpisodeSpec) -> None:
        def gen(req):
            _stop_if_cancelled(ep.cancel)  # between turns: a cancelled episode stops at its next turn
            out = self.generate_fn(req)
            _stop_if_cancelled(ep.cancel)  # cancelled while sampling: do not step an env that is being closed
            return out

        try:
            if ep.env is None:
                env = self.make_env()
                with self._lock:
                    ep.env = env
            v0 = getattr(self.policy, "policy_version", 0)
            policy = self.policy if hasattr(self.policy, "generate") else _CancellableText(self.policy, ep.cancel)
            traj = run_episode(ep.env, policy, self.cfg, task, gen)
            traj.meta.update(worker=self.worker_id, eid=ep.eid, version_start=v0,
                             version_end=getattr(self.policy, "policy_version", 0))
        except Exception as e:  # noqa: BLE001 -- make_env failed: an error result, the worker lives on
            traj = Trajectory(finish_reason="env_error", error=f"make_env: {e!r}", truncated=True,
                              meta={"worker": self.worker_id, "eid": ep.eid})
        except BaseException as e:  # noqa: BLE001 -- escaped run_episode: this worker is gone, like a dead process
            self._crash(f"{type(e).__name__}: {e}")
            return
        self._settle(ep, traj)

    def _settle(self, ep: _Episode, traj: Trajectory) -> None:
        """The episode thread's finish: deliver the result and pool the env, or (cancelled) discard both."""
        with self._lock:
            owned = self._episodes.pop(ep.eid, None) is ep  # False: cancel() took it first
            keep = owned and not ep.cancel.is_set() and self.alive
            if keep and ep.env is not None:
                self._pool.append(ep.env)
            close_here = not keep and not ep.env_closed_by_cancel
        if keep:
            self.sink.put(("done", self.worker_id, ep.eid, traj))
        elif close_here:
            _close_quietly(ep.env)

    def cancel(self, eid: int) -> None:
        with self._lock:
            ep = self._episodes.pop(eid, None)
            if ep is None:
                return
            ep.cancel.set()
            env, ep.env_closed_by_cancel = ep.env, ep.env is not None
        if env is not None:
            # Off-thread, so cancel never blocks: wait briefly for the episode to stop on its own (its in-flight env
            # step finishes instead of failing on a closed env), then close; a hung env.step may only return then.
            t = threading.Thread(target=_close_after, args=(ep.thread, env, self.cancel_grace_s), daemon=True,
                                 name=f"agentenv-w{self.worker_id}-close{eid}")
            with self._lock:
                self._threads.append(t)  # joined by close() like the episode threads
            t.start()

    def _crash(self, reason: str) -> None:
        with self._lock:
            if not self.alive:
                return
            self.alive = False
            eids = list(self._episodes)
        for eid in eids:
            self.cancel(eid)
        log.error("worker %d crashed: %s (its %d in-flight episodes are lost)", self.worker_id, reason, len(eids))
        self.sink.put(("died", self.worker_id, reason))

    def kill(self) -> None:
        """Fault injection: behave exactly as if the worker had crashed now."""
        self._crash("killed")

    def poll(self, timeout: float = 0.0) -> list:
        """Drain results (Ray actors; local workers share the driver's sink instead)."""
        return drain(self.sink, timeout)

    def load_weights(self, state_dict: dict, version: int) -> None:
        publish_to_policy(self.policy, state_dict, version)

    def close(self, join_timeout_s: float = 10.0) -> int:
        """Cancel everything, close envs, join threads. Returns how many threads are still alive (hung env calls)."""
        with self._lock:
            self.alive = False
            eids = list(self._episodes)
            pool, self._pool = self._pool, []
        for eid in eids:
            self.cancel(eid)
        for env in pool:
            _close_quietly(env)
        deadline = time.monotonic() + join_timeout_s
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in threads)


class _CancellableText:
    """A text policy (scripted expert, stand-in) seen through the same between-turns cancellation check."""

    def __init__(self, policy, cancel: threading.Event):
        self._policy, self._cancel = policy, cancel
        self.name = getattr(policy, "name", "")
        self.model_path = getattr(policy, "model_path", None)
        self.backend = getattr(policy, "backend", "text")

    def act(self, messages, info):
        _stop_if_cancelled(self._cancel)
        reply = self._policy.act(messages, info)
        _stop_if_cancelled(self._cancel)  # cancelled while it thought: no env step after cancel
        return reply


def drain(q: queue.Queue, timeout: float) -> list:
    """Everything in ``q``, waiting up to ``timeout`` seconds for the first item (0 = do not wait)."""
    out = []
    try:
        out.append(q.get(timeout=timeout) if timeout > 0 else q.get_nowait())
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        pass
    return out


def _stop_if_cancelled(cancel: threading.Event) -> None:
    if cancel.is_set():
        raise EpisodeCancelled("episode cancelled")


def _close_after(thread: threading.Thread, env, grace_s: float) -> None:
    thread.join(timeout=grace_s)
    _close_quietly(env)


def _close_quietly(env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 -- a broken env must not break shutdown
        pass
