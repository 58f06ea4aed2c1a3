"""The training loop: asynchronous single-rollout FlashREINFORCE, and a synchronous GRPO-style baseline.

Inputs: a :class:`TrainConfig`, an env factory (``make_env() -> gym.Env``), a policy factory
(``make_policy(worker_index) -> policy``), a learner (:class:`agentenv.trainer.learner.Learner` or anything with the
same ``update / policy_version / export_weights / state_dict / load_state_dict``) and a list of prompts
(:class:`agentenv.runtime.Task`). Entry point: ``Trainer(...).run()`` (or :func:`train`).

Mode ``"async"`` (FlashREINFORCE):

* Rollout workers keep episodes in flight continuously, one rollout per prompt. Prompts are drawn without
  replacement per epoch in a seeded order (:class:`PromptSampler`, whose state is checkpointed).
* Every finished trajectory lands in one completion buffer (completion order). As soon as it holds ``batch_size``
  trajectories the learner takes them, takes ONE optimizer step, and publishes the new weights. The update runs on a
  learner thread, so dispatching, timeouts and crash handling go on while it computes.
* Weights reach the samplers BETWEEN TURNS: ``HFPolicy.load_weights`` takes the sampler's lock, so a weight swap
  happens between two ``generate`` calls and never inside one. An episode may therefore span several versions;
  ``Trajectory.policy_version[t]`` records the version of every sampled token.
* Staleness control, two knobs:
  - ``queue_size`` Q (the paper's 1..8): at most ``Q * batch_size`` trajectories may be started but not yet taken by
    the learner (in flight + waiting in the buffer). Backpressure only: nothing is dropped. Q=1 overlaps generation
    of batch k+1 with update k (lag ~ 1); a larger Q allows more lag.
  - ``max_staleness`` (None = off): a trajectory whose lag exceeds it when a batch is formed is DROPPED (reason
    ``stale``) instead of trained. The gate of the loss, not this, is FlashREINFORCE's own drift control.
* Policy lag is MEASURED per batch, never inferred from Q: with V the learner's version being updated,
  ``lag_max = max_i (V - min token version of i)`` and ``lag_mean = mean_i (V - mean token version of i)``.

Mode ``"sync_grpo"`` (baseline): rounds of ``batch_size / group_size`` prompts, each rolled out ``group_size`` times
(``meta["group_id"]`` marks siblings); the learner waits for every episode of the round, updates once with the GRPO
loss (configure the learner with ``LearnerConfig(loss="grpo")``), publishes, and only then starts the next round.
Everything else (workers, accounting, logs, checkpoints) is shared.

Accounting invariant, checked after every update:
``started == trained + rejected + sum(dropped[reason]) + interrupted + in_flight + queued``.
``trained``/``rejected`` split a consumed batch by the learner's trust gate; ``dropped`` reasons are ``stale``,
``worker_crash`` (the worker died with the episode in flight), ``env_timeout`` (the episode ran longer than
``episode_timeout_s``) and ``error`` (``env_error``/``policy_error`` or a trajectory with no trainable token);
``interrupted`` counts episodes in flight or buffered when the run stopped (or at the checkpoint a run resumed from).

Faults: a worker crash loses only that worker's in-flight episodes; it is restarted (``restart_workers``) and the
run goes on. A hung episode is abandoned at its timeout (counted), its env is closed and never reused.

Shutdown: SIGINT (Ctrl-C) or :meth:`Trainer.request_stop` finishes the update in progress, writes a checkpoint (when
``run_dir`` is set), flushes ``metrics.jsonl`` / ``trajectories.jsonl``, cancels in-flight episodes and joins every
thread (and kills every Ray actor) it started. A second Ctrl-C raises ``KeyboardInterrupt`` at once.

Resume (``resume=True``): the latest checkpoint in ``run_dir/checkpoints`` restores the learner (weights, optimizer,
step, schedule, RNG), the update counter, the accounting counters and the prompt sampler (epoch, position, and the
prompts that were in flight, which are issued again first), so the data order continues.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentenv.runtime import Batcher, RolloutConfig, Task, run_episode
from agentenv.trajectory import JsonlWriter, Trajectory

log = logging.getLogger("agentenv.trainer.loop")

MODES = ("async", "sync_grpo")
BACKENDS = ("local", "ray")
DROP_REASONS = ("stale", "worker_crash", "env_timeout", "error")
_ERROR_FINISH = ("env_error", "policy_error")


# --------------------------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    mode: str = "async"  # "async" (FlashREINFORCE, one rollout per prompt) | "sync_grpo" (baseline)
    backend: str = "local"  # "local" (threads, one shared sampler) | "ray" (one actor + sampler per worker)
    batch_size: int = 4  # B: trajectories per update
    group_size: int = 8  # G: rollouts per prompt in sync_grpo (batch_size must be a multiple)
    queue_size: int = 2  # Q: at most Q * B trajectories started but not yet consumed (async)
    max_staleness: int | None = None  # drop a trajectory whose lag (versions) exceeds this; None = keep all
    num_workers: int = 2
    concurrency: int = 2  # episodes in flight per worker
    total_updates: int = 10  # the run ends after this many updates (counted across resumes)
    seed: int = 0  # prompt order
    run_dir: str | None = None  # metrics.jsonl, trajectories.jsonl, checkpoints/; None = write nothing
    checkpoint_every: int = 0  # updates between checkpoints (0 = only at the end / on stop)
    resume: bool = False  # continue from run_dir/checkpoints/latest
    episode_timeout_s: float = 600.0  # wall-clock limit per episode; longer ones are abandoned and counted
    restart_workers: bool = True  # replace a crashed worker (else run on with fewer)
    save_trajectories: bool = True  # write every finished trajectory to run_dir/trajectories.jsonl
    poll_interval_s: float = 0.02
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # its `concurrency` is ignored: see above
    # ray backend
    ray_address: str | None = None  # None: start a local cluster (RAY_AUTH_MODE=disabled, no dashboard)
    ray_num_cpus: int | None = 2  # for the local cluster only
    worker_num_cpus: float = 1.0  # Ray resources per rollout actor
    worker_num_gpus: float = 0.0  # e.g. 1 per vLLM engine actor on a GPU cluster

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("batch_size", "group_size", "queue_size", "num_workers", "concurrency", "total_updates"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mode == "sync_grpo" and self.batch_size % self.group_size:
            raise ValueError(f"sync_grpo needs batch_size ({self.batch_size}) to be a multiple of group_size "
                             f"({self.group_size})")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if not self.episode_timeout_s > 0:
            raise ValueError(f"episode_timeout_s must be > 0, got {self.episode_timeout_s}")
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every must be >= 0")
        if self.resume and not self.run_dir:
            raise ValueError("resume=True needs run_dir (where the checkpoints are)")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rollout"]["sampling"] = self.rollout.sampling.to_dict()
        return d


# --------------------------------------------------------------------------------------------------------------------
# picklable factories (Ray ships them to actors by reference)
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class GymEnvFactory:
    """``gymnasium.make(env_id, **kwargs)`` after importing agentenv, so agentenv/ ids resolve in a fresh process."""

    env_id: str
    kwargs: dict = field(default_factory=dict)

    def __call__(self):
        import gymnasium as gym

        import agentenv  # noqa: F401  (registers agentenv/ envs)

        return gym.make(self.env_id, **self.kwargs)


@dataclass
class HFPolicyFactory:
    """``load_hf_policy(model, seed=seed + worker_index)``: each Ray actor samples from its own seeded stream."""

    model: str = "tiny"
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"

    def __call__(self, worker_index: int = 0):
        from agentenv.models import load_hf_policy

        return load_hf_policy(self.model, seed=self.seed + worker_index, device=self.device, dtype=self.dtype)


def publish_to_policy(policy, state_dict: dict, version: int) -> None:
    """In-process weight sync. HFPolicy and the vLLM policy take ``load_weights``; older engines ``update_weights``."""
    fn = getattr(policy, "load_weights", None) or getattr(policy, "update_weights", None)
    if fn is None:
        raise TypeError(f"{type(policy).__name__} has neither load_weights nor update_weights: cannot publish weights")
    fn(state_dict, version)


# --------------------------------------------------------------------------------------------------------------------
# prompt order
# --------------------------------------------------------------------------------------------------------------------
class PromptSampler:
    """Prompt indices without replacement per epoch; epoch e's order is ``default_rng([seed, e]).permutation(n)``.

    ``requeue`` holds prompts to issue again before the next fresh one (those in flight at a checkpoint)."""

    def __init__(self, num_prompts: int, seed: int = 0):
        if num_prompts < 1:
            raise ValueError("need at least one prompt")
        self.n, self.seed = num_prompts, seed
        self.epoch, self.pos = 0, 0
        self.requeue: list[int] = []
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> list[int]:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n).tolist()

    def next(self) -> int:
        if self.requeue:
            return self.requeue.pop(0)
        if self.pos == self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._perm(self.epoch)
        self.pos += 1
        return self._order[self.pos - 1]

    def state_dict(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "pos": self.pos, "requeue": list(self.requeue)}

    def load_state_dict(self, s: dict) -> None:
        if s["n"] != self.n or s["seed"] != self.seed:
            raise ValueError(f"checkpoint's prompt sampler has n={s['n']} seed={s['seed']}, this run "
                             f"n={self.n} seed={self.seed}: the data or the seed changed, the order cannot continue")
        self.epoch, self.pos, self.requeue = int(s["epoch"]), int(s["pos"]), [int(i) for i in s["requeue"]]
        self._order = self._perm(self.epoch)


# --------------------------------------------------------------------------------------------------------------------
# rollout worker (threads); the Ray actor wraps the same class
# --------------------------------------------------------------------------------------------------------------------
class EpisodeCancelled(Exception):
    """Raised inside an episode's generate call once the loop has given up on it (timeout, crash, shutdown)."""


