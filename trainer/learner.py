"""The learner: one optimizer step per fresh batch of completed trajectories, on one device or as one FSDP2 rank.

Contract of :meth:`Learner.update`:

1. Refuse a trajectory seen before (by this learner, across checkpoints) or twice in the batch: ``ValueError``.
   A trajectory's key is its ``id``, or a content hash when ``id`` is empty. Refuse a trajectory sampled at another
   temperature than ``LearnerConfig.temperature`` (pi must be evaluated as mu was).
2. Collate (:func:`~agentenv.trainer.batch.collate`), take the whole-batch totals and the loss's whole-batch
   preparation (:mod:`~agentenv.trainer.losses`; ``permute_rewards``: the rewards shuffled among the rows first,
   the permuted-reward control), split into length-bucketed micro-batches
   (``max_tokens_per_microbatch``), and per micro-batch: chunked current log-probs (with the model's final-logit
   processing; entropies when the loss needs them or ``compute_entropy``), the registered loss with the whole-batch
   totals, ``backward()``. The summed gradients equal the full-batch loss's gradient.
3. Clip the grad norm (a non-finite norm raises and nothing is stepped), set the lr from the schedule, take ONE AdamW
   step, record the batch as consumed, and return float/int stats (plus ``admitted``: one bool per trajectory, in
   input order).

``step`` counts updates (batches consumed; it also indexes the lr schedule). ``policy_version`` names the WEIGHTS: it
is bumped only when the optimizer actually stepped. A batch with no signal (every row rejected, or every advantage
zero) has gradient exactly 0 and is consumed without an optimizer step (stats ``optimizer_step_skipped=1``), so the
weights -- and their version -- stay as they were. A trajectory's lag is ``policy_version - v`` for each of its
token versions ``v``, where ``policy_version`` is the version of the weights the gradient was computed at (before
this update), so lag 0 means "sampled by exactly these weights".

Precision: master weights and AdamW state are float32 whatever dtype the model arrived in. The COMPUTE dtype is
``autocast``: ``"bf16"`` (bf16 autocast; sharded: FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``), ``"none"`` (float32), or ``"auto"`` (bf16 on CUDA, float32 on CPU). :meth:`export_weights`
hands samplers the weights in the compute dtype.

Sharding: with ``shard=True`` (inside an initialised process group; see :mod:`~agentenv.trainer.distributed`, which
also gives the driver one object over W such ranks) the model is FSDP2-sharded (it may arrive on the meta device,
with rank 0 passing the weights as ``rank0_weights``: they are broadcast into the shards), every rank collates the whole
batch (global totals), processes the rows ``rank::world``, and runs the SAME micro-batch / loss / step code; the ranks
run equally many forward passes (a rank with fewer micro-batches repeats one with zero weight) and the per-row stats
are gathered so every rank returns the same stats. FSDP2 averages gradients, so each rank backpropagates
``world x`` its share.

Tail averaging (``average_last_updates`` = N > 0; :mod:`~agentenv.trainer.averaging`): the weights after each of the
last N of ``total_steps`` updates go into a running mean that :meth:`use_average` swaps in at the run's end.

Truncated sampling: ``sampling_truncated_fraction`` is the share of the batch sampled with top-k or top-p < 1 (mu is
then not the distribution pi is evaluated under); when at least half the lag-0 trajectories are rejected by the gate a
warning is logged (see :func:`agentenv.trainer.preflight.lag0_trust_check` to refuse such settings up front).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch import Tensor

from agentenv.core.config import AlgoConfig, FlashReinforceLoss, LossSection
from agentenv.core.trajectory import Trajectory

from . import checkpoint as ckpt
from .averaging import WeightAverage
from .batch import Batch, collate, microbatches, permute_rewards, trajectory_stats
from .logprobs import DEFAULT_CHUNK, TokenLogProbs
from .losses import LOSSES, LossInputs, LossResult, get_loss, merge_results
from .schedule import Schedule
from .sharding import max_over_ranks, rank_rows

log = logging.getLogger(__name__)


@dataclass
class LearnerConfig:
    """The learner's optimizer and compute settings; the loss and its options are ONE typed section (``loss``, the
    config's ``algo.loss``: :mod:`~agentenv.trainer.losses`). Every field shared with
    :class:`agentenv.core.config.AlgoConfig` has the SAME default (a test holds them equal); build one from a run
    config with :func:`learner_config_from`."""

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
    # objective: a registered loss's options section (a name or a mapping is validated into one: "grpo",
    # {"type": "flashreinforce", "no_trust": True})
    loss: LossSection | str | dict = field(default_factory=FlashReinforceLoss)
    failure_threshold: float | None = None  # failed = reward < this; None: failed = not success
    permute_rewards: bool = False  # the control: rewards shuffled among each batch's rows (batch.permute_rewards)
    permute_seed: int = 0  # with the update's step, seeds that shuffle (the run's loop.seed)
    # tail averaging (see use_average): the mean of the weights after each of the last N of total_steps updates
    average_last_updates: int = 0
    # compute
    temperature: float = 1.0  # divide logits by this: must match the sampler's temperature
    max_tokens_per_microbatch: int | None = None  # padded rows x width per forward; None = whole batch at once
    logprob_chunk_size: int = DEFAULT_CHUNK
    compute_entropy: bool = False  # report entropy_mean even when the loss does not need it
    gradient_checkpointing: bool = False
    autocast: str = "auto"  # compute dtype: "auto" (bf16 on CUDA, float32 on CPU) | "bf16" | "none"
    pad_token_id: int | None = None  # None: model.config.pad_token_id, else 0

    def __post_init__(self):
        if not isinstance(self.loss, LossSection):
            try:  # the config's own rules (the union, the shorthand, each option's range)
                self.loss = AlgoConfig(loss=self.loss).loss
            except ValidationError as e:
                raise ValueError(f"loss must be one of {sorted(LOSSES)} with valid options, got {self.loss!r}: "
                                 f"{e.errors()[0]['msg']}") from None
        get_loss(self.loss)  # a clear error listing the registered losses
        if self.autocast not in ("auto", "bf16", "none"):
            raise ValueError(f"autocast must be auto, bf16 or none, got {self.autocast!r}")
        if not self.lr > 0 or self.weight_decay < 0 or not self.max_grad_norm > 0:
            raise ValueError("need lr > 0, weight_decay >= 0, max_grad_norm > 0")
        if self.average_last_updates < 0 or (self.average_last_updates and not self.total_steps):
            raise ValueError("average_last_updates needs total_steps (the window is the last N of them) and N >= 0")
        self.betas = tuple(self.betas)
        self.lr_schedule()  # validates the schedule fields

    def lr_schedule(self) -> Schedule:
        return Schedule(self.schedule, self.total_steps, self.warmup_ratio, self.min_lr_ratio)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"loss": self.loss.model_dump(mode="json")}


_COMPUTE_DTYPES = {"auto": "auto", "float32": "none", "bfloat16": "bf16"}
NOT_LEARNER_FIELDS = frozenset({"allow_truncated_sampling"})  # algo.* used before the run (lag0_trust_check)


def learner_config_from(cfg, **overrides) -> LearnerConfig:
    """THE conversion from a :class:`agentenv.core.config.RunConfig`: ``cfg.algo`` (every field LearnerConfig shares;
    ``algo.loss`` is passed as the section it is), ``cfg.rollout.temperature``, ``cfg.loop.total_updates``,
    ``cfg.model.gradient_checkpointing`` and ``cfg.model.dtype`` (the compute dtype; float16 is refused: bf16 needs
    no loss scaling, fp16 would). The one ``algo`` field that is not the learner's is :data:`NOT_LEARNER_FIELDS`
    (read by the run's preflight)."""
    if cfg.model.dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"model.dtype={cfg.model.dtype!r} is not a learner compute dtype: "
                         "use bfloat16, float32 or auto")
    own = {f.name for f in fields(LearnerConfig)}
    unknown = set(type(cfg.algo).model_fields) - own - NOT_LEARNER_FIELDS
    if unknown:  # a new algo field must be consumed here or declared as someone else's, never silently dropped
        raise ValueError(f"algo fields {sorted(unknown)} have no LearnerConfig counterpart")
    shared = {k: getattr(cfg.algo, k) for k in type(cfg.algo).model_fields if k in own}
    kw = dict(shared, temperature=cfg.rollout.temperature, total_steps=cfg.loop.total_updates,
              gradient_checkpointing=cfg.model.gradient_checkpointing, autocast=_COMPUTE_DTYPES[cfg.model.dtype],
              compute_entropy=True, permute_seed=cfg.loop.seed)
    kw.update(overrides)
    return LearnerConfig(**kw)


