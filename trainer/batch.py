"""From a list of :class:`~agentenv.core.trajectory.Trajectory` to padded tensors and length-bucketed micro-batches.

Contract:

* :func:`collate` validates every trajectory (its own ``validate()``, plus: non-empty, at least one policy token, the
  first token not a policy token) and right-pads to ``[B, T_max]``: ``input_ids`` (pad id), ``attention_mask``,
  ``action_mask`` (False on padding), ``behavior_log_probs`` (0 on padding), plus ``rewards`` ``[B]`` (float64),
  ``failures`` ``[B]`` and the row's ``ids`` / ``group_ids``.
* ``failures[i]`` is ``not trajectory.success`` by default; with ``failure_threshold=x`` it is ``reward < x``.
* ``group_ids[i]`` is ``trajectory.meta["group_id"]`` when present, else ``trajectory.task`` (the prompt), and is used
  only by the GRPO baseline.
* :func:`microbatches` splits a batch into row subsets of similar length whose padded size ``rows x T_max`` stays
  within a token budget (a row longer than the budget goes alone). Rows are never split, so the per-row ``T_i`` is
  unchanged; the whole-batch quantities (reward mean, ``B``, ``sum T_i``) come from :meth:`Batch.full_batch`, computed
  BEFORE splitting and passed to every micro-batch's loss, which makes accumulated gradients equal the full batch's.
* :func:`permute_rewards` shuffles a batch's rewards (and failures with them) among its rows by a seeded permutation:
  the permuted-reward control (``algo.permute_rewards``).
* :func:`trajectory_stats` summarises what the tensors do not carry: policy lag against a given weight version,
  the share sampled with top-k / top-p < 1, and the trust gate's acceptance among lag-0 trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from agentenv.core.trajectory import Trajectory

from .objectives import FullBatch


@dataclass
class Batch:
    input_ids: Tensor  # [B, T] int64, right-padded
    attention_mask: Tensor  # [B, T] bool, False on padding
    action_mask: Tensor  # [B, T] bool, True on policy-sampled tokens
    behavior_log_probs: Tensor  # [B, T] float32, 0 off the action mask
    rewards: Tensor  # [B] float64
    failures: Tensor  # [B] bool
    ids: list[str]
    group_ids: list[str]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        return self.attention_mask.sum(dim=1)

    def full_batch(self) -> FullBatch:
        return FullBatch.of(self.rewards, self.action_mask)

    def select(self, rows: Sequence[int]) -> "Batch":
        """The given rows, trimmed to their own longest length (less padding to run through the model)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        width = int(self.lengths[idx].max())
        return Batch(
            input_ids=self.input_ids[idx, :width],
            attention_mask=self.attention_mask[idx, :width],
            action_mask=self.action_mask[idx, :width],
            behavior_log_probs=self.behavior_log_probs[idx, :width],
            rewards=self.rewards[idx],
            failures=self.failures[idx],
            ids=[self.ids[i] for i in rows],
            group_ids=[self.group_ids[i] for i in rows],
        )

    def to(self, device) -> "Batch":
        tensors = {k: getattr(self, k).to(device) for k in
                   ("input_ids", "attention_mask", "action_mask", "behavior_log_probs", "rewards", "failures")}
        return replace(self, **tensors)


def collate(
    trajectories: Sequence[Trajectory],
    *,
    pad_token_id: int = 0,
    failure_threshold: float | None = None,
) -> Batch:
    """Validate and right-pad trajectories into a :class:`Batch` (rows in the given order)."""
    if not trajectories:
        raise ValueError("cannot collate an empty list of trajectories")
    for i, traj in enumerate(trajectories):
        where = f"trajectory {i} (id {traj.id!r})"
        try:
            traj.validate()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if not traj.token_ids:
            raise ValueError(f"{where} has no tokens (text-policy trajectories cannot be trained on)")
        if not any(traj.action_mask):
            raise ValueError(f"{where} has no policy token")
        if traj.action_mask[0]:
            raise ValueError(f"{where}: its first token is marked as sampled but has no context to predict it from")
    b, width = len(trajectories), max(len(t.token_ids) for t in trajectories)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(b, width, dtype=torch.bool)
    action_mask = torch.zeros(b, width, dtype=torch.bool)
    behavior = torch.zeros(b, width, dtype=torch.float32)
    for i, traj in enumerate(trajectories):
        n = len(traj.token_ids)
        input_ids[i, :n] = torch.tensor(traj.token_ids, dtype=torch.long)
        attention_mask[i, :n] = True
        action_mask[i, :n] = torch.tensor(traj.action_mask, dtype=torch.bool)
        behavior[i, :n] = torch.tensor(traj.behavior_logprobs, dtype=torch.float32)
    rewards = torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float64)
    if failure_threshold is None:
        failures = torch.tensor([not t.success for t in trajectories], dtype=torch.bool)
    else:
        failures = rewards < failure_threshold
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        behavior_log_probs=behavior,
        rewards=rewards,
        failures=failures,
        ids=[t.id for t in trajectories],
        group_ids=[str(t.meta.get("group_id", t.task)) for t in trajectories],
    )


def microbatches(batch: Batch, max_tokens: int | None) -> list[tuple[list[int], Batch]]:
    """Length-bucketed row groups: ``[(rows, sub_batch), ...]`` covering every row exactly once. ``None`` = one
    micro-batch holding the whole batch."""
    if max_tokens is None:
        return [(list(range(len(batch))), batch)]
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = batch.lengths.tolist()
    order = sorted(range(len(batch)), key=lambda i: -lengths[i])  # longest first; sorted() is stable
    groups: list[list[int]] = []
    for i in order:
        # rows are sorted by decreasing length, so the group's first row sets its padded width
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [(rows, batch.select(rows)) for rows in groups]


def permute_rewards(batch: Batch, seed: int, step: int) -> Batch:
    """The batch with its rewards and failures shuffled among its rows by a permutation drawn from ``(seed, step)``:
    the same on every rank, and a new one each update."""
    perm = torch.as_tensor(np.random.default_rng([seed, step]).permutation(len(batch)), dtype=torch.long)
    return replace(batch, rewards=batch.rewards[perm], failures=batch.failures[perm])


def trajectory_stats(trajectories: Sequence[Trajectory], admitted: list[bool] | None, version: int) -> dict:
    """Lag (vs ``version``, the weights the gradient was computed at), truncated-sampling share, and the gate's
    acceptance among lag-0 trajectories."""
    lags = [[version - v for v in t.versions] for t in trajectories]
    flat = [x for row in lags for x in row]
    out = {"policy_lag_mean": sum(flat) / len(flat), "policy_lag_max": max(flat)} if flat else {}
    out["sampling_truncated_fraction"] = sum(_truncated(t) for t in trajectories) / len(trajectories)
    lag0 = [i for i, row in enumerate(lags) if row and max(row) == 0]
    if admitted is not None and lag0:
        out["lag0_acceptance_rate"] = sum(admitted[i] for i in lag0) / len(lag0)
    return out


def _truncated(t: Trajectory) -> bool:
    s = t.sampling or {}
    return (s.get("top_k") or 0) > 0 or (s.get("top_p") or 1.0) < 1.0
