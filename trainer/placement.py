"""Where a Ray run's parts go: placement groups for the learner ranks and the engine actors, on disjoint devices.

Contract of :class:`Placement` (made once per ``loop.backend=ray`` run, before the learner and the rollout actors):

* It starts (or joins, ``launch.ray_address``) Ray. A local cluster declares the CPUs and GPUs the plan computed
  (:mod:`agentenv.run.capacity`: ``launch.ray_num_cpus`` / ``ray_num_gpus``, defaulting to what the plan needs and
  the visible GPUs); Ray's own CPU/GPU count would leave actors unschedulable or oversubscribe.
* It checks the cluster's totals against the plan and reserves two placement groups: one bundle per learner rank
  (``{"CPU": 1, "GPU": 1}`` when the cluster has GPUs; strategy ``launch.learner_placement``: PACK keeps ranks on
  the fewest nodes, STRICT_SPREAD puts one per node) and one per engine (``{"CPU": worker_num_cpus, "GPU": g}``,
  g = ``worker_num_gpus`` or the engine's tensor-parallel size). Reserved bundles never share a GPU, so Ray hands
  learner ranks and engines disjoint device ids. A cluster that cannot hold them fails with the arithmetic
  (:class:`PlacementError`) instead of actors that never schedule.
* :meth:`learner_options` / :meth:`engine_options` are the ``.options(...)`` that pin actor ``i`` to its bundle.
* :func:`where` runs inside an actor and says where Ray put it: ``{"node": <node id>, "gpus": [ids Ray assigned]}``.
* :meth:`close` removes the groups and shuts Ray down when this object started it (after every actor is gone).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("agentenv.trainer.placement")


class PlacementError(RuntimeError):
    """The cluster cannot hold the plan's learner ranks and engines; the message has the arithmetic."""


def init_ray(num_cpus: int | None = 2, address: str | None = None, num_gpus: int | None = None) -> bool:
    """Start (or join) Ray unless it is already up. Returns True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=True)
    return True


def where() -> dict:
    """Called inside a Ray actor: its node and the GPU ids Ray assigned it."""
    import ray

    ctx = ray.get_runtime_context()
    return {"node": ctx.get_node_id(), "gpus": sorted(str(g) for g in ray.get_gpu_ids())}


class Placement:
    def __init__(self, *, learner_ranks: int, engines: int, gpus: bool | None, engine_gpus: float, engine_cpus: float,
                 learner_strategy: str = "PACK", ray_cpus: int | None = None, ray_gpus: int | None = None,
                 address: str | None = None, timeout_s: float = 120.0):
        import ray
        from ray.util.placement_group import placement_group

        self.ray = ray
        self._owns_ray = init_ray(ray_cpus, address, ray_gpus)
        self._groups: dict = {}
        if gpus is None:  # an existing cluster: reserve GPUs when it has them
            gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.learner_gpus = 1 if gpus else 0
        self.engine_gpus, self.engine_cpus = (engine_gpus if gpus else 0), engine_cpus
        try:
            self._check_totals(learner_ranks, engines)
            learner = [{"CPU": 1, **({"GPU": 1} if self.learner_gpus else {})}] * learner_ranks
            engine = [{"CPU": engine_cpus, **({"GPU": self.engine_gpus} if self.engine_gpus else {})}] * engines
            for name, bundles, strategy in (("learner", learner, learner_strategy), ("engines", engine, "PACK")):
                if bundles and any(bundles[0].values()):
                    self._groups[name] = placement_group(bundles, strategy=strategy, name=f"agentenv-{name}")
            for name, pg in self._groups.items():
                ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
                if not ready:
                    raise PlacementError(f"Ray could not place the {name} bundles {pg.bundle_specs} in {timeout_s:.0f}s"
                                         f" (cluster: {self._totals()}); with launch.learner_placement="
                                         f"{learner_strategy} each learner rank needs its own bundle on a node")
        except BaseException:
            self.close()
            raise
        log.info("placement: %s", {n: pg.bundle_specs for n, pg in self._groups.items()})

    def _totals(self) -> dict:
        r = self.ray.cluster_resources()
        return {"nodes": len([n for n in self.ray.nodes() if n.get("Alive")]), "CPU": r.get("CPU", 0),
                "GPU": r.get("GPU", 0)}

    def _check_totals(self, ranks: int, engines: int) -> None:
        have = self._totals()
        gpus = ranks * self.learner_gpus + engines * self.engine_gpus
        cpus = ranks + engines * self.engine_cpus
        if gpus > have["GPU"] or cpus > have["CPU"]:
            raise PlacementError(f"the Ray cluster ({have['nodes']} nodes, {have['CPU']:g} CPUs, {have['GPU']:g} GPUs) "
                                 f"cannot hold the plan: {ranks} learner ranks x ({self.learner_gpus} GPU, 1 CPU) + "
                                 f"{engines} engines x ({self.engine_gpus:g} GPU, {self.engine_cpus:g} CPU) = "
                                 f"{gpus:g} GPUs, {cpus:g} CPUs; lower launch.learner_world_size / "
                                 "launch.vllm_engines or grow the cluster")

    def _options(self, group: str, index: int, num_cpus: float, num_gpus: float) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = self._groups.get(group)
        opts = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        return opts

    def learner_options(self, rank: int) -> dict:
        return self._options("learner", rank, 1, self.learner_gpus)

    def engine_options(self, i: int) -> dict:
        return self._options("engines", i, self.engine_cpus, self.engine_gpus)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        groups, self._groups = self._groups, {}
        for pg in groups.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 -- Ray already down
                pass
        if self._owns_ray:
            self._owns_ray = False
            self.ray.shutdown()


def make_placement(cfg, plan) -> Placement:
    """The :class:`Placement` of a run's :class:`~agentenv.run.plan.LaunchPlan` (``plan.placement``: the numbers
    :mod:`agentenv.run.capacity` computed)."""
    p, L = plan.placement, cfg.launch
    existing = p["cluster"]["source"] == "existing cluster"  # its GPUs are known once joined
    engine_gpus = ((L.worker_num_gpus or (L.vllm_tensor_parallel if cfg.model.backend == "vllm" else 0)) if existing
                   else p["engines"]["gpus_each"])
    return Placement(learner_ranks=p["learner"]["ranks"] if p["learner"]["where"] == "ray actors" else 0,
                     engines=p["engines"]["count"], gpus=None if existing else bool(p["cluster"]["gpus"]),
                     engine_gpus=engine_gpus, engine_cpus=L.worker_num_cpus,
                     learner_strategy=L.learner_placement, ray_cpus=p["cluster"]["cpus"],
                     ray_gpus=p["cluster"]["gpus"], address=L.ray_address)
