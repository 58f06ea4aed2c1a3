"""The losses the learner can optimise, by name, behind one typed interface.

Contract:

* A loss is registered with :func:`register_loss` as ``compute(inputs: LossInputs, **options) -> LossResult``.
  ``options(config)`` picks the loss's keyword-only options from a
  :class:`~agentenv.trainer.learner.LearnerConfig`; ``prepare(batch)`` (optional) computes per-row tensors that need
  the WHOLE batch (GRPO's group advantages), which the learner slices per micro-batch into ``inputs.extra``;
  ``needs_entropy(config)`` says whether the learner must compute per-token entropies.
* :class:`LossResult` is the same for every loss, so the learner merges micro-batches one way:
  ``rows`` are per-trajectory ``[b]`` tensors (put back in batch order; ``advantages``, ``policy_tokens`` and
  ``retained_tokens`` are required), ``sums`` are added (``loss``: the micro-batch shares add up to the full loss),
  ``means`` are ``name -> (value, weight)`` merged as weighted means, ``maxima`` / ``minima`` merged by max / min.
  A NaN value (weight 0 for a mean) means "no such token in this micro-batch" and is left out of the merge.
* Adding a loss = one registered function here + a preset variant (``algo: {loss: NAME}``).

The objectives themselves (the math, hand-checked in tests) live in :mod:`agentenv.trainer.objectives`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from torch import Tensor

from .batch import Batch
from .objectives import FullBatch, flashreinforce_loss, group_advantages, grpo_loss


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch as every loss sees it (tensors on the compute device)."""

    log_probs: Tensor  # [b, T] current log pi of each token (0 off the action mask), differentiable
    behavior_log_probs: Tensor  # [b, T] log mu recorded by the sampler
    action_mask: Tensor  # [b, T] bool
    rewards: Tensor  # [b] float64
    failures: Tensor  # [b] bool
    full_batch: FullBatch  # whole-batch totals (B, mean reward, sum T_i)
    entropies: Tensor | None = None  # [b, T] when the loss asked for them
    extra: dict[str, Tensor] = field(default_factory=dict)  # this micro-batch's rows of prepare(batch)


@dataclass(frozen=True)
class LossResult:
    loss: Tensor  # scalar to backpropagate: this micro-batch's exact share of the full-batch loss
    rows: dict[str, Tensor]  # per trajectory [b], detached
    sums: dict[str, float] = field(default_factory=dict)
    means: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (value, weight)
    maxima: dict[str, float] = field(default_factory=dict)
    minima: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LossSpec:
    name: str
    compute: Callable[..., LossResult]
    options: Callable[[object], dict]
    prepare: Callable[[Batch], dict[str, Tensor]] | None = None
    needs_entropy: Callable[[object], bool] = lambda config: False


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, options: Callable[[object], dict], prepare=None, needs_entropy=None):
    """Decorator: register ``compute`` under ``name`` (names are unique)."""
    def wrap(compute):
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = LossSpec(name, compute, options, prepare, needs_entropy or (lambda config: False))
        return compute
    return wrap


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {name!r}")
    return LOSSES[name]


def _filtering(config) -> bool:
    return config.negative_token_fraction < 1.0


@register_loss(
    "flashreinforce",
    options=lambda c: dict(delta=math.inf if c.no_trust else c.delta, negative_token_fraction=c.negative_token_fraction,
                           no_is=c.no_is, token_mean=c.token_mean, constant_length=c.constant_length),
    needs_entropy=_filtering,
)
def flashreinforce(inp: LossInputs, *, delta: float, negative_token_fraction: float, no_is: bool, token_mean: bool,
                   constant_length: int | None) -> LossResult:
    filtering = negative_token_fraction < 1.0
    loss, st = flashreinforce_loss(
        inp.log_probs, inp.behavior_log_probs, inp.rewards, inp.action_mask, delta=delta,
        negative_token_fraction=negative_token_fraction, entropies=inp.entropies if filtering else None,
        failures=inp.failures if filtering else None, no_is=no_is, token_mean=token_mean,
        constant_length=constant_length, full_batch=inp.full_batch,
    )
    rows = {k: st[k] for k in ("advantages", "policy_tokens", "retained_tokens", "seq_kl", "admitted")}
    return _result(loss, rows, st)


@register_loss("grpo", options=lambda c: dict(clip_eps=c.grpo_clip_eps),
               prepare=lambda batch: {"advantages": group_advantages(batch.rewards, batch.group_ids)})
def grpo(inp: LossInputs, *, clip_eps: float) -> LossResult:
    loss, st = grpo_loss(inp.log_probs, inp.behavior_log_probs, inp.extra["advantages"], inp.action_mask,
                         clip_eps=clip_eps, num_policy_tokens=inp.full_batch.num_policy_tokens)
    result = _result(loss, {k: st[k] for k in ("advantages", "policy_tokens", "retained_tokens")}, st)
    result.means["clip_fraction"] = (float(st["clip_fraction"]), float(st["retained_tokens"].sum()))
    return result


def _result(loss: Tensor, rows: dict[str, Tensor], st: dict[str, Tensor]) -> LossResult:
    """The shared part: the loss value and the importance-ratio statistics over retained tokens."""
    retained = float(st["retained_tokens"].sum())
    return LossResult(loss=loss, rows={k: v.detach() for k, v in rows.items()}, sums={"loss": float(st["loss"])},
                      means={"ratio_mean": (float(st["ratio_mean"]), retained)},
                      maxima={"ratio_max": float(st["ratio_max"])}, minima={"ratio_min": float(st["ratio_min"])})


def merge_results(parts: list[tuple[list[int], LossResult]], batch_size: int) -> dict:
    """Micro-batch results (each with its rows of the batch) -> batch-level stats, the same way for every loss:
    per-row tensors back in batch order, then their summaries; sums added, means weighted, extrema reduced."""
    import torch

    rows: dict[str, Tensor] = {}
    for key in parts[0][1].rows:
        dtype = parts[0][1].rows[key].dtype
        out = torch.zeros(batch_size, dtype=dtype)
        for idx, r in parts:
            out[idx] = r.rows[key].cpu()
        rows[key] = out
    adv = rows["advantages"].double()
    stats = {"adv_mean": float(adv.mean()), "adv_std": float(adv.std(unbiased=False)),
             "policy_tokens": int(rows["policy_tokens"].sum()), "retained_tokens": int(rows["retained_tokens"].sum())}
    if "admitted" in rows:
        kl, admitted = rows["seq_kl"].double(), rows["admitted"].bool()
        stats.update(acceptance_rate=float(admitted.double().mean()), num_admitted=int(admitted.sum()),
                     seq_kl_mean=float(kl.mean()), seq_kl_max=float(kl.max()),
                     admitted=admitted.tolist())  # per trajectory, in the order given: the loop labels rejections
    results = [r for _, r in parts]
    for key in results[0].sums:
        stats[key] = sum(r.sums[key] for r in results)
    for key in results[0].means:
        live = [r.means[key] for r in results if r.means[key][1] > 0]
        total = sum(w for _, w in live)
        stats[key] = sum(v * w for v, w in live) / total if total > 0 else math.nan
    for key, reduce in [(k, max) for k in results[0].maxima] + [(k, min) for k in results[0].minima]:
        vals = [v for r in results for v in [(r.maxima | r.minima)[key]] if not math.isnan(v)]
        stats[key] = reduce(vals) if vals else math.nan
    return stats
