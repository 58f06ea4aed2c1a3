"""FSDP2 building blocks the sharded :class:`~agentenv.trainer.learner.Learner` uses inside one rank.

* :func:`init_distributed` joins the process group the usual env vars describe (NCCL with CUDA, gloo otherwise).
* :func:`fsdp2_shard` applies ``fully_shard`` to every decoder layer, then to the :class:`TokenLogProbs` wrapper as
  the root (it owns the embedding, final norm and LM head, gathered around the chunked log-prob forward). With a bf16
  compute dtype: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; the sharded master weights and
  AdamW state stay float32.
* Sharded init: a model built on the meta device is sharded first, then :func:`fill_from_rank0` allocates each
  rank's shards (``to_empty``) and fills them from the weights rank 0 alone loaded (:func:`rank0_weights`),
  broadcast by DCP's ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``; buffers (not
  sharded) are broadcast whole. Tied parameters stay one parameter.
* :func:`rank_rows` / :func:`max_over_ranks`: which rows of a batch a rank trains on, and the most micro-batches
  any rank runs (so every rank runs as many FSDP collectives).
* :func:`gather_full_state_dict` / :func:`full_train_state` are collectives: rank 0 gets full CPU state dicts, other
  ranks ``{}`` (weights for samplers; the in-memory ``Learner.state_dict``). Checkpoints never gather: each rank
  writes its own shard (:func:`agentenv.trainer.checkpoint.save_learner`).

The driver side (spawning the ranks, the object a run talks to) is :mod:`agentenv.trainer.distributed`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def fsdp2_shard(root: torch.nn.Module, model: torch.nn.Module, *, bf16: bool, device: torch.device | None = None,
                rank0_weights: dict | None = None) -> torch.nn.Module:
    """FSDP2-shard ``root`` (the module whose forward runs the model) in place: each decoder layer, then the root.
    A ``model`` on the meta device is then materialized on ``device`` and filled from rank 0
    (:func:`fill_from_rank0`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    meta = next(model.parameters()).is_meta
    kw = {}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(root, **kw)
    if meta:
        fill_from_rank0(model, device, rank0_weights)
    return root


def rank0_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What rank 0 broadcasts at a sharded init: the state dict and every buffer (the non-persistent ones, such as
    rotary frequencies, are in no state dict but are garbage after ``to_empty``)."""
    return {**model.state_dict(), **dict(model.named_buffers())}


@torch.no_grad()
def fill_from_rank0(model: torch.nn.Module, device: torch.device, weights: dict | None) -> None:
    """Collective, after ``fully_shard`` of a meta-device ``model``: allocate its shards on ``device`` (``to_empty``)
    and fill them from rank 0's ``weights`` (:func:`rank0_weights`; ``None`` on the other ranks), each rank keeping
    only its shard (DCP's ``broadcast_from_rank0``). Shared (tied) parameters stay one parameter."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    if rank == 0 and weights is None:
        raise ValueError("rank 0 of a meta-device sharded init needs the weights (rank0_weights)")
    model.to_empty(device=device)
    keys = set(model.state_dict())
    full = {k: v for k, v in weights.items() if k in keys} if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buf in model.named_buffers():  # not sharded by FSDP2: every rank holds the whole buffer
        if rank == 0:
            buf.copy_(weights[name])
        dist.broadcast(buf, src=0)


def rank_rows(n: int, rank: int, world: int) -> list[int]:
    """Rows ``rank, rank + world, ...`` of a batch of ``n``: strided so ranks get similar lengths."""
    if n < world:
        raise ValueError(f"batch of {n} trajectories cannot give every one of {world} learner ranks a row: "
                         "use loop.batch_size >= launch.learner_world_size")
    return list(range(rank, n, world))


def max_over_ranks(n: int, device) -> int:
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective. Rank 0: the full CPU state dict; other ranks: ``{}``. Plain modules pass through."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized():
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_train_state(model, optimizer) -> tuple[dict, dict]:
    """Collective: full (model, optimizer) state dicts on rank 0, ``({}, {})`` elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_train_state(model, optimizer, model_state: dict, optim_state: dict) -> None:
    """Collective: every rank passes the same full state dicts (as :func:`full_train_state` wrote them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
