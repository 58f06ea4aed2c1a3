"""Trajectory accounting and policy lag: every started trajectory ends in exactly one bucket, lag has one definition.

:class:`Ledger` owns the episodes in flight, the completion buffer and the counters, and is the only place that
moves a trajectory between buckets:

``started == trained + rejected + sum(dropped[reason]) + interrupted + in_flight + queued + learning``

is checked after every update (``balance() == 0``). ``dropped`` reasons are ``stale`` (lag above
``loop.max_staleness`` when a batch is formed), ``worker_crash`` (its worker died with it in flight), ``env_timeout``
(it ran longer than ``loop.episode_timeout_s``) and ``error`` (``env_error`` / ``policy_error``, or no trainable
token); ``interrupted`` counts what was in flight or buffered when the run stopped (or at the checkpoint a run
resumed from). ``trained`` / ``rejected`` split a consumed batch by the learner's trust gate.

Lag (:func:`trajectory_lag`), the ONE definition used by the loop's metrics, the trajectory records and the
staleness filter: with ``V`` the learner's version when the batch is taken, a trajectory's ``lag_mean`` is
``V - mean(token versions)`` and ``lag_max`` is ``V - min(token versions)`` over its sampled tokens (a text-policy
trajectory without tokens uses the version its episode started with). A batch reports the mean of ``lag_mean`` and
the max of ``lag_max``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from agentenv.core.trajectory import Trajectory

DROP_REASONS = ("stale", "worker_crash", "env_timeout", "error")
ERROR_FINISH = ("env_error", "policy_error")


def trajectory_lag(traj: Trajectory, version: int) -> tuple[float, int]:
    """``(V - mean token version, V - min token version)`` for learner version ``V``."""
    vs = [v for v, m in zip(traj.policy_version, traj.action_mask) if m]
    if not vs:
        v0 = int(traj.meta.get("version_start", version))
        return float(version - v0), version - v0
    return version - sum(vs) / len(vs), version - min(vs)


def admitted_mask(stats: dict, n: int) -> list[bool]:
    """Per-trajectory admission from the learner's stats (``admitted``: one bool per trajectory, in batch order)."""
    mask = stats.get("admitted")
    if mask is None:
        return [True] * n  # a loss without a gate (grpo) admits every row
    mask = [bool(x) for x in (mask.tolist() if hasattr(mask, "tolist") else mask)]
    if len(mask) != n:
        raise ValueError(f"learner returned {len(mask)} admission flags for a batch of {n}")
    return mask


@dataclass
class Counters:
    started: int = 0
    trained: int = 0
    rejected: int = 0
    dropped: dict = field(default_factory=lambda: {r: 0 for r in DROP_REASONS})
    interrupted: int = 0
    in_flight: int = 0  # running on a worker
    queued: int = 0  # finished, waiting in the completion buffer
    learning: int = 0  # taken by the learner, update not finished yet
    worker_restarts: int = 0

    def balance(self) -> int:
        """``started`` minus every bucket: 0 when the books add up."""
        return self.started - (self.trained + self.rejected + sum(self.dropped.values()) + self.interrupted
                               + self.in_flight + self.queued + self.learning)

    def flat(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "dropped"}
        d.update({f"dropped_{r}": n for r, n in self.dropped.items()})
        d["dropped"] = sum(self.dropped.values())
        return d


@dataclass
class InFlight:
    wid: int
    prompt: int
    t_start: float
    group_id: str | None = None


