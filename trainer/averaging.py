"""Tail averaging of a learner's weights: the uniform mean of the weights after each of the last N updates.

Contract of :class:`WeightAverage` (owned by :class:`~agentenv.trainer.learner.Learner`, ``average_last_updates``):

* :meth:`after_update(model, step)` folds the weights in when ``step`` (1-based, counted over ``total_steps``) is one
  of the last ``last_n``; an update that skipped the optimizer counts too: the mean is over updates.
* :meth:`fold(model)` adds the model's current parameters to a running float32 mean,
  ``m_k = m_{k-1} + (w - m_{k-1}) / k``, kept on the parameters' own device and sharding: under FSDP2 each rank
  averages its own shard of each DTensor, with no collective. Tied weights appear once (``named_parameters``).
* :meth:`swap_into(model)` copies the mean into the parameters and empties the average; it returns how many updates
  the mean covered (with fewer than 2 the weights already are the mean and nothing is copied).
* :meth:`state` / :meth:`load` carry the mean through the learner's in-memory ``state_dict`` as full CPU tensors
  (sharded: ``state`` is a collective; ``load`` re-shards each tensor exactly like its parameter). A checkpoint
  directory holds ``mean`` as it is, each rank its shard (:func:`agentenv.trainer.checkpoint.save_learner`). Either
  way a run resumed inside the window averages the same updates as one that never stopped.

Why: averaging the last iterates cancels part of their noise (Polyak-Ruppert averaging; LAWA for late checkpoints).
On the CPU ALFWorld demo the unseen success of one update's weights swings run to run by as much as RL's effect.
"""

from __future__ import annotations

import torch
from torch import Tensor


class WeightAverage:
    def __init__(self, last_n: int = 0, total_steps: int | None = None):  # LearnerConfig checks the pair
        self.last_n, self.total_steps = last_n, total_steps
        self.mean: dict[str, Tensor] | None = None
        self.count = 0  # updates folded into the mean

    def after_update(self, model: torch.nn.Module, step: int) -> None:
        if self.last_n and step > self.total_steps - self.last_n:
            self.fold(model)

    @torch.no_grad()
    def fold(self, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        if self.mean is None:
            self.mean, self.count = {k: p.detach().clone() for k, p in params.items()}, 1
            return
        self.count += 1
        for k, m in self.mean.items():
            m.lerp_(params[k].detach(), 1.0 / self.count)

    @torch.no_grad()
    def swap_into(self, model: torch.nn.Module) -> int:
        n, mean = self.count, self.mean
        self.mean, self.count = None, 0
        if n >= 2:
            for k, p in model.named_parameters():
                p.copy_(mean[k])
        return n

    def state(self) -> dict:
        full = None if self.mean is None else {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in self.mean.items()}
        return {"weight_average": full, "averaged_updates": self.count}

    def load(self, model: torch.nn.Module, state: dict) -> None:
        """From :meth:`state`'s keys in a checkpoint (absent in older ones: no average)."""
        full, self.mean, self.count = state.get("weight_average"), None, 0
        if full is None:
            return
        params = dict(model.named_parameters())
        if set(full) != set(params):
            raise ValueError(f"the checkpoint's weight average names {sorted(set(full) ^ set(params))[:5]} do not "
                             "match the model's parameters")
        mean = {}
        for k, p in params.items():
            if hasattr(p, "device_mesh"):  # an FSDP2 DTensor parameter: shard the mean exactly like it
                from torch.distributed.tensor import distribute_tensor

                mean[k] = distribute_tensor(full[k].to(device=p.device_mesh.device_type, dtype=p.dtype),
                                            p.device_mesh, p.placements)
            else:
                mean[k] = full[k].to(device=p.device, dtype=p.dtype).clone()
        self.mean, self.count = mean, int(state.get("averaged_updates", 0))