class WorkerCrash(BaseException):
    """Not an ``Exception``: run_episode does not catch it, so it takes the worker down (a simulated crash)."""


@dataclass
class _Episode:
    eid: int
    env: Any
    cancel: threading.Event
    thread: threading.Thread | None = None


class RolloutWorker:
    """Runs submitted episodes, each on its own thread with an env from this worker's pool.

    Results go to ``sink`` as ``("done", worker_id, eid, trajectory)``; a crash (any ``BaseException`` escaping
    ``run_episode``, or :meth:`kill`) marks the worker dead, cancels its episodes and emits
    ``("died", worker_id, reason)`` once. A cancelled episode's result is discarded and its env is closed, not reused.
    """

    def __init__(self, worker_id: int, make_env: Callable, policy, rollout_cfg: RolloutConfig,
                 generate_fn: Callable | None = None, sink: queue.Queue | None = None):
        self.worker_id, self.make_env, self.policy, self.cfg = worker_id, make_env, policy, rollout_cfg
        self.generate_fn = generate_fn or (lambda req: policy.generate([req])[0])
        self.sink = sink if sink is not None else queue.Queue()
        self.alive = True
        self._lock = threading.Lock()
        self._pool: list = []
        self._episodes: dict[int, _Episode] = {}
        self._threads: list[threading.Thread] = []

    def submit(self, eid: int, task: Task) -> None:
        with self._lock:
            if not self.alive:
                raise RuntimeError(f"worker {self.worker_id} is dead")
            env = self._pool.pop() if self._pool else None
            ep = _Episode(eid, env, threading.Event())
            self._episodes[eid] = ep
            ep.thread = threading.Thread(target=self._run, args=(ep, task), daemon=True,
                                         name=f"agentenv-w{self.worker_id}-ep{eid}")
            self._threads = [t for t in self._threads if t.is_alive()] + [ep.thread]
        ep.thread.start()

    def _run(self, ep: _Episode, task: Task) -> None:
        def gen(req):
            if ep.cancel.is_set():  # checked between turns: a cancelled episode stops at its next turn
                raise EpisodeCancelled(f"episode {ep.eid} cancelled")
            return self.generate_fn(req)

        try:
            if ep.env is None:
                ep.env = self.make_env()
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
        with self._lock:
            self._episodes.pop(ep.eid, None)
            cancelled = ep.cancel.is_set() or not self.alive
            if not cancelled:
                self._pool.append(ep.env)
        if cancelled:
            _close_quietly(ep.env)
            return
        self.sink.put(("done", self.worker_id, ep.eid, traj))

    def cancel(self, eid: int) -> None:
        with self._lock:
            ep = self._episodes.pop(eid, None)
        if ep is not None:
            ep.cancel.set()
            # A hung env.step may only return once the env is closed; close it off-thread so we never block on it.
            if ep.env is not None:
                t = threading.Thread(target=_close_quietly, args=(ep.env,), daemon=True,
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
        return _drain(self.sink, timeout)

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
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self._threads)