class Ledger:
    """In-flight episodes, the completion buffer (completion order) and the counters.

    ``record(traj)`` is called for every trajectory that leaves the books for good (dropped, trained, rejected,
    interrupted) with ``traj.meta["loop"]`` set to its status, so the run's trajectory file holds each exactly once.
    """

    def __init__(self, record: Callable[[Trajectory], None] = lambda t: None):
        self.counters = Counters()
        self.failing_in_a_row = 0  # episodes that ended as errors since the last usable one
        self.last_error = ""
        self.inflight: dict[int, InFlight] = {}
        self.buffer: list[Trajectory] = []
        self.record = record

    def start(self, eid: int, wid: int, prompt: int, group_id: str | None = None) -> None:
        self.inflight[eid] = InFlight(wid, prompt, time.perf_counter(), group_id)
        self.counters.started += 1
        self.counters.in_flight += 1

    def finish(self, eid: int, traj: Trajectory, step: int) -> None:
        """A worker delivered ``traj``: buffer it, or drop it as an error. Late results (already dropped) are ignored."""
        f = self.inflight.pop(eid, None)
        if f is None:
            return  # already accounted (timed out, or its worker was declared dead)
        self.counters.in_flight -= 1
        traj.meta.setdefault("prompt_index", f.prompt)
        if f.group_id is not None:
            traj.meta["group_id"] = f.group_id
        if traj.finish_reason in ERROR_FINISH or (traj.token_ids and not any(traj.action_mask)):
            self.failing_in_a_row += 1
            self.last_error = f"{traj.finish_reason}: {traj.error or 'no trainable token'}"
            self._drop(traj, "error", step)
            return
        self.failing_in_a_row = 0
        self.buffer.append(traj)
        self.counters.queued += 1

    def drop_inflight(self, eid: int, reason: str) -> InFlight | None:
        f = self.inflight.pop(eid, None)
        if f is not None:
            self.counters.in_flight -= 1
            self.counters.dropped[reason] += 1
        return f

    def timed_out(self, limit_s: float) -> list[tuple[int, InFlight]]:
        now = time.perf_counter()
        return [(eid, f) for eid, f in self.inflight.items() if now - f.t_start > limit_s]

    def drop_stale(self, version: int, max_staleness: int | None, step: int) -> None:
        if max_staleness is None:
            return
        keep = []
        for t in self.buffer:
            if trajectory_lag(t, version)[1] > max_staleness:
                self.counters.queued -= 1
                self._drop(t, "stale", step)
            else:
                keep.append(t)
        self.buffer = keep

    def take(self, n: int | None) -> list[Trajectory]:
        """The first ``n`` buffered trajectories (all when ``n`` is None), now counted as ``learning``."""
        n = len(self.buffer) if n is None else n
        batch, self.buffer = self.buffer[:n], self.buffer[n:]
        self.counters.queued -= len(batch)
        self.counters.learning += len(batch)
        return batch

    def settle(self, batch: list[Trajectory], admitted: list[bool], step: int, version: int) -> list[tuple[float, int]]:
        """The update of ``batch`` finished: count and record each row; returns each row's (lag_mean, lag_max)."""
        lags = [trajectory_lag(t, version) for t in batch]
        n_adm = sum(admitted)
        self.counters.learning -= len(batch)
        self.counters.trained += n_adm
        self.counters.rejected += len(batch) - n_adm
        for t, ok, (lm, lx) in zip(batch, admitted, lags):
            t.meta["loop"] = {"status": "trained" if ok else "rejected", "update": step, "version": version,
                              "lag_mean": lm, "lag_max": lx}
            self.record(t)
        return lags

    def interrupt_all(self, step: int) -> None:
        """Shutdown: whatever is running, buffered or mid-update ends in ``interrupted``."""
        for t in self.buffer:
            t.meta["loop"] = {"status": "interrupted", "update": step}
            self.record(t)
        c = self.counters
        c.interrupted += c.in_flight + c.queued + c.learning  # learning > 0 only if the last update raised
        c.in_flight = c.queued = c.learning = 0
        self.inflight.clear()
        self.buffer = []

    def _drop(self, traj: Trajectory, reason: str, step: int) -> None:
        self.counters.dropped[reason] += 1
        traj.meta["loop"] = {"status": "dropped", "reason": reason, "update": step}
        self.record(traj)

    # --- checkpoint ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return asdict(self.counters)

    def load_state_dict(self, c: dict) -> None:
        self.counters = Counters(**{**c, "dropped": dict(c["dropped"])})
        # Episodes in flight or buffered at the checkpoint never come back: they end in the "interrupted" bucket.
        cc = self.counters
        cc.interrupted += cc.in_flight + cc.queued + cc.learning
        cc.in_flight = cc.queued = cc.learning = 0
