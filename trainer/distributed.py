"""Scaling the learner past one device: FSDP2 (``torch.distributed.fsdp.fully_shard``) data parallelism.

Contract:

* :func:`init_distributed` joins the process group described by the usual env vars (``torchrun`` sets ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``; a Ray-placed learner group sets the same on each
  actor). Backend: NCCL with CUDA, gloo otherwise (CPU tests).
* :func:`shard_model` applies ``fully_shard`` to every decoder layer, then the root. FSDP2 AVERAGES gradients over
  ranks; each rank's loss is its exact share of the full-batch loss, so the step backpropagates ``world * share``
  and the average is the single-process gradient of the whole batch. (A sum reduction via
  ``set_gradient_divide_factor(1)`` would say the same, but it uses PREMUL_SUM, which gloo does not have.)
* :func:`sharded_flashreinforce_step` is one FlashREINFORCE update with the batch split by rows across ranks: every
  rank collates the WHOLE batch (so ``B``, the reward mean and the token totals are global -- the advantage
  ``R_i - mean(R)`` must be over the whole batch, not a rank's slice), keeps its rows ``rank::world``, computes the
  loss with the whole-batch totals, backward, clip, step. It equals a single-process step on the whole batch up to
  float rounding (tested with 2 gloo processes). Every rank must call it with the same trajectories.
* :func:`gather_full_state_dict` is a collective: every rank calls it; rank 0 gets the full, unsharded CPU state
  dict to publish to rollout workers (``ray.put`` + ``load_weights``), the others get ``{}``.

The log-probs here come from the model's own forward (``model(...).logits``), which FSDP2 unshards correctly; the
memory-lean chunked path of :mod:`agentenv.trainer.logprobs` reads ``lm_head.weight`` outside the root forward and
needs an explicit unshard before it can run on a sharded model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agentenv.trajectory import Trajectory


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(backend: str | None = None) -> DistInfo:
    """Join (or reuse) the default process group from torchrun-style env vars."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ and world > 1:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is not set: launch with torchrun (or set the "
                               "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT env vars)")
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), rank=rank, world_size=world)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, device)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one (HF causal LMs keep them in ``model.model.layers``)."""
    for path in ("model.layers", "transformer.h", "layers"):
        mod = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if isinstance(mod, torch.nn.ModuleList):
            return list(mod)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; pass them to shard_model(layers=...)")


def shard_model(model: torch.nn.Module, *, layers: Sequence[torch.nn.Module] | None = None, mesh=None,
                reshard_after_forward: bool = True, mp_policy=None) -> torch.nn.Module:
    """FSDP2-shard ``model`` in place (per layer, then the root)."""
    from torch.distributed.fsdp import fully_shard

    kw = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kw["mesh"] = mesh
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for layer in layers if layers is not None else decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective. Rank 0: the full CPU state dict (for publishing); other ranks: ``{}``. Plain modules pass through."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    if not dist.is_initialized():
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def rank_rows(n: int, rank: int, world: int) -> list[int]:
    """Rows ``rank, rank + world, ...``: strided so ranks get similar lengths after length-sorted batching."""
    if n < world:
        raise ValueError(f"batch of {n} trajectories cannot give every one of {world} ranks a row: "
                         "FSDP collectives need every rank in the forward; use batch_size >= world size")
    return list(range(rank, n, world))


def sharded_flashreinforce_step(model, optimizer, trajectories: Sequence[Trajectory], *, delta: float = 3e-3,
                                max_grad_norm: float = 1.0, pad_token_id: int = 0, temperature: float = 1.0) -> dict:
    """One FlashREINFORCE step on this rank's rows of the batch (see the module docstring). Returns global stats."""
    from .batch import collate
    from .loss import flashreinforce_loss

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    batch = collate(trajectories, pad_token_id=pad_token_id)
    full = batch.full_batch()  # whole-batch B, mean reward, token total: identical on every rank
    rows = rank_rows(len(batch), rank, world)
    mb = batch.select(rows)
    device = next(model.parameters()).device
    ids, attn = mb.input_ids.to(device), mb.attention_mask.to(device)
    logits = model(input_ids=ids, attention_mask=attn.long()).logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # logits at t-1 predict token t; position 0 predicts nothing (its action_mask is False by contract)
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    loss, st = flashreinforce_loss(logp, mb.behavior_log_probs.to(device), mb.rewards.to(device),
                                   mb.action_mask.to(device), delta=delta, full_batch=full)
    optimizer.zero_grad(set_to_none=True)
    (loss * world).backward()  # FSDP2 averages over ranks: mean of world * share = sum of shares = full gradient
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    admitted = [False] * len(batch)
    local = list(zip(rows, st["admitted"].tolist()))
    parts = [None] * world
    if world > 1:
        dist.all_gather_object(parts, local)
    else:
        parts = [local]
    for part in parts:
        for i, ok in part:
            admitted[i] = bool(ok)
    total_loss = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total_loss)
    return {"loss": float(total_loss), "grad_norm": float(grad_norm), "admitted": admitted,
            "num_admitted": sum(admitted), "acceptance_rate": sum(admitted) / len(batch)}
