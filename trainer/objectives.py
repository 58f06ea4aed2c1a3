"""The FlashREINFORCE objective, its ablations, and a GRPO baseline loss.

Contract of :func:`flashreinforce_loss` (one call sees one complete batch, or one micro-batch of it together with a
:class:`FullBatch` that carries the whole batch's totals):

* Inputs are ``[B, T]`` rows of whole trajectories (every turn included), a boolean ``action_mask`` that is True on
  policy-sampled tokens, ``rewards`` ``[B]``. Slots where ``action_mask`` is False may hold anything (NaN, inf,
  garbage): they are replaced by zeros before any arithmetic, so they never reach the loss or the gradient.
* ``A_i = R_i - mean(R)`` over the whole batch, before admission; detached.
* Sequence gate: with ``p = mu`` (behavior) and ``q = pi_theta`` (current) probabilities of the sampled token, both
  clamped to ``[1e-6, 1 - 1e-6]``, ``d = p log(p/q) + (1-p) log((1-p)/(1-q))``; ``D_i`` is its mean over the row's
  policy tokens, clamped at >= 0 and computed in float64; the row is admitted iff ``D_i <= delta``.
* Optional failure filter (``negative_token_fraction = q < 1``): a row with ``failures[i] = True`` keeps only its
  ``ceil(q * T_i)`` highest-entropy policy tokens (ties go to the earlier position). ``q`` is read as the decimal the
  caller wrote (``0.7 * 10`` keeps 7 tokens, not 8). The advantage sign plays no part; successes keep every token.
  Which rows are "failed" is the caller's decision; the :class:`~agentenv.trainer.learner.Learner` flags
  ``Trajectory.success == False`` unless configured with a reward threshold.
* ``rho = exp(clamp(log pi - log mu, -30, 30))`` is detached and evaluated only on tokens that survive the gate and
  the filter; the log-ratio is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before exponentiation, as the
  reference implementation does (a numerical guard: ``exp(30)`` is finite in float32). Non-finite log-probs on policy
  tokens are an input error (``ValueError``), never clamped.
* ``loss = -(1/B) sum_i (1/T_i) sum_t w_it log pi_it`` with ``w = m_i A_i rho`` on kept tokens, where ``B`` and
  ``T_i`` are the ORIGINAL batch size and policy-token count. Its gradient is exactly -g_hat of the paper.
* Half precision inputs are promoted to float32 before exponentiation; float64 stays float64.
* Stats are detached tensors.

Ablations (the paper's names; ablations only, not recommended settings): ``no_trust`` is ``delta=inf``;
``no_is=True`` is the paper's "no IS": the ratio's denominator is the detached CURRENT policy (``rho == 1``) and the
gate compares the current policy with itself (``D == 0``), so it admits every row ("removes both IS and trust");
``seq_kl`` still reports the measured KL(mu || pi). ``token_mean=True`` replaces ``1/(B T_i)`` by ``1/sum_j T_j``;
``constant_length=L`` replaces it by ``1/(B L)`` (each trajectory's token sum normalised by a constant). The GRPO
baseline is :func:`group_advantages` (group mean, no std normalisation) + :func:`grpo_loss` (PPO-clipped token mean).
The uniform interface the learner uses (typed results, a registry by name) is :mod:`agentenv.trainer.losses`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import torch
from torch import Tensor

PROB_CLAMP = 1e-6  # p and q of the Bernoulli KL are clamped to [PROB_CLAMP, 1 - PROB_CLAMP]
LOG_RATIO_CLAMP = 30.0  # log(pi / mu) is clamped to [-30, 30] before exp, as in the reference implementation


@dataclass(frozen=True)
class FullBatch:
    """Whole-batch totals. A micro-batch passes these so its loss is exactly its share of the full-batch loss."""

    num_trajectories: int  # B, the original batch size
    reward_mean: float  # mean(R) over the whole batch (float64)
    num_policy_tokens: int  # sum_i T_i over the whole batch (the token-mean denominator)

    @classmethod
    def of(cls, rewards: Tensor, action_mask: Tensor) -> "FullBatch":
        return cls(int(rewards.shape[0]), exact_mean(rewards), int(action_mask.sum()))


def exact_mean(x: Tensor) -> float:
    """Mean in float64, shifted by the first element so that identical values give exactly that value back
    (homogeneous rewards then have advantages of exactly 0, hence exactly zero gradient)."""
    x = x.detach().double()
    return float(x[0] + (x - x[0]).mean())


def flashreinforce_loss(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    rewards: Tensor,
    action_mask: Tensor,
    *,
    delta: float = 1e-3,
    negative_token_fraction: float = 1.0,
    entropies: Tensor | None = None,
    failures: Tensor | None = None,
    no_is: bool = False,
    token_mean: bool = False,
    constant_length: int | None = None,
    full_batch: FullBatch | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """FlashREINFORCE loss on a batch (see the module docstring for every rule). Returns ``(loss, stats)``."""
    q = negative_token_fraction
    _check_rows(log_probs, behavior_log_probs, rewards, action_mask, per_row_name="rewards")
    _check_options(delta=delta, q=q, token_mean=token_mean, constant_length=constant_length)
    _check_filter_inputs(log_probs, action_mask, q=q, entropies=entropies, failures=failures)
    _check_full_batch(full_batch, rows=log_probs.shape[0])
    full = full_batch if full_batch is not None else FullBatch.of(rewards, action_mask)
    mask = action_mask
    dtype = torch.float64 if log_probs.dtype == torch.float64 else torch.float32  # half -> float32 before exp
    # torch.where (not multiplication) so NaN/inf in non-policy slots cannot poison values or gradients.
    logp = torch.where(mask, log_probs.to(dtype), 0.0)

    with torch.no_grad():
        behavior = torch.where(mask, behavior_log_probs.to(dtype), 0.0)
        policy_tokens = mask.sum(dim=1)  # T_i, before the gate or the filter remove anything
        advantages = (rewards.double() - full.reward_mean).to(dtype)
        seq_kl = sequence_kl(logp.detach(), behavior, mask)  # measured KL(mu || pi), reported in every mode
        # no_is: the gate compares pi with itself (D = 0), so it admits every row
        admitted = torch.ones_like(seq_kl, dtype=torch.bool) if no_is else seq_kl <= delta  # D = delta admits
        keep = mask & admitted[:, None]
        if q < 1.0:
            keep &= ~failures[:, None] | top_entropy_mask(entropies, mask, q)
        if no_is:
            ratio = keep.to(dtype)  # pi / stopgrad(pi): value 1, gradient of log pi
        else:
            log_ratio = torch.where(keep, logp.detach() - behavior, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            ratio = torch.where(keep, torch.exp(log_ratio), 0.0)
        if token_mean:
            denom = torch.full_like(advantages, float(full.num_policy_tokens))
        elif constant_length is not None:
            denom = torch.full_like(advantages, float(full.num_trajectories * constant_length))
        else:
            denom = full.num_trajectories * policy_tokens.to(dtype)  # B * T_i: original sizes
        weights = advantages[:, None] * ratio / denom[:, None]  # zero wherever a token was not kept

    loss = -(weights * logp).sum()

    retained = keep.sum(dim=1)
    kept_ratios = ratio[keep]
    nan = torch.tensor(float("nan"), dtype=dtype, device=ratio.device)
    stats = {
        "loss": loss.detach(),
        "advantages": advantages,
        "seq_kl": seq_kl,
        "admitted": admitted,
        "acceptance_rate": admitted.double().mean(),
        "policy_tokens": policy_tokens,
        "retained_tokens": retained,
        "ratio_mean": kept_ratios.mean() if kept_ratios.numel() else nan,
        "ratio_max": kept_ratios.max() if kept_ratios.numel() else nan,
        "ratio_min": kept_ratios.min() if kept_ratios.numel() else nan,
    }
    if entropies is not None:
        stats["entropy_mean"] = torch.where(mask, entropies.detach().double(), 0.0).sum() / mask.sum()
    return loss, stats


def sequence_kl(log_probs: Tensor, behavior_log_probs: Tensor, action_mask: Tensor) -> Tensor:
    """Per-row mean over policy tokens of the sampled-token Bernoulli KL(mu || pi), in float64, clamped >= 0.
    Inputs must already be finite everywhere (non-policy slots zeroed)."""
    p = behavior_log_probs.detach().double().exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    q = log_probs.detach().double().exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    d = p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))
    d = torch.where(action_mask, d, 0.0)
    # a sequential row sum (cumsum's last column), not sum(): a vectorised sum's order depends on the row width, so
    # padding a batch with masked columns could move D by an ulp and flip a gate decision at D == delta
    return (d.cumsum(dim=1)[:, -1] / action_mask.sum(dim=1)).clamp_min(0.0)


def top_entropy_mask(entropies: Tensor, action_mask: Tensor, fraction: float) -> Tensor:
    """True on each row's ``ceil(fraction * T_i)`` highest-entropy policy tokens; ties go to the earlier position."""
    frac = Fraction(repr(float(fraction)))  # the decimal the caller wrote: avoids 0.7 * 10 -> ceil(7.000...1) = 8
    keep_counts = [math.ceil(frac * t) for t in action_mask.sum(dim=1).tolist()]
    k = torch.tensor(keep_counts, device=action_mask.device)
    ent = torch.where(action_mask, entropies.detach().double(), -math.inf)  # non-policy slots sort last
    order = torch.sort(ent, dim=1, descending=True, stable=True).indices  # stable: equal entropies keep position order
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(ent.shape[1], device=ent.device).expand_as(order))
    return action_mask & (rank < k[:, None])


