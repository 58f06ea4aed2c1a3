"""What to start next and when a batch is ready: the prompt order and two dispatch strategies.

* :class:`PromptSampler`: prompt indices without replacement per epoch; epoch ``e``'s order is
  ``default_rng([seed, e]).permutation(n)``. ``requeue`` holds prompts to issue again before the next fresh one (the
  unfinished ones at a checkpoint; a prompt drawn when no worker slot was free). Its state is checkpointed, so a
  resumed run continues the data order.
* :class:`AsyncDispatch` (FlashREINFORCE, ``loop.mode=async``): one rollout per prompt, episodes started whenever a
  slot is free, as long as at most ``queue_size * batch_size`` trajectories are started but not yet taken by the
  learner (backpressure, nothing dropped: Q=1 overlaps generation of batch k+1 with update k). A batch is the first
  ``batch_size`` trajectories in completion order. Rollouts go on while the learner updates.
* :class:`SyncGroupDispatch` (the GRPO baseline, ``loop.mode=sync_grpo``): rounds of ``batch_size / group_size``
  prompts, each rolled out ``group_size`` times (``group_id`` marks siblings); the batch is the whole round once
  every episode of it is resolved; nothing is generated while the learner updates (on-policy).

A strategy's ``fill(start, ledger)`` starts what it may through ``start(prompt, group_id) -> bool`` (False: no free
slot); ``take(ledger)`` returns a batch or None; ``unfinished_prompts(ledger)`` lists the prompts a resumed run must
issue again.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from agentenv.core.config import LoopConfig

from .accounting import Ledger

StartFn = Callable[[int, "str | None"], bool]


class PromptSampler:
    def __init__(self, num_prompts: int, seed: int = 0):
        if num_prompts < 1:
            raise ValueError("need at least one prompt")
        self.n, self.seed = num_prompts, seed
        self.epoch, self.pos = 0, 0
        self.requeue: list[int] = []
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> list[int]:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n).tolist()

    def next(self) -> int:
        if self.requeue:
            return self.requeue.pop(0)
        if self.pos == self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._perm(self.epoch)
        self.pos += 1
        return self._order[self.pos - 1]

    def state_dict(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "pos": self.pos, "requeue": list(self.requeue)}

    def load_state_dict(self, s: dict) -> None:
        if s["n"] != self.n or s["seed"] != self.seed:
            raise ValueError(f"checkpoint's prompt sampler has n={s['n']} seed={s['seed']}, this run "
                             f"n={self.n} seed={self.seed}: the data or the seed changed, the order cannot continue")
        self.epoch, self.pos, self.requeue = int(s["epoch"]), int(s["pos"]), [int(i) for i in s["requeue"]]
        self._order = self._perm(self.epoch)


class AsyncDispatch:
    generate_during_update = True

    def __init__(self, cfg: LoopConfig, sampler: PromptSampler):
        self.cfg, self.sampler = cfg, sampler

    def fill(self, start: StartFn, ledger: Ledger) -> None:
        c = self.cfg
        while c.queue_size * c.batch_size - (ledger.counters.in_flight + ledger.counters.queued) > 0:
            prompt = self.sampler.next()
            if not start(prompt, None):
                self.sampler.requeue.insert(0, prompt)  # no free slot: the prompt is issued next time
                return

    def take(self, ledger: Ledger):
        return ledger.take(self.cfg.batch_size) if len(ledger.buffer) >= self.cfg.batch_size else None

    def unfinished_prompts(self, ledger: Ledger) -> list[int]:
        return [f.prompt for f in ledger.inflight.values()] + [t.meta["prompt_index"] for t in ledger.buffer]


class SyncGroupDispatch:
    generate_during_update = False

    def __init__(self, cfg: LoopConfig, sampler: PromptSampler):
        self.cfg, self.sampler = cfg, sampler
        self.round_no = 0
        self.waiting: list[tuple[int, str]] = []  # (prompt, group_id) of the current round not yet started

    def fill(self, start: StartFn, ledger: Ledger) -> None:
        if not ledger.inflight and not ledger.buffer and not self.waiting:  # the previous round is consumed
            self.round_no += 1
            for _ in range(self.cfg.batch_size // self.cfg.group_size):
                p = self.sampler.next()
                self.waiting.extend([(p, f"r{self.round_no}-p{p}")] * self.cfg.group_size)
        while self.waiting and start(*self.waiting[0]):
            self.waiting.pop(0)

    def take(self, ledger: Ledger):
        if ledger.inflight or self.waiting or not ledger.buffer:
            return None  # the barrier: every episode of the round must be resolved
        return ledger.take(None)

    def unfinished_prompts(self, ledger: Ledger) -> list[int]:
        # an unfinished round restarts whole: each of its prompts once
        groups = {f.group_id: f.prompt for f in ledger.inflight.values()}
        groups.update({t.meta["group_id"]: t.meta["prompt_index"] for t in ledger.buffer})
        groups.update({g: p for p, g in self.waiting})
        return list(groups.values())


def make_dispatch(cfg: LoopConfig, sampler: PromptSampler):
    return AsyncDispatch(cfg, sampler) if cfg.mode == "async" else SyncGroupDispatch(cfg, sampler)