def trajectory_key(traj: Trajectory) -> str:
    """Identity used to refuse reuse: the id, or (no id) a hash of what the update would consume."""
    if traj.id:
        return traj.id
    content = json.dumps([traj.token_ids, traj.action_mask, traj.behavior_logprobs, traj.reward, traj.task])
    return "sha256:" + hashlib.sha256(content.encode()).hexdigest()


class Learner:
    def __init__(self, model: torch.nn.Module, config: LearnerConfig | None = None, *, device=None,
                 policy_version: int = 0, shard: bool = False, rank0_weights: dict | None = None):
        self.config = cfg = config or LearnerConfig()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        meta = next(model.parameters()).is_meta  # sharded init: the weights come from rank 0 (fsdp2_shard)
        self.model = model = model.float() if meta else model.to(device=self.device, dtype=torch.float32)  # masters
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.scorer = TokenLogProbs(model)
        self.sharded = shard
        if shard:
            from .sharding import fsdp2_shard

            fsdp2_shard(self.scorer, model, bf16=self.compute_dtype == torch.bfloat16, device=self.device,
                        rank0_weights=rank0_weights)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
        )
        self.loss_spec = get_loss(cfg.loss)
        self.schedule = cfg.lr_schedule()
        self.step = 0  # updates taken (batches consumed)
        self.policy_version = policy_version  # version of the current weights; +1 per optimizer step
        self.consumed: set[str] = set()
        self.average = WeightAverage(cfg.average_last_updates, cfg.total_steps)  # of the weights, over the window
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else getattr(model.config, "pad_token_id", None)
        self.pad_token_id = 0 if pad is None else int(pad)

    @property
    def rank_world(self) -> tuple[int, int]:
        return (dist.get_rank(), dist.get_world_size()) if self.sharded else (0, 1)

    @property
    def compute_dtype(self) -> torch.dtype:
        mode = self.config.autocast
        return torch.bfloat16 if mode == "bf16" or (mode == "auto" and self.device.type == "cuda") else torch.float32

    def components(self) -> dict:
        return {"strategy": "fsdp2" if self.sharded else "single", "world_size": self.rank_world[1],
                "master_dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                "compute_dtype": str(self.compute_dtype).removeprefix("torch.")}

    # --- the update -----------------------------------------------------------------------------------------------
    def update(self, trajectories: Sequence[Trajectory]) -> dict:
        t0 = time.perf_counter()
        cfg = self.config
        keys = [trajectory_key(t) for t in trajectories]
        self._check_fresh(keys)
        self._check_temperature(trajectories)
        batch = collate(trajectories, pad_token_id=self.pad_token_id, failure_threshold=cfg.failure_threshold)
        if cfg.permute_rewards:  # before the loss sees them: advantages from rewards unlinked to the behaviour
            batch = permute_rewards(batch, cfg.permute_seed, self.step)
        parts = self._backward(batch)

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, error_if_nonfinite=True)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        lr = cfg.lr * self.schedule(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # A batch with no signal (every row rejected by the gate, or all advantages zero) has gradient exactly 0.
        # The estimator's step is then a no-op; AdamW's is not (momentum and weight decay would keep moving the
        # policy while the gate rejects everything, which drifts it further from the behaviour policy: a collapse
        # seen in the CPU demo). So such a batch is consumed and counted, but the optimizer is left untouched.
        skipped = grad_norm == 0.0
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # free gradient memory between updates
        stats = merge_results(parts, len(batch))
        stats.update(trajectory_stats(trajectories, stats.get("admitted"), self.policy_version))
        self._warn_on_lag0_rejection(stats)
        self.step += 1
        self.policy_version += 0 if skipped else 1  # the version names the weights: unchanged weights, same version
        self.consumed.update(keys)  # only after the step: a failed update may be retried with the same batch
        self.average.after_update(self.model, self.step)
        stats.update(reward_mean=float(batch.rewards.mean()), grad_norm=grad_norm, optimizer_step_skipped=int(skipped),
                     lr=lr, step=self.step, policy_version=self.policy_version, num_trajectories=len(batch),
                     num_microbatches=len(parts), learner_time_s=time.perf_counter() - t0,
                     **({"rewards_permuted": 1} if cfg.permute_rewards else {}))
        return stats

    def _backward(self, batch: Batch) -> list[tuple[list[int], LossResult]]:
        """Forward + loss + backward over this rank's micro-batches; returns every rank's ``(rows, result)``."""
        cfg, spec = self.config, self.loss_spec
        rank, world = self.rank_world
        full = batch.full_batch()  # whole-batch totals: identical on every rank
        prepared = spec.prepare(batch) if spec.prepare else {}
        with_entropy = spec.needs_entropy(cfg.loss) or cfg.compute_entropy
        mine = rank_rows(len(batch), rank, world)
        local = [([mine[i] for i in rows], mb)  # rows of the whole batch, for the loss's prepared tensors and stats
                 for rows, mb in microbatches(batch.select(mine), cfg.max_tokens_per_microbatch)]
        passes = max_over_ranks(len(local), self.device) if world > 1 else len(local)
        was_training = self.model.training
        self.model.train()  # HF only checkpoints activations in train mode; Qwen2 has no dropout to worry about
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for i in range(passes):
            rows, mb = local[min(i, len(local) - 1)]
            mb = mb.to(self.device)
            with self._autocast():
                logp, ent = self.scorer(mb.input_ids, mb.attention_mask, mb.action_mask,
                                        chunk_size=cfg.logprob_chunk_size, temperature=cfg.temperature,
                                        with_entropy=with_entropy)
            extra = {k: v[rows].to(self.device) for k, v in prepared.items()}
            inputs = LossInputs(logp, mb.behavior_log_probs, mb.action_mask, mb.rewards, mb.failures, full,
                                ent if with_entropy else None, extra)
            result = spec.compute(inputs, cfg.loss)
            if i >= len(local):  # a repeat that only keeps this rank in step with the others' collectives
                (result.loss * 0.0).backward()
                continue
            (result.loss * world).backward()  # FSDP2 averages over ranks: mean of world x share = sum of shares
            if with_entropy and "entropy_mean" not in result.means:
                n = float(mb.action_mask.sum())
                result.means["entropy_mean"] = (float(ent.detach()[mb.action_mask].double().mean()), n)
            parts.append((rows, _to_cpu(result)))
        self.model.train(was_training)
        if world > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, parts)
            parts = [p for rank_parts in gathered for p in rank_parts]
        return parts

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

    def _check_temperature(self, trajectories: Sequence[Trajectory]) -> None:
        for t in trajectories:  # pi_theta must be evaluated at the temperature mu was sampled at, or rho is biased
            temp = (t.sampling or {}).get("temperature")
            if isinstance(temp, (int, float)) and temp > 0 and not math.isclose(temp, self.config.temperature):
                raise ValueError(f"trajectory {t.id!r} was sampled at temperature {temp} but the learner evaluates "
                                 f"log-probs at LearnerConfig.temperature={self.config.temperature}")

    def _warn_on_lag0_rejection(self, stats: dict) -> None:
        rate = stats.get("lag0_acceptance_rate")
        if rate is None or rate > 0.5 or self.rank_world[0] != 0:
            return
        truncated = stats.get("sampling_truncated_fraction", 0.0)
        why = (f"{100 * truncated:.0f}% of the batch was sampled with top-k / top-p < 1: use top_p=1, top_k=0 with "
               "FlashREINFORCE" if truncated else "the sampler's distribution differs from the learner's (precision, "
               "logit processing or temperature)")
        log.warning("the trust gate rejected %.0f%% of the lag-0 trajectories (sampled by these very weights): %s",
                    100 * (1 - rate), why)

    def _autocast(self):
        if self.compute_dtype == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # --- tail averaging -------------------------------------------------------------------------------------------
    def use_average(self) -> int:
        """At the run's end: the weights become their mean over the window (a new ``policy_version``; AdamW state kept).
        Returns how many updates it covered: 0 = averaging off, 1 = the mean is the weights, nothing changes."""
        n = self.average.swap_into(self.model)
        self.policy_version += n >= 2
        return n

    # --- weights for rollout workers ------------------------------------------------------------------------------
    def export_weights(self, device="cpu", dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """A detached copy of the full state dict in ``dtype`` (default: the compute dtype) for samplers; tied
        tensors stay shared in the copy. Sharded: a collective, rank 0 gets the weights, other ranks ``{}``."""
        dtype = dtype or self.compute_dtype
        if self.sharded:
            from .sharding import gather_full_state_dict

            state = gather_full_state_dict(self.model)
        else:
            state = self.model.state_dict()
        copies: dict = {}
        out = {}
        for name, t in state.items():
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if key not in copies:
                copies[key] = t.detach().to(device=device, dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
            out[name] = copies[key]
        return out

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, tensor)`` over the parameters without copying (tied weights appear once); do not modify them."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def save_pretrained(self, out_dir, source: str | None = None, dtype: str = "float32") -> None:
        """A Hugging Face model directory in ``dtype`` (+ the tokenizer found at ``source``); the cast happens per
        tensor as it is gathered. Sharded: a collective; rank 0 writes."""
        from .model_io import save_pretrained

        state = self.export_weights(dtype=getattr(torch, dtype))
        if self.rank_world[0] == 0:
            save_pretrained(self.model, state, out_dir, source=source, dtype=getattr(torch, dtype))

    # --- checkpointing --------------------------------------------------------------------------------------------
    def save(self, path) -> None:
        """A checkpoint directory, each rank writing its own shard (:func:`~agentenv.trainer.checkpoint.save_learner`;
        loads into a learner of any world size). Sharded: a collective."""
        ckpt.save_learner(self, path)

    def load(self, path) -> None:  # any world size's directory
        ckpt.load_learner(self, path)

    def state_dict(self) -> dict:
        """In memory with full tensors (sharded: a collective gathering to rank 0); checkpoints use :meth:`save`."""
        if self.sharded:
            from .sharding import full_train_state

            model_state, optim_state = full_train_state(self.model, self.optimizer)
        else:
            model_state, optim_state = self.model.state_dict(), self.optimizer.state_dict()
        return {"model": model_state, "optimizer": optim_state, **self.average.state(), **self.progress_state()}

    def progress_state(self) -> dict:
        """Everything but the tensors: step, policy version, consumed ids, schedule, config, RNG."""
        return {"step": self.step, "policy_version": self.policy_version, "consumed": sorted(self.consumed),
                "schedule": asdict(self.schedule), "config": json.dumps(self.config.to_dict()),
                "rng": ckpt.rng_state()}

    def load_state_dict(self, state: dict) -> None:
        if self.sharded:
            from .sharding import load_full_train_state

            load_full_train_state(self.model, self.optimizer, state["model"], state["optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.average.load(self.model, state)
        self.load_progress_state(state)

    def load_progress_state(self, state: dict) -> None:
        self.step = int(state["step"])
        self.policy_version = int(state["policy_version"])
        self.consumed = set(state["consumed"])
        ckpt.set_rng_state(state["rng"])

    def close(self) -> None:
        """Nothing to release in-process (the sharded driver's ``close`` stops its ranks)."""


def _to_cpu(r: LossResult) -> LossResult:
    return LossResult(loss=r.loss.detach().cpu(), rows={k: v.cpu() for k, v in r.rows.items()}, sums=r.sums,
                      means=r.means, maxima=r.maxima, minima=r.minima)


__all__ = ["LOSSES", "Learner", "LearnerConfig", "learner_config_from", "trajectory_key"]
