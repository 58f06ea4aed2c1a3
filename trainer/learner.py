"""The learner: one optimizer step per fresh batch of completed trajectories.

Contract of :meth:`Learner.update`:

1. Refuse a trajectory seen before (by this learner, across checkpoints) or twice in the batch: ``ValueError``.
   A trajectory's key is its ``id``, or a content hash when ``id`` is empty.
2. Collate (:func:`~agentenv.trainer.batch.collate`), take the whole-batch totals, split into length-bucketed
   micro-batches (``max_tokens_per_microbatch``), and per micro-batch: chunked current log-probs (entropies when the
   failure filter is on or ``compute_entropy``), the loss with the whole-batch totals, ``backward()``. The summed
   gradients equal the full-batch loss's gradient.
3. Clip the grad norm (a non-finite norm raises and nothing is stepped), set the lr from the schedule, take ONE AdamW
   step, bump ``step`` and ``policy_version``, record the batch as consumed, and return float/int stats (plus
   ``admitted``: one bool per trajectory, in input order).

bf16 autocast is used on CUDA (``autocast="auto"``), float32 on CPU. ``gradient_checkpointing`` turns on the HF
model's activation checkpointing. Weights for rollout workers: :meth:`export_weights` (a CPU copy of the state dict)
or :meth:`named_weights` (a no-copy iterator); ``policy_version`` is the version the CURRENT weights carry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

import torch
from torch import Tensor

from agentenv.trajectory import Trajectory

from . import checkpoint as ckpt
from .batch import collate, microbatches
from .logprobs import DEFAULT_CHUNK, token_log_probs
from .loss import flashreinforce_loss, group_advantages, grpo_loss
from .schedule import Schedule

LOSSES = ("flashreinforce", "grpo")


@dataclass
class LearnerConfig:
    # optimizer
    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    # schedule (see schedule.py)
    schedule: str = "constant"  # "constant" | "cosine"
    total_steps: int | None = None  # needed by "cosine"
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1
    # objective
    loss: str = "flashreinforce"  # "flashreinforce" | "grpo" (baseline)
    delta: float = 3e-3  # sequence trust threshold on the mean sampled-token Bernoulli KL
    no_trust: bool = False  # ablation: delta = inf
    no_is: bool = False  # ablation: importance ratio's denominator = detached current policy
    token_mean: bool = False  # ablation: 1 / sum_j T_j instead of 1 / (B T_i)
    negative_token_fraction: float = 1.0  # < 1 keeps only the top-entropy fraction of a failed row's tokens
    failure_threshold: float | None = None  # failed = reward < this; None: failed = not success
    grpo_clip_eps: float = 0.2
    # compute
    temperature: float = 1.0  # divide logits by this: must match the sampler's temperature
    max_tokens_per_microbatch: int | None = None  # padded rows x width per forward; None = whole batch at once
    logprob_chunk_size: int = DEFAULT_CHUNK
    compute_entropy: bool = False  # report entropy_mean even when the filter does not need it
    gradient_checkpointing: bool = False
    autocast: str = "auto"  # "auto" (bf16 on CUDA, none on CPU) | "bf16" | "none"
    pad_token_id: int | None = None  # None: model.config.pad_token_id, else 0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.autocast not in ("auto", "bf16", "none"):
            raise ValueError(f"autocast must be auto, bf16 or none, got {self.autocast!r}")
        if not self.lr > 0 or self.weight_decay < 0 or not self.max_grad_norm > 0:
            raise ValueError("need lr > 0, weight_decay >= 0, max_grad_norm > 0")
        self.betas = tuple(self.betas)
        self.lr_schedule()  # validates the schedule fields

    def lr_schedule(self) -> Schedule:
        return Schedule(self.schedule, self.total_steps, self.warmup_ratio, self.min_lr_ratio)


def trajectory_key(traj: Trajectory) -> str:
    """Identity used to refuse reuse: the id, or (no id) a hash of what the update would consume."""
    if traj.id:
        return traj.id
    content = json.dumps([traj.token_ids, traj.action_mask, traj.behavior_logprobs, traj.reward, traj.task])
    return "sha256:" + hashlib.sha256(content.encode()).hexdigest()


class Learner:
    def __init__(self, model: torch.nn.Module, config: LearnerConfig | None = None, *, device=None,
                 policy_version: int = 0):
        self.config = cfg = config or LearnerConfig()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
        )
        self.schedule = cfg.lr_schedule()
        self.step = 0  # optimizer steps taken
        self.policy_version = policy_version  # version of the current weights; +1 per update
        self.consumed: set[str] = set()
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else getattr(model.config, "pad_token_id", None)
        self.pad_token_id = 0 if pad is None else int(pad)

    # --- the update -----------------------------------------------------------------------------------------------
    def update(self, trajectories: Sequence[Trajectory]) -> dict:
        t0 = time.perf_counter()
        cfg = self.config
        keys = [trajectory_key(t) for t in trajectories]
        self._check_fresh(keys)
        for t in trajectories:  # pi_theta must be evaluated at the temperature mu was sampled at, or rho is biased
            temp = (t.sampling or {}).get("temperature")
            if isinstance(temp, (int, float)) and temp > 0 and not math.isclose(temp, cfg.temperature):
                raise ValueError(f"trajectory {t.id!r} was sampled at temperature {temp} but the learner evaluates "
                                 f"log-probs at LearnerConfig.temperature={cfg.temperature}")
        batch = collate(trajectories, pad_token_id=self.pad_token_id, failure_threshold=cfg.failure_threshold)
        full = batch.full_batch()
        filtering = cfg.loss == "flashreinforce" and cfg.negative_token_fraction < 1.0
        with_entropy = filtering or cfg.compute_entropy
        grpo_adv = group_advantages(batch.rewards, batch.group_ids) if cfg.loss == "grpo" else None

        was_training = self.model.training
        self.model.train()  # HF only checkpoints activations in train mode; Qwen2 has no dropout to worry about
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for rows, mb in microbatches(batch, cfg.max_tokens_per_microbatch):
            mb = mb.to(self.device)
            with self._autocast():
                logp, ent = token_log_probs(
                    self.model, mb.input_ids, mb.attention_mask, mb.action_mask,
                    chunk_size=cfg.logprob_chunk_size, temperature=cfg.temperature, with_entropy=with_entropy,
                )
            if cfg.loss == "grpo":
                loss, st = grpo_loss(logp, mb.behavior_log_probs, grpo_adv[rows].to(self.device), mb.action_mask,
                                     clip_eps=cfg.grpo_clip_eps, num_policy_tokens=full.num_policy_tokens)
            else:
                loss, st = flashreinforce_loss(
                    logp, mb.behavior_log_probs, mb.rewards, mb.action_mask,
                    delta=math.inf if cfg.no_trust else cfg.delta,
                    negative_token_fraction=cfg.negative_token_fraction,
                    entropies=ent, failures=mb.failures if filtering else None,
                    no_is=cfg.no_is, token_mean=cfg.token_mean, full_batch=full,
                )
            if ent is not None and "entropy_mean" not in st:
                st["entropy_mean"] = ent.detach()[mb.action_mask].double().mean()
            loss.backward()
            parts.append((rows, st))
        self.model.train(was_training)

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, error_if_nonfinite=True)
        lr = cfg.lr * self.schedule(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # A batch with no signal (every row rejected by the gate, or all advantages zero) has gradient exactly 0.
        # The estimator's step is then a no-op; AdamW's is not (momentum and weight decay would keep moving the
        # policy while the gate rejects everything, which drifts it further from the behaviour policy: a collapse
        # seen in the CPU demo). So such a batch is consumed and counted, but the optimizer is left untouched.
        skipped = float(grad_norm) == 0.0
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # free gradient memory between updates
        self.step += 1
        self.policy_version += 1
        self.consumed.update(keys)  # only after the step: a failed update may be retried with the same batch

        stats = _merge_stats(parts, len(batch))
        stats.update(self._lag_stats(trajectories))
        stats.update(
            reward_mean=float(batch.rewards.mean()),
            grad_norm=float(grad_norm),
            optimizer_step_skipped=int(skipped),
            lr=lr,
            step=self.step,
            policy_version=self.policy_version,
            num_trajectories=len(batch),
            num_microbatches=len(parts),
            learner_time_s=time.perf_counter() - t0,
        )
        return stats

    def _check_fresh(self, keys: list[str]) -> None:
        if not keys:
            raise ValueError("update() needs at least one trajectory")
        seen, dups = set(), []
        for k in keys:
            if k in self.consumed or k in seen:
                dups.append(k)
            seen.add(k)
        if dups:
            raise ValueError(f"trajectories {dups[:5]} were already used for an update (or repeat in this batch); "
                             "FlashREINFORCE takes one step per FRESH batch and discards it")

    def _autocast(self):
        mode = self.config.autocast
        if mode == "bf16" or (mode == "auto" and self.device.type == "cuda"):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _lag_stats(self, trajectories) -> dict:
        lags = [self.policy_version - 1 - v for t in trajectories for v in t.versions]  # vs the weights just updated
        return {"policy_lag_mean": sum(lags) / len(lags), "policy_lag_max": max(lags)} if lags else {}

    # --- weights for rollout workers ------------------------------------------------------------------------------
    def export_weights(self, device="cpu") -> dict[str, Tensor]:
        """A detached copy of the state dict (tied tensors stay shared in the copy)."""
        copies: dict = {}
        out = {}
        for name, t in self.model.state_dict().items():
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if key not in copies:
                copies[key] = t.detach().to(device, copy=True)
            out[name] = copies[key]
        return out

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, tensor)`` over the parameters without copying (tied weights appear once); do not modify them."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    # --- checkpointing --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "policy_version": self.policy_version,
            "consumed": sorted(self.consumed),
            "schedule": asdict(self.schedule),
            "config": json.dumps(asdict(self.config)),
            "rng": ckpt.rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.policy_version = int(state["policy_version"])
        self.consumed = set(state["consumed"])
        ckpt.set_rng_state(state["rng"])

    def save(self, path) -> None:
        """Atomically write a checkpoint file (temp file + rename)."""
        ckpt.atomic_save(self.state_dict(), path)

    def load(self, path) -> None:
        """Restore from :meth:`save`'s file into this learner (built with the same model architecture)."""
        self.load_state_dict(ckpt.load(path, map_location=self.device))


