"""Loop checkpoints: save, find, resume, and reconcile the run's JSONL files with the checkpoint a run resumes from.

Layout under ``RUN/checkpoints/``: one directory per checkpoint, ``step_NNNNNN/`` holding ``learner/`` (the learner's
own checkpoint directory: ``torch.distributed.checkpoint`` files, one shard per rank, written by the ranks themselves,
loadable at any world size: :func:`agentenv.trainer.checkpoint.save_learner`) and ``loop.pt`` (the loop part); the
newest ``loop.keep_checkpoints`` are kept (:func:`prune`). ``latest`` names the newest complete one. A checkpoint is
written into a temporary sibling (``.step_NNNNNN.*.tmp/``) renamed into place, and ``latest`` is replaced (atomically)
only after that, so a crash at any moment leaves the previous ``latest`` valid. Rewriting a step (the shutdown
checkpoint after that update's own) moves the old directory aside (``.step_NNNNNN.old.tmp``) for the instant of the
swap; :func:`remove_stale_tmp`, run when a run starts in that directory, puts it back if a crash struck in between,
then removes every temporary a crash left. Checkpoints of the earlier one-file form (``step_NNNNNN.pt``) still resume.

The loop part records how many rows ``trajectories.jsonl`` and ``metrics.jsonl`` held when it was taken. Rows after
that belong to updates a crash rolled back: :func:`roll_back_rows` rewrites each file so those rows carry
``"rolled_back": true`` (metrics) / ``meta["rolled_back"] = true`` (trajectories) and a torn last line is dropped,
so that each file says exactly once what the surviving run trained (readers skip rolled-back rows).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from . import checkpoint as ckpt

log = logging.getLogger("agentenv.trainer.loop_state")


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: str | os.PathLike, step: int, learner, loop: dict, keep: int | None = None) -> Path:
    """Checkpoint ``learner`` (its ranks write their shards: ``learner.save(dir)``) and the ``loop`` part as
    ``step_NNNNNN/``, then publish it as ``latest`` and prune (module docstring)."""
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=d))
    try:
        learner.save(tmp / "learner")
        ckpt.atomic_save(loop, tmp / "loop.pt")
        if path.exists():  # the same step again: swap; remove_stale_tmp undoes a crash between the two renames
            old = d / f".{path.name}.old.tmp"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        ckpt.fsync_dir(d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish_latest(d, path.name)
    log.info("checkpoint step=%d path=%s", step, path)
    if keep:
        prune(run_dir, keep)
    return path


def _publish_latest(d: Path, name: str) -> None:
    tmp = d / ".latest.tmp"
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / "latest")
    ckpt.fsync_dir(d)


def _checkpoints(d: Path) -> list[Path]:
    """Every checkpoint in ``d``, oldest first (zero-padded: name order is step order); the run's ``step_N/model``
    directories are not checkpoints of the loop (no ``loop.pt``)."""
    return sorted((p for p in d.glob("step_*") if (p / "loop.pt").is_file() or (p.suffix == ".pt" and p.is_file())),
                  key=lambda p: p.name.removesuffix(".pt"))


def prune(run_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (``loop.keep_checkpoints``); ``latest``'s is never one of
    them: it is the newest, and pruning runs only after ``latest`` names it."""
    current = latest(run_dir)
    gone = [p for p in _checkpoints(checkpoint_dir(run_dir))[:-keep] if p != current]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    if gone:
        log.info("pruned %d old checkpoint(s), kept %d (loop.keep_checkpoints)", len(gone), keep)
    return gone


def latest(run_dir: str | os.PathLike) -> Path | None:
    d = checkpoint_dir(run_dir)
    if not (d / "latest").exists():
        return None
    path = d / (d / "latest").read_text().strip()
    return path if path.exists() else None


def restore(run_dir: str | os.PathLike, learner) -> tuple[Path, dict]:
    """Load ``latest`` into ``learner`` (any world size: DCP reshards); returns its path and the loop part."""
    path = latest(run_dir)
    if path is None:
        raise FileNotFoundError(f"nothing to resume from: {checkpoint_dir(run_dir)}/latest does not exist or names a "
                                "missing checkpoint (a run writes its first checkpoint at loop.checkpoint_every or "
                                "when it stops)")
    if path.is_file():  # the earlier one-file form: {"learner": full state dict, "loop": ...}
        state = ckpt.load(path)
        learner.load_state_dict(state["learner"])
        return path, state["loop"]
    learner.load(path / "learner")
    return path, ckpt.load(path / "loop.pt")


def remove_stale_tmp(run_dir: str | os.PathLike) -> list[Path]:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    name = (d / "latest").read_text().strip() if (d / "latest").is_file() else ""
    aside = d / f".{name}.old.tmp"
    if name and not (d / name).exists() and aside.is_dir():  # a crash in the middle of a same-step swap
        os.replace(aside, d / name)
        log.warning("restored checkpoint %s, moved aside by a rewrite a crash interrupted", name)
    stale = sorted(d.glob(".*.tmp"))
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        log.warning("removed a partial checkpoint left by a crash: %s", p)
    return stale


def count_rows(path: Path) -> int:
    """Complete lines (a torn last line without its newline does not count)."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def roll_back_rows(path: Path, keep: int, *, trajectories: bool) -> int:
    """Mark every row after the first ``keep`` as rolled back (dropping a torn last line). Returns how many."""
    if not path.exists():
        return 0
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline; else a torn line a crash left
    if tail:
        log.warning("%s: dropped a torn last line (%d bytes) left by a crash", path, len(tail))
    marked = 0
    out = []
    for i, line in enumerate(lines):
        if i >= keep and line.strip():
            rec = json.loads(line)
            if "event" in rec:  # not an update's row (e.g. the shutdown summary written after the last checkpoint)
                out.append(line)
                continue
            if trajectories:
                rec.setdefault("meta", {})["rolled_back"] = True
            else:
                rec["rolled_back"] = True
            line = json.dumps(rec, ensure_ascii=False).encode()
            marked += 1
        out.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(b"".join(x + b"\n" for x in out))
    os.replace(tmp, path)
    if marked:
        log.warning("%s: %d rows belong to updates rolled back by a crash; marked rolled_back", path, marked)
    return marked