class _CancellableText:
    """A text policy (scripted expert, stand-in) seen through the same between-turns cancellation check."""

    def __init__(self, policy, cancel: threading.Event):
        self._policy, self._cancel = policy, cancel
        self.name = getattr(policy, "name", "")
        self.model_path = getattr(policy, "model_path", None)

    def act(self, messages, info):
        if self._cancel.is_set():
            raise EpisodeCancelled("episode cancelled")
        return self._policy.act(messages, info)


def _drain(q: queue.Queue, timeout: float) -> list:
    """Everything in ``q``, waiting up to ``timeout`` seconds for the first item (0 = do not wait)."""
    out = []
    try:
        out.append(q.get(timeout=timeout) if timeout > 0 else q.get_nowait())
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        pass
    return out


def _close_quietly(env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 -- a broken env must not break shutdown
        pass


# --------------------------------------------------------------------------------------------------------------------
# backends: where workers live and how weights reach them
# --------------------------------------------------------------------------------------------------------------------
class LocalBackend:
    """Workers as thread groups in this process, sharing ONE policy through one :class:`Batcher` (so generation is
    batched across all in-flight episodes). Weight sync is an in-process ``load_weights`` copy."""

    def __init__(self, cfg: TrainConfig, make_env: Callable, make_policy: Callable):
        self.cfg, self.make_env = cfg, make_env
        self.policy = make_policy(0)
        self.batcher = Batcher(self.policy) if hasattr(self.policy, "generate") else None
        self.sink: queue.Queue = queue.Queue()
        self.workers = [self._new(i) for i in range(cfg.num_workers)]
        self._retired: list[RolloutWorker] = []

    def _new(self, i: int) -> RolloutWorker:
        return RolloutWorker(i, self.make_env, self.policy, self.cfg.rollout, self.batcher, self.sink)

    def submit(self, wid: int, eid: int, task: Task) -> None:
        self.workers[wid].submit(eid, task)

    def cancel(self, wid: int, eid: int) -> None:
        self.workers[wid].cancel(eid)

    def poll(self, timeout: float) -> list:
        return _drain(self.sink, timeout)

    def publish(self, state_dict: dict, version: int) -> None:
        publish_to_policy(self.policy, state_dict, version)

    def kill_worker(self, wid: int) -> None:
        self.workers[wid].kill()

    def restart_worker(self, wid: int) -> None:
        self._retired.append(self.workers[wid])
        self.workers[wid] = self._new(wid)

    def close(self) -> dict:
        left = sum(w.close() for w in self.workers + self._retired)
        if self.batcher is not None:
            self.batcher.close()
        return {"leftover_threads": left}


def make_backend(cfg: TrainConfig, make_env: Callable, make_policy: Callable):
    if cfg.backend == "ray":
        from agentenv.trainer.ray_loop import RayBackend

        return RayBackend(cfg, make_env, make_policy)
    return LocalBackend(cfg, make_env, make_policy)


# --------------------------------------------------------------------------------------------------------------------
# accounting and lag
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Counters:
    started: int = 0
    trained: int = 0
    rejected: int = 0
    dropped: dict = field(default_factory=lambda: {r: 0 for r in DROP_REASONS})
    interrupted: int = 0
    in_flight: int = 0  # running on a worker
    queued: int = 0  # finished, waiting in the completion buffer
    learning: int = 0  # taken by the learner, update not finished yet
    worker_restarts: int = 0

    def balance(self) -> int:
        """``started`` minus every bucket: 0 when the books add up."""
        return self.started - (self.trained + self.rejected + sum(self.dropped.values()) + self.interrupted
                               + self.in_flight + self.queued + self.learning)

    def flat(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "dropped"}
        d.update({f"dropped_{r}": n for r, n in self.dropped.items()})
        d["dropped"] = sum(self.dropped.values())
        return d


def trajectory_lag(traj: Trajectory, version: int) -> tuple[float, int]:
    """(V - mean token version, V - min token version). Text-policy trajectories (no tokens) use the version the
    sampler had when the episode started."""
    vs = [v for v, m in zip(traj.policy_version, traj.action_mask) if m]
    if not vs:
        v0 = int(traj.meta.get("version_start", version))
        return float(version - v0), version - v0
    return version - sum(vs) / len(vs), version - min(vs)


# --------------------------------------------------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class _InFlight:
    wid: int
    prompt: int
    t_start: float
    group_id: str | None = None


class Trainer:
    """Drives workers and the learner. See the module docstring for the algorithm and guarantees.

    ``on_update(metrics)`` is called in the driver thread after every update with the flat metrics dict (the same
    one logged and written to ``metrics.jsonl``); it may call :meth:`request_stop` or :meth:`kill_worker`.
    """

    def __init__(self, cfg: TrainConfig, *, make_env: Callable, make_policy: Callable, learner,
                 tasks: Sequence[Task], on_update: Callable[[dict], None] | None = None):
        if not tasks:
            raise ValueError("no tasks (prompts) to train on")
        self.cfg, self.make_env, self.make_policy, self.learner = cfg, make_env, make_policy, learner
        self.tasks = list(tasks)
        self.on_update = on_update
        self.sampler = PromptSampler(len(self.tasks), cfg.seed)
        self.counters = Counters()
        self.step = 0  # updates done (across resumes)
        self.next_eid = 0
        self.history: list[dict] = []
        self._stop = threading.Event()
        self._inflight: dict[int, _InFlight] = {}
        self._buffer: list[Trajectory] = []  # completed, not yet consumed (completion order)
        self._round: set[int] = set()  # sync_grpo: eids of the current round still unresolved
        self._round_no = 0
        self._round_queue: list[tuple[int, str]] = []  # sync_grpo: (prompt, group_id) not yet started
        self.issued: list[int] = []  # prompt index of every episode started by this process, in order
        self._step0 = 0
        self._backend = None
        self._writer: JsonlWriter | None = None
        self._metrics_f = None
        self._t_learner = 0.0  # cumulative seconds in learner.update (+ export)
        self._t_publish = 0.0
        self._consumed_in_run = 0
        self._t0 = 0.0
        self._t_end = 0.0  # when the loop stopped (rates exclude the shutdown drain)
        self._last_update_end = 0.0
        self.run_dir = Path(cfg.run_dir) if cfg.run_dir else None
        if cfg.resume:
            self._restore()

    # --- public controls ----------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    def kill_worker(self, wid: int) -> None:
        """Fault injection (tests, chaos drills): crash worker ``wid`` now; the loop accounts and restarts it."""
        self._backend.kill_worker(wid)

    # --- main loop ----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        prev_handler = self._install_sigint()
        pool = ThreadPoolExecutor(1, thread_name_prefix="agentenv-learner")
        pending: Future | None = None
        try:
            self._open_outputs()
            self._backend = make_backend(cfg, self.make_env, self.make_policy)
            t = time.perf_counter()
            self._backend.publish(self.learner.export_weights(), self.learner.policy_version)
            self._t_publish += time.perf_counter() - t
            self._t0 = self._last_update_end = time.perf_counter()
            log.info("run start mode=%s backend=%s step=%d version=%d B=%d Q=%d workers=%d concurrency=%d",
                     cfg.mode, cfg.backend, self.step, self.learner.policy_version, cfg.batch_size, cfg.queue_size,
                     cfg.num_workers, cfg.concurrency)
            while not self._stop.is_set() and self.step < cfg.total_updates:
                if not cfg.restart_workers and not self._alive_workers() and not self._inflight and pending is None:
                    raise RuntimeError("every rollout worker has died and restart_workers=False: nothing can "
                                       "produce trajectories (see the 'worker=... died' log lines)")
                if pending is None:
                    batch = self._take_batch()
                    if batch is not None:
                        pending = pool.submit(self._learn, batch)
                if pending is None or self.cfg.mode == "async":  # sync: no rollouts while the learner runs
                    self._dispatch()
                self._handle(self._backend.poll(cfg.poll_interval_s))
                self._check_timeouts()
                if pending is not None and pending.done():
                    self._finish_update(*pending.result())  # re-raises a learner error
                    pending = None
            if pending is not None:  # stop requested mid-update: finish it, then shut down
                self._finish_update(*pending.result())
                pending = None
            self._t_end = time.perf_counter()
        finally:
            if pending is not None:
                pending.cancel()
            pool.shutdown(wait=True)
            summary = self._shutdown()
            self._restore_sigint(prev_handler)
        return summary

    # --- dispatch -----------------------------------------------------------------------------------------------
    def _capacity_left(self) -> int:
        cfg = self.cfg
        if cfg.mode == "async":
            # Q * B bound on started-but-unconsumed trajectories: the staleness knob (backpressure, no drops).
            return cfg.queue_size * cfg.batch_size - (self.counters.in_flight + self.counters.queued)
        return 0  # sync rounds are submitted by _dispatch itself

    def _free_worker(self) -> int | None:
        load = {w: 0 for w in self._alive_workers()}
        for f in self._inflight.values():
            if f.wid in load:
                load[f.wid] += 1
        free = [(n, w) for w, n in load.items() if n < self.cfg.concurrency]
        return min(free)[1] if free else None

    def _alive_workers(self) -> list[int]:
        return [i for i, w in enumerate(self._workers_view()) if w]

    def _workers_view(self) -> list[bool]:
        b = self._backend
        return [bool(getattr(w, "alive", True)) for w in b.workers]

    def _start(self, prompt: int, group_id: str | None = None) -> bool:
        wid = self._free_worker()
        if wid is None:
            return False
        eid = self.next_eid
        self.next_eid += 1
        task = self.tasks[prompt]
        if group_id is not None:
            task = Task(seed=task.seed, options=task.options, meta={**task.meta, "group_id": group_id})
        self._inflight[eid] = _InFlight(wid, prompt, time.perf_counter(), group_id)
        if group_id is not None:
            self._round.add(eid)  # before submit: a failed submit resolves (drops) it at once
        self.counters.started += 1
        self.counters.in_flight += 1
        self.issued.append(prompt)
        try:
            self._backend.submit(wid, eid, task)
        except Exception as e:  # noqa: BLE001 -- the worker died between our check and the submit
            log.warning("submit to worker %d failed: %s", wid, e)
            self._drop_inflight(eid, "worker_crash")
        return True

    def _dispatch(self) -> None:
        if self.cfg.mode == "async":
            while self._capacity_left() > 0:
                if not self._start_or_requeue(self.sampler.next()):
                    break
            return
        # sync_grpo: a round is batch_size/group_size prompts x group_size rollouts; start it once the previous
        # round is consumed, then keep feeding its episodes to free slots.
        if not self._round and not self._buffer and not self._round_queue:
            self._round_no += 1
            for _ in range(self.cfg.batch_size // self.cfg.group_size):
                p = self.sampler.next()
                gid = f"r{self.step}-p{p}-{self._round_no}"
                self._round_queue.extend([(p, gid)] * self.cfg.group_size)
        while self._round_queue:
            p, gid = self._round_queue[0]
            if not self._start(p, gid):
                break
            self._round_queue.pop(0)

    def _start_or_requeue(self, prompt: int) -> bool:
        if self._start(prompt):
            return True
        self.sampler.requeue.insert(0, prompt)  # no free slot: the prompt is issued next time
        return False

    # --- results ------------------------------------------------------------------------------------------------
    def _handle(self, events: list) -> None:
        for ev in events:
            if ev[0] == "died":
                _, wid, reason = ev
                lost = [eid for eid, f in self._inflight.items() if f.wid == wid]
                for eid in lost:
                    self._drop_inflight(eid, "worker_crash")
                log.warning("worker=%d died reason=%r lost_in_flight=%d restart=%s", wid, reason, len(lost),
                            self.cfg.restart_workers)
                if self.cfg.restart_workers and not self._stop.is_set():
                    self._backend.restart_worker(wid)
                    self.counters.worker_restarts += 1
                continue
            _, wid, eid, traj = ev
            f = self._inflight.pop(eid, None)
            if f is None:
                continue  # already accounted (timed out, or its worker was declared dead)
            self.counters.in_flight -= 1
            self._round.discard(eid)
            traj.meta.setdefault("prompt_index", f.prompt)
            if f.group_id is not None:
                traj.meta["group_id"] = f.group_id
            if traj.finish_reason in _ERROR_FINISH or (traj.token_ids and not any(traj.action_mask)):
                self._drop(traj, "error")
                continue
            self._buffer.append(traj)
            self.counters.queued += 1

    def _drop_inflight(self, eid: int, reason: str) -> None:
        f = self._inflight.pop(eid, None)
        if f is None:
            return
        self.counters.in_flight -= 1
        self.counters.dropped[reason] += 1
        self._round.discard(eid)

    def _drop(self, traj: Trajectory, reason: str) -> None:
        self.counters.dropped[reason] += 1
        traj.meta["loop"] = {"status": "dropped", "reason": reason, "update": self.step}
        self._write_traj(traj)

    def _check_timeouts(self) -> None:
        now = time.perf_counter()
        late = [(eid, f) for eid, f in self._inflight.items() if now - f.t_start > self.cfg.episode_timeout_s]
        for eid, f in late:
            log.warning("episode=%d worker=%d timed out after %.1fs; abandoned", eid, f.wid, now - f.t_start)
            self._drop_inflight(eid, "env_timeout")
            try:
                self._backend.cancel(f.wid, eid)
            except Exception as e:  # noqa: BLE001 -- a dead worker cannot cancel; its death is handled on poll
                log.warning("cancel episode=%d on worker=%d failed: %s", eid, f.wid, e)

    # --- learning -----------------------------------------------------------------------------------------------
    def _take_batch(self) -> list[Trajectory] | None:
        cfg, version = self.cfg, self.learner.policy_version
        if cfg.max_staleness is not None:
            keep = []
            for t in self._buffer:
                if trajectory_lag(t, version)[1] > cfg.max_staleness:
                    self.counters.queued -= 1
                    self._drop(t, "stale")
                else:
                    keep.append(t)
            self._buffer = keep
        if cfg.mode == "async":
            if len(self._buffer) < cfg.batch_size:
                return None
            batch, self._buffer = self._buffer[:cfg.batch_size], self._buffer[cfg.batch_size:]
        else:
            if self._round or self._round_queue or not self._buffer:
                return None  # the barrier: every episode of the round must be resolved
            batch, self._buffer = self._buffer, []
        self.counters.queued -= len(batch)
        self.counters.learning += len(batch)  # still counted while the update runs (or fails)
        return batch

    def _learn(self, batch: list[Trajectory]):
        """Learner thread: one update, then export + publish the new weights."""
        version = self.learner.policy_version
        t0 = time.perf_counter()
        stats = self.learner.update(batch)
        t1 = time.perf_counter()
        self._backend.publish(self.learner.export_weights(), self.learner.policy_version)
        t2 = time.perf_counter()
        return batch, version, stats, t0, t1, t2

    def _finish_update(self, batch, version, stats, t0, t1, t2) -> None:
        cfg, c = self.cfg, self.counters
        self.step += 1
        self._t_learner += t1 - t0
        self._t_publish += t2 - t1
        admitted = _admitted_mask(stats, len(batch))
        n_adm = sum(admitted)
        c.learning -= len(batch)
        c.trained += n_adm
        c.rejected += len(batch) - n_adm
        self._consumed_in_run += len(batch)
        lags = [trajectory_lag(t, version) for t in batch]
        for t, ok, (lm, lx) in zip(batch, admitted, lags):
            t.meta["loop"] = {"status": "trained" if ok else "rejected", "update": self.step, "version": version,
                              "lag_mean": lm, "lag_max": lx}
            self._write_traj(t)
        now = time.perf_counter()
        elapsed = max(1e-9, now - self._t0)
        n = len(batch)
        m = {
            "update": self.step,
            "policy_version": self.learner.policy_version,
            "mode": cfg.mode,
            "batch_size": n,
            "reward_mean": sum(t.reward for t in batch) / n,
            "success_rate": sum(t.success for t in batch) / n,
            "tool_calls_mean": sum(t.num_tool_calls for t in batch) / n,
            "turns_mean": sum(t.num_turns for t in batch) / n,
            "policy_tokens_mean": sum(t.num_policy_tokens for t in batch) / n,
            "lag_mean": sum(lm for lm, _ in lags) / n,
            "lag_max": max(lx for _, lx in lags),
            "versions_per_traj_max": max((len(t.versions) for t in batch), default=0),
            "acceptance_rate": n_adm / n,
            **c.flat(),
            "accounting_balance": c.balance(),
            "traj_per_s": self._consumed_in_run / elapsed,
            "updates_per_s": (self.step - self._step0) / elapsed,
            "time_generation_s": sum(t.time_generation_s for t in batch),
            "time_env_s": sum(t.time_env_s for t in batch),
            "time_learner_s": t1 - t0,
            "time_publish_s": t2 - t1,
            "time_wait_s": max(0.0, t0 - self._last_update_end),
            "learner_busy": self._t_learner / elapsed,
            "elapsed_s": elapsed,
        }
        for k, v in stats.items():  # the learner's own scalars (loss, grad_norm, lr, seq_kl_mean, ...)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                m[k if k.startswith("learner_") else f"learner_{k}"] = v
        self._last_update_end = now
        if c.balance() != 0:
            log.error("accounting does not add up: %s", c.flat())
        self.history.append(m)
        log.info("update=%d %s", self.step, " ".join(f"{k}={_fmt(v)}" for k, v in m.items() if k != "update"))
        if self._metrics_f is not None:
            self._metrics_f.write(json.dumps(m) + "\n")
            self._metrics_f.flush()
        if self.on_update is not None:
            self.on_update(m)
        if self.run_dir is not None and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            self.save_checkpoint()

    # --- checkpoint / resume ------------------------------------------------------------------------------------
    def loop_state(self) -> dict:
        """Everything but the learner. In-flight and buffered prompts are requeued: they are issued again on resume."""
        s = self.sampler.state_dict()
        if self.cfg.mode == "async":  # one issuance per unfinished episode
            pending = [f.prompt for f in self._inflight.values()] + [t.meta["prompt_index"] for t in self._buffer]
        else:  # an unfinished round restarts whole: each of its prompts once
            groups = {f.group_id: f.prompt for f in self._inflight.values()}
            groups.update({t.meta["group_id"]: t.meta["prompt_index"] for t in self._buffer})
            groups.update({g: p for p, g in self._round_queue})
            pending = list(groups.values())
        s["requeue"] = [int(p) for p in pending] + s["requeue"]
        return {"step": self.step, "next_eid": self.next_eid, "sampler": s, "counters": asdict(self.counters),
                "config": json.dumps(self.cfg.to_dict())}

    def save_checkpoint(self) -> Path:
        from agentenv.trainer import checkpoint as ckpt

        d = self.run_dir / "checkpoints"
        path = d / f"step_{self.step:06d}.pt"
        ckpt.atomic_save({"learner": self.learner.state_dict(), "loop": self.loop_state()}, path)
        tmp = d / ".latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, d / "latest")
        log.info("checkpoint step=%d path=%s", self.step, path)
        return path

    def _restore(self) -> None:
        from agentenv.trainer import checkpoint as ckpt

        d = self.run_dir / "checkpoints"
        if not (d / "latest").exists():
            raise FileNotFoundError(f"resume=True but {d}/latest does not exist: nothing to resume from")
        path = d / (d / "latest").read_text().strip()
        state = ckpt.load(path)
        self.learner.load_state_dict(state["learner"])
        loop = state["loop"]
        self.step, self.next_eid = int(loop["step"]), int(loop["next_eid"])
        self.sampler.load_state_dict(loop["sampler"])
        c = loop["counters"]
        self.counters = Counters(**{**c, "dropped": dict(c["dropped"])})
        # Episodes in flight or buffered at the checkpoint never come back: they end in the "interrupted" bucket.
        self.counters.interrupted += self.counters.in_flight + self.counters.queued + self.counters.learning
        self.counters.in_flight = self.counters.queued = self.counters.learning = 0
        log.info("resumed step=%d version=%d from %s sampler=%s", self.step, self.learner.policy_version, path,
                 loop["sampler"])

    # --- outputs, signals, shutdown -----------------------------------------------------------------------------
    def _open_outputs(self) -> None:
        self._step0 = self.step
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2))
        self._metrics_f = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 -- run-long
        if self.cfg.save_trajectories:
            self._writer = JsonlWriter(self.run_dir / "trajectories.jsonl", append=True)

    def _write_traj(self, traj: Trajectory) -> None:
        if self._writer is not None:
            self._writer.write(traj)

    def _install_sigint(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            if self._stop.is_set():
                raise KeyboardInterrupt
            log.warning("SIGINT: finishing the current update, then checkpoint and shut down (Ctrl-C again to abort)")
            self._stop.set()

        return signal.signal(signal.SIGINT, handler)

    @staticmethod
    def _restore_sigint(prev) -> None:
        if prev is not None:
            signal.signal(signal.SIGINT, prev)

    def _shutdown(self) -> dict:
        c = self.counters
        # Whatever is still running or buffered ends in the "interrupted" bucket. The checkpoint (taken first) keeps
        # those prompts in its requeue list so a resumed run issues them again.
        if self.run_dir is not None and self._backend is not None and self.step > 0:
            try:
                self.save_checkpoint()
            except Exception as e:  # noqa: BLE001 -- a failed final checkpoint must not hide the shutdown
                log.error("final checkpoint failed: %s", e)
        for t in self._buffer:
            t.meta["loop"] = {"status": "interrupted", "update": self.step}
            self._write_traj(t)
        c.interrupted += c.in_flight + c.queued + c.learning  # learning > 0 only if the last update raised
        c.in_flight = c.queued = c.learning = 0
        self._inflight.clear()
        self._buffer = []
        t_close = time.perf_counter()
        info = self._backend.close() if self._backend is not None else {}
        t_end = self._t_end or t_close
        elapsed = max(1e-9, t_end - self._t0) if self._t0 else 0.0
        summary = {"updates": self.step, "policy_version": self.learner.policy_version, **c.flat(),
                   "accounting_balance": c.balance(), "elapsed_s": elapsed,
                   "shutdown_s": time.perf_counter() - t_close,
                   "learner_busy": self._t_learner / elapsed if elapsed else 0.0,
                   "traj_per_s": self._consumed_in_run / elapsed if elapsed else 0.0, **info}
        log.info("shutdown %s", " ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
        if self._writer is not None:
            self._writer.close()
        if self._metrics_f is not None:
            self._metrics_f.write(json.dumps({"event": "shutdown", **summary}) + "\n")
            self._metrics_f.close()
        return summary


def _admitted_mask(stats: dict, n: int) -> list[bool]:
    """Per-trajectory admission from the learner's stats: ``admitted`` (a mask) when given, else the first
    ``num_admitted`` (counts are exact either way; only the per-trajectory label needs the mask)."""
    mask = stats.get("admitted")
    if mask is not None:
        mask = [bool(x) for x in (mask.tolist() if hasattr(mask, "tolist") else mask)]
        if len(mask) == n:
            return mask
    k = stats.get("num_admitted")
    k = n if k is None else int(k)
    return [True] * k + [False] * (n - k)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def train(cfg: TrainConfig, *, make_env: Callable, make_policy: Callable, learner, tasks: Sequence[Task],
          on_update: Callable[[dict], None] | None = None) -> dict:
    """Run a training loop to ``cfg.total_updates`` (or until stopped) and return the shutdown summary."""
    return Trainer(cfg, make_env=make_env, make_policy=make_policy, learner=learner, tasks=tasks,
                   on_update=on_update).run()