def _check_rows(log_probs: Tensor, behavior_log_probs: Tensor, per_row: Tensor, action_mask: Tensor, *,
                per_row_name: str = "rewards") -> None:
    """Shapes, dtypes and finiteness of the tensors every loss takes: ``[B, T]`` log-probs and mask, ``[B]`` rows."""
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [B, T], got shape {tuple(log_probs.shape)}")
    shape = tuple(log_probs.shape)
    if shape[0] == 0:
        raise ValueError("empty batch: log_probs has no rows")
    for name, t in (("behavior_log_probs", behavior_log_probs), ("action_mask", action_mask)):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but log_probs has {shape}")
    if tuple(per_row.shape) != shape[:1]:
        raise ValueError(f"{per_row_name} must have shape ({shape[0]},), got {tuple(per_row.shape)}")
    if action_mask.dtype != torch.bool:
        raise ValueError(f"action_mask must be a boolean tensor, got {action_mask.dtype}")
    if not (log_probs.is_floating_point() and behavior_log_probs.is_floating_point()):
        raise ValueError("log_probs and behavior_log_probs must be floating-point tensors")
    empty = (~action_mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} have no policy token (action_mask all False)")
    if not bool(torch.isfinite(per_row.double()).all()):
        raise ValueError(f"{per_row_name} must be finite, got {per_row.tolist()}")
    for name, t in (("log_probs", log_probs), ("behavior_log_probs", behavior_log_probs)):
        v = t.detach()[action_mask]
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"{name} has non-finite values on policy tokens")
        if bool((v > 0).any()):
            raise ValueError(f"{name} has positive values on policy tokens (max {v.max().item()}); log-probs are <= 0")


