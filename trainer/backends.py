"""Where rollout workers live and how weights reach their samplers: one small protocol, two backends.

:class:`Backend` is what the loop (:mod:`agentenv.trainer.loop`) talks to. It never decides anything: the loop
says which episode starts on which worker, and the backend moves calls and data.

* ``submit(wid, eid, task)`` / ``cancel(wid, eid)``: start / give up an episode on worker ``wid``.
* ``poll(timeout) -> events``: ``("done", wid, eid, trajectory)`` and ``("died", wid, reason)``.
* ``publish(weights, version)``: every live sampler holds ``version`` when it returns (swapped between turns).
  ``weights`` is a state dict or the learner's ``export_weights``, called only where the weights must come to the
  driver (a backend whose transfers the learner's ranks host never calls it).
* ``sleep()`` / ``wake_up()``: around the learner step, so a colocated vLLM engine can free its KV cache.
* ``alive_workers()``, ``kill_worker`` (fault injection), ``restart_worker``, ``close() -> {"leftover_threads": n}``.
* ``components() -> dict``: what actually started (sampler kind, backend, engines), for ``summary.json``.
* ``local_policy()``: the in-process sampler holding the published weights, or None (Ray: samplers live in actors).
* ``play(make_env, tasks, rollout) -> trajectories``: evaluation episodes on the same samplers, next to training.

:class:`LocalBackend` keeps the workers as thread groups in this process sharing ONE sampler through one
:func:`~agentenv.core.serving.request_server` (per request on a continuously serving vLLM engine; batched across
every in-flight episode otherwise); weight sync is an in-process ``load_weights``. The Ray backend is :class:`agentenv.trainer.ray_backend.RayBackend`.

The factories are picklable (Ray ships them to actors by reference): :class:`GymEnvFactory` (any gymnasium id,
including gymnasium's ``module:EnvId`` form, which imports ``module`` first) and the sampler factories of
:mod:`agentenv.samplers.factory`.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from agentenv.core.config import LaunchConfig, LoopConfig
from agentenv.core.runtime import EpisodeSpec, RolloutConfig
from agentenv.core.serving import request_server

from .workers import RolloutWorker, drain, publish_to_policy, sampler_kind

log = logging.getLogger("agentenv.trainer.backends")


class Backend(Protocol):
    def submit(self, wid: int, eid: int, task: EpisodeSpec) -> None: ...
    def cancel(self, wid: int, eid: int) -> None: ...
    def poll(self, timeout: float) -> list: ...
    def publish(self, weights, version: int) -> None: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...
    def alive_workers(self) -> list[int]: ...
    def kill_worker(self, wid: int) -> None: ...
    def restart_worker(self, wid: int) -> None: ...
    def components(self) -> dict: ...
    def local_policy(self): ...
    def play(self, make_env: Callable, tasks: list, rollout: RolloutConfig) -> list: ...
    def close(self) -> dict: ...


@dataclass
class GymEnvFactory:
    """``gymnasium.make(env_id, **kwargs)`` after importing agentenv, so agentenv/ ids resolve in a fresh process."""

    env_id: str
    kwargs: dict = field(default_factory=dict)

    def __call__(self):
        import gymnasium as gym

        import agentenv  # noqa: F401  (registers agentenv/ envs)

        return gym.make(self.env_id, **self.kwargs)


class LocalBackend:
    def __init__(self, loop: LoopConfig, rollout: RolloutConfig, make_env: Callable, make_policy: Callable):
        self.loop, self.rollout, self.make_env = loop, rollout, make_env
        self.policy = make_policy(0)
        self.batcher = request_server(self.policy) if hasattr(self.policy, "generate") else None
        self.sink: queue.Queue = queue.Queue()
        self.workers = [self._new(i) for i in range(loop.num_workers)]
        self._retired: list[RolloutWorker] = []

    def _new(self, i: int) -> RolloutWorker:
        return RolloutWorker(i, self.make_env, self.policy, self.rollout, self.batcher, self.sink)

    def submit(self, wid: int, eid: int, task: EpisodeSpec) -> None:
        self.workers[wid].submit(eid, task)

    def cancel(self, wid: int, eid: int) -> None:
        self.workers[wid].cancel(eid)

    def poll(self, timeout: float) -> list:
        return drain(self.sink, timeout)

    def publish(self, weights, version: int) -> None:
        publish_to_policy(self.policy, weights() if callable(weights) else weights, version)

    def sleep(self) -> None:
        getattr(self.policy, "sleep", lambda: None)()

    def wake_up(self) -> None:
        getattr(self.policy, "wake_up", lambda: None)()

    def alive_workers(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w.alive]

    def kill_worker(self, wid: int) -> None:
        self.workers[wid].kill()

    def restart_worker(self, wid: int) -> None:
        self._retired.append(self.workers[wid])
        self.workers[wid] = self._new(wid)

    def local_policy(self):
        return self.policy

    def play(self, make_env: Callable, tasks: list, rollout: RolloutConfig) -> list:
        from agentenv.core.runtime import run_episodes

        return run_episodes(make_env, self.policy, len(tasks), rollout, tasks=tasks)

    def components(self) -> dict:
        kind = sampler_kind(self.policy)
        return {"sampler": kind, "rollout_backend": "local", "vllm_engines": int(kind == "vllm")}

    def close(self) -> dict:
        left = sum(w.close() for w in self.workers + self._retired)
        if self.batcher is not None:
            self.batcher.close()
        close = getattr(self.policy, "close", None)
        if callable(close):
            close()
        return {"leftover_threads": left}


def make_backend(loop: LoopConfig, launch: LaunchConfig, rollout: RolloutConfig, make_env: Callable,
                 make_policy: Callable, placement=None, learner=None) -> Backend:
    """``placement`` (:class:`~agentenv.trainer.placement.Placement`, Ray only) pins each actor to its bundle;
    ``learner`` (Ray only) may host the engines' weight transfers on its own ranks."""
    if loop.backend == "ray":
        from .ray_backend import RayBackend  # ray is an optional dependency: imported only when asked for

        return RayBackend(loop, launch, rollout, make_env, make_policy, placement, learner)
    return LocalBackend(loop, rollout, make_env, make_policy)
