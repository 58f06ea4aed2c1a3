"""Loop checkpoints: save, find, resume, and reconcile the run's JSONL files with the checkpoint a run resumes from.

Layout under ``RUN/checkpoints/``: ``step_NNNNNN.pt`` (``{"learner": ..., "loop": ...}``, written atomically by
:func:`agentenv.trainer.checkpoint.atomic_save`; the newest ``loop.keep_checkpoints`` kept) and ``latest`` (the name of the newest complete one, replaced
atomically after the file is durable). A crash at any moment leaves the previous ``latest`` valid; the temporary
files such a crash can leave (``.step_*.pt.*.tmp``, ``.latest.tmp``) are removed by :func:`remove_stale_tmp` when a
run starts in that directory.

The loop part records how many rows ``trajectories.jsonl`` and ``metrics.jsonl`` held when it was taken. Rows after
that belong to updates a crash rolled back: :func:`roll_back_rows` rewrites each file so those rows carry
``"rolled_back": true`` (metrics) / ``meta["rolled_back"] = true`` (trajectories) and a torn last line is dropped,
so that each file says exactly once what the surviving run trained (readers skip rolled-back rows).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from . import checkpoint as ckpt

log = logging.getLogger("agentenv.trainer.loop_state")


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: str | os.PathLike, step: int, payload: dict, keep: int | None = None) -> Path:
    d = checkpoint_dir(run_dir)
    path = ckpt.atomic_save(payload, d / f"step_{step:06d}.pt")
    tmp = d / ".latest.tmp"
    tmp.write_text(path.name)
    os.replace(tmp, d / "latest")
    log.info("checkpoint step=%d path=%s", step, path)
    if keep:
        prune(run_dir, keep)
    return path


def prune(run_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` ``step_*.pt`` (``loop.keep_checkpoints``); ``latest``'s is never one of
    them: it is the newest, and pruning runs only after ``latest`` names it."""
    d = checkpoint_dir(run_dir)
    current = latest(run_dir)
    steps = sorted(d.glob("step_*.pt"), key=lambda p: p.name)  # zero-padded: name order is step order
    gone = [p for p in steps[:-keep] if p != current]
    for p in gone:
        p.unlink(missing_ok=True)
    if gone:
        log.info("pruned %d old checkpoint(s), kept %d (loop.keep_checkpoints)", len(gone), keep)
    return gone


def latest(run_dir: str | os.PathLike) -> Path | None:
    d = checkpoint_dir(run_dir)
    if not (d / "latest").exists():
        return None
    path = d / (d / "latest").read_text().strip()
    return path if path.exists() else None


def load_latest(run_dir: str | os.PathLike) -> tuple[Path, dict]:
    path = latest(run_dir)
    if path is None:
        raise FileNotFoundError(f"nothing to resume from: {checkpoint_dir(run_dir)}/latest does not exist or names a "
                                "missing file (a run writes its first checkpoint at loop.checkpoint_every or when "
                                "it stops)")
    return path, ckpt.load(path)


def remove_stale_tmp(run_dir: str | os.PathLike) -> list[Path]:
    d = checkpoint_dir(run_dir)
    stale = sorted(d.glob(".*.tmp")) if d.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
        log.warning("removed a partial checkpoint file left by a crash: %s", p)
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