def _check_options(*, delta: float, q: float, token_mean: bool, constant_length: int | None) -> None:
    if not isinstance(delta, (int, float)) or math.isnan(delta) or delta < 0:
        raise ValueError(f"delta must be >= 0 (inf turns the gate off), got {delta}")
    if not isinstance(q, (int, float)) or not (0.0 <= q <= 1.0):
        raise ValueError(f"negative_token_fraction must be in [0, 1], got {q}")
    if constant_length is not None:
        if isinstance(constant_length, bool) or not isinstance(constant_length, int) or constant_length < 1:
            raise ValueError(f"constant_length must be a positive int (or None), got {constant_length!r}")
        if token_mean:
            raise ValueError("token_mean and constant_length are two different normalisations: choose one")


def _check_filter_inputs(log_probs: Tensor, action_mask: Tensor, *, q: float, entropies: Tensor | None,
                         failures: Tensor | None) -> None:
    shape = tuple(log_probs.shape)
    if q < 1.0 and (entropies is None or failures is None):
        raise ValueError("negative_token_fraction < 1 filters failed rows by entropy: pass entropies and failures")
    if entropies is not None:
        if tuple(entropies.shape) != shape:
            raise ValueError(f"entropies has shape {tuple(entropies.shape)} but log_probs has {shape}")
        if not bool(torch.isfinite(entropies.detach()[action_mask]).all()):
            raise ValueError("entropies has non-finite values on policy tokens")
    if failures is not None and (failures.dtype != torch.bool or tuple(failures.shape) != shape[:1]):
        raise ValueError(f"failures must be a boolean tensor of shape ({shape[0]},), got {failures.dtype} "
                         f"{tuple(failures.shape)}")


