"""The loop's clock: how fast trajectories are consumed and how busy the learner is.

One :class:`Throughput` per :class:`~agentenv.trainer.loop.Trainer` run. ``start(step)`` when the backend is up (a
resumed run counts its updates from there), ``idle_before(t)`` for the learner's wait before an update,
``update(...)`` after each one -> the timings of the per-update record, ``stop()`` when the loop ends, ``summary()``
for the shutdown record. Elapsed time runs from ``start`` to ``stop`` (or to the shutdown, if the loop raised).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Throughput:
    t0: float = 0.0  # 0: never started (the backend failed to come up)
    t_end: float = 0.0
    last_update_end: float = 0.0
    step0: int = 0
    learner_s: float = 0.0  # the learner's busy time, summed over updates
    consumed: int = 0  # trajectories trained on

    def start(self, step: int) -> None:
        self.t0 = self.last_update_end = time.perf_counter()
        self.step0 = step

    def stop(self) -> None:
        self.t_end = time.perf_counter()

    def idle_before(self, t: float) -> float:
        """The learner's idle time from the end of the previous update to ``t``."""
        return max(0.0, t - self.last_update_end)

    def update(self, step: int, batch: list, learner_s: float, publish_s: float, wait_s: float) -> dict:
        """Book one update; the timings of its metrics record."""
        self.learner_s += learner_s
        self.consumed += len(batch)
        now = time.perf_counter()
        elapsed = max(1e-9, now - self.t0)
        self.last_update_end = now
        return {"traj_per_s": self.consumed / elapsed, "updates_per_s": (step - self.step0) / elapsed,
                "time_generation_s": sum(t.time_generation_s for t in batch),
                "time_env_s": sum(t.time_env_s for t in batch), "time_learner_s": learner_s,
                "time_publish_s": publish_s, "time_wait_s": wait_s,
                "learner_busy": self.learner_s / elapsed, "elapsed_s": elapsed}

    def summary(self, t_close: float) -> dict:
        elapsed = max(1e-9, (self.t_end or t_close) - self.t0) if self.t0 else 0.0
        return {"elapsed_s": elapsed, "learner_busy": self.learner_s / elapsed if elapsed else 0.0,
                "traj_per_s": self.consumed / elapsed if elapsed else 0.0}
