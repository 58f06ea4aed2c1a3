"""The learner past one device: FSDP2 ranks running the ONE :class:`~agentenv.trainer.learner.Learner`, and the single
object the driver talks to.

Contract:

* :func:`make_learner` is what a run calls: ``launch.learner_world_size == 1`` gives an in-process
  :class:`Learner`; ``W > 1`` gives a :class:`ShardedLearner` that spawns W worker processes
  (``torch.multiprocessing``, spawn), each joining a process group (gloo on CPU, NCCL on GPU, rank r on ``cuda:r``)
  and building ``Learner(model, config, shard=True)`` from a model on the meta device: rank 0 alone loads the
  weights (on host) and they are broadcast into the shards (:mod:`~agentenv.trainer.sharding`). Both have the same
  interface: ``update(trajs) -> stats``, ``step``, ``policy_version``, ``export_weights()``, ``save(dir)`` /
  ``load(dir)`` (a checkpoint directory: each rank writes / reads its own shard, any world size loads it),
  ``state_dict()`` / ``load_state_dict()`` (in memory, full tensors: gathered to rank 0 and through the driver, so
  not what checkpoints use), ``save_pretrained(dir)``, ``use_average()``, ``components()``, ``close()``.
* With a :class:`~agentenv.trainer.placement.Placement` (``loop.backend=ray``) the W ranks are Ray actors instead
  (:class:`RayShardedLearner`, below), each in its own placement bundle, so the learner can span nodes.
* Every rank receives every command with the same arguments (the whole batch: the rows are split inside
  :meth:`Learner.update`); rank 0's reply is returned. An exception on any rank is raised in the driver with that
  rank's traceback, and the learner stays usable when the error was a refused input (every rank refuses alike).
* Inside a rank the Learner shards itself with :mod:`agentenv.trainer.sharding` (FSDP2 ``fully_shard``, sharded
  init, full-state gathers for samplers). A checkpoint (:func:`agentenv.trainer.checkpoint.save_learner`) resumes a
  learner of any world size, a single-process one included.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentenv.core.trajectory import Trajectory


# --- the driver's object over W ranks -------------------------------------------------------------------------------


def make_learner(cfg, model_path: str, device: str | None = None, placement=None, **overrides):
    """The learner a run executes: one process, or ``cfg.launch.learner_world_size`` FSDP2 ranks (see the module
    docstring; with a :class:`~agentenv.trainer.placement.Placement` the ranks are Ray actors placed by it,
    :class:`RayShardedLearner`). ``overrides`` go to
    :func:`~agentenv.trainer.learner.learner_config_from`."""
    from .learner import Learner, learner_config_from
    from .model_io import load_learner_model

    config = learner_config_from(cfg, **overrides)
    world = cfg.launch.learner_world_size
    if world == 1:
        return Learner(load_learner_model(model_path), config, device=device)
    if placement is not None:
        return RayShardedLearner(config, model_path, world, placement)
    return ShardedLearner(config, model_path, world)


class ShardedLearner:
    """W worker processes, each one FSDP2 rank of :class:`Learner`; the Learner's interface in the driver."""

    def __init__(self, config, model_path: str, world_size: int, *, policy_version: int = 0, timeout_s: float = 3600):
        if world_size < 2:
            raise ValueError(f"a sharded learner needs world_size >= 2, got {world_size}")
        if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
            raise RuntimeError(f"launch.learner_world_size={world_size} but only {torch.cuda.device_count()} GPUs "
                               "are visible: lower it or make the GPUs visible")
        self.config, self.model_path, self.world_size, self.timeout_s = config, model_path, world_size, timeout_s
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        port = _free_port()
        self._procs = [ctx.Process(target=_rank_main, daemon=True, name=f"learner-rank{r}",
                                   args=(r, world_size, port, model_path, config, policy_version, self._inboxes[r],
                                         self._outbox))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        info = self._call("info")
        self.step, self.policy_version, self._components = info["step"], info["policy_version"], info["components"]

    def _call(self, name: str, *args):
        if not self._procs:
            raise RuntimeError("the sharded learner is closed")
        for q in self._inboxes:
            q.put((name, args))
        replies, deadline = {}, time.monotonic() + self.timeout_s
        while len(replies) < self.world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:  # a crashed rank never answers: do not wait for it
                    what = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead) or f"{self.timeout_s}s timeout"
                    self.close()
                    raise RuntimeError(f"sharded learner {name}: no reply ({what}); the learner ranks were stopped")
                continue
            replies[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in sorted(replies.items()) if not ok}
        if failed:  # a refused input is refused alike on every rank: re-raise it as the single learner would
            kind = ValueError if all(kind == "ValueError" for kind, _ in failed.values()) else RuntimeError
            first = next(iter(failed.values()))[1].strip().splitlines()[-1]
            raise kind(f"sharded learner {name}: {first}\n" + "\n".join(f"rank {r}:\n{tb}" for r, (_, tb) in
                                                                         failed.items()))
        return replies[0][1]

    def update(self, trajectories: Sequence[Trajectory]) -> dict:
        stats = self._call("update", list(trajectories))
        self.step, self.policy_version = stats["step"], stats["policy_version"]
        return stats

    def export_weights(self, device="cpu", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in self._call("export_weights", "cpu", dtype).items()}

    def components(self) -> dict:
        return dict(self._components)

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state_dict", state)
        self.step, self.policy_version = int(state["step"]), int(state["policy_version"])

    def save(self, path) -> None:
        """Every rank writes its own shard into the directory ``path`` (:meth:`Learner.save`); nothing comes here."""
        self._call("save", str(path))

    def load(self, path) -> None:
        """From a directory :meth:`save` wrote with any world size (a single-process learner's included)."""
        self.step, self.policy_version = self._call("load", str(path))

    def use_average(self) -> int:
        n, self.policy_version = self._call("use_average")
        return n

    def save_pretrained(self, out_dir, source: str | None = None, dtype: str = "float32") -> None:
        self._call("save_pretrained", str(out_dir), source or self.model_path, dtype)

    def close(self) -> None:
        procs, self._procs = self._procs, []
        for q in self._inboxes if procs else []:
            q.put(("close", ()))
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: queues may already be gone
            return


