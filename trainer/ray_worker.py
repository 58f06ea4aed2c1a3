"""The Ray actors' side of :mod:`agentenv.trainer.ray_backend`: the rollout actor's body and the weight-transfer
client that drives its engine.

* :class:`RayRolloutWorker` (wrapped with ``ray.remote`` by the backend) owns one sampler (``make_policy(i)``: an
  HFPolicy, or a vLLM engine), its envs and a :class:`~agentenv.trainer.workers.RolloutWorker`; it serves the
  backend's calls (submit / cancel / poll, weight loads, the engine side of a weight transfer, sleep / wake_up,
  evaluation episodes, fault injection) from several threads (``max_concurrency``).
* :class:`ActorClient` is vLLM's ``VLLMWeightSyncClient`` for one such actor: the four control-plane calls of a
  weight transfer as actor calls. Whoever hosts the trainer side (the driver, or a learner rank) holds one per engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from agentenv.core.runtime import EpisodeSpec, RolloutConfig
from agentenv.core.serving import request_server

from .placement import where
from .workers import RolloutWorker, sampler_kind

# An actor that cannot be scheduled is refused earlier (preflight, placement group); this bounds a slow start only
# (a vLLM engine on a loaded CPU box takes minutes).
READY_TIMEOUT_S = 1200


class RayRolloutWorker:
    """Actor body (wrapped with ``ray.remote`` by :class:`RayBackend`)."""

    def __init__(self, worker_id: int, make_env: Callable, make_policy: Callable, rollout_cfg: RolloutConfig):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.policy = make_policy(worker_id)
        self.batcher = request_server(self.policy) if hasattr(self.policy, "generate") else None
        self.worker = RolloutWorker(worker_id, make_env, self.policy, rollout_cfg, self.batcher)

    def ready(self) -> int:
        return os.getpid()

    def submit(self, eid: int, task: EpisodeSpec) -> None:
        self.worker.submit(eid, task)

    def cancel(self, eid: int) -> None:
        self.worker.cancel(eid)

    def poll(self, timeout: float) -> list:
        return self.worker.poll(timeout)

    def load_weights(self, state_dict: dict, version: int) -> int:
        self.worker.load_weights(state_dict, version)
        return version

    # the engine side of a weight transfer (agentenv.samplers.vllm_transfer), driven by ActorClient
    def transfer_spec(self) -> dict:
        spec = getattr(self.policy, "transfer_spec", None)
        return spec() if callable(spec) else {"transport": "object_store"}

    def init_weight_transfer(self, init_info: dict) -> None:
        self.policy.init_weight_transfer(init_info)

    def start_weight_update(self) -> None:
        self.policy.start_weight_update()

    def receive_weights(self, update_info) -> None:
        self.policy.receive_weights(update_info)

    def finish_weight_update(self, version: int) -> int:
        return self.policy.finish_weight_update(version)

    def sleep(self) -> None:
        getattr(self.policy, "sleep", lambda: None)()

    def wake_up(self) -> None:
        getattr(self.policy, "wake_up", lambda: None)()

    def sampler_kind(self) -> str:
        return sampler_kind(self.policy)

    def where(self) -> dict:
        return where()

    def play(self, make_env: Callable, tasks: list, rollout_cfg: RolloutConfig) -> list:
        """Evaluation on this actor's sampler: every task once, next to (sharing the engine with) training episodes."""
        from agentenv.core.runtime import run_episodes

        return run_episodes(make_env, self.policy, len(tasks), rollout_cfg, tasks=tasks)

    def crash(self) -> None:
        """Fault injection from the driver: a worker-level crash inside a live actor."""
        self.worker.kill()

    def close(self) -> int:
        left = self.worker.close()
        if self.batcher is not None:
            self.batcher.close()
        close = getattr(self.policy, "close", None)
        if callable(close):
            close()
        return left


class ActorClient:
    """vLLM's ``VLLMWeightSyncClient`` for one rollout actor: the four control-plane calls as actor calls (the actor
    is threaded, so its receive runs while the driver sends). ``version`` is what the update sets the engine to."""

    def __init__(self, ray, actor):
        self.ray, self.actor, self.version = ray, actor, None

    def _call(self, method: str, *args):
        return self.ray.get(getattr(self.actor, method).remote(*args), timeout=READY_TIMEOUT_S)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._call("receive_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", self.version)
