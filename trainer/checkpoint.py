"""Atomic checkpoint files and RNG capture.

Contract:

* :func:`atomic_save` writes ``torch.save(obj)`` to a temporary file in the target's directory, fsyncs it, then
  ``os.replace``-s it over the target: a reader (or a crash) sees the old file or the new one, never a partial one.
* :func:`load` reads with ``weights_only=True`` (no arbitrary pickles); everything saved here is tensors, numbers,
  strings and plain containers.
* :func:`rng_state` / :func:`set_rng_state` cover Python's ``random``, NumPy's global generator, torch CPU and every
  CUDA device, so a resumed run draws the same random numbers as one that never stopped.

What a learner checkpoint holds (model, optimizer, step, policy version, consumed trajectory ids, config, RNG) is
assembled by :meth:`agentenv.trainer.learner.Learner.state_dict`.
"""

from __future__ import annotations

import os
import random
import tempfile
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
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    return path


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
