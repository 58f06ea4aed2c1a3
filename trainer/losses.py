"""The losses the learner can optimise, each registered with its typed options section, behind one interface.

Contract:

* A loss is its options section (a :class:`~agentenv.core.config.LossSection` whose ``type`` literal is the loss's
  name: a member of the config's ``algo.loss`` union) and one function registered for it here with
  ``@register_loss(Section)``: ``compute(inputs: LossInputs, options: Section) -> LossResult``. ``prepare(batch)``
  (optional) computes per-row tensors that need the WHOLE batch (GRPO's group advantages), which the learner slices
  per micro-batch into ``inputs.extra``; ``needs_entropy(options)`` says whether the learner must compute per-token
  entropies. The learner holds the section itself (``LearnerConfig.loss``): no field is copied anywhere.
* :class:`LossResult` is the same for every loss, so the learner merges micro-batches one way:
  ``rows`` are per-trajectory ``[b]`` tensors (put back in batch order; ``advantages``, ``policy_tokens`` and
  ``retained_tokens`` are required), ``sums`` are added (``loss``: the micro-batch shares add up to the full loss),
  ``means`` are ``name -> (value, weight)`` merged as weighted means, ``maxima`` / ``minima`` merged by max / min.
  A NaN value (weight 0 for a mean) means "no such token in this micro-batch" and is left out of the merge.
* Adding a loss = its section in ``agentenv.core.config.LossConfig`` (the config is the layer below: it cannot import
  this module) + one registered function here + a preset variant (``algo: {loss: {type: NAME}}``).
  tests/test_learner.py holds the union's members and this registry equal.

The objectives themselves (the math, hand-checked in tests) live in :mod:`agentenv.trainer.objectives`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from torch import Tensor

from agentenv.core.config import FlashReinforceLoss, GRPOLoss, LossSection

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
    section: type[LossSection]  # the loss's options; its `type` literal is the loss's name
    compute: Callable[[LossInputs, LossSection], LossResult]
    prepare: Callable[[Batch], dict[str, Tensor]] | None = None
    needs_entropy: Callable[[LossSection], bool] = lambda options: False

    @property
    def name(self) -> str:
        return loss_name(self.section)


LOSSES: dict[str, LossSpec] = {}


def loss_name(section: type[LossSection]) -> str:
    name = section.model_fields["type"].default
    if not isinstance(name, str):
        raise TypeError(f"{section.__name__}.type must default to the loss's name (a Literal), got {name!r}")
    return name


def register_loss(section: type[LossSection], *, prepare=None, needs_entropy=None):
    """Decorator: register ``compute`` as the loss whose options are ``section`` (names are unique)."""
    def wrap(compute):
        name = loss_name(section)
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = LossSpec(section, compute, prepare, needs_entropy or (lambda options: False))
        return compute
    return wrap


def get_loss(options: LossSection) -> LossSpec:
    """The registered loss for an options section (its ``type``), checking the section is the registered class."""
    spec = LOSSES.get(getattr(options, "type", None))
    if spec is None or not isinstance(options, spec.section):
        raise ValueError(f"loss must be an options section of one of {sorted(LOSSES)}, got {options!r}")
    return spec


@register_loss(FlashReinforceLoss, needs_entropy=lambda o: o.negative_token_fraction < 1.0)
def flashreinforce(inp: LossInputs, o: FlashReinforceLoss) -> LossResult:
    filtering = o.negative_token_fraction < 1.0
    loss, st = flashreinforce_loss(
        inp.log_probs, inp.behavior_log_probs, inp.rewards, inp.action_mask,
        delta=math.inf if o.no_trust else o.delta, negative_token_fraction=o.negative_token_fraction,
        entropies=inp.entropies if filtering else None, failures=inp.failures if filtering else None,
        no_is=o.no_is, token_mean=o.token_mean, constant_length=o.constant_length, full_batch=inp.full_batch,
    )
    rows = {k: st[k] for k in ("advantages", "policy_tokens", "retained_tokens", "seq_kl", "admitted")}
    return _result(loss, rows, st)


@register_loss(GRPOLoss, prepare=lambda batch: {"advantages": group_advantages(batch.rewards, batch.group_ids)})
def grpo(inp: LossInputs, o: GRPOLoss) -> LossResult:
    loss, st = grpo_loss(inp.log_probs, inp.behavior_log_probs, inp.extra["advantages"], inp.action_mask,
                         clip_eps=o.clip_eps, num_policy_tokens=inp.full_batch.num_policy_tokens)
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
