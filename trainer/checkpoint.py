"""Atomic checkpoint files and RNG capture.

Contract:

* :func:`atomic_save` writes ``torch.save(obj)`` to a temporary file in the target's directory, fsyncs it, then
  ``os.replace``-s it over the target: a reader (or a crash) sees the old file or the new one, never a partial one.
* :func:`load` reads with ``weights_only=True`` (no arbitrary pickles); everything saved here is tensors, numbers,
  strings and plain containers.
* :func:`rng_state` / :func:`set_rng_state` cover Python's ``random``, NumPy's global generator, torch CPU and every
  CUDA device, so a resumed run draws the same random numbers as one that never stopped.

* :func:`save_learner` / :func:`load_learner` are a learner's checkpoint DIRECTORY (what ``Learner.save`` /
  ``Learner.load`` call; collectives on a sharded learner): ``torch.distributed.checkpoint`` (DCP) files, in which
  every rank writes its own shard of the model, the AdamW state (keyed by parameter name; absent before the first
  optimizer step) and the tail-average mean (when there is one), plus ``state.pt`` from rank 0: step, policy
  version, consumed ids, averaged-update count, schedule, config, RNG. Nothing is gathered to one rank, and DCP
  reshards on load, so a directory written by W ranks loads into a learner of any world size, one process included.
  Tensors round-trip exactly: the next update after a load is the one the saving learner would have taken.

What the in-memory form holds is :meth:`agentenv.trainer.learner.Learner.state_dict` (the same fields, full tensors).
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch


def atomic_save(obj, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # make the rename itself durable
    return path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make renames into directory ``path`` durable."""
    try:
        dfd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # some filesystems do not support fsync on directories


def save_learner(learner, path: str | os.PathLike) -> Path:
    """Write ``learner``'s checkpoint directory at ``path`` (module docstring). Collective when sharded."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    stepped = bool(learner.optimizer.state)  # before any step: no AdamW state to save (and none is invented)
    tensors = _dcp_tensors(learner, stepped, learner.average.mean is not None)
    with _single_process_ok():
        dcp.save(tensors, checkpoint_id=path, no_dist=not learner.sharded)
    if learner.rank_world[0] == 0:
        atomic_save({**learner.progress_state(), "optimizer_state": stepped,
                     "averaged_updates": learner.average.count}, path / "state.pt")
    return path


def load_learner(learner, path: str | os.PathLike) -> None:
    """Load a directory :func:`save_learner` wrote (by any number of ranks) into ``learner``. Collective when
    sharded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = Path(path)
    if not (path / "state.pt").is_file():
        raise FileNotFoundError(f"{path} is not a learner checkpoint directory (no state.pt)")
    state = load(path / "state.pt")
    stepped, averaged = bool(state["optimizer_state"]), int(state["averaged_updates"])
    tensors = _dcp_tensors(learner, stepped, averaged > 0)
    with _single_process_ok():
        dcp.load(tensors, checkpoint_id=path, no_dist=not learner.sharded)
    if stepped:
        set_state_dict(learner.model, learner.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optimizer"])
    else:
        set_model_state_dict(learner.model, tensors["model"])
        learner.optimizer.state.clear()
    learner.average.mean, learner.average.count = tensors.get("average"), averaged
    learner.load_progress_state(state)


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns that a process without a process group saves / loads alone: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _dcp_tensors(learner, optimizer: bool, average: bool) -> dict:
    """The learner's own (sharded) tensors by name, for DCP to write from or read into in place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer:
        model_state, optim_state = get_state_dict(learner.model, learner.optimizer)
        out = {"model": model_state, "optimizer": optim_state}
    else:
        out = {"model": get_model_state_dict(learner.model)}
    if average:  # the mean is sharded like its parameter; loading fills a same-shaped copy
        out["average"] = learner.average.mean if learner.average.mean is not None else {
            k: p.detach().clone() for k, p in learner.model.named_parameters()}
    return out


def load(path: str | os.PathLike, map_location="cpu"):
    return torch.load(path, map_location=map_location, weights_only=True)


def rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]  # weights_only loading turns tuples into lists
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
