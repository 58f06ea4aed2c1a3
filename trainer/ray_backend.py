"""Ray backend (:class:`agentenv.trainer.backends.Backend`): rollout workers as Ray actors, learner on the driver.

Same algorithm code path as the local backend: the driver's :class:`~agentenv.trainer.loop.Trainer` makes every
decision (what to start where, batching, staleness, timeouts, accounting); this module only moves calls and data.

* Each actor (:class:`~.ray_worker.RayRolloutWorker`) owns its sampler -- ``make_policy(worker_index)``: an HFPolicy on CPU, or a
  vLLM engine (``model.backend=vllm``: one engine per actor; give the actor ``launch.worker_num_gpus`` on a GPU
  cluster) -- its envs and a :class:`~agentenv.trainer.workers.RolloutWorker` (the same class the local backend
  runs), so env workers live in the actor's process next to their sampler. Actors are threaded (``max_concurrency``): a long ``poll`` never blocks
  ``submit`` / ``cancel`` / ``load_weights``.
* Weight sync: vLLM engines built with a weight-transfer backend (``launch.weight_transfer``: gloo on CPU, NCCL /
  CUDA IPC on GPUs; :mod:`agentenv.samplers.weight_transfer`) take vLLM's four-phase protocol. Its trainer side is
  hosted by the learner when the learner can (``hosts_weight_transfer``: a :class:`~.distributed.RayShardedLearner`,
  whose ranks gather each tensor on their devices and rank 0 sends it; not with ``loop.fixed_lag``), else by this
  process over the state dict the learner exports (on its own device for NCCL / IPC). Once the actors are up one
  group is opened per engine; each :meth:`RayBackend.publish` then sends every layer to each engine while the actor
  receives and loads (its policy holding generation off from start to finish, the version moving only once the
  engine holds every tensor). Otherwise (``object_store``, the explicit fallback, or an HF sampler) it does ONE
  ``ray.put`` of the state dict and every actor calls ``load_weights(state_dict, version)`` on it. Either way the
  call returns when all live actors have the new version; samplers swap weights between two generate calls
  (between turns). A restarted actor opens its own group and gets the current weights before it gets work (with
  learner-hosted transfers at the next publish: the ranks serve one command stream, the learner thread's).
* Completion: one outstanding long-poll per actor; ``ray.wait`` returns whichever actor has results first.
* Faults: an actor process that dies (``ray.kill``, OOM, segfault) surfaces as ``RayActorError`` on its poll; a
  worker-level crash inside a live actor arrives as a ``died`` event. Either way the driver drops that worker's
  in-flight episodes (counted), and :meth:`restart_worker` kills the old actor, starts a new one and loads the
  current weights into it before it gets work.
* Placement: with a :class:`~agentenv.trainer.placement.Placement` (what ``agentenv run`` passes) actor ``i`` runs
  in engine bundle ``i`` of the run's placement group, so engines and learner ranks never share a GPU;
  :meth:`placement_record` says where Ray put each engine and :meth:`weight_sync` how weights reached them
  (the transport actually used, mean seconds per publish). ``components()["vllm_engines"]`` counts every actor started,
  restarts included. :meth:`play` runs evaluation episodes on the actors' samplers, next to training.
* Cluster: without a placement, when Ray is not initialised, a local cluster is started with
  ``RAY_AUTH_MODE=disabled`` (Ray 2.60 turns on token auth otherwise), ``num_cpus=launch.ray_num_cpus`` (default:
  the actors' CPUs), ``num_gpus=launch.ray_num_gpus`` and no dashboard, and shut down at :meth:`close`; with
  ``launch.ray_address`` it joins that cluster instead. :meth:`close` kills every actor it created either way.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from agentenv.core.config import LaunchConfig, LoopConfig
from agentenv.core.runtime import EpisodeSpec, RolloutConfig

from .placement import init_ray
from .ray_worker import READY_TIMEOUT_S, ActorClient, RayRolloutWorker

log = logging.getLogger("agentenv.trainer.ray")


class _Handle:
    def __init__(self, actor, alive: bool = True):
        self.actor = actor
        self.alive = alive  # accepting episodes
        self.poll_ref = None
        self.starting_ref = None  # a restarted actor's ready() call; it gets work once this resolves
        self.transfer = False  # its weight-transfer group is open (False: object store, or not yet)
        self.pending = False  # restarted, up, waiting for the weights the next publish sends


class RayBackend:
    def __init__(self, loop: LoopConfig, launch: LaunchConfig, rollout: RolloutConfig, make_env: Callable,
                 make_policy: Callable, placement=None, learner=None):
        import ray

        self.ray = ray
        self.loop, self.launch, self.rollout = loop, launch, rollout
        self.make_env, self.make_policy, self.placement = make_env, make_policy, placement
        needed = max(1, math.ceil(loop.num_workers * launch.worker_num_cpus))
        self._owns_ray = placement is None and init_ray(launch.ray_num_cpus or needed, launch.ray_address,
                                                        launch.ray_num_gpus)
        self.started = 0  # actors spawned, restarts included
        self._publish_s: list[float] = []
        self._cls = ray.remote(RayRolloutWorker)
        self._weights = None  # (ObjectRef of the last published state dict (object store) or None, version)
        # Who runs the trainer side of the engines' transfers: the learner's ranks (weights leave their devices
        # directly) when it can host them -- not with loop.fixed_lag, whose held-back copies live in the driver --
        # else this process, over the state dict each publish exports here.
        self._host = learner if getattr(learner, "hosts_weight_transfer", False) and not loop.fixed_lag else None
        self._transport, self._sender, self._dtype = "object_store", None, None  # set by _open_transfers
        self._sync = threading.Lock()  # a publish and a restarted actor's catch-up never interleave
        self._events: list = []  # deaths the driver caused (kill_worker), reported on the next poll
        self.workers: list[_Handle] = []
        try:
            self.workers = [self._spawn(i) for i in range(loop.num_workers)]
            pids = ray.get([w.actor.ready.remote() for w in self.workers], timeout=READY_TIMEOUT_S)
            self._open_transfers()
        except BaseException:
            self.close()
            raise
        log.info("ray backend: %d rollout actors up (pids %s)", len(pids), pids)

    def _spawn(self, i: int) -> _Handle:
        opts = ({"num_cpus": self.launch.worker_num_cpus, "num_gpus": self.launch.worker_num_gpus}
                if self.placement is None else self.placement.engine_options(i))
        opts.update(max_concurrency=self.loop.concurrency + 8, max_restarts=0)
        self.started += 1
        return _Handle(self._cls.options(**opts).remote(i, self.make_env, self.make_policy, self.rollout))

    def submit(self, wid: int, eid: int, task: EpisodeSpec) -> None:
        w = self.workers[wid]
        if not w.alive:
            raise RuntimeError(f"worker {wid} is dead")
        w.actor.submit.remote(eid, task)  # a dead actor shows up on its poll

    def cancel(self, wid: int, eid: int) -> None:
        w = self.workers[wid]
        if w.alive:
            w.actor.cancel.remote(eid)

    def poll(self, timeout: float) -> list:
        ray = self.ray
        events, self._events = self._events, []
        refs, starting = {}, {}
        for i, w in enumerate(self.workers):
            if w.alive:
                if w.poll_ref is None:
                    w.poll_ref = w.actor.poll.remote(0.2)
                refs[w.poll_ref] = i
            elif w.starting_ref is not None:
                starting[w.starting_ref] = i
        if not refs and not starting:
            time.sleep(timeout)
            return events
        ready, _ = ray.wait(list(refs) + list(starting), num_returns=len(refs) + len(starting),
                            timeout=0 if events else timeout)
        for ref in ready:
            if ref in starting:
                self._started(starting[ref], ref)
                continue
            i = refs[ref]
            w = self.workers[i]
            w.poll_ref = None
            try:
                got = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                w.alive = False
                events.append(("died", i, f"actor died: {type(e).__name__}"))
                continue
            for ev in got:
                if ev[0] == "died":
                    w.alive = False
                events.append(ev)
        return events

    def _open_transfers(self) -> None:
        """Phases 1-2 of vLLM's weight transfer with every engine that was built with a transfer backend."""
        specs = self.ray.get([w.actor.transfer_spec.remote() for w in self.workers], timeout=READY_TIMEOUT_S)
        kinds = {s["transport"] for s in specs}
        if kinds == {"object_store"}:
            return
        if len(kinds) != 1:
            raise RuntimeError(f"the rollout engines were built for different weight transports {sorted(kinds)}")
        import torch

        from agentenv.samplers.weight_sources import StateDictSource
        from agentenv.samplers.weight_transfer import TransferSender

        self._transport, self._dtype = kinds.pop(), specs[0]["dtype"]
        if self._host is None:  # NCCL / IPC: sent from a GPU in the engine's dtype, one tensor at a time
            gpu = self._transport in ("nccl", "ipc")
            self._sender = TransferSender(self._transport, StateDictSource(
                device="cuda" if gpu else None, dtype=getattr(torch, self._dtype) if gpu else None))
        for i, (w, spec) in enumerate(zip(self.workers, specs)):
            self._open(i, w, spec)

    def _open(self, i: int, w: _Handle, spec: dict) -> None:
        world = 1 + spec["workers"]  # the trainer's sender + the engine's workers
        if self._host is not None:
            self._host.open_transfer(i, self._transport, w.actor, world, self._dtype)
        else:
            self._sender.open(i, ActorClient(self.ray, w.actor), world_size=world,
                              master_address=self.ray.util.get_node_ip_address())
        w.transfer = True

    def publish(self, weights, version: int) -> None:
        """``weights``: a state dict, or the learner's ``export_weights`` (called only if this process must hold
        them; weights hosted by the learner's ranks never come here)."""
        ray, t0 = self.ray, time.perf_counter()
        with self._sync:
            if self._transport != "object_store":  # phases 3-4
                # a restarted actor whose weights come from the learner's ranks catches up here, in the learner's
                # thread: its ranks serve one command stream, which a catch-up from the poll thread could interleave
                pending = [i for i, w in enumerate(self.workers) if w.pending]
                keys = [i for i, w in enumerate(self.workers) if w.alive and w.transfer] + pending
                if self._host is not None:
                    errors = self._host.send_weights(keys, version)["errors"]
                else:
                    self._sender.source.set(self._export(weights))
                    errors = self._sender.send(keys, version)
                self._weights = (None, version)
                self._settle(errors, pending)
            else:
                ref = ray.put(self._export(weights))  # one copy in the object store, shared by every actor on a node
                self._weights = (ref, version)
                acks = {w.actor.load_weights.remote(ref, version): i for i, w in enumerate(self.workers) if w.alive}
                for r, i in acks.items():
                    try:
                        ray.get(r)
                    except ray.exceptions.RayActorError:
                        self.workers[i].alive = False  # its poll reports the death; nothing else to do here
        self._publish_s.append(time.perf_counter() - t0)

    def _export(self, weights) -> dict:
        if not callable(weights):
            return weights
        if self._transport in ("nccl", "ipc"):  # cast and kept on the learner's GPU: no host round trip
            import torch

            return weights(device="cuda" if torch.cuda.is_available() else "cpu", dtype=getattr(torch, self._dtype))
        return weights()

    def _settle(self, errors: dict, pending: list[int]) -> None:
        """After a send: an engine that failed because its actor died leaves the rotation (its poll reports the
        death); a live engine that failed is a bug and raises. Restarted actors that got the weights rejoin."""
        for i, reason in errors.items():
            w = self.workers[i]
            try:
                self.ray.get(w.actor.ready.remote(), timeout=60)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
                w.alive, w.pending, w.transfer = False, False, False
                self._close_transfer(i)
                continue
            raise RuntimeError(f"weight transfer to rollout engine {i} failed: {reason}")
        for i in pending:
            if i not in errors:
                self.workers[i].alive, self.workers[i].pending = True, False
                log.info("rollout actor %d restarted", i)

    def _close_transfer(self, i: int) -> None:
        try:
            if self._host is not None:
                self._host.close_transfer(i)
            elif self._sender is not None:
                self._sender.close(i)
        except Exception as e:  # noqa: BLE001 -- closing a dead engine's group is best effort
            log.warning("closing the weight transfer of engine %d: %s", i, e)

    def _on_live(self, method: str) -> None:
        refs = [getattr(w.actor, method).remote() for w in self.workers if w.alive]
        for r in refs:
            try:
                self.ray.get(r)
            except self.ray.exceptions.RayActorError:
                pass  # its poll reports the death

    def alive_workers(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w.alive]

    def sleep(self) -> None:
        self._on_live("sleep")

    def wake_up(self) -> None:
        self._on_live("wake_up")

    def local_policy(self):
        return None

    def components(self) -> dict:
        kinds = set()
        for w in self.workers:
            try:
                kinds.add(self.ray.get(w.actor.sampler_kind.remote(), timeout=60))
            except Exception:  # noqa: BLE001 -- a dead actor says nothing about the others
                pass
        kind = kinds.pop() if len(kinds) == 1 else "/".join(sorted(kinds)) or "unknown"
        return {"sampler": kind, "rollout_backend": "ray",
                "vllm_engines": self.started if kind == "vllm" else 0}

    def placement_record(self) -> list[dict]:
        """Where Ray put each live engine actor: ``[{"engine": i, "node", "gpus"}]``."""
        refs = {i: w.actor.where.remote() for i, w in enumerate(self.workers) if w.alive}
        return [{"engine": i, **self.ray.get(r, timeout=60)} for i, r in refs.items()]

    def weight_sync(self) -> dict:
        """How weights reached the engines (``gloo`` / ``nccl`` / ``ipc``: vLLM's weight-transfer API; ``object_store``:
        one ``ray.put`` per update) and the mean seconds per publish, every engine holding the new version."""
        n = len(self._publish_s)
        sender = ("none" if self._transport == "object_store" else
                  "learner ranks (rank 0 sends)" if self._host is not None else "driver")
        return {"transport": self._transport, "sender": sender,
                "seconds_mean": sum(self._publish_s) / n if n else None, "publishes": n}

    def play(self, make_env: Callable, tasks: list, rollout: RolloutConfig) -> list:
        """Every task once on the rollout actors' samplers (dealt round-robin to the live ones), next to training."""
        live = [w for w in self.workers if w.alive]
        if not live:
            raise RuntimeError("no live rollout actor to evaluate on")
        shares = [tasks[i::len(live)] for i in range(len(live))]
        refs = [w.actor.play.remote(make_env, share, rollout) for w, share in zip(live, shares) if share]
        return [t for r in refs for t in self.ray.get(r)]

    def kill_worker(self, wid: int) -> None:
        """Fault injection: kill the actor process outright. It gets no more work from this moment; the driver sees
        the death (and drops its in-flight episodes) on the next poll."""
        w = self.workers[wid]
        self.ray.kill(w.actor, no_restart=True)
        if w.alive:
            w.alive = False
            self._events.append(("died", wid, "killed (ray.kill)"))

    def restart_worker(self, wid: int) -> None:
        """Replace a dead actor without blocking the loop: the new one gets work once its ready() resolves."""
        self._kill_quietly(self.workers[wid].actor)
        w = self._spawn(wid)
        w.alive = False
        w.starting_ref = w.actor.ready.remote()
        self.workers[wid] = w

    def _started(self, wid: int, ref) -> None:
        w = self.workers[wid]
        w.starting_ref = None
        try:
            self.ray.get(ref)
            with self._sync:  # a fresh actor has make_policy's weights: bring it up to date first
                if self._transport != "object_store":
                    self._open(wid, w, self.ray.get(w.actor.transfer_spec.remote(), timeout=READY_TIMEOUT_S))
                    if self._host is not None:  # the learner's ranks send it at the next publish (see publish)
                        w.pending = True
                        log.info("rollout actor %d restarted; it gets the weights at the next publish", wid)
                        return
                    if self._weights is not None:
                        self._settle(self._sender.send([wid], self._weights[1]), [])
                elif self._weights is not None:
                    self.ray.get(w.actor.load_weights.remote(*self._weights))
        except Exception as e:  # noqa: BLE001 -- it stays out of rotation; the run goes on with the others
            log.error("restarted rollout actor %d failed to start: %s", wid, e)
            return
        w.alive = True
        log.info("rollout actor %d restarted", wid)

    def _kill_quietly(self, actor) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 -- already gone
            pass

    def close(self) -> dict:
        ray = self.ray
        left = 0
        closes = {}
        for w in self.workers:
            if w.alive:
                closes[w.actor.close.remote()] = w  # joins the actor's episode threads, closes its envs
        for r in closes:
            try:
                left += int(ray.get(r, timeout=30))
            except Exception:  # noqa: BLE001 -- dead or hung: it is killed below anyway
                pass
        if self._sender is not None:
            self._sender.close()
        for w in self.workers:
            self._kill_quietly(w.actor)
        self.workers = []
        self._weights = None
        if self._owns_ray:
            ray.shutdown()
        return {"leftover_threads": left}
