"""The training loop: thin wiring over single-purpose parts. Async single-rollout FlashREINFORCE, or sync GRPO.

Who does what (each a module of its own; this one only connects them):

* :mod:`.dispatch` decides WHAT to start and WHEN a batch is ready (:class:`~.dispatch.AsyncDispatch`: one rollout
  per prompt, ``loop.queue_size * loop.batch_size`` started-but-unconsumed at most; :class:`~.dispatch.SyncGroupDispatch`:
  GRPO rounds behind a barrier), drawing prompts from a checkpointed :class:`~.dispatch.PromptSampler`.
* :mod:`.backends` says WHERE episodes run and moves weights (:class:`~.backends.LocalBackend`: threads in this
  process; :class:`~.ray_backend.RayBackend`: one actor per worker), both over :class:`~.workers.RolloutWorker`,
  which plays episodes with :func:`agentenv.core.runtime.run_episode`.
* :mod:`.accounting` keeps the books (:class:`~.accounting.Ledger`: every started trajectory ends in exactly one
  bucket) and the one definition of lag.
* The learner (:mod:`.learner`, anything with ``update / policy_version / export_weights / save / load``; a
  checkpoint is a directory its ranks write into) takes ONE optimizer step per fresh batch, on a learner thread, so
  dispatching, timeouts and crash handling go on while it computes; its new weights are published to every sampler
  (swapped between turns).
* :func:`agentenv.core.metrics.update_record` builds the one per-update record; the sink
  (:class:`agentenv.core.metrics.MetricsLogger`) writes ``metrics.jsonl`` / TensorBoard / the ``[update N]`` line.
* Samplers get the learner's newest weights after each update; ``loop.fixed_lag = k`` (a benchmark harness, sync
  mode only) publishes the weights ``k`` versions older instead (the starting weights until there are that many; an
  update that made no step, e.g. a batch of equal rewards, makes no new version), so once ``k`` versions exist
  every batch was sampled exactly ``k`` versions behind. The held-back weights are not
  checkpointed: a resumed run starts its lag again from the resumed weights.
* :mod:`.loop_state` checkpoints the loop with the learner, and on resume reconciles the run's JSONL files with the
  checkpoint (rows of rolled-back updates are marked).

Call order, per loop iteration (driver thread): ``dispatch.take`` -> learner thread ``update`` + ``publish`` ->
``dispatch.fill`` -> ``backend.poll`` -> ``ledger.finish`` -> timeouts -> on a finished update: ``ledger.settle``,
``update_record``, sink, ``on_update``, checkpoint cadence.

Faults: a worker crash loses only its in-flight episodes (counted ``worker_crash``); the worker is restarted
(``loop.restart_workers``). A hung episode is abandoned at ``loop.episode_timeout_s`` (counted), its env closed.
Shutdown (SIGINT / :meth:`Trainer.request_stop` / done): finish the update in progress, record what was still
running as ``interrupted``, checkpoint (when ``run_dir`` is set), run ``on_end`` (only when the loop completed:
the final evaluation, on the still-running samplers), record where the engines ran and how weights reached them
(``components["placement"]``, ``["weight_sync"]``, Ray), flush the files, close the backend (joins every
thread, kills every actor it started). ``on_start`` runs once the samplers hold the first weights;
:meth:`Trainer.play` runs evaluation episodes on the rollout samplers from these hooks and ``on_update``. A second
Ctrl-C raises ``KeyboardInterrupt`` at once, and so does the first during ``on_start`` / ``on_end`` (an evaluation
has no update to finish: it stops now, as it would outside the loop).
Resume (``resume=True``): learner (weights, optimizer, step, schedule, RNG), update counter, counters and the prompt
sampler (unfinished prompts are issued again first) come back from ``run_dir/checkpoints/latest``.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agentenv.core.config import LaunchConfig, LoopConfig
from agentenv.core.metrics import MetricsLogger, update_record
from agentenv.core.runtime import EpisodeSpec, RolloutConfig
from agentenv.core.trajectory import JsonlWriter, Trajectory

from . import loop_state
from .accounting import Ledger, admitted_mask
from .backends import make_backend
from .dispatch import PromptSampler, make_dispatch
from .throughput import Throughput

log = logging.getLogger("agentenv.trainer.loop")


@dataclass
class _Update:
    batch: list[Trajectory]
    version: int  # the learner's version the batch was trained against
    stats: dict
    learner_s: float
    publish_s: float
    wait_s: float  # the learner's idle time before this update


class Trainer:
    def __init__(self, loop: LoopConfig, *, rollout: RolloutConfig, make_env: Callable, make_policy: Callable,
                 learner, tasks: Sequence[EpisodeSpec], run_dir: str | Path | None = None, resume: bool = False,
                 launch: LaunchConfig | None = None, metrics: MetricsLogger | None = None,
                 on_update: Callable[[dict], None] | None = None, save_trajectories: bool = True,
                 sleep_samplers_during_update: bool = False, placement=None,
                 on_start: Callable[[], None] | None = None, on_end: Callable[[], None] | None = None):
        if not tasks:
            raise ValueError("no tasks (prompts) to train on")
        if resume and run_dir is None:
            raise ValueError("resume=True needs run_dir (where the checkpoints are)")
        self.cfg, self.rollout, self.launch = loop, rollout, launch or LaunchConfig()
        self.make_env, self.make_policy, self.learner = make_env, make_policy, learner
        self.tasks, self.on_update = list(tasks), on_update
        self.placement, self.on_start, self.on_end = placement, on_start, on_end
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.save_trajectories, self.sleep_samplers = save_trajectories, sleep_samplers_during_update
        self.sampler = PromptSampler(len(self.tasks), loop.seed)
        self.dispatch = make_dispatch(loop, self.sampler)
        self.ledger = Ledger(record=self._write_traj)
        self.metrics, self._owns_metrics = metrics, False
        self.step, self.next_eid = 0, 0
        self.history: list[dict] = []
        self.components: dict = {}
        self.interrupted = False  # stopped by SIGINT (Ctrl-C) before total_updates
        self._stop = threading.Event()
        self._backend = None
        self._published: int | None = None  # the version the samplers hold
        self._ended = False  # the loop finished without an error: on_end runs at shutdown
        self._in_hook = False  # on_start / on_end (evaluations) running: a Ctrl-C stops them at once
        self._held_back: deque = deque(maxlen=loop.fixed_lag + 1)  # (weights, version), oldest first
        self._writer: JsonlWriter | None = None
        self._rows_resumed: dict | None = None
        self.clock = Throughput()
        if resume:
            self._restore()

    @property
    def counters(self):
        return self.ledger.counters

    # --- public controls ----------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    def kill_worker(self, wid: int) -> None:
        """Fault injection (tests, chaos drills): crash worker ``wid`` now; the loop accounts and restarts it."""
        self._backend.kill_worker(wid)

    def local_policy(self):
        """The in-process sampler holding the current weights (local backend), else None (Ray: it lives in actors)."""
        return self._backend.local_policy() if self._backend is not None else None

    def play(self, make_env: Callable, tasks: list, rollout: RolloutConfig) -> list[Trajectory]:
        """Evaluation episodes on the rollout samplers (between updates: ``on_start`` / ``on_update`` / ``on_end``),
        with the learner's current weights (published first when they changed, e.g. by weight averaging)."""
        if self._published != self.learner.policy_version:
            self._backend.publish(self.learner.export_weights, self.learner.policy_version)
            self._published = self.learner.policy_version
        return self._backend.play(make_env, tasks, rollout)

    def inflight_on(self, wid: int) -> int:
        return sum(f.wid == wid for f in self.ledger.inflight.values())

    # --- main loop ----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        prev_handler = self._install_sigint()
        pool = ThreadPoolExecutor(1, thread_name_prefix="agentenv-learner")
        pending: Future | None = None
        try:
            self._open_outputs()
            self._backend = make_backend(cfg, self.launch, self.rollout, self.make_env, self.make_policy,
                                         self.placement, self.learner)
            self.components = self._backend.components()
            self._publish()
            if self.on_start is not None:
                self._hook(self.on_start)
            self.clock.start(self.step)
            log.info("run start mode=%s backend=%s step=%d version=%d B=%d Q=%d workers=%d concurrency=%d",
                     cfg.mode, cfg.backend, self.step, self.learner.policy_version, cfg.batch_size, cfg.queue_size,
                     cfg.num_workers, cfg.concurrency)
            while not self._stop.is_set() and self.step < cfg.total_updates:
                if not cfg.restart_workers and not self._backend.alive_workers() and not self.ledger.inflight \
                        and pending is None:
                    raise RuntimeError("every rollout worker has died and restart_workers=False: nothing can "
                                       "produce trajectories (see the 'worker=... died' log lines)")
                if pending is None:
                    self.ledger.drop_stale(self.learner.policy_version, cfg.max_staleness, self.step)
                    batch = self.dispatch.take(self.ledger)
                    if batch is not None:
                        pending = pool.submit(self._learn, batch)
                if pending is None or self.dispatch.generate_during_update:
                    self.dispatch.fill(self._start, self.ledger)
                self._handle(self._backend.poll(cfg.poll_interval_s))
                self._check_timeouts()
                if pending is not None and pending.done():
                    self._finish_update(pending.result())  # re-raises a learner error
                    pending = None
            if pending is not None:  # stop requested mid-update: finish it, then shut down
                self._finish_update(pending.result())
                pending = None
            self.clock.stop()
            self._ended = True
        finally:
            if pending is not None:
                pending.cancel()
            pool.shutdown(wait=True)
            summary = self._shutdown()
            self._restore_sigint(prev_handler)
        return summary

    def _start(self, prompt: int, group_id: str | None) -> bool:
        """Start ``prompt`` on the least-loaded live worker; False when every worker is full."""
        load = {w: 0 for w in self._backend.alive_workers()}
        for f in self.ledger.inflight.values():
            if f.wid in load:
                load[f.wid] += 1
        free = [(n, w) for w, n in load.items() if n < self.cfg.concurrency]
        if not free:
            return False
        wid, eid = min(free)[1], self.next_eid
        self.next_eid += 1
        task = self.tasks[prompt]
        if group_id is not None:
            task = EpisodeSpec(seed=task.seed, options=task.options, meta={**task.meta, "group_id": group_id})
        self.ledger.start(eid, wid, prompt, group_id)
        try:
            self._backend.submit(wid, eid, task)
        except Exception as e:  # noqa: BLE001 -- the worker died between our check and the submit
            log.warning("submit to worker %d failed: %s", wid, e)
            self.ledger.drop_inflight(eid, "worker_crash")
        return True

    def _handle(self, events: list) -> None:
        for ev in events:
            if ev[0] == "died":
                _, wid, reason = ev
                lost = [eid for eid, f in self.ledger.inflight.items() if f.wid == wid]
                for eid in lost:
                    self.ledger.drop_inflight(eid, "worker_crash")
                log.warning("worker=%d died reason=%r lost_in_flight=%d restart=%s", wid, reason, len(lost),
                            self.cfg.restart_workers)
                if self.cfg.restart_workers and not self._stop.is_set():
                    self._backend.restart_worker(wid)
                    self.counters.worker_restarts += 1
            else:
                _, wid, eid, traj = ev
                self.ledger.finish(eid, traj, self.step)
                if self.ledger.failing_in_a_row >= max(16, 2 * self.cfg.batch_size):
                    raise RuntimeError(f"the last {self.ledger.failing_in_a_row} episodes all failed, nothing can be "
                                       f"trained; the last one: {self.ledger.last_error}")

    def _check_timeouts(self) -> None:
        for eid, f in self.ledger.timed_out(self.cfg.episode_timeout_s):
            log.warning("episode=%d worker=%d timed out after %.1fs; abandoned", eid, f.wid,
                        time.perf_counter() - f.t_start)
            self.ledger.drop_inflight(eid, "env_timeout")
            try:
                self._backend.cancel(f.wid, eid)
            except Exception as e:  # noqa: BLE001 -- a dead worker cannot cancel; its death is handled on poll
                log.warning("cancel episode=%d on worker=%d failed: %s", eid, f.wid, e)

    # --- learning -----------------------------------------------------------------------------------------------
    def _learn(self, batch: list[Trajectory]) -> _Update:
        """Learner thread: one update, then publish the new weights."""
        version, t0 = self.learner.policy_version, time.perf_counter()
        wait_s = self.clock.idle_before(t0)
        if self.sleep_samplers:
            self._backend.sleep()  # colocated vLLM: free the KV cache for the learner step
        try:
            stats = self.learner.update(batch)
        finally:
            if self.sleep_samplers:
                self._backend.wake_up()
        t1 = time.perf_counter()
        self._publish()
        t2 = time.perf_counter()
        return _Update(batch, version, stats, t1 - t0, t2 - t1, wait_s)

    def _publish(self) -> None:
        """The samplers' next weights: the learner's, or with ``loop.fixed_lag`` those ``fixed_lag`` updates older."""
        weights = (self.learner.export_weights, self.learner.policy_version)  # exported only where a backend must
        if self.cfg.fixed_lag:  # only then are old copies kept: a large model's exported weights are not small
            if not self._held_back or self._held_back[-1][1] != weights[1]:  # a skipped step made no new version
                self._held_back.append((self.learner.export_weights(), weights[1]))
            weights = self._held_back[0]
        self._backend.publish(*weights)
        self._published = weights[1]

    def _finish_update(self, u: _Update) -> None:
        self.step += 1
        lags = self.ledger.settle(u.batch, admitted_mask(u.stats, len(u.batch)), self.step, u.version)
        timings = self.clock.update(self.step, u.batch, u.learner_s, u.publish_s, u.wait_s)
        c = self.counters
        rec = update_record(update=self.step, policy_version=self.learner.policy_version, mode=self.cfg.mode,
                            batch=u.batch, lags=lags, learner_stats=u.stats,
                            counters={**c.flat(), "accounting_balance": c.balance()}, timings=timings)
        if c.balance() != 0:
            log.error("accounting does not add up: %s", c.flat())
        if self.metrics is not None:
            rec = self.metrics.log_update(rec)
        self.history.append(rec)
        if self.on_update is not None:
            self.on_update(rec)
        if self.run_dir is not None and self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()

    # --- checkpoint / resume ------------------------------------------------------------------------------------
    def loop_state(self) -> dict:
        """Everything but the learner. Unfinished prompts are requeued: they are issued again on resume."""
        s = self.sampler.state_dict()
        s["requeue"] = [int(p) for p in self.dispatch.unfinished_prompts(self.ledger)] + s["requeue"]
        return {"step": self.step, "next_eid": self.next_eid, "sampler": s, "counters": self.ledger.state_dict(),
                "rows": self._rows(), "config": json.dumps(self.cfg.model_dump(mode="json"))}

    def save_checkpoint(self, state: dict | None = None) -> Path:
        return loop_state.save(self.run_dir, self.step, self.learner, state or self.loop_state(),
                               keep=self.cfg.keep_checkpoints)

    def _rows(self) -> dict:
        d = self.run_dir
        return {"trajectories": loop_state.count_rows(d / "trajectories.jsonl") if d else 0,
                "metrics": loop_state.count_rows(d / "metrics.jsonl") if d else 0}

    def _restore(self) -> None:
        loop_state.remove_stale_tmp(self.run_dir)
        path, s = loop_state.restore(self.run_dir, self.learner)
        self.step, self.next_eid = int(s["step"]), int(s["next_eid"])
        self.sampler.load_state_dict(s["sampler"])
        self.ledger.load_state_dict(s["counters"])
        self._rows_resumed = s.get("rows")
        log.info("resumed step=%d version=%d from %s", self.step, self.learner.policy_version, path)

    # --- outputs, signals, shutdown -----------------------------------------------------------------------------
    def _open_outputs(self) -> None:
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        loop_state.remove_stale_tmp(self.run_dir)
        if self._rows_resumed is not None:  # rows written after the checkpoint belong to rolled-back updates
            loop_state.roll_back_rows(self.run_dir / "trajectories.jsonl", self._rows_resumed["trajectories"],
                                      trajectories=True)
            loop_state.roll_back_rows(self.run_dir / "metrics.jsonl", self._rows_resumed["metrics"],
                                      trajectories=False)
        if self.metrics is None:
            self.metrics, self._owns_metrics = MetricsLogger(self.run_dir, tensorboard=False, echo=None), True
        elif self._rows_resumed is not None:
            self.metrics.reopen()  # it opened metrics.jsonl before the file was reconciled
        if self.save_trajectories:
            self._writer = JsonlWriter(self.run_dir / "trajectories.jsonl", append=True)

    def _write_traj(self, traj: Trajectory) -> None:
        if self._writer is not None:
            self._writer.write(traj)

    def _install_sigint(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            if self._stop.is_set() or self._in_hook:  # no update in flight to finish: stop now
                self.interrupted = True
                raise KeyboardInterrupt
            log.warning("SIGINT: finishing the current update, then checkpoint and shut down (Ctrl-C again to abort)")
            self.interrupted = True
            self._stop.set()

        return signal.signal(signal.SIGINT, handler)

    def _hook(self, fn: Callable[[], None]) -> None:
        self._in_hook = True
        try:
            fn()
        finally:
            self._in_hook = False

    @staticmethod
    def _restore_sigint(prev) -> None:
        if prev is not None:
            signal.signal(signal.SIGINT, prev)

    def _shutdown(self) -> dict:
        state = self.loop_state() if self._backend is not None else None  # requeue what is unfinished, first
        running = [(f.wid, eid) for eid, f in self.ledger.inflight.items()]
        self.ledger.interrupt_all(self.step)
        if self.run_dir is not None and state is not None and self.step > 0:
            state.update(counters=self.ledger.state_dict(), rows=self._rows())
            try:
                self.save_checkpoint(state)
            except Exception as e:  # noqa: BLE001 -- a failed final checkpoint must not hide the shutdown
                log.error("final checkpoint failed: %s", e)
        end_error = None
        if self._ended and self.on_end is not None and not self.interrupted and self._backend is not None:
            try:  # after the final checkpoint (of the weights rollouts used), before the samplers go
                for wid, eid in running:  # interrupted already: they would only slow the final evaluation
                    self._backend.cancel(wid, eid)
                self._hook(self.on_end)
            except BaseException as e:  # noqa: BLE001 -- re-raised once the backend is closed
                end_error = e
        if self._backend is not None and hasattr(self._backend, "placement_record"):
            try:  # where the engines ran and how weights reached them, recorded before the actors go
                self.components.update(self._backend.components())
                self.components["placement"] = {"engines": self._backend.placement_record()}
                self.components["weight_sync"] = self._backend.weight_sync()
            except Exception as e:  # noqa: BLE001 -- a record must not hide the shutdown
                log.error("recording the placement failed: %s", e)
        t_close = time.perf_counter()
        info = self._backend.close() if self._backend is not None else {}
        rates = self.clock.summary(t_close)
        c = self.counters
        summary = {"updates": self.step, "policy_version": self.learner.policy_version,
                   "stopped_by_user": self.interrupted,
                   **c.flat(),
                   "accounting_balance": c.balance(), "elapsed_s": rates["elapsed_s"],
                   "shutdown_s": time.perf_counter() - t_close,
                   "learner_busy": rates["learner_busy"], "traj_per_s": rates["traj_per_s"], **info}
        log.info("shutdown %s", " ".join(f"{k}={v}" for k, v in summary.items()))
        if self._writer is not None:
            self._writer.close()
        if self.metrics is not None:
            self.metrics.log_event("shutdown", **summary)
            if self._owns_metrics:
                self.metrics.close()
        if end_error is not None:
            raise end_error
        return summary
