"""Learning-rate schedules as pure functions of the update index (no hidden state: resuming only needs the step).

Contract: ``schedule(step)`` returns the multiplier applied to the base learning rate for update number ``step``
(0-based: the first update uses ``step=0``).

* ``constant``: 1.0 always.
* ``cosine`` (cosine with a minimum lr): linear warmup over ``round(warmup_ratio * total_steps)`` updates, reaching
  1.0 on the last warmup update -- update 0 already has a non-zero lr, because in one-pass RL a batch stepped with
  lr 0 is a batch thrown away -- then a half cosine from 1.0 down to ``min_lr_ratio``, reached at update
  ``total_steps - 1`` and held afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    name: str = "constant"  # "constant" | "cosine"
    total_steps: int | None = None  # required by "cosine"
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        if self.name not in ("constant", "cosine"):
            raise ValueError(f"unknown schedule {self.name!r} (constant or cosine)")
        if self.name == "cosine" and (self.total_steps is None or self.total_steps < 1):
            raise ValueError(f"the cosine schedule needs total_steps >= 1, got {self.total_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"need 0 <= warmup_ratio < 1 and 0 <= min_lr_ratio <= 1, got {self.warmup_ratio}, "
                             f"{self.min_lr_ratio}")

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_ratio * self.total_steps) if self.name == "cosine" else 0

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.name == "constant":
            return 1.0
        warm = self.warmup_steps
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, self.total_steps - warm - 1))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def constant() -> Schedule:
    return Schedule("constant")


def cosine_with_min_lr(total_steps: int, warmup_ratio: float = 0.03, min_lr_ratio: float = 0.1) -> Schedule:
    return Schedule("cosine", total_steps, warmup_ratio, min_lr_ratio)