def _rank_main(rank, world, port, model_path, config, policy_version, inbox, outbox) -> None:
    """One learner rank: join the group, build the sharded Learner, serve commands until ``close``."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        learner = _rank_learner(rank, model_path, config, policy_version)
    except BaseException as e:
        outbox.put((rank, False, (type(e).__name__, traceback.format_exc())))
        return
    while True:
        name, args = inbox.get()
        if name == "close":
            break
        try:
            value = _serve(learner, name, args)
            outbox.put((rank, True, value if rank == 0 else None))
        except Exception as e:
            outbox.put((rank, False, (type(e).__name__, traceback.format_exc())))
    dist.destroy_process_group()


def _rank_learner(rank: int, model_path: str, config, policy_version: int):
    """Join the group (env vars set) and build this rank's sharded Learner: every rank builds the model on the meta
    device from its config; rank 0 alone loads the weights, on host, and they are broadcast into the shards."""
    from .learner import Learner
    from .model_io import load_learner_model
    from .sharding import init_distributed, rank0_weights

    model = load_learner_model(model_path, meta=True)  # before joining the group: a bad path fails every rank, fast
    weights = rank0_weights(load_learner_model(model_path)) if rank == 0 else None
    info = init_distributed()
    return Learner(model, config, device=info.device, shard=True, policy_version=policy_version,
                   rank0_weights=weights)


def _serve(learner, name: str, args: tuple):
    if name == "info":
        return {"step": learner.step, "policy_version": learner.policy_version, "components": learner.components()}
    if name == "use_average":  # every rank swaps its own shard of the mean in; the driver tracks the new version
        return learner.use_average(), learner.policy_version
    if name == "load":
        learner.load(*args)
        return learner.step, learner.policy_version
    if name in ("update", "export_weights", "state_dict", "load_state_dict", "save", "save_pretrained"):
        return getattr(learner, name)(*args)
    raise ValueError(f"unknown learner command {name!r}")


# --- the ranks as Ray actors ------------------------------------------------------------------------------------
# The sharded learner as Ray actors: FSDP2 ranks that can span nodes, placed by :mod:`agentenv.trainer.placement`.
#
# :class:`RayShardedLearner` is :class:`ShardedLearner` (same driver-side interface,
# same commands served by the same ``_serve``) with its W ranks as Ray actors instead of local processes: rank r runs
# in the bundle :meth:`Placement.learner_options(r)` reserves, on whichever node Ray put it. Rank 0 picks the
# rendezvous address (its node's IP and a free port there); every rank then joins one ``torch.distributed`` group
# (NCCL with CUDA, gloo on CPU). With a GPU bundle Ray sets ``CUDA_VISIBLE_DEVICES`` to the rank's device, so each
# rank uses ``cuda:0`` of its own view. Every command goes to every rank with the same arguments; rank 0's reply is
# returned; a refused input (a ``ValueError`` on every rank) is raised as ``ValueError``, anything else as
# ``RuntimeError`` with each failing rank's error. :meth:`placement` says where each rank runs:
# ``[{"rank": r, "node": <Ray node id>, "gpus": [ids]}]``. The ranks also host the trainer side of the engines' weight
# transfers (``open_transfer`` / ``send_weights``): every rank gathers each tensor on its device, rank 0 sends it.


class LearnerRank:
    """Actor body of one rank (wrapped with ``ray.remote`` by :class:`RayShardedLearner`)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.learner, self.sender = rank, world, None, None

    def where(self) -> dict:
        from .placement import where

        return {"rank": self.rank, **where()}

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port(bind="0.0.0.0")

    def setup(self, addr: str, port: int, model_path: str, config, policy_version: int) -> None:
        import torch

        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(self.rank), WORLD_SIZE=str(self.world),
                          LOCAL_RANK="0")  # Ray narrows CUDA_VISIBLE_DEVICES to this rank's GPU
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world))
        self.learner = _rank_learner(self.rank, model_path, config, policy_version)

    def call(self, name: str, args: tuple):
        value = _serve(self.learner, name, args)
        return value if self.rank == 0 else None

    # the trainer side of vLLM's weight transfer, hosted here so weights go from the learner's own devices
    def open_transfer(self, key, transport: str, engine_actor, world_size: int, dtype_name: str) -> None:
        import ray

        from agentenv.samplers.weight_sources import ModelSource
        from agentenv.samplers.weight_transfer import TransferSender

        from .ray_worker import ActorClient

        if self.sender is None:  # gloo sends the master weights as they are; NCCL / IPC in the engine's dtype
            dtype = getattr(torch, dtype_name) if transport in ("nccl", "ipc") else None
            self.sender = TransferSender(transport, ModelSource(self.learner.model, dtype), rank=self.rank)
        self.sender.open(key, ActorClient(ray, engine_actor), world_size=world_size)

    def send_weights(self, keys: list, version: int | None = None) -> dict:
        version = self.learner.policy_version if version is None else version
        errors = self.sender.send(keys, version)
        return {"version": version, "errors": errors} if self.rank == 0 else None

    def close_transfer(self, key=None) -> None:
        if self.sender is not None:
            self.sender.close(key)

    def close(self) -> None:
        import torch.distributed as dist

        if self.sender is not None:
            self.sender.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class RayShardedLearner(ShardedLearner):
    def __init__(self, config, model_path: str, world_size: int, placement, *, policy_version: int = 0,
                 timeout_s: float = 3600):
        import ray

        if world_size < 2:
            raise ValueError(f"a sharded learner needs world_size >= 2, got {world_size}")
        self.ray, self.config, self.model_path, self.world_size = ray, config, model_path, world_size
        self.timeout_s = timeout_s
        cls = ray.remote(LearnerRank)
        self._procs = [cls.options(**placement.learner_options(r), max_restarts=0).remote(r, world_size)
                       for r in range(world_size)]
        try:
            self._where = ray.get([a.where.remote() for a in self._procs], timeout=300)
            addr, port = ray.get(self._procs[0].address.remote())
            self._gather([a.setup.remote(addr, port, model_path, config, policy_version) for a in self._procs],
                         "setup")
            info = self._call("info")
        except BaseException:
            self.close()
            raise
        self.step, self.policy_version, self._components = info["step"], info["policy_version"], info["components"]

    def placement(self) -> list[dict]:
        return [dict(w) for w in self._where]

    # Weights to vLLM engines straight from the ranks (rank 0 sends each tensor as the ranks gather it on device):
    # what :class:`~agentenv.trainer.ray_backend.RayBackend` uses instead of exporting a state dict to the driver.
    hosts_weight_transfer = True

    def open_transfer(self, key, transport: str, engine_actor, world_size: int, dtype_name: str) -> None:
        self._gather([a.open_transfer.remote(key, transport, engine_actor, world_size, dtype_name)
                      for a in self._procs], "open_transfer")

    def send_weights(self, keys: list, version: int | None = None) -> dict:
        """Send the current weights to the engines ``keys`` (labelled ``version``, default the learner's); returns
        ``{"version": v, "errors": {key: reason}}`` for engines whose transfer failed."""
        return self._gather([a.send_weights.remote(list(keys), version) for a in self._procs], "send_weights")

    def close_transfer(self, key=None) -> None:
        self._gather([a.close_transfer.remote(key) for a in self._procs], "close_transfer")

    def _gather(self, refs: list, name: str):
        ray, values, failed = self.ray, [], {}
        for r, ref in enumerate(refs):
            try:
                values.append(ray.get(ref, timeout=self.timeout_s))
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else None
                failed[r] = (type(cause).__name__ if cause else "RayTaskError", str(cause or e))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                self.close()
                raise RuntimeError(f"sharded learner {name}: rank {r} gave no reply ({type(e).__name__}); the "
                                   "learner ranks were stopped") from e
        if failed:
            kind = ValueError if all(k == "ValueError" for k, _ in failed.values()) else RuntimeError
            first = next(iter(failed.values()))[1].strip().splitlines()[-1]
            raise kind(f"sharded learner {name}: {first}\n" + "\n".join(f"rank {r}: {m}" for r, (_, m) in
                                                                        failed.items()))
        return values[0]

    def _call(self, name: str, *args):
        if not self._procs:
            raise RuntimeError("the sharded learner is closed")
        return self._gather([a.call.remote(name, args) for a in self._procs], name)

    def close(self) -> None:
        actors, self._procs = getattr(self, "_procs", []), []
        if not actors:
            return
        for ref in [a.close.remote() for a in actors]:
            try:
                self.ray.get(ref, timeout=60)
            except Exception:  # noqa: BLE001 -- dead or hung: killed below
                pass
        for a in actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 -- already gone
                pass


def _free_port(bind: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]