def _merge_stats(parts: list[tuple[list[int], dict]], batch_size: int) -> dict:
    """Per-row stats back in batch order, then batch-level floats for a metrics logger."""
    def rows_of(key, dtype=torch.float64):
        out = torch.zeros(batch_size, dtype=dtype)
        for rows, st in parts:
            out[rows] = st[key].detach().cpu().to(dtype)
        return out

    adv = rows_of("advantages")
    policy, retained = rows_of("policy_tokens", torch.long), rows_of("retained_tokens", torch.long)
    stats = {
        "loss": sum(float(st["loss"]) for _, st in parts),
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std(unbiased=False)),
        "policy_tokens": int(policy.sum()),
        "retained_tokens": int(retained.sum()),
    }
    if "seq_kl" in parts[0][1]:
        kl, admitted = rows_of("seq_kl"), rows_of("admitted", torch.bool)
        stats.update(acceptance_rate=float(admitted.double().mean()), num_admitted=int(admitted.sum()),
                     seq_kl_mean=float(kl.mean()), seq_kl_max=float(kl.max()),
                     admitted=admitted.tolist())  # per trajectory, in the order given: the loop labels rejections
    # ratio stats are over retained tokens: weight each micro-batch's mean by its retained count
    counts = [int(st["retained_tokens"].sum()) for _, st in parts]
    live = [(n, st) for n, (_, st) in zip(counts, parts) if n > 0]
    if live:
        stats["ratio_mean"] = sum(n * float(st["ratio_mean"]) for n, st in live) / sum(n for n, _ in live)
        stats["ratio_max"] = max(float(st["ratio_max"]) for _, st in live)
        stats["ratio_min"] = min(float(st["ratio_min"]) for _, st in live)
    else:
        stats.update(ratio_mean=math.nan, ratio_max=math.nan, ratio_min=math.nan)
    if "clip_fraction" in parts[0][1]:
        stats["clip_fraction"] = sum(n * float(st["clip_fraction"]) for n, (_, st) in zip(counts, parts)) / sum(counts)
    if "entropy_mean" in parts[0][1]:
        n_pol = [int(st["policy_tokens"].sum()) for _, st in parts]
        stats["entropy_mean"] = sum(n * float(st["entropy_mean"]) for n, (_, st) in zip(n_pol, parts)) / sum(n_pol)
    return stats