def _check_full_batch(full_batch: FullBatch | None, *, rows: int) -> None:
    if full_batch is not None and (full_batch.num_trajectories < rows or full_batch.num_policy_tokens < 1):
        raise ValueError(f"full_batch {full_batch} cannot contain this {rows}-row micro-batch")


# --- GRPO baseline (for side-by-side comparisons) -----------------------------------------------------------------


def group_advantages(rewards: Tensor, group_ids: Sequence) -> Tensor:
    """A_i = R_i - mean of R over the rows sharing i's group id (G samples of one prompt). No std normalisation."""
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"{len(group_ids)} group ids for {rewards.shape[0]} rewards")
    if not bool(torch.isfinite(rewards.double()).all()):
        raise ValueError(f"rewards must be finite, got {rewards.tolist()}")
    out = torch.empty(rewards.shape[0], dtype=torch.float64, device=rewards.device)
    rows: dict = {}
    for i, g in enumerate(group_ids):
        rows.setdefault(g, []).append(i)
    for idx in rows.values():
        r = rewards.detach().double()[idx]
        out[idx] = r - exact_mean(r)
    return out


def grpo_loss(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    num_policy_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clipped token-mean loss with the behavior policy as the old policy:
    ``-(1/N) sum min(rho A, clip(rho, 1-eps, 1+eps) A)``, ``rho`` NOT detached. ``N`` defaults to this call's
    policy-token count; pass the whole batch's when this call sees one micro-batch."""
    _check_rows(log_probs, behavior_log_probs, advantages, action_mask, per_row_name="advantages")
    if not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    mask = action_mask
    dtype = torch.float64 if log_probs.dtype == torch.float64 else torch.float32
    logp = torch.where(mask, log_probs.to(dtype), 0.0)
    behavior = torch.where(mask, behavior_log_probs.detach().to(dtype), 0.0)
    adv = advantages.detach().to(dtype)[:, None]
    ratio = torch.exp(logp - behavior)
    if not bool(torch.isfinite(ratio.detach()).all()):
        raise FloatingPointError("importance ratio overflowed on a policy token (log pi - log mu too large)")
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    n = num_policy_tokens if num_policy_tokens is not None else int(mask.sum())
    loss = -torch.where(mask, surrogate, 0.0).sum() / n
    with torch.no_grad():
        r = ratio[mask]
        clipped = (surrogate < ratio * adv)[mask].double().mean()  # tokens whose objective the clip flattened
    stats = {
        "loss": loss.detach(),
        "advantages": advantages.detach(),
        "policy_tokens": mask.sum(dim=1),
        "retained_tokens": mask.sum(dim=1),
        "clip_fraction": clipped,
        "ratio_mean": r.mean().detach(),
        "ratio_max": r.max().detach(),
        "ratio_min": r.min().detach(),
    }
    return loss, stats