# --- interim single-device factory (replaced by the sharded learner's factory) ------------------------------------
def make_learner(cfg, model_path: str, device: str | None = None) -> "Learner":
    from transformers import AutoModelForCausalLM

    a = cfg.algo
    if cfg.launch.learner_world_size > 1:
        raise ValueError("launch.learner_world_size > 1 is not available in this build")
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    lc = LearnerConfig(lr=a.lr, weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm, schedule=a.schedule,
                       total_steps=cfg.loop.total_updates, warmup_ratio=a.warmup_ratio, min_lr_ratio=a.min_lr_ratio,
                       loss=a.loss, delta=a.delta, no_trust=a.no_trust, no_is=a.no_is, token_mean=a.token_mean,
                       negative_token_fraction=a.negative_token_fraction, grpo_clip_eps=a.grpo_clip_eps,
                       temperature=cfg.rollout.temperature, max_tokens_per_microbatch=a.max_tokens_per_microbatch,
                       gradient_checkpointing=cfg.model.gradient_checkpointing, compute_entropy=True)
    learner = Learner(model, lc, device=device)
    learner.model_path = model_path
    return learner


def _save_pretrained(self, out, tokenizer_from: str | None = None):
    from pathlib import Path

    from transformers import AutoTokenizer

    out = Path(out)
    self.model.save_pretrained(out)
    if tokenizer_from:
        AutoTokenizer.from_pretrained(tokenizer_from, local_files_only=True).save_pretrained(out)
    return out


Learner.save_pretrained = _save_pretrained
Learner.components = lambda self: {"strategy": "single", "world_size": 1, "master_dtype": "float32",
                                   "compute_dtype": "float32"}
Learner.close = lambda self: None
